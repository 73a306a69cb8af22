"""The start-up heap is frozen out of Python's collector (EngineConfig.freeze_gc)."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import pytest
from helpers.models import make_tiny_checkpoint

from pitstop import LLM, SamplingParams
from pitstop.loop.gc_heap import freeze_startup_heap, thaw_heap


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("gc"), "llama", with_tokenizer=False)


@pytest.fixture(autouse=True)
def _thawed():
    gc.unfreeze()
    yield
    gc.unfreeze()


def _engine(model: Path, **settings) -> LLM:
    settings.setdefault("freeze_gc", True)  # the suite's default is off (tests/conftest.py)
    return LLM(model=str(model), device="cpu", kv_cache_gib=0.01, max_model_len=64, **settings)


def test_freeze_gc_is_on_unless_the_environment_says_no(monkeypatch: pytest.MonkeyPatch) -> None:
    from pitstop import EngineConfig

    monkeypatch.delenv("PITSTOP_FREEZE_GC", raising=False)
    assert EngineConfig().freeze_gc is True
    for off in ("0", "false", "No", "off"):
        monkeypatch.setenv("PITSTOP_FREEZE_GC", off)
        assert EngineConfig().freeze_gc is False
    monkeypatch.setenv("PITSTOP_FREEZE_GC", "1")
    assert EngineConfig().freeze_gc is True


def test_start_up_freezes_the_heap_and_close_thaws_it(tiny: Path) -> None:
    llm = _engine(tiny)
    frozen = gc.get_freeze_count()
    assert frozen > 1000  # torch, the model's modules, the engine
    # a full collection now walks only what was made since start-up, not the frozen heap
    assert len(gc.get_objects(generation=2)) < frozen
    out = llm.generate(
        [{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=4, temperature=0.0)
    )
    assert len(out[0].outputs[0].token_ids) == 4
    llm.close()
    assert gc.get_freeze_count() == 0


def test_freeze_gc_off_leaves_the_collector_alone(tiny: Path) -> None:
    llm = _engine(tiny, freeze_gc=False)
    assert gc.get_freeze_count() == 0
    llm.close()
    assert gc.get_freeze_count() == 0


def test_an_engine_dropped_without_close_is_collected_at_the_next_start_up(tiny: Path) -> None:
    """Frozen objects are never collected: the next start-up thaws before it collects."""
    llm = _engine(tiny)
    cycle: list[object] = []
    cycle.append(cycle)  # garbage only a collection finds, frozen with the engine
    probe = weakref.ref(llm.engine)

    class Marker:
        pass

    marker = Marker()
    marker.self = marker  # a reference cycle that refcounting alone never frees
    alive = weakref.ref(marker)
    freeze_startup_heap()  # the marker is frozen too
    del marker, cycle, llm
    gc.collect()
    assert alive() is not None  # frozen: the collector does not see it
    second = _engine(tiny)
    assert alive() is None  # thawed and collected by the second engine's start-up
    assert probe() is None  # so is the first engine (it holds cycles of its own)
    second.close()


def test_thaw_heap_returns_every_object_to_the_collector() -> None:
    freeze_startup_heap()
    assert gc.get_freeze_count() > 0
    thaw_heap()
    assert gc.get_freeze_count() == 0
