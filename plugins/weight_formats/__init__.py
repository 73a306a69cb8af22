"""Weight formats: how a model holds and multiplies its linear layers' weights (``weights=``).

``dense`` (the default) and ``fp8`` are the registered formats. The GGUF modules are the
parts of a format that keeps a GGUF file's blocks quantized (issue 33, not yet registered):
:mod:`~pitstop.plugins.weight_formats.gguf_blocks` describes llama.cpp's block layouts and
dequantizes raw blocks with torch ops (CPU or CUDA), bit-exact to ``gguf.quants``;
:mod:`~pitstop.plugins.weight_formats.gguf_linear` holds one weight matrix as those raw
blocks and multiplies by it, dequantizing on the fly; :mod:`~pitstop.plugins.weight_formats.gguf_gemv`
does the same on the GPU in one Triton kernel that reads the blocks directly.
"""
