"""What each kind of strategy must provide: small typed protocols.

A plugin registers a *factory* under a name (see :mod:`pitstop.plugin_system.hookspecs`);
the engine calls it once, when it is built, and then talks to the object it
returned only through the members below. Each kind's register hook, factory
signature and protocol are one table, :data:`pitstop.plugin_system.kinds.KINDS`;
:meth:`pitstop.plugin_system.plugin_manager.PluginManager.create` checks every object it
builds against its protocol.

Optional capabilities are declared, with their defaults, on one class per
kind (:class:`AllocatorBase`, :class:`KernelSetBase`, :class:`SamplerBase`,
:class:`ProposerBase`, :class:`ModelBase`, :class:`ModelSourceReaderBase`;
:class:`KeepsBlocksBase` for a weight format that keeps blocks): a plugin
inherits it, or defines the member itself, or leaves it out and gets the
default. The core asks one way, ``AllocatorBase.of(allocator, "caches_prefixes")``
(:meth:`Capabilities.of`), and never tests a plugin's name.
"""

from __future__ import annotations

import inspect
import types
from collections.abc import Sequence as Seq
from typing import Any, Protocol, runtime_checkable

import attrs
import torch

from pitstop.ground.attention import AttentionMetadata
from pitstop.ground.metrics import AllocatorStats  # noqa: F401  (home: ground.metrics)
from pitstop.plugin_system.fused_layer_ops import FusedLayerOps  # noqa: F401  (home: short)
from pitstop.plugin_system.grammar import GrammarBackend, GrammarMatcher  # noqa: F401  (home)
from pitstop.plugin_system.moe_ops import MoEOps  # noqa: F401  (home: short)
from pitstop.plugin_system.sampler import RowInputs, Sampler, SamplerOutput  # noqa: F401  (home)
from pitstop.plugin_system.weight_format import KeepsBlocks, WeightFormat  # noqa: F401  (home: short)
from pitstop.requests.sampling_params import SamplingParams
from pitstop.requests.sequence import Sequence

# ---------------------------------------------------------------- capabilities


class Capabilities:
    """The optional members of one kind, with their defaults (subclassed per kind).

    :meth:`of` is how the core reads a capability of a strategy, whether the strategy
    inherits the class, defines the member itself, or leaves it out."""

    @classmethod
    def of(cls, obj: object, member: str) -> Any:
        """``obj``'s optional ``member``, or this kind's default when ``obj`` lacks it.

        A default method comes bound to ``obj``; a name this kind does not
        declare raises ``AttributeError`` (a typo is not a missing capability).
        """
        default = inspect.getattr_static(cls, member)
        value = getattr(obj, member, None)
        if value is not None:
            return value
        return types.MethodType(default, obj) if inspect.isfunction(default) else default


# ---------------------------------------------------------------- allocator


@runtime_checkable
class Allocator(Protocol):
    """Hands out KV-cache pages (numbers, never tensors) to sequences.

    A sequence *holds* token slots: after ``allocate`` it holds
    ``seq.num_tokens``; ``append(seq, n)`` makes it hold ``n`` more;
    ``truncate(seq, n)`` gives back its last ``n``. Every method that is
    refused (``can_*`` false) must have been checked first by the caller;
    calling ``allocate``/``append`` without room raises and changes no state.
    """

    page_size: int
    num_pages: int

    def can_allocate(self, seq: Sequence) -> bool:
        """Whether ``seq`` (``seq.num_tokens`` tokens) can be admitted now."""
        ...

    def allocate(self, seq: Sequence) -> int:
        """Admit ``seq``; return how many of its leading tokens are already cached (< num_tokens)."""
        ...

    def can_append(self, seq: Sequence, num_tokens: int) -> bool:
        """Whether ``seq`` can hold ``num_tokens`` more tokens."""
        ...

    def append(self, seq: Sequence, num_tokens: int) -> None:
        """Make ``seq`` hold ``num_tokens`` more tokens."""
        ...

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Give back ``seq``'s last ``num_tokens`` held slots (uncomputed drafts, never inside
        a page others share: an allocator may refuse such a cut; whole pages may always go)."""
        ...

    def free(self, seq: Sequence) -> None:
        """Release everything ``seq`` holds (a no-op for an unknown sequence)."""
        ...

    def block_table(self, seq: Sequence) -> list[int]:
        """The pages of ``seq`` in order: token ``t`` lives in page ``table[t // page_size]``."""
        ...

    def num_held_tokens(self, seq: Sequence) -> int:
        """How many token slots ``seq`` holds."""
        ...

    def on_tokens_computed(self, seq: Sequence) -> None:
        """Told after a step that ``seq.num_computed_tokens`` tokens now have KV (for prefix hashing)."""
        ...

    def stats(self) -> AllocatorStats:
        """A snapshot of the allocator's state."""
        ...


class AllocatorBase(Capabilities):
    """The defaults of an allocator's optional capabilities."""

    # Whether the samples of an n > 1 request share the first one's prompt pages: the engine then
    # starts the others once the first computed the prompt, calling share_prompt for each.
    shares_prefix_pages: bool = False
    # Whether allocate() may serve a prompt's leading tokens from a cache without computing them
    # (then prompt_logprobs, which needs every prompt token computed, is refused).
    caches_prefixes: bool = False

    def share_prompt(self, child: Sequence, parent: Sequence) -> None:
        """Let ``child`` (not admitted yet) share ``parent``'s computed prompt pages: by
        default nothing is shared and ``child`` computes its own prompt."""
        del child, parent

    def bind_kv_cache(self, kv_cache: torch.Tensor) -> None:
        """Handed the runner's KV cache once, at build (a host tier copies pages); ignored."""

    def before_launch(self) -> None:
        """Called before each step's launch: order the allocator's copies before it; no-op."""


# ---------------------------------------------------------------- scheduler


@attrs.frozen
class ScheduledSequence:
    """One sequence in a step: it computes ``num_new_tokens`` tokens from ``num_computed_tokens`` on."""

    seq: Sequence
    num_new_tokens: int


@attrs.frozen
class StepPlan:
    """What one step runs, and which sequences the scheduler preempted to make room."""

    scheduled: list[ScheduledSequence]
    preempted: list[Sequence] = attrs.Factory(list)

    @property
    def num_tokens(self) -> int:
        """Tokens computed in this step."""
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        """True when nothing is scheduled."""
        return not self.scheduled


@runtime_checkable
class Scheduler(Protocol):
    """Decides which sequences run each step and how many tokens each computes.

    Under the overlapped engine loop (``overlap``) a step is planned before
    the previous step's sampled tokens are known: a decoding sequence's last
    token may be *pending* (still one uncomputed token to schedule), a
    sequence at its length limit has ``num_uncomputed_tokens == 0`` and must
    not be scheduled, and finishes arrive through :meth:`on_step_done` one
    step late. Free a sequence's pages only when preempting it (listed in
    ``StepPlan.preempted``), in :meth:`abort`, or when :meth:`on_step_done`
    names it. ``pitstop.testing.scheduler`` checks all of it.
    """

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence (status WAITING)."""
        ...

    def abort(self, request_id: str) -> Sequence | None:
        """Remove a request wherever it is, freeing its pages; return it (None if unknown)."""
        ...

    def has_work(self) -> bool:
        """Whether any sequence is waiting or running."""
        ...

    def schedule(self) -> StepPlan:
        """Plan the next step: admit, grow and preempt through the allocator."""
        ...

    def on_step_done(self, plan: StepPlan, finished: Seq[Sequence]) -> None:
        """Told, once ``plan``'s results are applied, which sequences finished; release them.

        Under the overlapped loop ``plan`` is the step before the last one
        planned, and a finished sequence may be in the step in flight (its
        extra token is discarded by the engine).
        """
        ...

    @property
    def num_waiting(self) -> int:
        """Sequences queued."""
        ...

    @property
    def num_running(self) -> int:
        """Sequences admitted."""
        ...


@runtime_checkable
class StepBudgetSettings(Protocol):
    """A scheduler's settings that bound a step by something else than
    ``max_num_batched_tokens`` (the ``chunked`` scheduler's ``chunk_size``).

    The runner sizes its prefill workspace and its piecewise CUDA graphs from
    this budget before the scheduler exists
    (:meth:`~pitstop.plugin_system.plugin_manager.PluginManager.step_token_budget`); a
    scheduler whose settings lack the method is taken to keep every step
    within ``max_num_batched_tokens``.
    """

    def step_token_budget(self) -> int:
        """The most tokens one step of this scheduler computes."""
        ...


# ---------------------------------------------------------------- kernels


@attrs.frozen
class RotaryCache:
    """Precomputed cos and sin for every position: ``[max_positions, head_size // 2]`` each."""

    cos: torch.Tensor
    sin: torch.Tensor


@runtime_checkable
class KernelSet(Protocol):
    """The ops a model runs through. Resolved once; called directly on the hot path.

    Under tensor parallelism a rank's set also has ``all_reduce``, ``embed`` and ``gather_logits``
    (added by the executor: :meth:`pitstop.runner.peers.RankParallel.wrap_kernels`), which a
    kernel set plugin does not implement.
    """

    name: str

    def rms_norm(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        residual: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """RMSNorm of ``x`` (+ ``residual`` first, when given); returns (normed, new residual or None)."""
        ...

    def linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``x @ weight.T + bias``."""
        ...

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """``silu(x[..., :d]) * x[..., d:]`` for the merged gate-up output of width 2d."""
        ...

    def rope_and_store(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        rotary: RotaryCache,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        kv_scale: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q ``[T, Hq, D]`` and k ``[T, Hkv, D]`` (neox layout); write k, v into the cache slots.

        Caches are ``[num_pages, page_size, Hkv, D]``; returns the rotated q and k. An fp8 cache
        comes with ``kv_scale`` (float32 ``[2]``, on the device; wider caches get none): store
        ``k / kv_scale[0]``, ``v / kv_scale[1]`` saturated to the format's finite range (a set
        without the parameter is refused for fp8). A set declaring ``fuses_qk_norm`` also gets
        ``qk_norm=(q_weight, k_weight), qk_norm_eps=`` (Qwen3): RMS-normalize each head first.
        A set whose ``norm_linear_deferred`` defers also gets ``row_scale=(x, eps)``.
        """
        ...

    def attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        kv_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Causal attention of q ``[T, Hq, D]`` over the paged cache; returns ``[T, Hq, D]``.
        An fp8 cache's values are multiplied by ``kv_scale`` (K's, then V's) when read."""
        ...

    def describe(self) -> dict[str, str]:
        """Op name -> which implementation runs it here (and why, for a fallback)."""
        ...

    merge_projections: bool

    def cuda_graph_safe(self, head_size: int) -> bool:
        """Whether a decode step of this head size can be captured in a CUDA graph."""
        ...


class KernelSetBase(Capabilities):
    """The defaults of a kernel set's optional capabilities."""

    merge_projections: bool = False  # the model concatenates q/k/v and gate/up at load
    fuses_qk_norm: bool = False  # rope_and_store takes qk_norm= (see KernelSet.rope_and_store)
    # Whether the model runs each decoder layer through FusedLayerOps: the norms' gains folded
    # into the projections after them at load, the residual adds in the projections before.
    fuses_layer: bool = False
    moe: Any = None  # MoEOps.moe; None: an MoE model runs the reference loop itself
    # which of MoEOps.moe's optional arguments the set's moe takes: router=, residual=, norm_eps=
    moe_takes_router = moe_adds_residual = moe_takes_norm = False

    def cuda_graph_safe(self, head_size: int) -> bool:
        """Whether a decode step can be captured in a CUDA graph: not unless the set says so."""
        del head_size
        return False

    def norm_linear_deferred(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float | None, bias: Any = None, **kw: Any
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, float] | None]:
        """A fused layer's input norm + QKV: ``(norm_linear(...), None)`` (this default), or
        ``(x @ weight.T, (x, eps))``, the row scale left to ``rope_and_store(row_scale=)``,
        which then multiplies each token's q, k, v by ``1 / rms(x[t])`` first (``kw``: the
        ``lora=`` of an adapter plugin, passed on)."""
        return self.norm_linear(x, weight, eps, bias, **kw), None


# ---------------------------------------------------------------- sampler


class SamplerBase(Capabilities):
    """The defaults of a sampler's optional capabilities."""

    # Whether it applies penalties, logit_bias, blocked tokens, grammar masks,
    # allowed tokens, user processors and logprobs=k (else the engine refuses requests using them).
    supports_logits_processors: bool = False
    # (seqs, hidden, starts, compute_logits) -> {input index: PromptLogprobs}: the
    # log-probabilities of the prompt tokens a step's rows predict (None: the engine refuses
    # prompt_logprobs; the standard sampler's: pitstop.plugins.samplers.logprobs).
    prompt_logprobs: Any = None

    def prepare_request(self, params: SamplingParams, tokenizer: Any) -> Any:
        """What the sampler keeps of a request for its rows' processors (handed back in each
        row's ``RowInputs.prepared``), made when the request enters: nothing by default."""
        del params, tokenizer

    def add_step_inputs(
        self,
        batch: Any,
        rows: Seq[RowInputs | None],
        pending_rows: Seq[int],
        last_sampled: torch.Tensor,
        vocab_size: int,
        seq_ids: Seq[int],
    ) -> Any:
        """``batch`` plus this step's per-row tensors (token histories, blocked tokens, a
        grammar's bitmask) from ``rows``; a pending token is ``last_sampled[pending_rows[i]]``,
        on the device. Only a sampler that supports logits processors is handed rows: the
        default adds nothing."""
        del rows, pending_rows, last_sampled, vocab_size, seq_ids
        return batch

    def forget(self, seq_ids: Seq[int]) -> None:
        """Drop what it keeps of sequences that are gone (token histories): nothing kept."""
        del seq_ids


# ---------------------------------------------------------------- proposer


@attrs.frozen
class Proposal:
    """Draft tokens for one sequence (and their draft probabilities ``[k, V]`` when known)."""

    token_ids: list[int]
    probs: torch.Tensor | None = None
    # The drafts on the device (a proposer that computes them there, so that the engine never
    # waits for them): ``token_ids`` then holds as many PENDING_TOKEN placeholders.
    device_token_ids: torch.Tensor | None = None


@runtime_checkable
class Proposer(Protocol):
    """Proposes draft tokens for speculative decoding."""

    def propose(self, seqs: Seq[Sequence], k: int) -> list[Proposal]:
        """Up to ``k`` draft tokens for each sequence."""
        ...

    def on_accepted(self, seq: Sequence, num_accepted: int) -> None:
        """Told how many of ``seq``'s drafts were kept, so it can roll its own state back."""
        ...

    def release(self, seq: Sequence) -> None:
        """Told that ``seq`` finished or was aborted: free whatever the proposer holds for it."""
        ...


class ProposerBase(Capabilities):
    """The default of a proposer's optional capability."""

    def release(self, seq: Sequence) -> None:
        """Nothing to free: a proposer that keeps no per-sequence state."""
        del seq


# ---------------------------------------------------------------- tool-call parser


@runtime_checkable
class ToolParser(Protocol):
    """Reads the tool calls a model wrote in its own format (``tool_choice="auto"``).

    One per server, built by ``factory(tokenizer)``; it keeps no state per
    request (streaming is done by :class:`pitstop.entrypoints.tool_calls.ToolCallStream`
    from successive views).
    """

    def parse(self, text: str, final: bool) -> Any:
        """The :class:`~pitstop.entrypoints.tool_calls.ToolCallView` of ``text``: its content and calls.

        With ``final=False`` the text may still grow, and the view must be a
        prefix of the view of any longer text (hold back what may change:
        the start of a tag, trailing whitespace, a name not yet closed).
        """
        ...

    def tool_prompt(self, tools: Seq[dict[str, Any]]) -> str:
        """System-prompt text that lists ``tools`` (OpenAI's shape) and says how to call
        them in this parser's format, for chat templates that do not render tools."""
        ...


# ---------------------------------------------------------------- model


@runtime_checkable
class Model(Protocol):
    """A model architecture: a ``torch.nn.Module`` the runner loads and calls."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """The forward pass over one step's tokens (e.g. :mod:`pitstop.plugins.models.llama`)."""
        ...

    def eval(self) -> Any:
        """Inference mode (``torch.nn.Module.eval``)."""
        ...

    def init_dummy(self, seed: int) -> None:
        """Fill every parameter with seeded random values (``dummy:`` models).

        A model with ``supports_tensor_parallel`` also takes ``shard=`` (an executor's
        :attr:`pitstop.runner.peers.RankParallel.shard`): draw the whole model's
        tensors, keep the rank's part of each.
        """
        ...

    def load_weights(self, weights: Any) -> None:
        """Copy ``(name, tensor)`` pairs of a checkpoint into the parameters."""
        ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits ``[N, vocab]`` of the selected hidden rows (any float dtype; samplers widen)."""
        ...


class ModelBase(Capabilities):
    """The defaults of a model's optional capabilities."""

    # it takes init_dummy(shard=) and loads a rank's part of each tensor (else TP > 1 is refused)
    supports_tensor_parallel: bool = False
    # load_weights takes a checkpoint's quantized blocks (a KeepsBlocks format's; else refused)
    loads_quantized_weights: bool = False

    def weight_bytes(self) -> int:
        """Device bytes of its weights as held (the bench's floor): parameters and buffers."""
        return sum(t.numel() * t.element_size() for t in [*self.parameters(), *self.buffers()])  # type: ignore[attr-defined]


class KeepsBlocksBase(Capabilities):
    """The defaults of a :class:`KeepsBlocks` weight format's optional members: the words
    with which the engine refuses a model whose source offers no blocks."""

    # whose blocks the format keeps ("a GGUF file")
    blocks_of: str = "a quantized checkpoint"
    # what to pass instead ("a .gguf model (e.g. smollm2-135m)")
    blocks_model: str = "a model whose source offers its blocks"


# ---------------------------------------------------------------- model source


@runtime_checkable
class ModelSourceReader(Protocol):
    """Where models of one kind come from (a file format, a model name, a store).

    Loading a model asks every registered source, in name order, whether it
    :meth:`claims` the model string; the first that does loads it (:meth:`load`). A source
    that sets ``asked_last`` (``huggingface``: it claims any folder) is asked after the
    others; the engine itself reads only ``dummy:`` presets.
    """

    # the model strings it reads, as an error lists them ("'smollm2-135m', a .gguf file")
    accepts: str

    def claims(self, model: str) -> bool:
        """Whether ``model`` is one of its own: cheap, no loading, no error."""
        ...

    def load(self, model: str, tokenizer: Any) -> Any:
        """The :class:`~pitstop.loading.checkpoint.ModelSource` of ``model``: config,
        tokenizer and weights, checked; ``tokenizer`` (a ``Tokenizer`` or None) replaces
        the model's own. A model it cannot read is a ``ModelLoadError`` naming the fix."""
        ...

    def read_tokenizer(self, path: str) -> Any:
        """The ``Tokenizer`` a ``tokenizer=`` path of its kind holds, or None (not one)."""
        ...


class ModelSourceReaderBase(Capabilities):
    """The defaults of a model source's optional capabilities."""

    # asked after the sources that are not (a catch-all, such as one that claims any folder)
    asked_last: bool = False

    def read_tokenizer(self, path: str) -> Any:
        """None: it reads no tokenizer on its own (``tokenizer=`` takes a folder)."""
        del path
        return None
