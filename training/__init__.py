"""Training the bundled default model: tokenizer, data packing, model config, training loop, evaluation."""
