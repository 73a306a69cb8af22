"""The :class:`~pitstop.server.protocol.APIError` answers the routes share.

Each function builds one kind of answer (a refused body, a request the
engine refused, the server shutting down, the engine failing), so every
route words it, and counts it, the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pitstop.errors import InvalidRequestError
from pitstop.server.errors import validation_message
from pitstop.server.protocol import APIError, clip

# The fields an engine refusal may name as OpenAI's ``param`` (its message's first word).
_SAMPLING_PARAMS = (
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stop_token_ids",
    "messages",
    "logit_bias",
    "n",
    "min_tokens",
    "structured_outputs",
    "logprobs",
    "prompt_logprobs",
)


def invalid_request(
    exc: InvalidRequestError, prompt_param: str, structured_param: str | None = None
) -> APIError:
    """The 400 of a request the engine refused, ``param`` naming the field at fault.

    ``prompt_param`` is the field a refusal of the prompt points at;
    ``structured_param`` the one a refusal of ``structured_outputs`` does.
    """
    message = str(exc)
    if "max_model_len" in message:
        return APIError(400, message, param=prompt_param, code="context_length_exceeded")
    first = message.split(" ", 1)[0].rstrip(":").split("[", 1)[0].split(".", 1)[0]
    if first == "structured_outputs" and structured_param is not None:
        return APIError(400, message, param=structured_param)
    param = first if first in _SAMPLING_PARAMS else prompt_param
    return APIError(400, message, param=param)


def body_error(errors: Sequence[dict[str, Any]]) -> APIError:
    """The 400 of a body that fails the request models, in pitstop's words (server.errors)."""
    first = errors[0] if errors else {}
    if first.get("type") == "extra_forbidden":
        loc = [str(p) for p in first.get("loc", ())]
        return APIError(
            400,
            f"unknown field {clip('.'.join(loc))}: pitstop does not implement it, so it is refused "
            "rather than ignored; remove it (docs/server.md lists every field)",
            param=loc[0] if loc else None,
            code="unsupported_field",
        )
    param, message = validation_message(errors)
    return APIError(400, message, param=param)


def shutdown_error() -> APIError:
    """The 503 of a request the server's shutdown cut short."""
    return APIError(
        503,
        "the server shut down before the request finished; send it again to another server "
        "or after the restart",
        type="server_error",
        code="shutting_down",
        headers={"Connection": "close"},
    )


def engine_closed_error(exc: BaseException) -> APIError:
    """The 503 of a request sent to an engine that no longer takes any."""
    return APIError(
        503, str(exc), type="server_error", code="shutting_down", headers={"Connection": "close"}
    )


def asleep_error(retry_after_s: int, why: str | None = None) -> APIError:
    """The 503 of a request sent while the engine sleeps (POST /sleep): never accepted."""
    return APIError(
        503,
        why
        or "the engine is asleep (POST /sleep) and accepts no request until POST /wake_up; "
        f"retry after {retry_after_s} s",
        type="server_error",
        code="engine_asleep",
        headers={"Retry-After": str(retry_after_s)},
    )


def engine_error(exc: BaseException) -> APIError:
    """The 503 of a request whose engine step failed."""
    return APIError(503, str(exc), type="server_error", code="engine_error")


def request_failed(finish_reason: str | None) -> APIError:
    """The 500 of a request the engine ended with a failure of its own."""
    return APIError(
        500,
        f"the engine failed this request ({finish_reason})",
        type="server_error",
        code="request_failed",
    )
