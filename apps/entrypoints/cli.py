"""The ``pitstop`` command: ``generate``, ``chat``, ``plugins``, and every subcommand a plugin
registers (``register_commands``: ``serve``, ``bench``, ``verify``, ``cache`` of the ``gguf``
model source, and third-party ones)."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from typing import Any

from pitstop.config import EngineConfig
from pitstop.entrypoints.chat import render_chat
from pitstop.entrypoints.commands import commands
from pitstop.entrypoints.engine_args import add_cli_flags, config_from_cli
from pitstop.errors import PitstopError, PluginError, did_you_mean
from pitstop.plugin_system.plugin_manager import get_plugin_manager

# argparse prints this as it is: plain text, no reST markup
DESCRIPTION = (
    "pitstop: an LLM inference engine in which every strategy is a plugin. Subcommands: "
    "generate, chat, serve, bench, verify, plugins, cache."
)


def _sampling_flags(
    parser: argparse.ArgumentParser, *, max_tokens: int, temperature: float
) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument(
        "--max-tokens",
        type=int,
        default=max_tokens,
        help=f"most tokens to generate (default: {max_tokens})",
    )
    g.add_argument(
        "--temperature",
        type=float,
        default=temperature,
        help=f"0 is greedy (default: {temperature:g})",
    )
    g.add_argument("--top-p", type=float, default=1.0, help="1 disables (default: 1)")
    g.add_argument("--top-k", type=int, default=-1, help="-1 or 0 disables (default: -1)")
    g.add_argument("--min-p", type=float, default=0.0, help="0 disables (default: 0)")
    g.add_argument(
        "--sampling-seed",
        type=int,
        default=None,
        help="seed of this request's sampling (default: the engine's --seed)",
    )
    g.add_argument(
        "--stop", action="append", default=None, help="stop string (repeatable; default: none)"
    )


def _params(args: argparse.Namespace):
    from pitstop.entrypoints.sampling_params import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        seed=args.sampling_seed,
        stop=args.stop or (),
    )


def cmd_plugins(args: argparse.Namespace) -> int:
    """Print every registered strategy: kind, name, distribution, version."""
    pm = get_plugin_manager()
    rows = [("KIND", "NAME", "DISTRIBUTION", "VERSION", "DESCRIPTION")]
    rows += [(s.kind, s.name, s.distribution, s.version, s.description) for s in pm.strategies()]
    rows += [("command", c.name, c.distribution, c.version, c.help) for c in commands(pm).values()]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r[:4], widths, strict=True)) + "  " + r[4])
    if args.settings:
        _print_settings(pm.strategies())
    if args.check:
        _print_check(pm, config_from_cli(args))
    return 0


def _print_check(pm, config: EngineConfig) -> None:
    """What the kernel set and the weight format run on this machine (``--check``)."""
    import attrs
    import torch

    from pitstop.runner.model_runner import resolve_device, resolve_dtype

    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    if config.kernels == "auto":
        config = attrs.evolve(config, kernels=pm.auto_kernels(device.type))
    kernels = pm.create("kernels", config.kernels, config, device, dtype)
    print(f"\nkernels {config.kernels!r} on {device} ({dtype}, torch {torch.__version__}):")
    for op, impl in kernels.describe().items():
        print(f"  {op:16s} {impl}")
    weights = pm.create("weights", config.weights, config, kernels, device, dtype)
    print(f"\nweights {config.weights!r}:")
    for op, impl in weights.describe().items():
        print(f"  {op:16s} {impl}")


def _print_settings(strategies) -> None:
    """Each strategy's declared settings: key and alias (or engine setting), values,
    default, meaning."""
    from pitstop.entrypoints.catalogue import describe

    for s in strategies:
        if s.settings is None:
            continue
        print(f"\n{s.kind} {s.name!r} settings ({s.distribution}):")
        for key, alias, allowed, default, meaning in describe(s.settings, s.name, EngineConfig()):
            names = f"{key} ({alias})" if alias else key
            print(f"  {names:48s} {allowed:42s} default {default:12s} {meaning}")


def cmd_generate(args: argparse.Namespace) -> int:
    """Generate a completion for each prompt."""
    from pitstop.entrypoints.llm import LLM

    llm = LLM(config=config_from_cli(args))
    outs = llm.generate(args.prompts, _params(args))
    for out in outs:
        if len(outs) > 1:
            print(f"--- {out.prompt!r} [{out.finish_reason}]")
        print(out.text)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    """Chat with the model, streaming tokens as they come (one message with -m)."""
    from pitstop.entrypoints.llm import LLM

    llm = LLM(config=config_from_cli(args))
    params = _params(args)
    history: list[dict[str, str]] = []
    if args.system:
        history.append({"role": "system", "content": args.system})
    interactive = args.message is None
    if interactive:
        print("pitstop chat: type a message; an empty line or Ctrl-D quits.", file=sys.stderr)
    while True:
        if interactive:
            try:
                text = input("> ").strip()
            except EOFError:
                print()
                return 0
            if not text:
                return 0
        else:
            text = args.message
        history.append({"role": "user", "content": text})
        ids = render_chat(llm.tokenizer, history).token_ids
        reply = ""
        for out in llm.stream(prompt_token_ids=ids, sampling_params=params):
            print(out.text_delta, end="", flush=True)
            reply = out.text
        print()
        history.append({"role": "assistant", "content": reply})
        if not interactive:
            return 0


class ArgumentParser(argparse.ArgumentParser):
    """argparse without prefix matching (``--max-token 4`` is an error, not ``--max-tokens``),
    whose error for an unknown flag names the nearest flag of the chosen subcommand.

    ``add_subparsers`` builds its subparsers with the class of the parser it is called on, so
    every subcommand (and a plugin's own, and theirs) inherits this.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)

    def parse_args(self, args: Any = None, namespace: Any = None) -> argparse.Namespace:  # type: ignore[override]
        """Parse ``args``; an unknown flag is an error (exit 2) with a did-you-mean."""
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            known = _option_strings(self, parsed)
            named = [
                e + did_you_mean(e.split("=", 1)[0], known) if e.startswith("--") else e
                for e in extras
            ]
            self.error(f"unrecognized arguments: {' '.join(named)}")
        return parsed


def _option_strings(parser: argparse.ArgumentParser, parsed: argparse.Namespace) -> list[str]:
    """Every long flag of ``parser`` and of the subcommands ``parsed`` chose."""
    found: list[str] = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            chosen = action.choices.get(getattr(parsed, action.dest, None) or "")
            if chosen is not None:
                found += _option_strings(chosen, parsed)
        elif action.help is not argparse.SUPPRESS:
            found += [o for o in action.option_strings if o.startswith("--")]
    return found


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every built-in subcommand."""
    parser = ArgumentParser(prog="pitstop", description=DESCRIPTION)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("plugins", help="list every registered strategy")
    p.add_argument(
        "--check", action="store_true", help="also say which kernel ops run fused on this machine"
    )
    p.add_argument(
        "--settings",
        action="store_true",
        help="also list every plugin's declared settings (keys, flags, values, defaults)",
    )
    add_cli_flags(p)
    p.set_defaults(func=cmd_plugins)

    p = sub.add_parser("generate", help="complete one or more prompts")
    p.add_argument("prompts", nargs="+", help="prompt text")
    add_cli_flags(p)
    _sampling_flags(p, max_tokens=64, temperature=0.0)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("chat", help="chat with the model (interactive unless -m is given)")
    p.add_argument(
        "-m",
        "--message",
        help="send one message, print the answer, exit (default: interactive)",
    )
    p.add_argument("--system", help="system prompt (default: none)")
    add_cli_flags(p)
    _sampling_flags(p, max_tokens=256, temperature=0.0)
    p.set_defaults(func=cmd_chat)

    for command in commands(get_plugin_manager()).values():  # serve, bench, verify, plugins' own
        if command.name in sub.choices:
            raise PluginError(
                f"{command.distribution} ({command.module}) registers the command "
                f"{command.name!r}, which pitstop has built in; rename it"
            )
        p = sub.add_parser(command.name, help=command.help, description=command.description)
        command.setup(p)
        p.set_defaults(func=command.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``pitstop`` command."""
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    try:
        return args.func(args)
    except PitstopError as exc:
        print(f"pitstop: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
