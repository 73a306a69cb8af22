"""``draft``: a second, smaller model with the same tokenizer proposes k tokens.

The draft model (``speculative_model``: any model pitstop loads) runs in its
own :class:`~pitstop.runner.model_runner.ModelRunner` with its own paged KV cache and its
own ``paged`` allocator, with as many pages as the target's cache (so it can
follow every sequence the target holds; a sequence it has no room for gets
no drafts). For each sequence it keeps the token ids whose KV it holds; at
every proposal it first re-syncs with the target's tokens, keeping the
longest common prefix (so a rejection, drafts dropped by the scheduler, or a
preemption all roll back the same way), truncates the rest, then

1. computes the target's tokens it has not seen (the whole prompt the first
   time: the draft prefills its own copy) and draws ``d_1``;
2. decodes ``d_1 .. d_{k-1}`` one at a time, drawing ``d_2 .. d_k``.

The drafts stay on the device: each step's tokens go into the draft
runner's ``last_sampled`` buffer and the next step reads them as pending
tokens, so the decode steps replay the draft runner's own CUDA decode graphs
(captured on a GPU for batches up to ``speculative_max_batch``); the
proposal returns them as a device tensor (``Proposal.device_token_ids``,
with placeholders for ``token_ids``), which the target's verification reads
in place. Nothing waits for the device: the step's one synchronization is
the verification's. The draft's own token list holds placeholders for the
drafts whose KV it computed until :meth:`DraftProposer.on_accepted` tells it
which were kept.

Each draft is drawn from the draft model's processed distribution ``q`` under
the request's own sampling parameters, and ``q`` goes with the proposal, so
the core's rejection sampling is exact; greedy requests draw the argmax.
When a sequence finishes, the engine calls :meth:`DraftProposer.release` and
its draft pages are freed.

It helps when the draft agrees with the target often and costs much less per
token (k draft forwards per step are paid whatever is accepted).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING, Any

import attrs
import torch

import pitstop
from pitstop.errors import ConfigError
from pitstop.ground.poison import FreshPageTracker
from pitstop.ground.step import SeqInput
from pitstop.ground.transfer import to_device
from pitstop.loading.weights import load_model_source
from pitstop.plugin_system.protocols import Proposal
from pitstop.plugin_system.sampler import make_generator
from pitstop.plugin_system.settings import setting
from pitstop.plugins.samplers.batch import is_greedy
from pitstop.plugins.samplers.draws import exponential_race
from pitstop.requests.sampling_params import SamplingParams
from pitstop.requests.sequence import PENDING_TOKEN
from pitstop.runner.model_runner import ModelRunner
from pitstop.speculation.spec_adaptation import speculation_max_batch
from pitstop.speculation.speculative import draft_room

if TYPE_CHECKING:
    from pitstop.config import EngineConfig
    from pitstop.requests.sequence import Sequence
    from pitstop.speculation.speculative import ProposerContext


def greedy_rows(
    batch: Any, params: Seq[SamplingParams], device: torch.device
) -> torch.Tensor | None:
    """Which rows draft greedily, ``[B]`` bool on ``device``; None when all of them do.

    Read off the standard sampler's batch (``all_greedy``, ``temperature`` already on the
    device: no copy, no wait); any other sampler's batch is only what its own
    ``probabilities`` reads, so the rows' parameters decide there (one small copy).
    """
    all_greedy = getattr(batch, "all_greedy", None)
    if all_greedy is None:
        all_greedy = all(is_greedy(p) for p in params)
    if all_greedy:
        return None
    temperature = getattr(batch, "temperature", None)
    if isinstance(temperature, torch.Tensor):
        return temperature == 0.0
    return torch.tensor([is_greedy(p) for p in params], dtype=torch.bool, device=device)


@attrs.frozen
class DraftSettings:
    """The settings of the ``draft`` proposer."""

    model: str | None = setting(
        None,
        type=str,
        required=True,
        alias="speculative_model",
        help="the draft model to load (a smaller model with the target's tokenizer)",
    )


@attrs.define(eq=False)
class _DraftSeq:
    """What the draft keeps for one of the target's sequences (one record per sequence)."""

    kv_ids: list[int] = attrs.Factory(list)  # the tokens whose KV the draft holds
    synced: int = 0  # how many of them are known to be the target's
    generator: torch.Generator | None = None  # a seeded request's draws (made at its first)


class DraftProposer:
    """A small model that drafts autoregressively over its own paged KV cache."""

    def __init__(
        self,
        config: EngineConfig,
        context: ProposerContext,
        *,
        settings: DraftSettings,
    ) -> None:
        draft_model = settings.model
        if draft_model is None:  # the plugin manager reads a selected proposer's required model
            raise ConfigError("speculative='draft' needs draft.model (speculative_model=PATH)")
        assert config.max_model_len is not None
        self.max_model_len = config.max_model_len
        source = load_model_source(draft_model)
        mc = source.model_config
        if mc.vocab_size > context.vocab_size:
            raise ConfigError(
                f"the draft model {draft_model!r} has a vocabulary of {mc.vocab_size} tokens, "
                f"more than the target's {context.vocab_size}; a draft model must share the target's tokenizer"
            )
        self.vocab_size = context.vocab_size
        max_batch = speculation_max_batch(config)  # the most sequences that ever draft at once
        draft_config = attrs.evolve(
            config,
            model=draft_model,
            speculative=None,
            tokenizer=None,
            adapter=None,  # the draft model runs without adapters; the target verifies with them
            max_batch_size=max_batch,
            # the draft runs no scheduler of its own: the target's prefill bound (which may
            # exceed the draft's smaller batch) is left out, and follows max_batch_size
            options={
                k: v for k, v in config.options.items() if not k.endswith("max_prefill_batch")
            },
        )
        self.device = context.device
        self.runner = ModelRunner(draft_config, mc, context.plugins, context.device, context.dtype)
        self.runner.load_weights(source.weights)
        self.runner.init_kv_cache(context.num_pages)
        self.runner.maybe_capture_graphs()  # decode graphs for the draft's own steps (CUDA)
        self.allocator = context.plugins.create(
            "allocator", "paged", draft_config, context.num_pages
        )
        if draft_config.poison_memory:  # its pages are poisoned when handed out, as the engine's
            self.allocator = FreshPageTracker(self.allocator, self.runner.poison_pages)
        self._seqs: dict[int, _DraftSeq] = {}  # seq_id -> its draft KV tokens, sync point, draws
        self._shared = make_generator(config.seed + 1, context.device)

    # ------------------------------------------------------------------ protocol
    def propose(self, seqs: Seq[Sequence], k: int) -> list[Proposal]:
        """Up to ``k`` drafts per sequence (with their distributions), never past its limits."""
        rooms = {seq.seq_id: draft_room(seq, k, self.max_model_len) for seq in seqs}
        active = [
            seq for seq in seqs if rooms[seq.seq_id] > 0 and self._prepare(seq, rooms[seq.seq_id])
        ]
        if len(active) > self.runner.last_sampled.shape[0]:
            raise RuntimeError(
                f"{len(active)} sequences asked the draft model for drafts at once, more than the "
                f"{self.runner.last_sampled.shape[0]} it was built for (speculative_max_batch)"
            )
        probs: dict[int, list[torch.Tensor | None]] = {seq.seq_id: [] for seq in active}
        order_per_step: list[list[Sequence]] = []  # each step's sequences, in its sampled order
        tokens_per_step: list[torch.Tensor] = []
        with torch.inference_mode():
            step = list(active)
            made = 0
            while step:
                inputs = []
                for seq in step:
                    ids = self._seqs[seq.seq_id].kv_ids
                    # the first step catches up with the target; later ones read the last draft
                    if made == 0:
                        new, start = seq.token_ids[len(ids) :], len(ids)
                    else:  # draft d_made sits right after the target's tokens and d_1 ..
                        new, start = [PENDING_TOKEN], seq.num_tokens + made - 1
                    inputs.append(
                        SeqInput(
                            seq.seq_id,
                            new,
                            start,
                            self.allocator.block_table(seq),
                            True,
                            seq.sampling_params,
                        )
                    )
                order = sorted(range(len(step)), key=lambda i: len(inputs[i].token_ids) == 1)
                ordered = [step[i] for i in order]
                tokens, q = self._forward([inputs[i] for i in order], ordered)
                order_per_step.append(ordered)
                tokens_per_step.append(tokens)
                for seq, row in zip(ordered, q, strict=True):
                    probs[seq.seq_id].append(row)
                made += 1
                step = [seq for seq in ordered if made < rooms[seq.seq_id]]
        drafts = self._gather_drafts(active, order_per_step, tokens_per_step)
        for seq in active:  # the draft now holds the KV of the target's tokens and d_1 .. d_{k-1}
            ids = self._seqs[seq.seq_id].kv_ids
            ids.extend(seq.token_ids[len(ids) :])
            ids.extend([PENDING_TOKEN] * (rooms[seq.seq_id] - 1))  # known after verification
        out = []
        for seq in seqs:
            device_ids = drafts.get(seq.seq_id)
            if device_ids is None:
                out.append(Proposal([]))
                continue
            greedy = is_greedy(seq.sampling_params)
            out.append(
                Proposal(
                    [PENDING_TOKEN] * len(device_ids),
                    None if greedy else torch.stack(probs[seq.seq_id]),
                    device_token_ids=device_ids,
                )
            )
        return out

    def on_accepted(self, seq: Sequence, num_accepted: int) -> None:
        """Roll the draft's KV back to what the target kept (the target's tokens are appended).

        The draft's KV of the kept drafts stays: their placeholders take the
        target's tokens, which are those drafts.
        """
        state = self._seqs.get(seq.seq_id)
        if state is None:
            return
        ids = state.kv_ids
        first = next((i for i, t in enumerate(ids) if t == PENDING_TOKEN), len(ids))
        kept = min(num_accepted, len(ids) - first, seq.num_tokens - first)
        ids[first : first + kept] = seq.token_ids[first : first + kept]
        self._sync(seq)

    def release(self, seq: Sequence) -> None:
        """Free ``seq``'s draft pages (the engine calls this when a request finishes or aborts)."""
        self._seqs.pop(seq.seq_id, None)
        self.allocator.free(seq)
        self.runner.forget_block_tables([seq.seq_id])

    # ------------------------------------------------------------------ internals
    def _gather_drafts(
        self,
        active: list[Sequence],
        order_per_step: list[list[Sequence]],
        tokens_per_step: list[torch.Tensor],
    ) -> dict[int, torch.Tensor]:
        """Each sequence's drafts as one device tensor, gathered from the steps' tokens (no wait)."""
        if not tokens_per_step:
            return {}
        where: dict[int, list[int]] = {seq.seq_id: [] for seq in active}
        row = 0
        for ordered in order_per_step:
            for seq in ordered:
                where[seq.seq_id].append(row)
                row += 1
        flat = torch.cat(tokens_per_step)
        rows = [r for seq in active for r in where[seq.seq_id]]
        index = to_device(rows, torch.int64, self.device)
        gathered = flat[index].split([len(where[seq.seq_id]) for seq in active])
        return {seq.seq_id: ids for seq, ids in zip(active, gathered, strict=True)}

    def _sync(self, seq: Sequence) -> int:
        """Keep the draft KV of the longest prefix shared with the target's tokens; truncate the rest.

        Only the tokens past the last synced point can differ (the target's
        tokens are append-only), so this compares at most a few drafts.
        """
        state = self._seqs[seq.seq_id]
        ids = state.kv_ids
        target = seq.token_ids
        # The last token is always recomputed: its logits give the first draft.
        keep = min(len(ids), len(target) - 1)
        i = min(state.synced, keep)
        while i < keep and ids[i] == target[i]:
            i += 1
        del ids[i:]
        state.synced = i
        held = self.allocator.num_held_tokens(seq)
        if held > i:
            self.allocator.truncate(seq, held - i)
            self.runner.forget_block_tables([seq.seq_id])  # the graphs re-read its table
        return i

    def _prepare(self, seq: Sequence, room: int) -> bool:
        """Sync ``seq`` and make the draft hold slots for its tokens and ``room - 1`` drafts."""
        if seq.seq_id not in self._seqs:
            if not self.allocator.can_allocate(seq):
                return False
            self.allocator.allocate(seq)
            self._seqs[seq.seq_id] = _DraftSeq()
        self._sync(seq)
        need = seq.num_tokens + room - 1 - self.allocator.num_held_tokens(seq)
        if need > 0:
            if not self.allocator.can_append(seq, need):
                return False
            self.allocator.append(seq, need)
        return True

    def _forward(
        self, inputs: list[SeqInput], seqs: list[Sequence]
    ) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
        """Run the draft model over one batch; draw one token per sequence from its processed q.

        The tokens stay on the device, in the runner's ``last_sampled`` too (the next
        step's pending inputs); nothing is read back.
        """
        runner = self.runner
        hidden, rows, _ = runner.forward(inputs)
        logits = runner.model.compute_logits(runner.select_rows(hidden, rows))
        if logits.shape[1] < self.vocab_size:  # a draft vocabulary may be smaller than the target's
            pad = logits.new_full(
                (logits.shape[0], self.vocab_size - logits.shape[1]), float("-inf")
            )
            logits = torch.cat([logits, pad], dim=1)
        params = [s.sampling_params or SamplingParams() for s in seqs]
        gens = [self._generator(s) for s in seqs]
        batch = runner.sampler.make_batch(params, gens)
        greedy = greedy_rows(batch, params, logits.device)
        if greedy is None:  # greedy drafts need no distribution (the verifier takes point masses)
            tokens = logits.argmax(dim=-1)
            runner.last_sampled[: len(inputs)].copy_(tokens)
            runner.sampling.last_rows = {inp.seq_id: i for i, inp in enumerate(inputs)}
            return tokens, [None] * len(inputs)
        q = runner.sampler.probabilities(logits, batch)
        tokens = exponential_race(q, gens, self._shared)
        tokens = torch.where(greedy, logits.argmax(dim=-1), tokens)
        runner.last_sampled[: len(inputs)].copy_(tokens)
        runner.sampling.last_rows = {inp.seq_id: i for i, inp in enumerate(inputs)}
        return tokens, list(q.unbind(0))

    def _generator(self, seq: Sequence) -> torch.Generator | None:
        params = seq.sampling_params
        if params.seed is None or is_greedy(params):
            return None
        state = self._seqs[seq.seq_id]  # prepared: every sequence a draft step runs
        if state.generator is None:
            state.generator = make_generator(params.seed + 1, self.device)
        return state.generator


def create_draft(
    config: EngineConfig, context: ProposerContext, *, settings: DraftSettings
) -> DraftProposer:
    """A smaller model of the same tokenizer proposes k tokens autoregressively."""
    return DraftProposer(config, context, settings=settings)


@pitstop.hookimpl
def register_proposers(register: Any) -> None:
    """Register the ``draft`` proposer."""
    register("draft", create_draft, settings=DraftSettings)
