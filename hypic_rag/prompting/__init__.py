"""Prompts as segments: how a prompt is laid out and cut into the segments whose cache entries are reused.

- `format`: the RAG layout (`PromptFormat`: prefix, one segment per chunk, question) and tokenizing a segment on its
  own (`tokenize_segment`), recorded whole in an index's manifest.
- `segments`: prompts given as separated segments (OpenAI completions, the LlamaIndex LLM).
- `chat`: chat messages as a segmented request (documents become cached segments).
- `matching`: prompts without separators cut at the known chunks and segments they contain.
"""
