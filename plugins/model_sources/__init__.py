"""Model sources: where a model string (``config.model``) is read from, beside the
engine's own Hugging Face folders, local Hugging Face cache and ``dummy:`` presets.

``gguf`` (:mod:`~pitstop.plugins.model_sources.gguf`) reads llama.cpp's GGUF files and the
shipped ``smollm2-135m``.
"""
