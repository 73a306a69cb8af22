"""The executor kind: how the engine picks what runs a model split over several ranks.

The ``mp`` executor itself (tensor parallelism over gloo) is tested in
tests/plugins/executors/; here, the boundary: the name is checked once, with the others,
an executor of a third party's runs the engine from the context it is handed, and at
``tensor_parallel_size = 1`` nothing of the executor's is imported.
"""

from __future__ import annotations

import json
import multiprocessing
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from helpers.models import make_tiny_checkpoint

import pitstop
from pitstop import EngineConfig
from pitstop.entrypoints.llm import LLM
from pitstop.entrypoints.sampling_params import SamplingParams
from pitstop.errors import PluginError
from pitstop.loop import engine as engine_module
from pitstop.plugin_system import settings
from pitstop.plugin_system.plugin_manager import PluginManager, get_plugin_manager
from pitstop.runner import model_runner
from pitstop.runner.model_runner import ModelRunner

GREEDY = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8], [9] * 12, [3]]
SETTINGS = dict(device="cpu", kv_cache_gib=0.01, max_model_len=64)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("executor"), "llama", with_tokenizer=False)


def test_an_unknown_executor_is_refused_naming_the_registered_ones() -> None:
    pm = get_plugin_manager()
    config = EngineConfig(tensor_parallel_size=2, distributed_executor_backend="ray")
    with pytest.raises(PluginError, match=r"unknown executor 'ray'; registered executor names: mp"):
        pm.resolve(config)
    near = EngineConfig(tensor_parallel_size=2, distributed_executor_backend="mpp")
    with pytest.raises(PluginError, match=r"unknown executor 'mpp' \(did you mean 'mp'\?\)"):
        pm.resolve(near)


def test_an_engine_with_an_unknown_executor_starts_nothing() -> None:
    with pytest.raises(PluginError, match="unknown executor 'ray'.*registered executor names: mp"):
        LLM(
            "dummy:qwen3-0.6b",
            tensor_parallel_size=2,
            distributed_executor_backend="ray",
            **SETTINGS,
        )
    assert not multiprocessing.active_children()


def test_at_one_rank_the_executor_is_not_looked_up() -> None:
    # vLLM's "uni" (one process) is what pitstop does at tensor_parallel_size=1
    resolved = get_plugin_manager().resolve(EngineConfig(distributed_executor_backend="uni"))
    assert resolved.of("executor") is None


class OneProcess:
    """The whole model in the engine's process, whatever the size says (docs/plugins.md)."""

    contexts: list = []

    def __init__(self, config):
        self.config = config

    def rank_model_config(self, model_config):
        return model_config

    def start(self, context):
        OneProcess.contexts.append(context)
        return ModelRunner(
            context.config,
            context.model_config,
            context.plugins,
            context.device,
            context.dtype,
            resolved=context.resolved,
        )


def _one_process_module() -> ModuleType:
    module = ModuleType("one_process_executor")

    def register_executors(register) -> None:
        register("one-process", OneProcess)

    module.register_executors = pitstop.hookimpl(register_executors)
    return module


def test_a_third_party_executor_runs_the_engine_from_the_config_resolved_once(
    tiny: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    want = [
        o.token_ids
        for o in LLM(str(tiny), **SETTINGS).generate(
            prompt_token_ids=PROMPTS, sampling_params=GREEDY, use_tqdm=False
        )
    ]
    pm = PluginManager(extra_modules=[_one_process_module()])
    assert "one-process" in pm.names("executor") and "mp" in pm.names("executor")
    resolved = []
    original = settings.resolve

    def counted(*a: Any, **k: Any) -> Any:
        resolved.append(a)
        return original(*a, **k)

    for module in (settings, engine_module, model_runner):  # each place resolve is called from
        monkeypatch.setattr(module, "resolve", counted)
    OneProcess.contexts.clear()
    llm = LLM(
        str(tiny),
        tensor_parallel_size=2,
        distributed_executor_backend="one-process",
        plugins=pm,
        **SETTINGS,
    )
    assert len(resolved) == 1  # by the engine; the executor's runner took it from the context
    (context,) = OneProcess.contexts
    assert context.resolved.config is resolved[0][0]  # the engine's resolution, handed on
    assert context.config is llm.engine.config
    assert context.plugins is pm and context.model_config == llm.engine.model_config
    got = llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY, use_tqdm=False)
    assert [o.token_ids for o in got] == want


_ONE_RANK_SCRIPT = """
import json, sys
import torch.distributed as dist
from pitstop import LLM, SamplingParams
llm = LLM(sys.argv[1], device="cpu", kv_cache_gib=0.01, max_model_len=64)
llm.generate(prompt_token_ids=[[1, 2, 3]], sampling_params=SamplingParams(max_tokens=2),
             use_tqdm=False)
loaded = sorted(m for m in sys.modules if m.startswith("pitstop.plugins.executors"))
print("LOADED", json.dumps([loaded, dist.is_initialized()]))
"""


def test_an_engine_of_one_rank_imports_no_tensor_parallel_code(tiny: Path) -> None:
    # only the module that registers the mp executor loads (with every plugin); its
    # sharding, process groups, collectives, launcher and runners do not
    done = subprocess.run(
        [sys.executable, "-c", _ONE_RANK_SCRIPT, str(tiny)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("LOADED "))
    loaded, distributed = json.loads(line.removeprefix("LOADED "))
    assert loaded == [
        "pitstop.plugins.executors",
        "pitstop.plugins.executors.tensor_parallel",
        "pitstop.plugins.executors.tensor_parallel.executor",
    ]
    assert distributed is False
