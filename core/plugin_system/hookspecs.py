"""The hooks a pitstop plugin can implement.

Register-style hooks are called once, when the plugin manager loads, with a
``register(name, factory, description="", settings=None)`` callable; every
implementation is called and each may register any number of strategies.
Each kind's factory signature and protocol are in :data:`pitstop.plugin_system.kinds.KINDS`
(the one table of them); ``settings`` is a class of declared settings
(:mod:`pitstop.plugin_system.settings`). Observer hooks are called by the
engine at most once per step; their return values are ignored.

Implement a hook in your plugin module with ``@pitstop.hookimpl`` and declare
the module under the ``pitstop`` entry-point group.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from collections.abc import Callable

    Register = Callable[..., None]

hookspec = pluggy.HookspecMarker("pitstop")
hookimpl = pluggy.HookimplMarker("pitstop")


@hookspec
def register_allocators(register: Register) -> None:
    """Register KV-cache allocators.

    Called once when plugins load. Call ``register(name, factory)`` for each
    allocator (factory: ``KINDS["allocator"]``). The config's ``allocator``
    setting picks one by name.
    """


@hookspec
def register_schedulers(register: Register) -> None:
    """Register schedulers.

    Called once when plugins load (factory: ``KINDS["scheduler"]``). The
    config's ``scheduler`` setting picks one by name.
    """


@hookspec
def register_kernels(register: Register) -> None:
    """Register kernel sets.

    Called once when plugins load (factory: ``KINDS["kernels"]``). The
    config's ``kernels`` setting picks one by name; ``kernels="auto"`` picks one
    that registered with ``auto_devices=`` naming the device's type (``"cuda"``),
    else one registered with ``auto_devices=("*",)``.
    """


@hookspec
def register_samplers(register: Register) -> None:
    """Register samplers.

    Called once when plugins load (factory: ``KINDS["sampler"]``). The
    config's ``sampler`` setting picks one by name.
    """


@hookspec
def register_proposers(register: Register) -> None:
    """Register speculative-decoding proposers.

    Called once when plugins load (factory: ``KINDS["proposer"]``). The
    config's ``speculative`` setting picks one by name (None: no speculation).
    """


@hookspec
def register_verifiers(register: Register) -> None:
    """Register draft verifiers: which of a step's speculative drafts are kept.

    Called once when plugins load (factory: ``KINDS["verifier"]``; the protocol:
    :mod:`pitstop.plugin_system.verifier`). The config's ``speculative_verifier``
    setting picks one by name (default ``rejection``); it is built only when the
    engine speculates.
    """


@hookspec
def register_models(register: Register) -> None:
    """Register model architectures.

    Called once when plugins load. ``register(architecture, factory)`` with the
    architecture name a checkpoint's ``config.json`` uses (for example
    ``"LlamaForCausalLM"``) and a factory as ``KINDS["model"]`` says.
    """


@hookspec
def register_model_sources(register: Register) -> None:
    """Register model sources: where a model string (``config.model``) is read from.

    Called once when plugins load (factory: ``KINDS["source"]``, given the plugin
    manager, whose registry says which architectures exist). Loading a model asks every
    registered source, in name order (those that set ``asked_last``, such as
    ``huggingface``, after the others), whether it claims the model string; the first that
    does loads it. ``dummy:<preset>`` is read by the engine itself when no source claims it.
    """


@hookspec
def register_weight_formats(register: Register) -> None:
    """Register weight formats: how a model holds and multiplies its linear layers' weights.

    Called once when plugins load (factory: ``KINDS["weights"]``). The config's
    ``weights`` setting picks one by name (default ``dense``: the checkpoint's tensors
    in the model's dtype, through the kernel set's ``linear``).
    """


@hookspec
def register_tool_parsers(register: Register) -> None:
    """Register tool-call parsers (the formats in which models write tool calls).

    Called once when plugins load (factory: ``KINDS["tool_parser"]``).
    ``pitstop serve --tool-call-parser NAME`` picks one by name; it reads the
    calls of ``tool_choice="auto"`` answers, streamed or not.
    """


@hookspec
def register_grammars(register: Register) -> None:
    """Register grammar backends: structured outputs' compilers (JSON schema, regex, ...).

    Called once when plugins load (factory: ``KINDS["grammar"]``). The config's
    ``grammar`` setting picks one by name (default ``llguidance``); the engine
    builds it at the first request that asks for structured outputs.
    """


@hookspec
def register_executors(register: Register) -> None:
    """Register executors: how the engine runs a model split over several ranks.

    Called once when plugins load (factory: ``KINDS["executor"]``; the protocol:
    :mod:`pitstop.plugin_system.executor`). At ``tensor_parallel_size > 1`` the config's
    ``distributed_executor_backend`` picks one by name (default ``mp``: spawned processes or
    ``torchrun``'s ranks over ``torch.distributed``); at 1 the engine runs the model in its
    own process and builds none.
    """


@hookspec
def register_adapters(register: Register) -> None:
    """Register adapter methods: fine-tuned adapters served on the base weights per request.

    Called once when plugins load (factory: ``KINDS["adapter"]``; the protocol:
    :mod:`pitstop.plugin_system.adapter`). The config's ``adapter`` setting picks one by
    name (``lora``; vLLM's ``enable_lora=True``); default none, and a request that names an
    adapter is then refused.
    """


@hookspec
def on_step_finished(engine: Any, stats: Any) -> None:
    """Observe one finished engine step.

    Called after every step that ran, with the engine and a
    :class:`pitstop.ground.metrics.StepStats` (tokens, batch composition, timings,
    allocator statistics). Keep it cheap: it runs on the serving loop.
    """


@hookspec
def on_request_finished(engine: Any, output: Any) -> None:
    """Observe a request that finished (stopped, hit its length, or was aborted).

    Called once per request with the engine and its final
    :class:`pitstop.requests.outputs.RequestOutput`, which carries its timestamps.
    """
