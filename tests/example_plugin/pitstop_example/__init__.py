"""An example third-party pitstop plugin.

It registers one strategy of each kind but the sampler, one command and one
observer:

* the allocator ``lifo``: paged KV cache whose free list is a stack, so the
  page freed last is handed out first (warm in the GPU's L2 when it is
  reused soon);
* the scheduler ``sjf`` (:mod:`pitstop_example.sjf`): shortest job first
  with an aging bound, written against the scheduler protocol alone;
* the kernel set ``sdpa`` (:mod:`pitstop_example.sdpa`): a step's attention
  in a few batched torch SDPA calls, every other op from another kernel set;
* the proposer ``recall`` (:mod:`pitstop_example.recall`): drafts what
  followed the same tokens last time, in any request;
* the command ``pitstop lifo-demo``: admits and frees a few sequences on a
  ``lifo`` allocator built from the engine flags (``--page-size``,
  ``--lifo.max-pages``) and prints which pages each one got;
* the model architecture ``BigramForCausalLM`` (:mod:`pitstop_example.bigram`):
  a checkpoint folder whose ``config.json`` names it loads and runs like a
  Llama one;
* the weight format ``int8`` (:mod:`pitstop_example.int8`): weight-only int8
  with one scale per output channel, in plain torch (``weights="int8"``);
* the model source ``npz`` (:mod:`pitstop_example.npz`): a bigram model saved
  with ``numpy.savez`` loads by its path (``LLM("model.npz")``);
* an ``on_request_finished`` observer that counts finished requests by
  finish reason (read them from ``FINISHED``).

Install it (``pip install -e tests/example_plugin``) and pick it by name:
``LLM("smollm2-135m", allocator="lifo", scheduler="sjf", kernels="sdpa",
speculative="recall")``.
"""

from __future__ import annotations

import argparse
from collections import Counter
from types import SimpleNamespace
from typing import Any

import attrs

import pitstop
import pitstop.entrypoints.engine_args
from pitstop.entrypoints.engine_args import config_from_cli
from pitstop.plugin_system.plugin_manager import get_plugin_manager
from pitstop.plugin_system.protocols import AllocatorStats
from pitstop.plugin_system.settings import read_settings, setting
from pitstop_example import bigram, int8, npz, recall, sdpa, sjf

FINISHED: Counter[str] = Counter()


class LifoAllocator:
    """Pages of ``page_size`` tokens on demand; the most recently freed page is reused first."""

    def __init__(self, num_pages: int, page_size: int) -> None:
        self.num_pages = num_pages
        self.page_size = page_size
        self._free = list(range(num_pages - 1, -1, -1))  # a stack: pop() takes page 0 first
        self._tables: dict[int, list[int]] = {}
        self._held: dict[int, int] = {}

    def _pages(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def can_allocate(self, seq: Any) -> bool:
        """Whether ``seq`` is new and the whole of it fits in the free pages."""
        return seq.seq_id not in self._tables and self._pages(seq.num_tokens) <= len(self._free)

    def allocate(self, seq: Any) -> int:
        """Give ``seq`` pages for all its tokens; nothing is ever cached, so return 0."""
        if seq.seq_id in self._tables:
            raise RuntimeError(f"sequence {seq.request_id!r} is already admitted")
        need = self._pages(seq.num_tokens)
        if need > len(self._free):
            raise RuntimeError(
                f"out of KV pages: {seq.request_id!r} needs {need}, {len(self._free)} free"
            )
        self._tables[seq.seq_id] = [self._free.pop() for _ in range(need)]
        self._held[seq.seq_id] = seq.num_tokens
        return 0

    def can_append(self, seq: Any, num_tokens: int) -> bool:
        """Whether ``seq`` can hold ``num_tokens`` more tokens."""
        held = self._held[seq.seq_id]
        extra = self._pages(held + num_tokens) - len(self._tables[seq.seq_id])
        return extra <= len(self._free)

    def append(self, seq: Any, num_tokens: int) -> None:
        """Make ``seq`` hold ``num_tokens`` more tokens, taking pages as needed."""
        if not self.can_append(seq, num_tokens):
            raise RuntimeError(f"out of KV pages for {seq.request_id!r}")
        held = self._held[seq.seq_id] + num_tokens
        table = self._tables[seq.seq_id]
        while len(table) < self._pages(held):
            table.append(self._free.pop())
        self._held[seq.seq_id] = held

    def truncate(self, seq: Any, num_tokens: int) -> None:
        """Give back the last ``num_tokens`` tokens, and any page left empty."""
        held = self._held[seq.seq_id] - num_tokens
        if held < 0:
            raise RuntimeError(f"cannot truncate {num_tokens} tokens of {seq.request_id!r}")
        table = self._tables[seq.seq_id]
        while len(table) > self._pages(held):
            self._free.append(table.pop())
        self._held[seq.seq_id] = held

    def free(self, seq: Any) -> None:
        """Release every page of ``seq`` (last page first, so page order is kept on reuse)."""
        table = self._tables.pop(seq.seq_id, None)
        self._held.pop(seq.seq_id, None)
        if table:
            self._free.extend(reversed(table))

    def block_table(self, seq: Any) -> list[int]:
        """The pages of ``seq`` in token order."""
        return list(self._tables[seq.seq_id])

    def num_held_tokens(self, seq: Any) -> int:
        """How many token slots ``seq`` holds (0 if unknown)."""
        return self._held.get(seq.seq_id, 0)

    def on_tokens_computed(self, seq: Any) -> None:
        """Nothing to do: this allocator caches no prefixes."""

    def stats(self) -> AllocatorStats:
        """Pages free, tokens held and reserved."""
        used = self.num_pages - len(self._free)
        return AllocatorStats(
            num_pages=self.num_pages,
            pages_free=len(self._free),
            tokens_held=sum(self._held.values()),
            tokens_reserved=used * self.page_size,
        )


@attrs.frozen
class LifoSettings:
    """The settings of the ``lifo`` allocator: ``--lifo.max-pages``, ``[plugins.lifo]``."""

    max_pages: int | None = setting(
        None,
        type=int,
        minimum=1,
        optional=True,
        help="use at most this many of the KV cache's pages (unset: all of them)",
    )


def make_lifo(config: pitstop.EngineConfig, num_pages: int) -> LifoAllocator:
    """Paged KV cache that reuses the most recently freed page first."""
    settings = read_settings(config, "lifo", LifoSettings)
    if settings.max_pages is not None:
        num_pages = min(num_pages, settings.max_pages)
    return LifoAllocator(num_pages, config.page_size)


@pitstop.hookimpl
def register_allocators(register) -> None:
    """Register the ``lifo`` allocator."""
    register("lifo", make_lifo, settings=LifoSettings)


@pitstop.hookimpl
def register_schedulers(register) -> None:
    """Register the ``sjf`` scheduler."""
    register("sjf", sjf.make_sjf, settings=sjf.SjfSettings)


@pitstop.hookimpl
def register_kernels(register) -> None:
    """Register the ``sdpa`` kernel set."""
    register("sdpa", sdpa.make_sdpa, settings=sdpa.SdpaSettings)


@pitstop.hookimpl
def register_proposers(register) -> None:
    """Register the ``recall`` proposer."""
    register("recall", recall.make_recall, settings=recall.RecallSettings)


def add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    """``pitstop lifo-demo``'s flags: the cache size, then every engine and plugin setting."""
    parser.add_argument("--num-pages", type=int, default=8, help="pages in the demo cache")
    parser.add_argument(
        "--tokens", type=int, nargs="+", default=[5, 9, 3], help="token count of each sequence"
    )
    pitstop.entrypoints.engine_args.add_cli_flags(parser, with_model=False)


def run_demo(args: argparse.Namespace) -> int:
    """Admit the sequences, free the first, admit it again: the pages it gets back are reused."""
    allocator = get_plugin_manager().create(
        "allocator", "lifo", config_from_cli(args), args.num_pages
    )
    seqs = [
        SimpleNamespace(seq_id=i, request_id=f"s{i}", num_tokens=n)
        for i, n in enumerate(args.tokens)
    ]
    for seq in seqs:
        if not allocator.can_allocate(seq):
            print(f"{seq.request_id}: {seq.num_tokens} tokens do not fit")
            return 1
        allocator.allocate(seq)
        print(f"{seq.request_id}: pages {allocator.block_table(seq)}")
    allocator.free(seqs[0])
    again = SimpleNamespace(seq_id=len(seqs), request_id="again", num_tokens=seqs[0].num_tokens)
    allocator.allocate(again)
    print(f"again: pages {allocator.block_table(again)} (freed last, reused first)")
    return 0


@pitstop.hookimpl
def register_weight_formats(register) -> None:
    """Register the ``int8`` weight format."""
    register("int8", int8.make_int8, settings=int8.Int8Settings)


@pitstop.hookimpl
def register_commands(register) -> None:
    """Register ``pitstop lifo-demo``."""
    register("lifo-demo", add_demo_arguments, run_demo, help="show LIFO page reuse")


@pitstop.hookimpl
def register_models(register) -> None:
    """Register the ``BigramForCausalLM`` architecture."""
    register(bigram.ARCHITECTURE, bigram.make_bigram, architecture=bigram.BIGRAM)


@pitstop.hookimpl
def register_model_sources(register) -> None:
    """Register the ``npz`` model source."""
    register("npz", npz.make_npz_source)


@pitstop.hookimpl
def on_request_finished(engine: Any, output: Any) -> None:
    """Count finished requests by finish reason."""
    FINISHED[output.finish_reason] += 1
