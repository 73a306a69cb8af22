"""The named workloads of docs/workloads.md, random ones in the style of ``vllm bench``, and JSONL files.

Token ids are drawn from a seeded generator (the model does not care what they
say), EOS is ignored, and every request produces exactly its ``output_len``.
``nano`` reproduces nano-vllm's ``bench.py`` draw for draw (``random.seed(0)``,
prompt lengths and token ids interleaved, then output lengths), which is what
docs/workloads.md's floor table was computed from.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs

from pitstop.errors import PitstopError

# nano-vllm draws token ids in [0, 10000]; every preset's vocabulary is larger.
TOKEN_ID_HIGH = 10000


class WorkloadError(PitstopError, ValueError):
    """A workload name, range or file is invalid."""


@attrs.frozen
class BenchRequest:
    """One request of a workload: token ids (or text) and exactly how many tokens to generate."""

    output_len: int
    prompt_token_ids: tuple[int, ...] | None = attrs.field(
        default=None, converter=lambda v: None if v is None else tuple(v)
    )
    prompt: str | None = None

    @property
    def input_len(self) -> int:
        """Prompt length in tokens (text prompts: unknown until tokenized, reported as 0)."""
        return len(self.prompt_token_ids) if self.prompt_token_ids is not None else 0


@attrs.frozen(kw_only=True)
class Workload:
    """A list of requests plus how they are sent and sampled.

    ``mode`` is ``offline`` (every request submitted at once) or ``online``
    (``concurrency`` closed-loop clients, or Poisson arrivals at ``request_rate``
    requests per second). ``repeats`` > 1 times the run that many times after a
    warm-up and keeps the best (``single``).
    """

    name: str
    requests: tuple[BenchRequest, ...] = attrs.field(converter=tuple)
    mode: str = "offline"
    concurrency: int | None = None
    request_rate: float | None = None
    temperature: float = 0.0
    top_k: int = -1
    repeats: int = 1
    seed: int = 0
    default_model: str | None = None
    engine_defaults: dict[str, Any] = attrs.Factory(dict)
    shared_prefix_len: int = 0  # tokens at the start of each prompt shared with other requests
    # requests one client sends one after another, each when the one before completed (the
    # turns of conversations); None: every request on its own
    streams: tuple[tuple[int, ...], ...] | None = None
    # vLLM's own arguments for this workload (``--peer vllm``), beside the shared ones
    peer_args: dict[str, Any] = attrs.Factory(dict)
    description: str = ""

    @property
    def reuses_prompts(self) -> bool:
        """Whether prompts repeat earlier prompts' tokens (a shared prefix, a history)."""
        return self.shared_prefix_len > 0 or self.streams is not None

    @property
    def num_requests(self) -> int:
        return len(self.requests)

    @property
    def total_input_tokens(self) -> int:
        return sum(r.input_len for r in self.requests)

    @property
    def total_output_tokens(self) -> int:
        return sum(r.output_len for r in self.requests)

    def summary(self) -> dict[str, Any]:
        """What the JSON output says about the workload."""
        ins = [r.input_len for r in self.requests]
        outs = [r.output_len for r in self.requests]
        return {
            "name": self.name,
            "mode": self.mode,
            "num_requests": self.num_requests,
            "concurrency": self.concurrency,
            "request_rate": self.request_rate,
            "seed": self.seed,
            "temperature": self.temperature,
            "top_k": self.top_k,
            "repeats": self.repeats,
            "input_tokens": sum(ins),
            "output_tokens": sum(outs),
            "input_len_range": [min(ins, default=0), max(ins, default=0)],
            "output_len_range": [min(outs, default=0), max(outs, default=0)],
            "shared_prefix_len": self.shared_prefix_len,
            "streams": len(self.streams) if self.streams is not None else None,
        }


Range = tuple[int, int]


def parse_range(text: str) -> Range:
    """``"A:B"`` (inclusive) or ``"N"`` -> ``(A, B)``; both positive, A <= B."""
    try:
        lo, _, hi = text.partition(":")
        a, b = int(lo), int(hi or lo)
    except ValueError:
        raise WorkloadError(f"a length range is A:B (or N), got {text!r}") from None
    if a < 1 or b < a:
        raise WorkloadError(f"a length range needs 1 <= A <= B, got {text!r}")
    return a, b


def _ids(rng: random.Random, n: int, high: int) -> list[int]:
    return [rng.randint(0, high) for _ in range(n)]


def _uniform_requests(
    rng: random.Random, num_requests: int, input_len: Range, output_len: Range, token_high: int
) -> list[BenchRequest]:
    """Requests with uniform output and prompt lengths (output drawn first, then the prompt)."""
    return [
        BenchRequest(rng.randint(*output_len), _ids(rng, rng.randint(*input_len), token_high))
        for _ in range(num_requests)
    ]


# ---------------------------------------------------------------------- generators
def nano(
    num_requests: int = 256,
    input_len: Range = (100, 1024),
    output_len: Range = (100, 1024),
    seed: int = 0,
    token_high: int = TOKEN_ID_HIGH,
) -> Workload:
    """nano-vllm's offline throughput benchmark (256 requests, all at once)."""
    rng = random.Random(seed)
    prompts = [_ids(rng, rng.randint(*input_len), token_high) for _ in range(num_requests)]
    outs = [rng.randint(*output_len) for _ in range(num_requests)]
    return Workload(
        name="nano",
        requests=[BenchRequest(o, p) for p, o in zip(prompts, outs, strict=True)],
        seed=seed,
        default_model="dummy:qwen3-0.6b",
        engine_defaults={"max_model_len": 4096},
        description="offline throughput, nano-vllm's benchmark",
    )


def single(
    num_requests: int = 1,
    input_len: Range = (128, 128),
    output_len: Range = (256, 256),
    seed: int = 0,
    token_high: int = TOKEN_ID_HIGH,
) -> Workload:
    """One interactive stream, sampled at temperature 0.8 / top-k 200, best of 5 after a warm-up."""
    reqs = _uniform_requests(random.Random(seed), num_requests, input_len, output_len, token_high)
    return Workload(
        name="single",
        requests=reqs,
        temperature=0.8,
        top_k=200,
        repeats=5,
        seed=seed,
        default_model="dummy:llama3-8b",
        description="one interactive stream (decode latency)",
    )


def cpu_smoke(
    num_requests: int = 64,
    input_len: Range = (16, 256),
    output_len: Range = (16, 128),
    seed: int = 0,
    token_high: int = TOKEN_ID_HIGH,
) -> Workload:
    """What a developer machine can run: SmolLM2-135M, fp32, CPU, greedy, all at once."""
    reqs = _uniform_requests(random.Random(seed), num_requests, input_len, output_len, token_high)
    return Workload(
        name="cpu-smoke",
        requests=reqs,
        seed=seed,
        default_model="smollm2-135m",
        engine_defaults={"device": "cpu", "dtype": "float32"},
        description="SmolLM2-135M on a CPU",
    )


def _longtail_requests(
    rng: random.Random,
    num_requests: int,
    input_len: Range | None,
    output_len: Range,
    token_high: int,
    prefixes: list[list[int]] | None = None,
) -> list[BenchRequest]:
    reqs = []
    for _ in range(num_requests):
        if input_len is not None:
            n = rng.randint(*input_len)
        elif rng.random() < 0.9:
            n = rng.randint(128, 512)
        else:
            n = rng.randint(2048, 4096)
        out = rng.randint(*output_len)
        ids = _ids(rng, n, token_high)
        if prefixes:
            ids = prefixes[rng.randrange(len(prefixes))] + ids
        reqs.append(BenchRequest(out, ids))
    return reqs


def longtail(
    num_requests: int = 500,
    input_len: Range | None = None,
    output_len: Range = (32, 256),
    seed: int = 0,
    token_high: int = TOKEN_ID_HIGH,
) -> Workload:
    """The article's online experiment: 90% short prompts, 10% long ones; 32 closed-loop clients."""
    rng = random.Random(seed)
    return Workload(
        name="longtail",
        requests=_longtail_requests(rng, num_requests, input_len, output_len, token_high),
        mode="online",
        concurrency=32,
        seed=seed,
        default_model="dummy:qwen3-8b",
        # the longest prompt (4,096) plus the longest output (256) must fit
        engine_defaults={"max_model_len": 4096 + 256},
        description="online latency, long-tailed prompts",
    )


PREFIX_COUNT = 4
PREFIX_LEN = 1024


def prefix(
    num_requests: int = 500,
    input_len: Range | None = None,
    output_len: Range = (32, 256),
    seed: int = 0,
    token_high: int = TOKEN_ID_HIGH,
    prefix_len: int = PREFIX_LEN,
) -> Workload:
    """``longtail`` with one of 4 fixed system prompts (1,024 tokens; ``prefix_len``, the
    CLI's ``--shared-prefix-len``) before each prompt."""
    rng = random.Random(seed)
    prefixes = [_ids(rng, prefix_len, token_high) for _ in range(PREFIX_COUNT)]
    return Workload(
        name="prefix",
        requests=_longtail_requests(rng, num_requests, input_len, output_len, token_high, prefixes),
        mode="online",
        concurrency=32,
        seed=seed,
        default_model="dummy:qwen3-8b",
        shared_prefix_len=prefix_len,
        engine_defaults={"max_model_len": prefix_len + 4096 + 256},
        description=f"longtail behind 4 shared system prompts of {prefix_len} tokens",
    )


MULTITURN_TURNS = 6
MULTITURN_OPEN = 4  # conversations one client keeps open, sending their turns in turn
MULTITURN_KV_GIB = 16.0  # the device cache: about 116k tokens of qwen3-8b, under the histories
MULTITURN_HOST_GIB = 64.0  # vLLM's kv_offloading_size (and the tiered column's, in its matrix)


def multiturn(
    num_requests: int = 200 * MULTITURN_TURNS,
    input_len: Range = (1500, 3000),
    output_len: Range = (100, 300),
    seed: int = 0,
    token_high: int = TOKEN_ID_HIGH,
) -> Workload:
    """Conversations of 6 turns, each prompt the whole history so far plus a new message.

    ``num_requests`` turns in all (200 conversations by default); ``input_len``
    is the first prompt's range, each later message a quarter of it, and each
    reply ``output_len`` (the reply in the next turn's history is drawn, as
    the model's own tokens would be ignored text to the engine). A client keeps
    4 conversations open and sends their turns in turn, so a history waits
    for 3 other requests of its client (and everyone else's traffic) between
    two turns: what users who read and think do to a cache.
    """
    rng = random.Random(seed)
    message = (max(1, input_len[0] // 4), max(1, input_len[1] // 4))
    num_conversations = -(-num_requests // MULTITURN_TURNS)
    turns: list[list[BenchRequest]] = []
    for c in range(num_conversations):
        count = min(MULTITURN_TURNS, num_requests - c * MULTITURN_TURNS)
        history = _ids(rng, rng.randint(*input_len), token_high)
        conversation = []
        for _ in range(count):
            out = rng.randint(*output_len)
            conversation.append(BenchRequest(out, history))
            history = history + _ids(rng, out, token_high)  # the reply
            history = history + _ids(rng, rng.randint(*message), token_high)  # the next message
        turns.append(conversation)
    requests: list[BenchRequest] = []
    index: list[list[int]] = []
    for conversation in turns:
        index.append(list(range(len(requests), len(requests) + len(conversation))))
        requests.extend(conversation)
    streams = []
    for first in range(0, len(turns), MULTITURN_OPEN):
        group = index[first : first + MULTITURN_OPEN]
        streams.append(
            tuple(ids[t] for t in range(MULTITURN_TURNS) for ids in group if t < len(ids))
        )
    longest = max(r.input_len + r.output_len for r in requests)
    return Workload(
        name="multiturn",
        requests=requests,
        mode="online",
        concurrency=16,
        seed=seed,
        default_model="dummy:qwen3-8b",
        streams=tuple(streams),
        engine_defaults={
            "max_model_len": max(longest, 8192),
            "kv_cache_gib": MULTITURN_KV_GIB,
        },
        peer_args={
            "kv_offloading_size": MULTITURN_HOST_GIB,
            "kv_offloading_backend": "native",
        },
        description="conversations whose turns resend their whole history",
    )


GENERATORS: dict[str, Callable[..., Workload]] = {
    "nano": nano,
    "single": single,
    "cpu-smoke": cpu_smoke,
    "longtail": longtail,
    "prefix": prefix,
    "multiturn": multiturn,
}
OFFLINE = ("nano", "single", "cpu-smoke")
ONLINE = ("longtail", "prefix", "multiturn")


def build_workload(
    name: str,
    *,
    num_requests: int | None = None,
    input_len: Range | None = None,
    output_len: Range | None = None,
    seed: int = 0,
    token_high: int = TOKEN_ID_HIGH,
    shared_prefix_len: int | None = None,
) -> Workload:
    """A named workload (or a JSONL file), with the overrides the CLI allows
    (``shared_prefix_len``: the ``prefix`` workload's system prompts, ``--shared-prefix-len``)."""
    if num_requests is not None and num_requests < 1:
        raise WorkloadError(f"--num-requests must be >= 1, got {num_requests}")
    if shared_prefix_len is not None and (name != "prefix" or shared_prefix_len < 1):
        raise WorkloadError(
            f"--shared-prefix-len {shared_prefix_len}: only the prefix workload has shared system "
            "prompts, and their length is at least 1 token; drop the flag or use --workload prefix"
        )
    if name not in GENERATORS:
        path = Path(name)
        if path.suffix in (".jsonl", ".json") or path.exists():
            wl = load_jsonl(path, seed=seed, token_high=token_high)
            reqs = wl.requests[:num_requests] if num_requests else wl.requests
            return attrs.evolve(wl, requests=reqs)
        raise WorkloadError(
            f"unknown workload {name!r}; named workloads: {', '.join(GENERATORS)}, or a JSON-lines file"
        )
    kwargs: dict[str, Any] = {"seed": seed, "token_high": token_high}
    if num_requests is not None:
        kwargs["num_requests"] = num_requests
    if input_len is not None:
        kwargs["input_len"] = input_len
    if output_len is not None:
        kwargs["output_len"] = output_len
    if shared_prefix_len is not None:
        kwargs["prefix_len"] = shared_prefix_len
    return GENERATORS[name](**kwargs)


# ---------------------------------------------------------------------- JSONL files
def load_jsonl(path: str | Path, *, seed: int = 0, token_high: int = TOKEN_ID_HIGH) -> Workload:
    """Read a JSON-lines file: one object a line with ``prompt`` (text), ``prompt_token_ids``
    or ``input_len`` (random ids), and ``output_len`` (or ``max_tokens``).

    Blank lines and lines starting with ``#`` are skipped; any other bad line is
    an error naming the line.
    """
    path = Path(path)
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise WorkloadError(f"cannot read workload file {path}: {exc}") from exc
    rng = random.Random(seed)
    reqs: list[BenchRequest] = []
    for no, line in enumerate(lines, 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        where = f"{path}:{no}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise WorkloadError(f"{where}: not valid JSON ({exc.msg})") from None
        if not isinstance(obj, dict):
            raise WorkloadError(
                f"{where}: each line must be a JSON object, got {type(obj).__name__}"
            )
        out = obj.get("output_len", obj.get("max_tokens"))
        if not isinstance(out, int) or isinstance(out, bool) or out < 1:
            raise WorkloadError(
                f"{where}: needs output_len (or max_tokens), an integer >= 1; got {out!r}"
            )
        given = [k for k in ("prompt", "prompt_token_ids", "input_len") if k in obj]
        if len(given) != 1:
            raise WorkloadError(
                f"{where}: give exactly one of prompt, prompt_token_ids, input_len (got {given or 'none'})"
            )
        key = given[0]
        value = obj[key]
        if key == "prompt":
            if not isinstance(value, str) or not value:
                raise WorkloadError(f"{where}: prompt must be non-empty text")
            reqs.append(BenchRequest(out, prompt=value))
        elif key == "prompt_token_ids":
            if (
                not isinstance(value, list)
                or not value
                or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value)
            ):
                raise WorkloadError(
                    f"{where}: prompt_token_ids must be a non-empty list of integers >= 0"
                )
            reqs.append(BenchRequest(out, value))
        else:
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise WorkloadError(f"{where}: input_len must be an integer >= 1, got {value!r}")
            reqs.append(BenchRequest(out, _ids(rng, value, token_high)))
    if not reqs:
        raise WorkloadError(f"workload file {path} holds no requests")
    return Workload(name=path.name, requests=reqs, seed=seed, description=f"requests from {path}")


def fit_to_model(
    workload: Workload, *, vocab_size: int, max_model_len: int
) -> tuple[Workload, list[str]]:
    """Drop requests that cannot run (longer than ``max_model_len``, ids outside the vocabulary).

    Returns the workload that remains and one message per skipped request, so a
    bad line in a user's file is reported and counted, not a crash.
    """
    kept: list[BenchRequest] = []
    skipped: list[str] = []
    new_index: dict[int, int] = {}
    for i, r in enumerate(workload.requests):
        if r.prompt_token_ids is not None:
            if r.input_len + r.output_len > max_model_len:
                skipped.append(
                    f"request {i}: {r.input_len} prompt + {r.output_len} output tokens exceed "
                    f"max_model_len {max_model_len}"
                )
                continue
            if max(r.prompt_token_ids) >= vocab_size:
                skipped.append(
                    f"request {i}: token id {max(r.prompt_token_ids)} >= vocabulary {vocab_size}"
                )
                continue
        new_index[i] = len(kept)
        kept.append(r)
    if not kept:
        raise WorkloadError(
            f"no request of workload {workload.name!r} fits this model: " + "; ".join(skipped[:3])
        )
    streams = workload.streams
    if streams is not None:  # the turns that remain, in their order
        streams = tuple(
            kept_ids
            for kept_ids in (tuple(new_index[i] for i in s if i in new_index) for s in streams)
            if kept_ids
        )
    return attrs.evolve(workload, requests=kept, streams=streams), skipped
