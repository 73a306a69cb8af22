"""The PNG of a benchmark: TTFT CDF per configuration, TTFT P50/P90/P99 bars, throughput bars.

matplotlib is imported here only, when a plot is asked for.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pitstop.errors import PitstopError


class PlotError(PitstopError, RuntimeError):
    """The plot cannot be drawn (matplotlib missing)."""


def plot(columns: list[dict[str, Any]], path: str | Path, *, title: str = "") -> Path:
    """Draw ``columns`` (each ``{"name", "figures", "ttfts_ms"}``) into ``path``; return it."""
    fig = figure(columns, title=title)  # a PlotError without matplotlib
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plain_numbers(axis: Any) -> None:
    """Tick labels of ``axis`` as plain numbers: no offset (``+1.2991e4``), no powers of ten.

    TTFTs of one configuration often lie within a few ms of 13 s; matplotlib
    then labels the ticks ``0.2, 0.4`` beside an offset ``+1.2991e4``, which
    nobody reads as milliseconds.
    """
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    formatter = ScalarFormatter(useOffset=False)
    formatter.set_scientific(False)
    axis.set_major_formatter(formatter)
    if axis.get_scale() == "log":
        axis.set_minor_formatter(NullFormatter())


def figure(columns: list[dict[str, Any]], *, title: str = "") -> Any:
    """The matplotlib figure of :func:`plot` (Agg backend), not yet saved."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PlotError(
            "the plot (--plot, --out) needs matplotlib, which is not installed: "
            "pip install matplotlib (or pitstop[bench]) "
            "(the results JSON was still written if asked for)"
        ) from None
    cols = [c for c in columns if c.get("figures")]
    if not cols:
        raise PlotError("nothing to plot: every configuration failed")
    fig, (ax_cdf, ax_ttft, ax_tput) = plt.subplots(1, 3, figsize=(16, 5))
    for c in cols:
        xs = sorted(c.get("ttfts_ms") or [])
        if xs:
            ax_cdf.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=c["name"])
    # TTFTs that span orders of magnitude (an ablation from a static baseline) read on a log axis
    p50s = [c["figures"]["ttft_ms"]["p50"] for c in cols]
    p99s = [c["figures"]["ttft_ms"]["p99"] for c in cols]
    log_scale = min(p50s) > 0 and max(p99s) / min(p50s) > 50
    ax_cdf.set_xlabel("TTFT (ms)" + (", log scale" if log_scale else ""))
    ax_cdf.set_ylabel("fraction of requests")
    ax_cdf.set_title("TTFT CDF")
    ax_cdf.grid(alpha=0.3)
    ax_cdf.legend(fontsize=8)

    width = 0.8 / 3
    for k, q in enumerate(("p50", "p90", "p99")):
        vals = [c["figures"]["ttft_ms"][q] for c in cols]
        ax_ttft.bar(
            [i + (k - 1) * width for i in range(len(cols))], vals, width, label=f"TTFT {q.upper()}"
        )
    ax_ttft.set_xticks(range(len(cols)), [c["name"] for c in cols], rotation=20, fontsize=8)
    ax_ttft.set_ylabel("ms" + (", log scale" if log_scale else ""))
    if log_scale:
        ax_cdf.set_xscale("log")
        ax_ttft.set_yscale("log")
    ax_ttft.set_title("TTFT percentiles")
    ax_ttft.legend(fontsize=8)

    ax_tput.bar(
        range(len(cols)), [c["figures"]["output_tok_per_s"] for c in cols], color="tab:green"
    )
    ax_tput.set_xticks(range(len(cols)), [c["name"] for c in cols], rotation=20, fontsize=8)
    ax_tput.set_ylabel("output tok/s")
    ax_tput.set_title("throughput")
    for axis in (ax_cdf.xaxis, ax_ttft.yaxis, ax_tput.yaxis):
        plain_numbers(axis)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig
