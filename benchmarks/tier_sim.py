"""Replay the ``multiturn`` workload's turns through the ``tiered`` allocator on the CPU.

The allocator alone, no model: the bench driver's clients (the workload's ``concurrency``,
16) each run one conversation group's turns in order, then the next group no client has
started; a wave is each busy client's next turn, admitted (its prompt pages looked up on
the device, then on the host; the wave cut where the device cache would overflow), its
prompt counted as computed, its reply appended in chunks of 10 tokens with a step boundary
(``before_launch``) before each chunk, then freed; the next wave follows. (Until
2026-12-07 every group ran at once: past 384 turns that put more histories between two
turns of a conversation than the host tier holds, 1.3% hits at 1,200 turns, which the
driver never does: 75.7% with it.) Device and host sizes are the workload's
(``kv_cache_gib`` and ``--kv-offloading-size`` GiB of ``qwen3-8b`` pages). Prints the
hit rate of prompt tokens and the pages copied each way, in GiB of ``qwen3-8b``.

Copies move no bytes here (a 4-byte page stands in). ``--late``: every copy stays in
flight until the step boundary after the next, as an asynchronous copy on a GPU can,
which is what exposed duplicate saves of one page in issue 50 (the H200 copied 334 GiB
to a 64 GiB tier on 360 turns). Usage::

    python benchmarks/tier_sim.py --num-requests 360 [--late] [--host-gib 64]
"""

from __future__ import annotations

import argparse
import random
from typing import Any

import torch

from pitstop.bench.workloads import MULTITURN_HOST_GIB, MULTITURN_KV_GIB, build_workload
from pitstop.entrypoints.sampling_params import SamplingParams
from pitstop.plugins.allocators.tiered import TieredAllocator
from pitstop.plugins.allocators.tiered.copier import PageCopier, PageCopy
from pitstop.requests.sequence import Sequence

PAGE = 16
TOKEN_BYTES = 147_456  # qwen3-8b: 36 layers x K and V x 8 heads x 128 x 2 bytes
CHUNK = 10  # reply tokens between two step boundaries


class _Late:
    """A copy's end, reached after ``steps`` step boundaries (or when waited for)."""

    def __init__(self, steps: int) -> None:
        self.left = steps

    def query(self) -> bool:
        return self.left <= 0

    def synchronize(self) -> None:
        self.left = 0

    def seconds(self) -> float:
        return 0.0

    def fence(self) -> None:
        pass


class LateCopier(PageCopier):
    """Copies that end two step boundaries after they start (see :class:`_Late`)."""

    def __init__(self, kv_cache: torch.Tensor, host_slots: int) -> None:
        super().__init__(kv_cache, host_slots)
        self.signals: list[_Late] = []

    def _copy(self, direction: str, pages: list[int], slots: list[int]) -> PageCopy:
        signal = _Late(2)
        self.signals.append(signal)
        return PageCopy(direction, pages, slots, len(pages) * self.page_bytes, signal)

    def step(self) -> None:
        """One step boundary passed."""
        for signal in self.signals:
            signal.left -= 1
        self.signals = [s for s in self.signals if s.left > 0]


def replay(num_requests: int, host_gib: float, late: bool) -> dict[str, Any]:
    """Run the replay; the hit rate and the GiB copied each way."""
    workload = build_workload("multiturn", num_requests=num_requests)
    device_pages = int(MULTITURN_KV_GIB * 2**30 // (PAGE * TOKEN_BYTES))
    host_pages = int(host_gib * 2**30 // (PAGE * TOKEN_BYTES))
    factory = LateCopier if late else PageCopier
    alloc = TieredAllocator(PAGE, device_pages, max_host_pages=host_pages, copier_factory=factory)
    alloc.bind_kv_cache(torch.zeros(1, 1, device_pages, PAGE, 1, 1))

    def boundary() -> None:
        if late:
            alloc.copier.step()
        alloc.before_launch()

    rng = random.Random(0)
    streams = [list(s) for s in workload.streams]
    prompt_tokens = cached_tokens = waves = 0

    def run(wave: list[tuple[Sequence, int]]) -> None:
        """Generate the wave's replies, a step boundary before each chunk, then free them."""
        for done in range(0, max((out for _, out in wave), default=0), CHUNK):
            boundary()
            for seq, out in wave:
                n = min(CHUNK, out - done)
                if n <= 0:
                    continue
                alloc.append(seq, n)
                for _ in range(n):
                    seq.append_token(rng.randrange(10_000))
                seq.num_computed_tokens = seq.num_tokens - 1
                alloc.on_tokens_computed(seq)
        for seq, _ in wave:
            alloc.free(seq)

    # the bench's driver: ``concurrency`` clients, each sending its stream's turns one after
    # another and then taking the next stream no client has started (replayed in lockstep: a
    # wave is each busy client's next turn)
    clients = workload.concurrency or len(streams)
    queue = list(range(len(streams)))[::-1]
    active: list[list[int]] = [
        [queue.pop(), 0] for _ in range(min(clients, len(streams)))
    ]  # [stream, next turn]
    while active:
        wave: list[tuple[Sequence, int]] = []
        for client in active:
            s, turn = streams[client[0]], client[1]
            client[1] += 1
            request = workload.requests[s[turn]]
            seq = Sequence(
                request_id=f"turn-{s[turn]}",
                prompt_token_ids=list(request.prompt_token_ids or ()),
                sampling_params=SamplingParams(),
            )
            boundary()
            # the device holds no more of this wave (its prompt and every reply so far, no
            # hit counted): finish what it holds first, as the engine's scheduler would wait
            # (1,200 turns: 16 histories of up to 7.3k tokens outgrow the 116k-token cache)
            reserve = sum(-(-out // PAGE) + 1 for _, out in wave)
            need = -(-(seq.num_tokens + request.output_len) // PAGE) + 1
            if wave and need + reserve > alloc.stats().pages_free:
                run(wave)
                waves += 1
                wave = []
                boundary()
            cached = alloc.allocate(seq)
            cached_tokens += cached
            prompt_tokens += seq.num_tokens
            seq.num_computed_tokens = seq.num_tokens
            alloc.on_tokens_computed(seq)
            wave.append((seq, request.output_len))
        run(wave)
        waves += 1
        for client in active:
            if client[1] >= len(streams[client[0]]) and queue:
                client[:] = [queue.pop(), 0]
        active = [c for c in active if c[1] < len(streams[c[0]])]
    counters = alloc.counters.as_dict()
    page_bytes = 4 * PAGE  # the stand-in kv cache: float32, one element a token
    gib = PAGE * TOKEN_BYTES / 2**30
    return {
        "hit_rate": cached_tokens / prompt_tokens,
        "gib_to_host": counters["bytes_to_host"] / page_bytes * gib,
        "gib_to_device": counters["bytes_to_device"] / page_bytes * gib,
        "device_pages": device_pages,
        "host_pages": host_pages,
        "waves": waves,
    }


def main(argv: list[str] | None = None) -> int:
    """Print one line of figures."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--num-requests", type=int, default=360)
    parser.add_argument("--host-gib", type=float, default=MULTITURN_HOST_GIB)
    parser.add_argument("--late", action="store_true", help="copies end two steps later")
    args = parser.parse_args(argv)
    r = replay(args.num_requests, args.host_gib, args.late)
    print(
        f"{args.num_requests} turns, {r['device_pages']} device and {r['host_pages']} host pages"
        f"{', late copies' if args.late else ''}: hit rate {r['hit_rate']:.1%}, "
        f"{r['gib_to_host']:.1f} GiB to host, {r['gib_to_device']:.1f} GiB to device"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
