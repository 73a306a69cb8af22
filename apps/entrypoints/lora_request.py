"""vLLM's ``LoRARequest``, also at its module path ``pitstop.lora.request`` (``vllm.lora.request``).

``LLM.generate`` and ``LLM.chat`` take one (or one per prompt) as ``lora_request`` on an
engine built with ``enable_lora=True`` (the adapter plugin ``lora``,
:mod:`pitstop.plugins.adapters.lora`; docs/lora.md). ``beam_search`` refuses it
(:data:`pitstop.entrypoints.vllm_surface.LORA_REFUSAL`).
"""

from __future__ import annotations

import attrs

from pitstop.errors import InvalidRequestError


def _name(_inst: object, att: attrs.Attribute, value: object) -> None:
    if not isinstance(value, str) or not value:
        raise InvalidRequestError(
            f"LoRARequest.{att.name} must be a non-empty string, got {value!r}"
        )


def _int_id(_inst: object, att: attrs.Attribute, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidRequestError(
            f"LoRARequest.{att.name} must be an integer >= 1 (vLLM's rule), got {value!r}"
        )


@attrs.frozen
class LoRARequest:
    """vLLM's ``LoRARequest(lora_name, lora_int_id, lora_path)``: a value naming an adapter.

    Built and compared as vLLM's (``lora_int_id`` >= 1, the adapter's identity in the
    engine: one id, one path).
    """

    lora_name: str = attrs.field(validator=_name)
    lora_int_id: int = attrs.field(validator=_int_id)
    lora_path: str = attrs.field(default="", validator=attrs.validators.instance_of(str))
    base_model_name: str | None = attrs.field(default=None, kw_only=True)
    tensorizer_config_dict: dict | None = attrs.field(default=None, kw_only=True, eq=False)

    @property
    def adapter_id(self) -> int:
        """vLLM's alias of ``lora_int_id``."""
        return self.lora_int_id

    @property
    def name(self) -> str:
        """vLLM's alias of ``lora_name``."""
        return self.lora_name

    @property
    def path(self) -> str:
        """vLLM's alias of ``lora_path``."""
        return self.lora_path


__all__ = ["LoRARequest"]
