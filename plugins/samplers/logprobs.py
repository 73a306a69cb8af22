"""Prompt log-probabilities: what the model gave each prompt token a step's rows predict.

The standard sampler's ``prompt_logprobs`` (as vLLM's runner asks its sampler for
them): the runner calls it in a step in which some sequence asked for
``prompt_logprobs``, with the step's hidden rows and the model's ``compute_logits``;
it waits for the device (the values are read back at once).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pitstop.ground.step import PromptLogprobs, SeqInput


def prompt_logprobs(
    seqs: list[SeqInput],
    hidden: torch.Tensor,
    starts: list[int],
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
) -> dict[int, PromptLogprobs]:
    """Log-probabilities of the prompt tokens some sequences of this step predict.

    ``starts[i]`` is sequence ``i``'s first row of ``hidden``. One logits GEMM
    over those rows, then the targets' log-probabilities, ranks and top-k,
    read back at once. Returns input index -> one entry per target.
    """
    rows: list[int] = []
    targets: list[int] = []
    owners: list[int] = []
    for i, s in enumerate(seqs):
        if s.prompt_targets:
            rows.extend(range(starts[i], starts[i] + len(s.prompt_targets)))
            targets.extend(s.prompt_targets)
            owners.append(i)
    k = max(s.prompt_logprobs for s in seqs if s.prompt_targets)
    index = torch.tensor(rows, dtype=torch.int64, device=hidden.device)
    logprobs = torch.log_softmax(compute_logits(hidden[index]).float(), dim=-1)
    target = torch.tensor(targets, dtype=torch.int64, device=hidden.device).unsqueeze(1)
    chosen = logprobs.gather(1, target)
    ranks = ((logprobs > chosen).sum(-1) + 1).tolist()
    top_lp, top_ids = logprobs.topk(max(k, 1), dim=-1)
    chosen_l, top_lp_l, top_ids_l = (
        chosen.squeeze(1).tolist(),
        top_lp.tolist(),
        top_ids.tolist(),
    )
    out: dict[int, PromptLogprobs] = {}
    row = 0
    for i in owners:
        s = seqs[i]
        entries = []
        for _ in s.prompt_targets or ():
            top = list(zip(top_ids_l[row], top_lp_l[row], strict=True))[: s.prompt_logprobs]
            entries.append((chosen_l[row], ranks[row], top))
            row += 1
        out[i] = entries
    return out
