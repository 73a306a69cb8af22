"""Model loading: where a model comes from (the registered model sources, then a Hugging
Face folder, the local Hugging Face cache or a dummy preset), its shape and tokenizer, how
its weights reach the model, the checked-weights mode and the KV cache's element type."""
