"""``pitstop bench offline|online``: run a workload on one or more configurations (and a peer).

Registered through the ``register_commands`` hook (entry point ``commands-bench``). Examples::

    pitstop bench offline --workload cpu-smoke --peer transformers
    pitstop bench offline --workload nano --output results.json --plot nano.png
    pitstop bench online --workload longtail --matrix baseline,+paged,+continuous,+fused
    pitstop bench online --workload my-traffic.jsonl --request-rate 4 --model dummy:qwen3-0.6b
    pitstop bench online --url http://127.0.0.1:8000 --workload longtail --concurrency 32
    pitstop bench online --workload multiturn --matrix +prefix,+tiered --kv-offloading-size 64 --peer vllm
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
from pathlib import Path
from typing import Any

import attrs

from pitstop.bench import floor as floors
from pitstop.bench import matrix as matrices
from pitstop.bench.options import (
    SCHEMA,
    BenchError,
    clients_from_args,
    workload_from_args,
)
from pitstop.bench.peers import PEERS, PeerRun, measure_in_process
from pitstop.bench.report import (
    device_name,
    git_commit,
    now_iso,
    table,
    write_json,
)
from pitstop.bench.workloads import (
    GENERATORS,
    TOKEN_ID_HIGH,
    Workload,
    fit_to_model,
    parse_range,
)
from pitstop.config import EngineConfig
from pitstop.entrypoints.engine_args import add_cli_flags, config_from_cli, config_from_dict
from pitstop.errors import PitstopError
from pitstop.plugin_system.hookspecs import hookimpl

log = logging.getLogger(__name__)


@hookimpl
def register_commands(register: Any) -> None:
    """Register ``pitstop bench``."""
    register(
        "bench",
        add_arguments,
        cmd_bench,
        help="benchmark a workload (offline or online), configurations, peers",
    )


def add_arguments(bench: argparse.ArgumentParser) -> None:
    """``pitstop bench``'s ``offline`` and ``online`` modes and their flags."""
    modes = bench.add_subparsers(dest="bench_mode", required=True)
    for mode, names, help_text in (
        ("offline", "nano|single|cpu-smoke|FILE", "every request submitted at once"),
        (
            "online",
            "longtail|prefix|multiturn|FILE",
            "simulated clients: closed loop or Poisson arrivals",
        ),
    ):
        p = modes.add_parser(
            mode,
            help=help_text,
            description=__doc__,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        g = p.add_argument_group("workload")
        g.add_argument(
            "--workload",
            default="nano" if mode == "offline" else "longtail",
            help=f"{names}: a named workload (docs/workloads.md) or a JSON-lines file of requests",
        )
        g.add_argument(
            "--num-requests", type=int, help="how many requests (default: the workload's)"
        )
        g.add_argument(
            "--input-len", type=parse_range, metavar="A:B", help="prompt lengths, uniform in [A, B]"
        )
        g.add_argument(
            "--output-len",
            type=parse_range,
            metavar="A:B",
            help="output lengths, uniform in [A, B]",
        )
        g.add_argument(
            "--shared-prefix-len",
            type=int,
            metavar="N",
            help="the prefix workload's 4 system prompts, N tokens each (default 1,024)",
        )
        g.add_argument(
            "--repeats", type=int, help="timed runs after the warm-up, best kept (single: 5)"
        )
        g.add_argument("--no-warmup", action="store_true", help="skip the warm-up run")
        g.add_argument(
            "--lora-adapters",
            type=int,
            default=0,
            metavar="N",
            help="serve every request with one of N random LoRA adapters of rank --lora-rank on "
            "every projection, in turn (written for the model's shape; adapter=lora and "
            "max_loras=N unless set); a matrix configuration may set lora_adapters itself",
        )
        g.add_argument(
            "--lora-rank", type=int, default=16, metavar="R", help="rank of --lora-adapters (16)"
        )
        if mode == "online":
            g.add_argument(
                "--concurrency", type=int, help="closed-loop clients (default: the workload's, 32)"
            )
            g.add_argument(
                "--request-rate", type=float, help="Poisson arrivals, requests per second"
            )
            g.add_argument(
                "--url",
                metavar="URL",
                help="measure a running server (pitstop serve, http://HOST:PORT) through its "
                "OpenAI streaming API instead of an engine in this process",
            )
            g.add_argument(
                "--api-key",
                metavar="KEY",
                help="with --url: the server's API key (default: $PITSTOP_API_KEY)",
            )
        r = p.add_argument_group("what to compare")
        r.add_argument(
            "--matrix",
            help=f"configurations to run in turn: steps ({','.join(matrices.STEPS)}), each adding one "
            "strategy to the previous, or a TOML file of named configurations",
        )
        r.add_argument(
            "--only",
            metavar="NAMES",
            help="run only these configurations of --matrix (comma-separated; each keeps the "
            "settings of its place in the steps), e.g. to split one matrix over several runs",
        )
        r.add_argument(
            "--peer",
            choices=PEERS,
            help="also run the workload through this engine, same requests and model: "
            "transformers (in this process) or vllm (a process of its own; docs/benchmarks.md)",
        )
        r.add_argument(
            "--peer-arg",
            action="append",
            metavar="KEY=VALUE",
            help="with --peer vllm: an LLM(...) keyword / vllm serve flag on top of the "
            "shared ones (repeatable; VALUE is JSON or text), e.g. enforce_eager=true",
        )
        r.add_argument(
            "--measure-ceilings",
            action="store_true",
            help="measure copy bandwidth and bf16 matrix rate on this GPU for the floor (default: "
            "the H200's documented ones on an H200, measured on any other GPU)",
        )
        o = p.add_argument_group("output")
        o.add_argument(
            "--output", metavar="FILE", help="write every figure, config and timing as JSON"
        )
        o.add_argument(
            "--out",
            metavar="DIR",
            help="write DIR/results.json (summary + raw per-request and per-token timings) "
            "and DIR/plot.png (needs matplotlib)",
        )
        o.add_argument(
            "--plot",
            metavar="FILE",
            help="PNG of the TTFT CDF, TTFT P50/P90/P99 and throughput per configuration",
        )
        add_cli_flags(p)
        p.set_defaults(func=cmd_bench)


# ---------------------------------------------------------------------- orchestration
def base_config(args: argparse.Namespace, workload: Workload) -> EngineConfig:
    """The engine config of the flags, with the workload's defaults where no flag was given."""
    given = {k: v for k, v in vars(args).items() if v is not None}
    if "model" not in given:
        args.model = workload.default_model or "smollm2-135m"
    for key, value in workload.engine_defaults.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    return config_from_cli(args)


def _tokenize(workload: Workload, tokenizer: Any) -> Workload:
    if all(r.prompt is None for r in workload.requests):
        return workload
    if tokenizer is None:
        raise BenchError(
            f"workload {workload.name!r} has text prompts but the model has no tokenizer"
        )
    reqs = [
        r
        if r.prompt is None
        else attrs.evolve(r, prompt=None, prompt_token_ids=tokenizer.encode(r.prompt))
        for r in workload.requests
    ]
    return attrs.evolve(workload, requests=reqs)


def run_bench(args: argparse.Namespace) -> dict[str, Any]:
    """Run everything the flags ask for; return the results document (also printed as a table)."""
    from pitstop.bench.peers import SEPARATE_PROCESS_PEERS, run_peer
    from pitstop.loading.weights import load_model_source
    from pitstop.runner.model_runner import resolve_device

    if getattr(args, "url", None):
        from pitstop.bench.http import run_http_bench

        return run_http_bench(args)
    if args.workload not in GENERATORS and not Path(args.workload).exists():
        workload_from_args(args)  # raises the error that lists the workloads
    wl = workload_from_args(args)
    asked_max_len = getattr(args, "max_model_len", None)  # a flag, before the workload's default
    config = base_config(args, wl)
    configs = matrices.parse_matrix(args.matrix) if args.matrix else [("pitstop", {})]
    if getattr(args, "only", None):
        configs = matrices.select(configs, args.only)
    source = load_model_source(config.model, tokenizer=config.tokenizer)
    mc = source.model_config
    context = mc.max_position_embeddings
    if asked_max_len is None and (config.max_model_len or 0) > context:
        # the workload's default is a wish: a model of a shorter context runs at its own
        print(
            f"[bench] max_model_len {config.max_model_len} (the workload's default) is capped at "
            f"the model's context of {context} tokens",
            file=sys.stderr,
        )
        config = attrs.evolve(config, max_model_len=context)
    token_high = min(TOKEN_ID_HIGH, mc.vocab_size - 1)
    if token_high != TOKEN_ID_HIGH:
        wl = workload_from_args(args, token_high)
    wl = _tokenize(wl, source.tokenizer)
    max_len = config.max_model_len or min(mc.max_position_embeddings, 4096)
    wl, skipped = fit_to_model(wl, vocab_size=mc.vocab_size, max_model_len=max_len)
    for msg in skipped[:5]:
        print(f"[bench] skipped {msg}", file=sys.stderr)
    if skipped:
        print(
            f"[bench] skipped {len(skipped)} of {len(skipped) + wl.num_requests} requests "
            "that do not fit the model",
            file=sys.stderr,
        )
    concurrency, rate = clients_from_args(args, wl)
    repeats = args.repeats or wl.repeats
    device = resolve_device(config.device)
    dev = str(device)

    # The floor: n/a on CPU; on CUDA the H200's ceilings there, measured here on another GPU.
    ceilings: floors.Ceilings | None = None
    if device.type == "cuda":
        ceilings = floors.ceilings_for(device, args.measure_ceilings)
    elif args.measure_ceilings:
        log.warning("--measure-ceilings needs a CUDA device; the floor is n/a on %s", dev)
    floor = None
    if ceilings is not None:
        in_flight = concurrency if concurrency is not None else None
        floor = floors.floor(
            mc,
            [(r.input_len, r.output_len) for r in wl.requests],
            concurrency=in_flight,
            shared_prefix=(wl.shared_prefix_len, 4 if wl.shared_prefix_len else 0),
            ceilings=ceilings,
        )

    peer: dict[str, Any] | None = None
    notes: list[str] = []
    peer_run = PeerRun(
        args=args,
        config=config,
        workload=wl,
        model_config=mc,
        device=dev,
        max_model_len=max_len,
        concurrency=concurrency,
        request_rate=rate,
        repeats=repeats,
        warmup=not args.no_warmup,
        floor=floor,
        skipped=skipped,
    )
    if (
        args.peer
        and getattr(args, "lora_adapters", 0)
        and (args.peer != "vllm" or args.bench_mode != "offline")
    ):
        raise BenchError(
            f"--lora-adapters with --peer {args.peer} ({args.bench_mode}) is not wired (the peer "
            "would run without adapters); only the offline vLLM peer takes them: use "
            "`pitstop bench offline ... --peer vllm`, or run without --peer"
        )
    if args.peer and args.peer in SEPARATE_PROCESS_PEERS:
        # first, while this process holds no GPU memory; its process has exited before ours start
        peer, notes = run_peer(args.peer, peer_run)

    columns: list[dict[str, Any]] = []
    base_settings = {k: getattr(config, k) for k in EngineConfig.field_names()}
    for name, overrides in configs:
        columns.append(_pitstop_column(name, {**base_settings, **overrides}, overrides, peer_run))

    if args.peer and peer is None:
        peer, notes = run_peer(args.peer, peer_run)
    if peer is not None and peer.get("figures"):
        peer["ratio"] = _ratios(columns, peer)

    doc = {
        "schema": SCHEMA,
        "date": now_iso(),
        "commit": git_commit(),
        "device": device_name(dev),
        "mode": args.bench_mode,
        "workload": {
            **wl.summary(),
            "skipped": len(skipped),
            "concurrency": concurrency,
            "request_rate": rate,
        },
        "model": {"name": config.model, "params": mc.num_params, "shape": attrs.asdict(mc)},
        "ceilings": ceilings.as_dict() if ceilings else None,
        "floor": floor.as_dict() if floor else None,
        "configs": columns,
        "peer": peer,
        "notes": notes,
    }
    return doc


def _config_dict(cfg: EngineConfig) -> dict[str, Any]:
    return {k: v for k, v in attrs.asdict(cfg).items() if not isinstance(v, dict) or v}


def _ratios(columns: list[dict[str, Any]], peer: dict[str, Any]) -> dict[str, Any]:
    """pitstop / peer for each configuration that ran: throughput up is better, TTFT down;
    with ``--repeats``, also the ratio of the medians of output tok/s."""
    out: dict[str, Any] = {}
    pf = peer["figures"]
    for c in columns:
        f = c.get("figures")
        if not f:
            continue
        ttft, peer_ttft = f["ttft_ms"]["p50"], pf["ttft_ms"]["p50"]
        out[c["name"]] = {
            "output_tok_per_s": f["output_tok_per_s"] / pf["output_tok_per_s"],
            "req_per_s": f["req_per_s"] / pf["req_per_s"],
            "ttft_p50_peer_over_pitstop": peer_ttft / ttft
            if ttft and not math.isnan(ttft) and not math.isnan(peer_ttft)
            else None,
        }
        mine = (f.get("repeats") or {}).get("output_tok_per_s")
        theirs = (pf.get("repeats") or {}).get("output_tok_per_s")
        if mine and theirs and theirs["median"]:
            out[c["name"]]["output_tok_per_s_median"] = mine["median"] / theirs["median"]
    return out


def _pitstop_column(
    name: str, settings: dict[str, Any], overrides: dict[str, Any], run: PeerRun
) -> dict[str, Any]:
    """The results column of one configuration (``error`` when it cannot run)."""
    from pitstop.bench.backends import PitstopBackend

    col: dict[str, Any] = {"name": name, "backend": "pitstop", "settings": overrides}
    try:
        adapters = int(settings.get("lora_adapters", getattr(run.args, "lora_adapters", 0) or 0))
        settings = matrices.engine_settings(settings)
        if adapters < 0:
            raise BenchError(f"lora_adapters must be >= 0, got {adapters}")
        if adapters:
            settings["adapter"] = settings.get("adapter") or "lora"
            options = dict(settings.get("options") or {})
            if not {"max_loras", "lora.max_loras"} & set(options):
                options["max_loras"] = adapters
            settings["options"] = options
        cfg = config_from_dict(settings)
        col["config"] = _config_dict(cfg)
        print(
            f"[bench] {name}: {matrices.describe(col['config'])} on {cfg.model}",
            file=sys.stderr,
        )
        held: dict[str, int] = {}

        from pitstop.bench.lora_adapters import bench_adapters

        requests = bench_adapters(run, adapters) if adapters else None
        if requests:
            col["lora_adapters"] = len(requests)

        def open_backend() -> PitstopBackend:
            backend = PitstopBackend(cfg, run.workload, lora_requests=requests)
            held["weight_bytes"] = backend.weight_bytes()
            return backend

        measure_in_process(run, open_backend, col, floor=lambda: _column_floor(run, held))
    except (PitstopError, RuntimeError, ValueError, ImportError) as exc:
        col["error"] = f"{type(exc).__name__}: {exc}"
        print(f"[bench] {name} failed: {col['error']}", file=sys.stderr)
    return col


def _column_floor(run: PeerRun, held: dict[str, int]) -> floors.Floor | None:
    """The workload's floor with the weight bytes the column's engine held (its weight
    format's), recorded in the column; the run's floor when none were read."""
    if run.floor is None or not held.get("weight_bytes"):
        return run.floor
    return run.floor.with_weight_bytes(held["weight_bytes"])


def render(doc: dict[str, Any]) -> str:
    """The plain-text report: a header, the table, the peer ratio."""
    wl = doc["workload"]
    head = [
        f"workload {wl['name']} ({doc['mode']}): {wl['num_requests']} requests, "
        f"{wl['input_tokens']:,} prompt + {wl['output_tokens']:,} output tokens"
        + (f", {wl['concurrency']} clients" if wl.get("concurrency") else "")
        + (f", Poisson {wl['request_rate']} req/s" if wl.get("request_rate") else "")
        + (f", {wl['skipped']} skipped" if wl.get("skipped") else ""),
        (
            f"model {doc['model']['name']} served at {doc['server']['url']} (measured over HTTP); "
            if doc.get("server")
            else f"model {doc['model']['name']} ({doc['model']['params'] / 1e9:.2f}B params) on {doc['device']}; "
        )
        + f"commit {doc['commit'] or 'unknown'}; {doc['date']}",
    ]
    if doc["floor"]:
        f = doc["floor"]
        bound = (
            f"; {f['flops_bound_steps']} of {f['decode_steps']} decode steps bound by FLOPs"
            if "flops_bound_steps" in f
            else ""
        )
        head.append(
            f"floor {f['seconds']:.2f} s ({f['output_tok_per_s']:,.0f} output tok/s, {f['req_per_s']:.1f} req/s): "
            f"each step the larger of its bytes over {doc['ceilings']['copy_TB_per_s']:.2f} TB/s and its FLOPs over "
            f"{doc['ceilings']['matmul_TFLOP_per_s']:.0f} TFLOP/s ({doc['ceilings']['source']}){bound}"
        )
    else:
        head.append(
            "floor: n/a (the server's device is not known over HTTP)"
            if doc.get("server")
            else "floor: n/a (no GPU ceilings on this device)"
        )
    cols = [(c["name"], c.get("figures"), c.get("error")) for c in doc["configs"]]
    peer = doc.get("peer")
    if peer:
        cols.append((peer["name"], peer.get("figures"), peer.get("error")))
    lines = [*head, "", table(cols)]
    failures = [
        f"{c['name']}: {n} request(s) failed: {msg}"
        for c in doc["configs"]
        for msg, n in (c.get("errors") or {}).items()
    ]
    notes = [f"note: {n}" for n in doc.get("notes") or ()]
    if failures or notes:
        lines += ["", *failures, *notes]
    if peer and peer.get("ratio"):
        lines.append("")
        for name, r in peer["ratio"].items():
            median = r.get("output_tok_per_s_median")
            lines.append(
                f"pitstop[{name}] / {peer['name']}: {r['output_tok_per_s']:.2f}x output tok/s"
                + (f" ({median:.2f}x of the medians)" if median else "")
                + f", {r['req_per_s']:.2f}x req/s (same run)"
            )
    if peer and peer.get("version"):
        lines.append(f"{peer['name']}: {peer['backend']} {peer['version']}, {_peer_config(peer)}")
    return "\n".join(lines)


def _peer_config(peer: dict[str, Any]) -> str:
    """The peer's arguments in one line (the model last: a path can be long)."""
    cfg = dict(peer.get("config") or {})
    model = cfg.pop("model", None)
    return ", ".join(f"{k}={v}" for k, v in cfg.items()) + (f"; model {model}" if model else "")


def publish(doc: dict[str, Any], out_json: str | Path | None, out_png: str | Path | None) -> int:
    """Write the results JSON and the plot asked for, print the report. The exit status: 1 if
    no configuration has figures, 2 if the plot failed (the JSON is still written), 3 if the
    peer asked for failed (the pitstop columns are still written), else 0."""
    if out_json:
        write_json(out_json, doc)
        print(f"[bench] wrote {out_json}", file=sys.stderr)
    plot_error = None
    if out_png:
        from pitstop.bench.plot import PlotError, plot

        cols = list(doc["configs"]) + ([doc["peer"]] if doc.get("peer") else [])
        try:
            plot(
                cols,
                out_png,
                title=f"{doc['workload']['name']} on {doc['model']['name']}, {doc['device']}",
            )
            print(f"[bench] wrote {out_png}", file=sys.stderr)
        except PlotError as exc:
            plot_error = exc
    print(render(doc))
    if plot_error is not None:
        print(f"pitstop: error: {plot_error}", file=sys.stderr)
        return 2
    if not any(c.get("figures") for c in doc["configs"]):
        return 1
    peer = doc.get("peer")
    if peer and peer.get("error"):
        print(f"pitstop: error: {peer['name']} failed: {peer['error']}", file=sys.stderr)
        return 3
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    """Entry point of ``pitstop bench offline|online``."""
    doc = run_bench(args)
    out_json = args.output
    out_png = args.plot
    if args.out:
        out_json = out_json or str(Path(args.out) / "results.json")
        out_png = out_png or str(Path(args.out) / "plot.png")
    return publish(doc, out_json, out_png)
