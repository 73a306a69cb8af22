"""Weights updated in place: Hugging Face-named tensors onto the model's parameters.

A batch is checked whole before any byte is copied (a name the model lacks, a wrong
shape or dtype, a repeated name, a non-finite value: the batch is refused, the tensors
named, and the old weights stay whole). The names go through the model plugin's own
loading map (``model.name_map`` and ``model.shapes_of``, the ones ``load_weights``
uses), so q/k/v land in the merged ``qkv_proj`` rows and gate/up in ``gate_up_proj``
exactly as at load; a tied ``lm_head.weight`` is the embedding; with ``fused.layer`` the
norms' gains stay folded into the projections after them (:mod:`.folded_norms`). Every copy is
``param.copy_`` into the existing storage: addresses stay, so captured CUDA graphs stay
valid.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Sequence
from typing import Any

import attrs
import torch
from torch import nn

from pitstop.entrypoints.rollout.errors import WeightUpdateError
from pitstop.entrypoints.rollout.folded_norms import FoldedNorms

TIED_HEAD = "lm_head.weight"
EMBEDDING = "model.embed_tokens.weight"
SHOWN = 5  # problems listed in one refusal


@attrs.frozen
class TensorSpec:
    """What a tensor of a batch is, before its values are read: name, shape, dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype


@attrs.frozen
class Placement:
    """Where one Hugging Face tensor goes: ``param`` (rows ``offset`` onward when merged)."""

    name: str  # the Hugging Face name (a tied head's is the embedding's)
    param: torch.Tensor
    offset: int | None

    def copy_(self, tensor: torch.Tensor) -> None:
        """Copy ``tensor`` into its place (cast to the parameter's dtype by the copy)."""
        target = self.param.data
        if self.offset is not None:
            target = target[self.offset : self.offset + tensor.shape[0]]
        # host -> device copies are queued (the caller synchronises once at the end)
        target.copy_(tensor, non_blocking=target.device.type == "cuda")


class WeightMap:
    """The model's Hugging Face names -> its parameters, read once from the model plugin.

    ``ignored(name)``: checkpoint tensors the architecture skips at load (rotary
    ``inv_freq``); ``discarded()``: the names whose values ``sleep(level=2)`` discarded and
    no update has written since (the sleep state's; :mod:`.folded_norms` reads it). Refuses,
    with the reason, a model whose weights cannot change in place.
    """

    def __init__(
        self,
        model: nn.Module,
        ignored: Callable[[str], bool] = lambda n: False,
        discarded: Callable[[], Collection[str]] = frozenset,
    ) -> None:
        for attr in ("name_map", "shapes_of", "cfg"):
            if not hasattr(model, attr):
                raise WeightUpdateError(
                    f"the {type(model).__name__} model plugin has no {attr}; its weights cannot "
                    "be updated in place (build a new LLM from the new checkpoint)"
                )
        self.model = model
        self.cfg = model.cfg
        self.merged = bool(getattr(model, "merged", False))
        self.shapes: dict[str, tuple[int, ...]] = dict(model.shapes_of(model.cfg))
        self.params = dict(model.named_parameters())
        self.ignored = ignored
        self.tied = bool(getattr(model.cfg, "tie_word_embeddings", False))
        # fused.layer: the norms' gains folded into the projections, kept folded by every write
        self.folds = FoldedNorms.of(model, self._hf_names(), discarded)

    def _hf_names(self) -> dict[int, list[str]]:
        """Each parameter's checkpoint names by ``id`` (``q_proj``, ``k_proj`` and
        ``v_proj``'s for a merged ``qkv_proj``)."""
        names: dict[int, list[str]] = {}
        for name in self.shapes:
            target, _ = self.model.name_map(self.cfg, self.merged, name)
            if target in self.params:
                names.setdefault(id(self.params[target]), []).append(name)
        return names

    @property
    def names(self) -> list[str]:
        """Every Hugging Face name the model holds."""
        return list(self.shapes)

    def dtype(self, name: str) -> torch.dtype:
        """The dtype the model holds ``name`` in."""
        return self.placement(name).param.dtype

    def placement(self, name: str) -> Placement:
        """Where ``name`` goes; :class:`WeightUpdateError` for a name without a place."""
        key = EMBEDDING if (name == TIED_HEAD and self.tied) else name
        target, offset = self.model.name_map(self.cfg, self.merged, key)
        if key not in self.shapes or target is None:
            raise WeightUpdateError(
                f"the model has no tensor named {name!r}; give Hugging Face checkpoint names "
                f"(e.g. {self.names[:2]})"
            )
        param = self.params.get(target)
        if param is None:
            raise WeightUpdateError(
                f"{name!r} maps to {target!r}, which the weight format replaced at load "
                "(not a dense parameter); weight updates need weights='dense'"
            )
        return Placement(key, param, offset)

    def check(self, specs: Iterable[TensorSpec], *, cast: bool = False) -> list[Placement | None]:
        """Each spec's placement (None: an ignored tensor, or a tied head whose embedding is
        in the batch too). Every problem of the batch is collected first and raised as one
        :class:`WeightUpdateError` naming the tensors. ``cast``: any floating dtype is taken
        (a checkpoint on disk is cast as at load); otherwise the dtype must be the model's."""
        specs = list(specs)
        given = {s.name for s in specs}
        problems: list[str] = []
        out: list[Placement | None] = []
        seen: set[str] = set()
        for spec in specs:
            if self.ignored(spec.name) or (
                spec.name == TIED_HEAD and self.tied and EMBEDDING in given
            ):
                out.append(None)
                continue
            try:
                place = self.placement(spec.name)
            except WeightUpdateError as exc:
                problems.append(str(exc))
                out.append(None)
                continue
            problems += self._problems(spec, place, cast)
            if place.name in seen:
                problems.append(f"{spec.name!r} is given twice in one batch; give it once")
            seen.add(place.name)
            out.append(place)
        if self.folds is not None and not problems:
            problems += self.folds.problems(_rows_written(specs, out))
        if problems:
            more = f" (and {len(problems) - SHOWN} more)" if len(problems) > SHOWN else ""
            raise WeightUpdateError(
                f"weight update refused, nothing of this batch of {len(specs)} tensor(s) was "
                f"applied: {'; '.join(problems[:SHOWN])}{more}"
            )
        return out

    def _problems(self, spec: TensorSpec, place: Placement, cast: bool) -> list[str]:
        """What is wrong with one tensor's shape and dtype (empty: nothing)."""
        problems = []
        expected = self.shapes[place.name]
        if tuple(spec.shape) != tuple(expected):
            problems.append(
                f"{spec.name!r} has shape {tuple(spec.shape)}, the model holds {tuple(expected)}"
            )
        want = place.param.dtype
        if cast and not spec.dtype.is_floating_point:
            problems.append(f"{spec.name!r} is {spec.dtype}, not a floating-point tensor")
        elif not cast and spec.dtype != want:
            problems.append(
                f"{spec.name!r} is {spec.dtype}, the model holds {want}; cast it first "
                f"(tensor.to({want}))"
            )
        return problems


def _rows_written(
    specs: Sequence[TensorSpec], places: Sequence[Placement | None]
) -> list[tuple[torch.Tensor, int, int]]:
    """``(parameter, start row, stop row)`` of each tensor a batch writes, as
    :meth:`Placement.copy_` slices it."""
    out = []
    for spec, place in zip(specs, places, strict=True):
        if place is None:
            continue
        rows = place.param.shape[0] if place.param.ndim else 1
        start, stop = (
            (0, rows) if place.offset is None else (place.offset, place.offset + spec.shape[0])
        )
        out.append((place.param, start, stop))
    return out


def write_batch(
    weights: WeightMap,
    specs: Sequence[TensorSpec],
    places: Sequence[Placement | None],
    tensors: Iterable[torch.Tensor],
) -> list[str]:
    """Copy a checked batch's ``tensors`` (one per spec, in order; read lazily) into their
    places, then keep fused.layer's folded gains folded; returns the names written."""
    writes = _rows_written(specs, places)
    old = weights.folds.old_gains(writes) if weights.folds is not None else {}
    written = []
    with torch.no_grad():
        for tensor, place in zip(tensors, places, strict=True):
            if place is not None:
                place.copy_(tensor)
                written.append(place.name)
        if weights.folds is not None:
            weights.folds.fold(writes, old)
    return written


def spec_of(name: str, tensor: torch.Tensor) -> TensorSpec:
    """The :class:`TensorSpec` of a tensor in hand."""
    if not isinstance(tensor, torch.Tensor):
        raise WeightUpdateError(f"{name!r} is a {type(tensor).__name__}, not a torch.Tensor")
    return TensorSpec(name, tuple(tensor.shape), tensor.dtype)


def _finite(tensor: torch.Tensor) -> torch.Tensor:
    """A 0-d bool on the tensor's device: no NaN, no infinity. Min and max propagate NaN
    and show an infinity: two reductions, no mask as large as the tensor."""
    if tensor.element_size() == 1:  # fp8: no reductions of its own
        tensor = tensor.float()
    return torch.isfinite(torch.stack(torch.aminmax(tensor))).all()


def check_finite(named: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Refuse a batch with a NaN or infinite value, naming the tensors (check_weights)."""
    named = [(n, t) for n, t in named if t.is_floating_point()]
    if not named:
        return
    by_device: dict[torch.device, list[int]] = {}
    for i, (_, t) in enumerate(named):
        by_device.setdefault(t.device, []).append(i)
    finite = [True] * len(named)
    for indices in by_device.values():  # one host sync per device, not one per tensor
        flags = torch.stack([_finite(named[i][1]) for i in indices]).tolist()
        for i, ok in zip(indices, flags, strict=True):
            finite[i] = ok
    bad = [n for (n, _), ok in zip(named, finite, strict=True) if not ok]
    if bad:
        raise WeightUpdateError(
            f"weight update refused, nothing applied: {len(bad)} tensor(s) hold NaN or "
            f"infinite values, e.g. {bad[:SHOWN]}"
        )


def update_in_place(
    weights: WeightMap, named: Iterable[tuple[str, Any]], *, check_values: bool = True
) -> list[str]:
    """Check the whole batch of ``(hf_name, tensor)`` pairs, then copy each into place.

    Returns the Hugging Face names written (a tied head counted as the embedding).
    """
    batch = [(name, tensor) for name, tensor in named]
    specs = [spec_of(n, t) for n, t in batch]
    places = weights.check(specs)
    if check_values:
        check_finite(batch)
    return write_batch(weights, specs, places, (t for _, t in batch))
