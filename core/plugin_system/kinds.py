"""The kinds of strategy: one table of register hook, factory signature and protocol.

This is the one place a kind is defined. The plugin manager calls each
kind's hook to fill its registry, and :func:`missing_members` checks what a
factory returned against the kind's protocol (``pitstop.plugin_system.protocols``),
counting a member a base class gives a default for as present only when the
object has it (inherit the base class to get the default).
"""

from __future__ import annotations

import inspect

import attrs

from pitstop.plugin_system import protocols
from pitstop.plugin_system.adapter import Adapters
from pitstop.plugin_system.executor import Executor
from pitstop.plugin_system.verifier import Verifier


@attrs.frozen
class Kind:
    """One kind of strategy."""

    name: str
    hook: str  # the register hook of pitstop.plugin_system.hookspecs that fills it
    factory: str  # the factory's signature, as documented
    protocol: type  # what the object the factory returns must provide
    selected_by: str  # the EngineConfig setting (or what) picks a name


KINDS: dict[str, Kind] = {
    kind.name: kind
    for kind in (
        Kind(
            "allocator",
            "register_allocators",
            "factory(config: EngineConfig, num_pages: int) -> Allocator",
            protocols.Allocator,
            "allocator",
        ),
        Kind(
            "scheduler",
            "register_schedulers",
            "factory(config: EngineConfig, allocator: Allocator) -> Scheduler",
            protocols.Scheduler,
            "scheduler",
        ),
        Kind(
            "kernels",
            "register_kernels",
            "factory(config: EngineConfig, device: torch.device, dtype: torch.dtype) -> KernelSet",
            protocols.KernelSet,
            "kernels",
        ),
        Kind(
            "sampler",
            "register_samplers",
            "factory(config: EngineConfig, device: torch.device) -> Sampler",
            protocols.Sampler,
            "sampler",
        ),
        Kind(
            "proposer",
            "register_proposers",
            "factory(config: EngineConfig, context: ProposerContext) -> Proposer",
            protocols.Proposer,
            "speculative",
        ),
        Kind(
            "verifier",
            "register_verifiers",
            "factory(config: EngineConfig, sampler: Sampler, device: torch.device) -> Verifier",
            Verifier,
            "speculative_verifier",
        ),
        Kind(
            "model",
            "register_models",
            "factory(model_config: ModelConfig, kernels: KernelSet[, *, weights: WeightFormat])"
            " -> Model (a torch.nn.Module)",
            protocols.Model,
            "the checkpoint's architecture name",
        ),
        Kind(
            "source",
            "register_model_sources",
            "factory(plugins: PluginManager) -> ModelSourceReader",
            protocols.ModelSourceReader,
            "the model string (config.model): the first source, by name, that claims it",
        ),
        Kind(
            "weights",
            "register_weight_formats",
            "factory(config: EngineConfig, kernels: KernelSet, device: torch.device, "
            "dtype: torch.dtype) -> WeightFormat",
            protocols.WeightFormat,
            "weights",
        ),
        Kind(
            "tool_parser",
            "register_tool_parsers",
            "factory(tokenizer: Tokenizer | None) -> ToolParser",
            protocols.ToolParser,
            "--tool-call-parser (pitstop serve)",
        ),
        Kind(
            "grammar",
            "register_grammars",
            "factory(config: EngineConfig, tokenizer: Tokenizer, vocab_size: int) -> GrammarBackend",
            protocols.GrammarBackend,
            "grammar",
        ),
        Kind(
            "executor",
            "register_executors",
            "factory(config: EngineConfig) -> Executor",
            Executor,
            "distributed_executor_backend",
        ),
        Kind(
            "adapter",
            "register_adapters",
            "factory(config: EngineConfig, context: AdapterContext) -> Adapters",
            Adapters,
            "adapter",
        ),
    )
}


def protocol_members(protocol: type) -> list[str]:
    """The members a protocol declares: its methods and annotated attributes, in order."""
    members: list[str] = []
    for cls in reversed(protocol.__mro__):
        if cls is object or not getattr(cls, "_is_protocol", False) or cls.__name__ == "Protocol":
            continue
        names = list(getattr(cls, "__annotations__", {}))
        names += [
            name
            for name, value in vars(cls).items()
            if (inspect.isfunction(value) or isinstance(value, property))
            and (not name.startswith("_") or name == "__call__")
        ]
        members += [n for n in names if n not in members]
    return members


def missing_members(kind: Kind, obj: object) -> list[str]:
    """The members of ``kind``'s protocol that ``obj`` lacks (empty: it conforms)."""
    return lacks(kind.protocol, obj)


def lacks(protocol: type, obj: object) -> list[str]:
    """The members of ``protocol`` that ``obj`` lacks, looked up with ``getattr`` (unlike a
    runtime protocol's ``isinstance`` on Python 3.12+, this finds an ``nn.Module``'s
    submodules); a method must be callable."""
    missing = []
    for name in protocol_members(protocol):
        value = getattr(obj, name, None)
        if value is None or (
            inspect.isfunction(getattr(protocol, name, None)) and not callable(value)
        ):
            missing.append(name)
    return missing
