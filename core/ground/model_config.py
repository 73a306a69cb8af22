"""`ModelConfig`: the shape of a decoder-only model, read from a checkpoint or a preset.

Every architecture plugin builds one from the files it reads (its
:class:`~pitstop.plugin_system.architecture.Architecture`'s ``config_from_hf`` and
``gguf.config``); the engine sizes the KV cache by it and refuses a
``max_model_len`` the model cannot compute exactly
(:meth:`ModelConfig.check_max_model_len`). The bounds below, and
:func:`positive_int`, are what every reader checks a claimed size against.
"""

from __future__ import annotations

from typing import Any

import attrs

from pitstop.errors import ConfigError, ModelLoadError

# The largest value a shape field may claim (far above any released model): a larger
# one is a corrupt or hostile file, refused before anything of that size is allocated.
MAX_DIM = 2**20
MAX_LAYERS = 4096
MAX_VOCAB = 2**23
MAX_POSITIONS = 2**31 - 1


def positive_int(value: Any, field: str, where: str, limit: int) -> int:
    """``value`` as an int in [1, limit]; anything else is a ModelLoadError naming
    ``field`` and the file (``where``) it came from."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= limit:
        raise ModelLoadError(
            f"{where}: {field}={value!r} is not a whole number between 1 and {limit:,}; "
            "the file is corrupt or describes no model pitstop can run"
        )
    return value


@attrs.frozen(kw_only=True)
class ModelConfig:
    """Architecture and shape of a decoder-only model.

    ``architecture`` is the model registry name of the architecture plugin that
    runs it (the ``architectures`` entry of a checkpoint's ``config.json``); the
    plugin manager maps it to a model factory. The other fields are the shapes
    and switches the built-in family reads; a plugin of another architecture
    fills those its model needs and leaves the rest at their defaults.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # transformers' rope parameters besides rope_theta ({"rope_type": "yarn", "factor": 4.0, ...});
    # None is the default rope
    rope_scaling: dict[str, Any] | None = None
    # per-frequency rope scaling factors, as some GGUF files store a scaled rope: every
    # inverse frequency is divided by one
    rope_freq_factors: tuple[float, ...] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q, k and v
    o_proj_bias: bool = False  # bias on the attention's output projection
    mlp_bias: bool = False  # bias on gate, up and down
    qk_norm: bool = False  # RMSNorm on each head of q and k
    # The attention window of the layers that have one (transformers' use_sliding_window);
    # pitstop runs such a model only where the window never cuts: max_model_len <= window.
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @property
    def rope_type(self) -> str:
        """The rope variant (transformers' ``rope_type``; ``default`` when unscaled)."""
        scaling = self.rope_scaling or {}
        return str(scaling.get("rope_type", scaling.get("type", "default")))

    @property
    def num_params(self) -> int:
        """Parameter count, embeddings included (output head counted once when tied)."""
        q, kv = self.num_heads * self.head_size, self.num_kv_heads * self.head_size
        attn = self.hidden_size * (2 * q + 2 * kv)
        attn += (q + 2 * kv) * self.attention_bias + self.hidden_size * self.o_proj_bias
        mlp = 3 * self.hidden_size * self.intermediate_size
        mlp += (2 * self.intermediate_size + self.hidden_size) * self.mlp_bias
        norms = 2 * self.hidden_size + (2 * self.head_size if self.qk_norm else 0)
        per_layer = attn + mlp + norms
        emb = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + emb + self.hidden_size

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token over all layers, in elements (multiply by the dtype's size)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_size

    def check_max_model_len(self, max_model_len: int) -> None:
        """Refuse a ``max_model_len`` at which this model would compute something other
        than ``transformers`` does (a :class:`ConfigError` that names the fix)."""
        if self.sliding_window is not None and self.sliding_window < max_model_len:
            raise ConfigError(
                f"the model uses sliding-window attention (sliding_window={self.sliding_window}), "
                f"shorter than max_model_len={max_model_len}; pitstop does not implement attention "
                f"windows, so it runs this model only where the window never cuts: use "
                f"max_model_len <= {self.sliding_window}"
            )
        if self.rope_type == "dynamic" and max_model_len > self.max_position_embeddings:
            raise ConfigError(
                f"rope_type='dynamic' (dynamic NTK) recomputes its frequencies once a sequence grows "
                f"past max_position_embeddings={self.max_position_embeddings}, and transformers then "
                f"makes them depend on the longest sequence of the batch; pitstop implements it "
                f"exactly up to there only: use max_model_len <= {self.max_position_embeddings}"
            )
