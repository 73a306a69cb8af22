"""The fake vLLM's LoRA package."""
