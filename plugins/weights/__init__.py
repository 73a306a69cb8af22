"""Weights kept in their file's storage format (issue 33: quantized weights as a strategy).

:mod:`~pitstop.plugins.weights.gguf_blocks` describes llama.cpp's GGUF block layouts and
dequantizes raw blocks with torch ops (CPU or CUDA), bit-exact to ``gguf.quants``;
:mod:`~pitstop.plugins.weights.quantized_linear` holds one weight matrix as those raw blocks
and multiplies by it, dequantizing on the fly; ``triton_dequant_gemv`` does the same on the
GPU in one Triton kernel that reads the blocks directly.

These modules import torch, numpy, triton and gguf only, nothing of the engine: the
wiring into the loader and the model's linear layers comes later.
"""
