"""vLLM's ``vllm.lora`` package path; :mod:`pitstop.lora.request` has ``LoRARequest``."""
