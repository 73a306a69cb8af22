"""Which part of every weight a tensor-parallel rank holds (Megatron-style).

For tensor parallelism of size ``n``, rank ``r`` holds:

- column-parallel weights, split by output rows: ``q_proj`` by query heads,
  ``k_proj``/``v_proj`` by KV heads (or one replicated KV head when there are
  fewer KV heads than ranks), ``gate_proj``/``up_proj`` by intermediate rows;
- row-parallel weights, split by input columns: ``o_proj`` and ``down_proj``;
  their partial outputs are summed over the ranks (all-reduce), so their bias
  is held by rank 0 only (zeros elsewhere) and added once;
- a mixture of experts' experts as dense SwiGLUs are: every rank holds every
  expert, each cut by its intermediate rows (Mixtral's ``w1``/``w3`` as
  gate/up, ``w2`` as down; a shared expert likewise); the router is whole, so
  every rank routes each token to the same experts and one all-reduce after
  the block sums the parts;
- the embedding and the output head split by vocabulary rows, each rank's
  part padded to ``ceil(vocab / n)`` rows;
- every norm weight whole.

A rank's model is the ordinary model built from :func:`shard_model_config`
(its heads, KV heads, intermediate size and vocabulary part), loaded with the
tensors :class:`WeightShard` cuts: the model code is the same at every size.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import attrs
import torch

from pitstop.errors import ConfigError
from pitstop.ground.model_config import ModelConfig

# The largest size listed as "sizes that work" in an error.
_MAX_LISTED_SIZE = 64


def sizes_that_work(cfg: ModelConfig, limit: int = _MAX_LISTED_SIZE) -> list[int]:
    """The tensor-parallel sizes (up to ``limit``) this model splits into evenly."""
    return [n for n in range(1, limit + 1) if _split_problem(cfg, n) is None]


def _split_widths(cfg: ModelConfig) -> dict[str, int]:
    """The feed-forward widths a rank holds ``1/n`` of: ``intermediate_size`` and those a
    model config names in its ``tensor_parallel_widths`` (e.g. each expert's), when set."""
    names = ("intermediate_size", *getattr(type(cfg), "tensor_parallel_widths", ()))
    widths = {name: getattr(cfg, name) for name in names}
    return {name: w for name, w in widths.items() if w is not None}


def _split_problem(cfg: ModelConfig, n: int) -> str | None:
    """Why ``cfg`` cannot be split over ``n`` ranks, or None when it can."""
    hq, hkv = cfg.num_heads, cfg.num_kv_heads
    if hq % n:
        return f"its {hq} query heads do not divide by {n}"
    if hkv % n and n % hkv:
        return f"its {hkv} KV heads neither divide by {n} nor divide {n} (to be replicated)"
    for name, width in _split_widths(cfg).items():
        if width % n:
            return f"its {name.replace('_', ' ')} {width} does not divide by {n}"
    return None


def check_tensor_parallel_size(cfg: ModelConfig, n: int) -> None:
    """Refuse a size the model's heads, KV heads or MLP do not split into, naming the sizes that do."""
    problem = _split_problem(cfg, n)
    if problem is not None:
        raise ConfigError(
            f"tensor_parallel_size={n} cannot split this {cfg.architecture} model: {problem} "
            f"(it has {cfg.num_heads} query heads, {cfg.num_kv_heads} KV heads, intermediate "
            f"size {cfg.intermediate_size}); sizes that work: "
            f"{', '.join(map(str, sizes_that_work(cfg)))}"
        )


def shard_model_config(cfg: ModelConfig, n: int) -> ModelConfig:
    """The shape of one rank's part of ``cfg`` split over ``n`` ranks (checked first)."""
    check_tensor_parallel_size(cfg, n)
    widths = {name: width // n for name, width in _split_widths(cfg).items()}
    return attrs.evolve(
        cfg,
        num_heads=cfg.num_heads // n,
        num_kv_heads=max(1, cfg.num_kv_heads // n),
        vocab_size=math.ceil(cfg.vocab_size / n),
        **widths,
    )


@attrs.frozen
class Region:
    """A slice ``[start, stop)`` of a tensor along ``dim``."""

    dim: int
    start: int
    stop: int


# Mixtral's experts name gate, up and down w1, w3 and w2
_COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "w1", "w3")
_ROW_PARALLEL = ("o_proj", "down_proj", "w2")
_VOCAB_PARALLEL = ("model.embed_tokens.weight", "lm_head.weight")


@attrs.frozen
class WeightShard:
    """Rank ``rank`` of ``size``: cuts each Hugging Face tensor of ``model_config`` to its part."""

    model_config: ModelConfig  # the whole model's shape
    rank: int
    size: int

    @property
    def vocab_rows(self) -> int:
        """Rows of the embedding and the head on every rank (the last one padded)."""
        return math.ceil(self.model_config.vocab_size / self.size)

    def region(self, name: str, shape: Sequence[int]) -> Region | None:
        """The part of tensor ``name`` (of the whole model's ``shape``) this rank holds; None:
        the whole tensor."""
        cfg, r, n = self.model_config, self.rank, self.size
        if name in _VOCAB_PARALLEL:
            rows = self.vocab_rows
            return Region(0, min(r * rows, cfg.vocab_size), min((r + 1) * rows, cfg.vocab_size))
        parts = name.split(".")
        if len(parts) < 2 or parts[-2] not in _COLUMN_PARALLEL + _ROW_PARALLEL:
            return None
        proj, kind = parts[-2], parts[-1]
        d = cfg.head_size
        if proj in _ROW_PARALLEL:
            if kind != "weight":
                return None  # the bias is added once, after the sum (see finish)
            width = shape[1] // n  # o_proj: query heads x head size; down: this MLP's width
            return Region(1, r * width, (r + 1) * width)
        if proj == "q_proj":
            width = cfg.num_heads // n * d
            return Region(0, r * width, (r + 1) * width)
        if proj in ("k_proj", "v_proj"):
            hkv = cfg.num_kv_heads
            head = r * hkv // n if hkv < n else r * (hkv // n)  # replicated when fewer than ranks
            heads = max(1, hkv // n)
            return Region(0, head * d, (head + heads) * d)
        width = (
            shape[0] // n
        )  # gate and up (dense, an expert's or a shared expert's), weight or bias
        return Region(0, r * width, (r + 1) * width)

    def finish(self, name: str, part: torch.Tensor) -> torch.Tensor:
        """This rank's tensor from its cut part: vocabulary rows padded, row-parallel biases zeroed
        off rank 0 (the all-reduce adds rank 0's once)."""
        if name in _VOCAB_PARALLEL and part.shape[0] < self.vocab_rows:
            pad = part.new_zeros(self.vocab_rows - part.shape[0], *part.shape[1:])
            return torch.cat([part, pad])
        parts = name.split(".")
        if self.rank > 0 and parts[-1] == "bias" and len(parts) > 1 and parts[-2] in _ROW_PARALLEL:
            return torch.zeros_like(part)
        return part

    def take(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of a whole tensor ``name``."""
        region = self.region(name, tensor.shape)
        if region is not None:
            tensor = tensor.narrow(region.dim, region.start, region.stop - region.start)
        return self.finish(name, tensor.contiguous())

    def take_all(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """This rank's part of every ``(name, whole tensor)`` (dummy weights, an uncached GGUF)."""
        for name, tensor in weights:
            part = self.take(name, tensor)
            del tensor
            yield name, part

    def read(self, f: Any, entry: Any) -> torch.Tensor:
        """Read only this rank's part of a safetensors ``entry`` (name, shape, dtype, byte start)
        from the open file ``f``: rows in one read, a column slice one row at a time."""
        shape = tuple(entry.shape)
        region = self.region(entry.name, shape)
        itemsize = torch.empty(0, dtype=entry.dtype).element_size()
        if region is None:
            region = Region(0, 0, shape[0] if shape else 1)
        count = region.stop - region.start
        out_shape = (*shape[: region.dim], count, *shape[region.dim + 1 :])
        out = torch.empty(out_shape, dtype=entry.dtype)
        if out.numel():
            # bytes of one index along region.dim (for dim 0 a whole row), and how often it repeats
            inner = math.prod(shape[region.dim + 1 :]) * itemsize
            outer = math.prod(shape[: region.dim])
            stride = (shape[region.dim] if shape else 1) * inner
            from pitstop.plugins.model_sources.huggingface.safetensors import read_exactly

            view = memoryview(out.view(-1).view(torch.uint8).numpy())
            chunk = count * inner
            for i in range(outer):
                f.seek(entry.start + i * stride + region.start * inner)
                read_exactly(f, view[i * chunk : (i + 1) * chunk], entry)
        return self.finish(entry.name, out)
