"""On/off environment settings: one reading for all, and a bad value refused by name."""

from __future__ import annotations

import pytest

from pitstop import EngineConfig
from pitstop.env_flags import OFF, ON, env_flag
from pitstop.errors import ConfigError

NAME = "PITSTOP_TEST_FLAG"


@pytest.mark.parametrize("default", [True, False])
def test_unset_or_empty_is_the_default(monkeypatch: pytest.MonkeyPatch, default: bool) -> None:
    monkeypatch.delenv(NAME, raising=False)
    assert env_flag(NAME, default) is default
    monkeypatch.setenv(NAME, "  ")
    assert env_flag(NAME, default) is default


def test_every_spelling_in_any_case(monkeypatch: pytest.MonkeyPatch) -> None:
    for value, expected in [*((v, True) for v in ON), *((v, False) for v in OFF)]:
        for spelled in (value, value.upper(), f" {value} "):
            monkeypatch.setenv(NAME, spelled)
            assert env_flag(NAME, not expected) is expected, spelled


def test_a_value_that_is_neither_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(NAME, "maybe")
    with pytest.raises(ConfigError, match=f"{NAME}='maybe' is not an on/off value"):
        env_flag(NAME, True)


@pytest.mark.parametrize("variable", ["PITSTOP_POISON_MEMORY", "PITSTOP_FREEZE_GC"])
def test_the_config_refuses_a_bad_value_where_it_reads_it(
    monkeypatch: pytest.MonkeyPatch, variable: str
) -> None:
    monkeypatch.setenv(variable, "maybe")
    with pytest.raises(ConfigError, match=f"{variable}='maybe'"):
        EngineConfig()  # its defaults read the variable
