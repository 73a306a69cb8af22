"""Triton kernels of the ``fused`` kernel set, one module per kernel family.

Every module here imports :mod:`triton` at import time, so import them only
once you know Triton can run (a CUDA device, or ``TRITON_INTERPRET=1`` set
before the first import, which makes Triton run kernels on CPU tensors
through its interpreter). :mod:`pitstop.plugins.kernels.fused` does that.

- :mod:`.rmsnorm`: residual add + RMSNorm in one pass (also Qwen3's per-head q/k norm);
- :mod:`.silu`: SiLU-and-mul of a merged gate-up output;
- :mod:`.rope_store`: rotary embedding of q and k plus the K/V store into the paged cache;
- :mod:`.paged_attention`: decode (split-K flash-decoding) and variable-length
  causal prefill over the paged cache, both GQA-packed, sharing one page-gather loop;
- :mod:`.fused_linear`: skinny-M GEMMs with the RMSNorm row scale, SiLU·mul or the
  residual add inside (``norm_linear``, ``norm_gate_up``, ``linear_residual``), split-K
  reduced in the same launch;
- :mod:`.pdl`: programmatic dependent launch, decided once, for every kernel above.
"""
