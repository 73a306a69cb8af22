"""Requests and what comes back: the engine's sampling value and the checks that need the
model, a request's sequences and state, the per-row sampling tensors, and the outputs handed
back (vLLM's validated surface, structured outputs and prompt forms: :mod:`pitstop.entrypoints`)."""
