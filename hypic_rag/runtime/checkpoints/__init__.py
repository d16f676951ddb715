"""Reading checkpoint directories without importing transformers, in one place.

Importing transformers and its model code costs seconds (about 3.5 s of a one-shot `hypic-rag ask`'s ~6 s on a
2-core machine: it pulls in torch._dynamo and torch.distributed), more than everything else a one-shot command does.
So for the checkpoints we can reproduce exactly, the package reads config.json, tokenizer.json and the safetensors
files itself, and falls back to transformers for everything else (the reason is logged):

- `native/`: hybrid models with transformers' module names and shapes (`load_native`; Qwen3.5 dense, the bundled
  default model's family), driven by `runtime.model.load_model` as it drives transformers' model;
- `tokenizer`: a checkpoint's tokenizer (`load_tokenizer`, `CheckpointTokenizer`), as `AutoTokenizer` gives it;
- `bert_encoder`, `batch_tokenizer`: the sentence embedder's plain BERT encoder and its padded batches of token ids
  (`retrieval.embeddings` uses them for the default MiniLM embedder).

Each is tested equal to what transformers returns for the same directory.
"""
