"""Every matrix file in benchmarks/workloads/ parses and resolves: a typo in a setting fails here,
not after a device run has started (``pitstop bench --matrix FILE``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pitstop.bench.matrix import parse_matrix
from pitstop.entrypoints.engine_args import config_from_dict
from pitstop.plugin_system.plugin_manager import get_plugin_manager

WORKLOADS = Path(__file__).resolve().parents[3] / "benchmarks" / "workloads"
MATRICES = sorted(WORKLOADS.glob("*.toml"))
# matrices of the example distribution's strategies (tests/example_plugin, pip-installed on the H200)
EXAMPLE_STRATEGIES = {
    "sjf.toml": ("scheduler", "sjf"),
    "recall-single.toml": ("proposer", "recall"),
}


def test_there_are_matrix_files() -> None:
    """The glob below finds the shipped matrices (a moved folder would make every case vanish)."""
    assert len(MATRICES) >= 5


@pytest.mark.parametrize("path", MATRICES, ids=lambda p: p.name)
def test_every_configuration_resolves(path: Path) -> None:
    """Each table becomes an EngineConfig whose strategies and settings resolve, the way
    ``pitstop bench --matrix FILE`` builds them (parse_matrix, then EngineConfig.from_dict)."""
    manager = get_plugin_manager()
    if path.name in EXAMPLE_STRATEGIES:
        kind, strategy = EXAMPLE_STRATEGIES[path.name]
        if strategy not in manager.names(kind):
            pytest.skip(f"{path.name} needs pitstop-example's {kind} {strategy!r} (not installed)")
    for name, settings in parse_matrix(str(path)):
        # lora_adapters is the bench's own key (the adapters it writes), not an engine setting
        settings = {k: v for k, v in settings.items() if k != "lora_adapters"}
        config = config_from_dict(settings)
        manager.resolve(config)
        assert name
