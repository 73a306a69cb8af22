"""The ``huggingface`` model source: Hugging Face checkpoint folders and the local cache.

- :mod:`~pitstop.plugins.model_sources.huggingface.source`: the plugin (what it claims,
  asked after every other source);
- :mod:`~pitstop.plugins.model_sources.huggingface.checkpoint`: a folder (``config.json``,
  ``*.safetensors``) -> the claiming architecture's config and tensors, checked;
- :mod:`~pitstop.plugins.model_sources.huggingface.hub`: ``org/name`` ids, resolved from
  the local Hugging Face cache only;
- :mod:`~pitstop.plugins.model_sources.huggingface.safetensors`: the safetensors reader
  (the ``gguf`` source's cache of converted files reads through it too);
- :mod:`~pitstop.plugins.model_sources.huggingface.tokenizer`: ``tokenizer.json`` folders,
  read and written.
"""
