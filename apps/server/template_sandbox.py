"""Rendering a chat template sent in a request, bounded in time and memory.

A chat template is a program: Jinja's sandbox keeps it from reaching
Python's internals, but not from looping (``range`` is capped at 100,000
items, nested loops are not) or from building a string of a gigabyte. So
when the server trusts request templates (``--trust-request-chat-template``,
vLLM's flag; without it such a request is a 400), :class:`TemplateSandbox`
renders them in a separate process (:mod:`pitstop.server.template_worker`):

- **time**: a render that has not answered within ``timeout_s`` (the
  ``--chat-template-timeout``, 2 s) is a 400, and the process is killed and
  started again for the next request;
- **memory**: the process may allocate ``memory_bytes`` (256 MiB) beyond what
  its imports take; a template that needs more is a 400;
- **size**: a rendered prompt over ``max_output_chars`` is a 400;
- **one at a time**: the server renders one request template at a time
  (:attr:`~pitstop.server.state.AppState.template_slot`), so they never hold
  more than one worker thread, and the model's own template (trusted, rendered
  in the server's threads as before) never waits for them.

The process starts at the first request template (transformers' import takes
a few seconds) and ends with the server.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from pitstop.entrypoints.chat_template import validate_messages
from pitstop.errors import InvalidRequestError

_WORKER = Path(__file__).with_name("template_worker.py")
START_TIMEOUT_S = 60.0  # the worker's imports (transformers), on a loaded machine


class TemplateSandbox:
    """A worker process that renders request chat templates (see the module docstring)."""

    def __init__(
        self, *, timeout_s: float, memory_bytes: int, max_output_chars: int = 8 << 20
    ) -> None:
        self.timeout_s = timeout_s
        self.memory_bytes = memory_bytes
        self.max_output_chars = max_output_chars
        self._proc: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()
        self.kills = 0  # renders stopped for running too long

    def renderer(self, special_tokens: dict[str, Any]) -> Any:
        """A function with ``render_chat_template``'s arguments (the tokenizer left out)
        (:mod:`pitstop.entrypoints.chat_template`) that renders here;
        ``special_tokens`` (``bos_token``, ...) are given to the template, as transformers does."""

        def render(
            messages: list[dict[str, Any]],
            add_generation_prompt: bool = True,
            *,
            chat_template: str | None = None,
            continue_final_message: bool = False,
            template_kwargs: dict[str, Any] | None = None,
            tools: list[dict[str, Any]] | None = None,
        ) -> str:
            return self.render(
                {
                    "template": chat_template,
                    "messages": validate_messages(messages),
                    "tools": tools,
                    "add_generation_prompt": add_generation_prompt,
                    "continue_final_message": continue_final_message,
                    "kwargs": {**special_tokens, **(template_kwargs or {})},
                }
            )

        return render

    def render(self, request: dict[str, Any]) -> str:
        """Render one request in the worker; a failure, a timeout or too much memory is an
        :class:`InvalidRequestError` naming the bound and the flag."""
        line = (json.dumps(request, ensure_ascii=False) + "\n").encode("utf-8")
        with self._lock:
            proc = self._started()
            assert proc.stdin is not None and proc.stdout is not None
            try:
                proc.stdin.write(line)
                proc.stdin.flush()
                answer = _read_line(proc, time.monotonic() + self.timeout_s)
            except TimeoutError:
                self.kills += 1
                self._stop()
                raise InvalidRequestError(
                    f"chat_template did not finish rendering within {self.timeout_s:g} s "
                    "(--chat-template-timeout) and was stopped; send a template without "
                    "long loops, or leave chat_template out to use the model's own"
                ) from None
            except (OSError, EOFError):
                self._stop()
                raise InvalidRequestError(
                    f"chat_template stopped the renderer (more than {self.memory_bytes >> 20} "
                    "MiB of memory, or a crash); send a smaller template"
                ) from None
        reply = json.loads(answer)
        if "error" in reply:
            raise InvalidRequestError(f"chat_template could not be rendered: {reply['error']}")
        return reply["text"]

    def _started(self) -> subprocess.Popen[bytes]:
        """The running worker, started (and waited for) if there is none."""
        if self._proc is not None and self._proc.poll() is None:
            return self._proc
        self._proc = subprocess.Popen(
            [
                sys.executable,
                "-I",
                str(_WORKER),
                str(self.memory_bytes),
                str(self.max_output_chars),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env={**os.environ, "TOKENIZERS_PARALLELISM": "false"},
        )
        try:
            _read_line(self._proc, time.monotonic() + START_TIMEOUT_S)
        except (TimeoutError, EOFError, OSError):
            self._stop()
            raise InvalidRequestError(
                "the chat template sandbox did not start (is transformers installed?); "
                "leave chat_template out to use the model's own"
            ) from None
        return self._proc

    def _stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(5)

    def close(self) -> None:
        """End the worker (the server is stopping)."""
        with self._lock:
            self._stop()


def _read_line(proc: subprocess.Popen[bytes], deadline: float) -> bytes:
    """One line of the worker's stdout by ``deadline`` (TimeoutError), EOFError if it ended."""
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    data = bytearray()
    while not data.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError
        ready, _, _ = select.select([fd], [], [], left)
        if not ready:
            continue
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            raise EOFError
        data += chunk
    return bytes(data)
