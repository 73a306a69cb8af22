"""The engine's entry points: what a program or a person calls, outside the engine.

The offline :class:`~pitstop.entrypoints.llm.LLM`, the server's
:class:`~pitstop.entrypoints.async_engine.AsyncLLM`, the ``pitstop`` command
(:mod:`pitstop.entrypoints.cli`), beam search over ``LLM``, chat rendering and tool calls, and
vLLM's names for what pitstop does not do (:mod:`pitstop.entrypoints.vllm_surface`). The engine
(:class:`pitstop.loop.engine.LLMEngine`) imports none of them; they import the engine.
"""
