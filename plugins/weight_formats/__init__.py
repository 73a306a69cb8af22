"""Weight formats: how a model holds and multiplies its linear layers' weights (``weights=``).

``dense`` (the default), ``fp8`` and ``gguf`` are the registered formats. ``gguf``
(:mod:`~pitstop.plugins.weight_formats.gguf`, issue 33) keeps a GGUF file's blocks
quantized, built from three parts: :mod:`~pitstop.plugins.weight_formats.gguf_blocks`
describes llama.cpp's block layouts and dequantizes raw blocks with torch ops (CPU or
CUDA), bit-exact to ``gguf.quants``; :mod:`~pitstop.plugins.weight_formats.gguf_linear`
holds one weight matrix as those raw blocks and multiplies by it, dequantizing on the fly;
:mod:`~pitstop.plugins.weight_formats.gguf_gemv` does the same on the GPU in one Triton
kernel that reads the blocks directly.
"""
