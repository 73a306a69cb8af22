"""The ``gguf`` model source: llama.cpp's GGUF files, beside the ``gguf`` weight format
(:mod:`pitstop.plugins.weight_formats.gguf`) that keeps their blocks quantized.

- :mod:`~pitstop.plugins.model_sources.gguf.source`: the plugin (what it claims, the
  shipped ``smollm2-135m``, ``pitstop cache``);
- :mod:`~pitstop.plugins.model_sources.gguf.file`: the file format (metadata, tensors,
  byte checks, dequantizing), :class:`GGUFModelFile` for the architecture plugins;
- :mod:`~pitstop.plugins.model_sources.gguf.loader`: a file -> the claiming architecture's
  config and tensors, checked;
- :mod:`~pitstop.plugins.model_sources.gguf.cache`: the cache of converted files;
- :mod:`~pitstop.plugins.model_sources.gguf.quantized`: a matrix kept in its blocks
  (``weights=gguf``) and the merges of its parts;
- :mod:`~pitstop.plugins.model_sources.gguf.tokenizer`: the file's own tokenizer.
"""
