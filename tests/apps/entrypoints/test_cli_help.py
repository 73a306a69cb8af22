"""``pitstop --help`` a newcomer can trust: every option says its default, no reST markup."""

from __future__ import annotations

import argparse
import re

import pytest

from pitstop.entrypoints.cli import build_parser

MARKUP = re.compile(r"``|:(class|func|mod|meth|data|attr):`")


# pitstop's own commands (an installed third-party plugin may add more: its help is its own)
BUILT_IN = ("pitstop", "generate", "chat", "plugins", "cache", "serve", "bench", "verify")


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {"pitstop": parser, **action.choices}


@pytest.mark.parametrize("name", BUILT_IN)
def test_help_has_no_markup_and_says_every_default(name: str) -> None:
    parser = _subparsers()[name]
    text = parser.format_help()
    assert not MARKUP.search(text), MARKUP.search(text)
    missing = []
    for action in parser._actions:
        if not action.option_strings or action.help in (None, argparse.SUPPRESS):
            continue
        if isinstance(action, argparse._HelpAction | argparse._StoreTrueAction):
            continue  # a switch: off unless given
        if action.dest in ("config", "option", "func"):
            continue  # a file to read / a repeatable plugin setting: nothing by default
        if "default" not in action.help:
            missing.append(action.option_strings[-1])
    assert not missing, f"pitstop {name}: options whose help gives no default: {missing}"


def test_a_bad_boolean_flag_is_an_argparse_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["generate", "--fused-qkv", "maybe", "hi"])
    assert info.value.code == 2
    assert "--fused-qkv: expected true or false" in capsys.readouterr().err


def test_threads_are_set_and_printed_at_start_up(caplog: pytest.LogCaptureFixture) -> None:
    import logging

    import torch
    from helpers.models import smollm2_gguf

    from pitstop import LLM

    smollm2_gguf()
    wanted = torch.get_num_threads()  # the same count: the rest of the test session is unchanged
    with caplog.at_level(logging.INFO, logger="pitstop.loop.engine"):
        LLM("smollm2-135m", device="cpu", kv_cache_gib=0.02, max_model_len=128, threads=wanted)
    assert f"CPU threads: {wanted}" in caplog.text
    assert torch.get_num_threads() == wanted
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--threads", "many", "hi"])
