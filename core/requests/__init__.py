"""Requests and what comes back: the prompt forms, sampling parameters and their
checks, structured outputs and tool calls, chat rendering, a request's sequences and
state, the per-row sampling tensors, and the outputs handed back."""
