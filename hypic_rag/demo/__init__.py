"""The bundled demo: a small trained hybrid model and the synthetic corpus it knows (`assets/`), where they live, the
corpus's questions, and the check that says when the model is asked about documents outside its world.

- `default_model`: the bundled model's and the example corpus's paths (`default_model_path`, `example_corpus_path`);
- `example_corpus`: the corpus's questions with their answers (`read_questions`);
- `world`: whether a corpus or a question fits the bundled model's synthetic world, and the note that says so.
"""
