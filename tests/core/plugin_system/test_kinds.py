"""The kinds table and the protocol check of ``PluginManager.create``."""

from __future__ import annotations

import inspect
import sys
from types import ModuleType
from typing import Any

import pytest
import torch

import pitstop
from pitstop import EngineConfig
from pitstop.errors import ConfigError, PluginError
from pitstop.plugin_system import hookspecs
from pitstop.plugin_system.kinds import KINDS, missing_members, protocol_members
from pitstop.plugin_system.plugin_manager import PluginManager
from pitstop.plugin_system.protocols import ProposerBase


def _module(name: str, hook: str, strategy: str, factory) -> ModuleType:
    module = ModuleType(name)

    def register(register) -> None:
        register(strategy, factory)

    setattr(module, hook, pitstop.hookimpl(register))
    return module


class HalfAllocator:
    """An allocator that forgot ``free`` and ``block_table``."""

    page_size = 4
    num_pages = 8

    def can_allocate(self, seq):  # noqa: D102
        return True

    def allocate(self, seq):  # noqa: D102
        return 0

    def can_append(self, seq, n):  # noqa: D102
        return True

    def append(self, seq, n):  # noqa: D102
        pass

    def truncate(self, seq, n):  # noqa: D102
        pass

    def num_held_tokens(self, seq):  # noqa: D102
        return 0

    def on_tokens_computed(self, seq):  # noqa: D102
        pass

    def stats(self):  # noqa: D102
        return None


class QuietProposer:
    def propose(self, seqs, k):  # noqa: D102
        return []

    def on_accepted(self, seq, num_accepted):  # noqa: D102
        pass


class QuietProposerWithBase(ProposerBase, QuietProposer):
    pass


def test_the_table_names_every_register_hook() -> None:
    hooks = {
        name
        for name, fn in inspect.getmembers(hookspecs, inspect.isfunction)
        if hasattr(fn, "pitstop_spec") and name.startswith("register_")
    }
    assert {kind.hook for kind in KINDS.values()} == hooks
    for kind in KINDS.values():
        assert protocol_members(kind.protocol), kind.name


def test_create_names_the_plugin_and_the_missing_members() -> None:
    pm = PluginManager(
        load_entry_points=False,
        extra_modules=[
            _module("half", "register_allocators", "half", lambda c, n: HalfAllocator())
        ],
    )
    with pytest.raises(PluginError) as info:
        pm.create("allocator", "half", EngineConfig(), 8)
    text = str(info.value)
    assert "allocator 'half'" in text and "HalfAllocator" in text
    assert (
        "free" in text
        and "block_table" in text
        and "pitstop.plugin_system.protocols.Allocator" in text
    )
    assert "can_allocate" not in text.split("lacks")[1].split(";")[0]


def test_optional_members_come_from_the_base_class() -> None:
    assert missing_members(KINDS["proposer"], QuietProposer()) == ["release"]
    assert missing_members(KINDS["proposer"], QuietProposerWithBase()) == []
    pm = PluginManager(
        load_entry_points=False,
        extra_modules=[
            _module("quiet", "register_proposers", "quiet", lambda c, ctx: QuietProposer()),
            _module("based", "register_proposers", "based", lambda c, ctx: QuietProposerWithBase()),
        ],
    )
    with pytest.raises(PluginError, match="lacks release"):
        pm.create("proposer", "quiet", EngineConfig(), None)
    proposer = pm.create("proposer", "based", EngineConfig(), None)
    assert proposer.release(None) is None


def test_every_built_in_conforms() -> None:
    pm = PluginManager()
    config = EngineConfig(max_model_len=64)
    cpu = torch.device("cpu")
    built = [pm.create("allocator", name, config, 16) for name in pm.names("allocator")]
    built += [pm.create("scheduler", name, config, built[0]) for name in pm.names("scheduler")]
    built += [
        pm.create("kernels", name, config, cpu, torch.float32) for name in pm.names("kernels")
    ]
    built += [pm.create("sampler", name, config, cpu) for name in pm.names("sampler")]
    assert len(built) >= 9
    kernels = pm.create("kernels", "reference", config, cpu, torch.float32)
    assert kernels.cuda_graph_safe(64) is False and kernels.merge_projections is False


def _kernels_module(name: str, **register_kw: Any) -> Any:
    """A plugin module whose register_kernels hook registers one kernel set ``name``."""
    mod = type(sys)(f"fake_kernels_{name}")

    def hook(register) -> None:
        register(name, lambda config, device, dtype: None, **register_kw)

    mod.register_kernels = pitstop.hookimpl(hook)
    return mod


def test_kernels_auto_asks_what_each_kernel_set_declares() -> None:
    pm = PluginManager()  # the built-ins: fused declares cuda, reference any device
    assert (pm.auto_kernels("cuda"), pm.auto_kernels("cpu")) == ("fused", "reference")
    assert pm.auto_kernels("xpu") == "reference"
    pm.add_module(_kernels_module("cpu-fast", auto_devices=("cpu",)), distribution="x", version="1")
    assert pm.auto_kernels("cpu") == "cpu-fast" and pm.auto_kernels("cuda") == "fused"
    bare = PluginManager(load_entry_points=False, extra_modules=[_kernels_module("only")])
    with pytest.raises(ConfigError, match="no registered kernel set declares itself for 'cpu'"):
        bare.auto_kernels("cpu")


def test_auto_devices_is_for_kernel_sets_only() -> None:
    mod = type(sys)("fake_sampler_auto")
    mod.register_samplers = pitstop.hookimpl(
        lambda register: register("s", lambda config, device: None, auto_devices=("cuda",))
    )
    with pytest.raises(PluginError, match="only kernel sets take auto_devices"):
        PluginManager(load_entry_points=False, extra_modules=[mod])
    with pytest.raises(PluginError, match="device type names"):
        PluginManager(
            load_entry_points=False, extra_modules=[_kernels_module("k", auto_devices=("",))]
        )
