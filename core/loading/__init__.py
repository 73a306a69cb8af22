"""Model loading: where a model comes from (a Hugging Face folder, a GGUF file, a
dummy preset), its shape and tokenizer, what the loaders ask a model plugin, the
checked-weights mode and the KV cache's element type."""
