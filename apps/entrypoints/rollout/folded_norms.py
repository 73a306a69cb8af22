"""Weight updates of a fused-layer model: the RMSNorm gains folded into its projections.

With ``fused.layer`` the model multiplies each RMSNorm's gain into the projection after it
at load (``W' = W * g``: the input norm's into ``qkv_proj``, the post-attention norm's into
``gate_up_proj``, or into an MoE block's router and experts; the model's ``norms_to_fold``)
and keeps the gain as loaded. A weight update writes checkpoint values, so
:class:`FoldedNorms` keeps the pairs folded across any batching of the new tensors:

- rows of a projection written by a batch are multiplied by its gain's value after the
  batch (in float32, rounded once, as at load: one batch holding both gives the weights a
  fresh load of the checkpoint gives);
- a gain written by a batch without all of its projection's rows rescales the rows it
  leaves by ``new / old`` (a trainer's buckets may part a norm from its projections;
  rounded once more). Where the old gain holds a zero those rows lost their values at
  load, so such a batch is refused before anything is copied, naming the tensors to add;
- after ``sleep(level=2)`` discarded the weights (the sleep state's names still to write,
  ``discarded``) a gain has no value until written: rows written before it are kept as
  given and folded when it arrives.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Sequence

import torch
from torch import nn

FOLD_ROWS = 4096  # rows multiplied at a time (an MoE block's experts are large)


def _merge(ranges: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted, overlapping or touching ``[start, stop)`` ranges joined."""
    out: list[tuple[int, int]] = []
    for start, stop in sorted(ranges):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], stop))
        else:
            out.append((start, stop))
    return out


def _left(rows: int, ranges: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """The ``[start, stop)`` ranges of ``range(rows)`` that ``ranges`` (merged) leave."""
    out, at = [], 0
    for start, stop in ranges:
        if start > at:
            out.append((at, start))
        at = max(at, stop)
    if at < rows:
        out.append((at, rows))
    return out


def _scale_rows(weight: torch.Tensor, ranges: Iterable[tuple[int, int]], by: torch.Tensor) -> None:
    """``weight[start:stop] *= by`` (broadcast over the last dimension) in float32, in place."""
    for start, stop in ranges:
        for rows in weight.data[start:stop].split(FOLD_ROWS):
            rows.copy_(rows.float() * by)


class FoldedNorms:
    """Which projection weights hold which norm's gain, and the gains' state (module doc)."""

    def __init__(
        self,
        pairs: Sequence[tuple[torch.Tensor, torch.Tensor]],
        names: dict[int, list[str]],
        discarded: Callable[[], Collection[str]],
    ):
        """``pairs``: ``(projection weight, norm gain)`` as the model folded them;
        ``names``: each parameter's checkpoint names by ``id``; ``discarded()``: the names
        whose values ``sleep(level=2)`` discarded and no update has written since."""
        self.gain_of: dict[int, torch.Tensor] = {id(w): g for w, g in pairs}
        self.weights_of: dict[int, list[torch.Tensor]] = {}
        for w, g in pairs:
            self.weights_of.setdefault(id(g), []).append(w)
        self.names, self.discarded = names, discarded
        self.raw: dict[int, list[tuple[int, int]]] = {}  # rows written while the gain had none

    @classmethod
    def of(
        cls,
        model: nn.Module,
        names: dict[int, list[str]],
        discarded: Callable[[], Collection[str]],
    ) -> FoldedNorms | None:
        """The fused layers' pairs of ``model`` (None where no layer is fused); ``names`` and
        ``discarded`` as :class:`FoldedNorms` takes them."""
        if not getattr(model, "fused_layers", False):
            return None
        pairs = [
            pair
            for layer in getattr(model, "layers", ())
            if getattr(layer, "fused", False)
            for pair in layer.norms_to_fold()
        ]
        return cls(pairs, names, discarded) if pairs else None

    def gain_names(self) -> set[str]:
        """The checkpoint names of every gain folded into a projection."""
        return {name for g in self.weights_of for name in self.names.get(g, ())}

    def _valid(self, gain_id: int, discarded: Collection[str]) -> bool:
        """Whether the gain holds the value its projections were folded with (not discarded)."""
        return not any(name in discarded for name in self.names.get(gain_id, ()))

    def problems(self, writes: Sequence[tuple[torch.Tensor, int, int]]) -> list[str]:
        """What a batch writing ``(parameter, start row, stop row)`` cannot keep folded: a gain
        written without all of its projection's rows where the old gain holds a zero."""
        rows, discarded = self._rows(writes), self.discarded()
        out = []
        for gain in {id(p): p for p, _, _ in writes if id(p) in self.weights_of}.values():
            if not self._valid(id(gain), discarded) or bool((gain.data != 0).all()):
                continue
            for weight in self.weights_of[id(gain)]:
                if _left(weight.shape[0], rows.get(id(weight), [])):
                    out.append(
                        f"{self._name(gain)} is given without all of {self._name(weight)}, "
                        "whose rows fused.layer multiplied by the old gain, which holds zeros; "
                        f"give {self._name(weight)}'s tensors in the same batch (or build the "
                        "engine with fused.layer=false)"
                    )
        return out

    def old_gains(self, writes: Sequence[tuple[torch.Tensor, int, int]]) -> dict[int, torch.Tensor]:
        """Float32 copies of the valid gains a batch writes (taken before it writes them)."""
        discarded = self.discarded()
        return {
            id(p): p.data.float().clone()
            for p, _, _ in writes
            if id(p) in self.weights_of and self._valid(id(p), discarded)
        }

    def fold(
        self, writes: Sequence[tuple[torch.Tensor, int, int]], old: dict[int, torch.Tensor]
    ) -> None:
        """After a batch wrote ``writes``: fold the rows it wrote (and rows kept as given) into
        their gains' values, and rescale the rows of each written gain that it left (before
        the sleep state marks the batch written: its gains count as valid here)."""
        rows, discarded = self._rows(writes), self.discarded()
        gains = {id(p) for p, _, _ in writes if id(p) in self.weights_of}
        touched = {id(p): p for p, _, _ in writes if id(p) in self.gain_of}
        for g in gains:
            touched.update((id(w), w) for w in self.weights_of[g])
        for key, weight in touched.items():
            gain = self.gain_of[key]
            fresh = _merge(rows.get(key, []) + self.raw.get(key, []))
            if id(gain) not in gains and not self._valid(id(gain), discarded):
                self.raw[key] = fresh  # no gain to fold with yet (after level 2)
                continue
            self.raw.pop(key, None)
            g = gain.data.float()
            _scale_rows(weight, fresh, g)
            if id(gain) in old:  # the rows it left hold W * old gain
                ratio = torch.where(old[id(gain)] != 0, g / old[id(gain)], torch.ones_like(g))
                _scale_rows(weight, _left(weight.shape[0], fresh), ratio)

    def _rows(self, writes: Sequence[tuple[torch.Tensor, int, int]]) -> dict[int, list]:
        rows: dict[int, list[tuple[int, int]]] = {}
        for param, start, stop in writes:
            if id(param) in self.gain_of:
                rows.setdefault(id(param), []).append((start, stop))
        return {k: _merge(v) for k, v in rows.items()}

    def _name(self, param: torch.Tensor) -> str:
        return ", ".join(repr(n) for n in self.names.get(id(param), ["a parameter"]))
