"""The sandbox process that renders chat templates sent in requests (run as a script).

Started by :class:`pitstop.server.template_sandbox.TemplateSandbox` as
``python -I template_worker.py MEMORY_BYTES MAX_OUTPUT_BYTES``: it imports
transformers' Jinja renderer (the same sandboxed environment, filters and
globals as ``apply_chat_template``), then limits its own address space to what
it uses plus ``MEMORY_BYTES`` and answers one JSON line per JSON line read from
stdin: ``{"text": ...}`` or ``{"error": ...}``. A render that runs too long is
ended by the parent, which kills this process; a render that allocates past
the limit fails with MemoryError here. It imports nothing of pitstop's, and
ends when its parent does.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import threading
import time
from typing import Any


def _render(request: dict[str, Any]) -> str:
    try:
        from transformers.utils.chat_template_utils import render_jinja_template
    except ImportError:  # transformers < 4.50: compile, then render as apply_chat_template did
        render_jinja_template = None
    if render_jinja_template is None:
        from transformers.utils.chat_template_utils import _compile_jinja_template

        if request["continue_final_message"]:
            raise ValueError(
                "continue_final_message with a request template needs transformers 4.50"
            )
        template = _compile_jinja_template(request["template"])
        return template.render(
            messages=request["messages"],
            tools=request["tools"],
            add_generation_prompt=request["add_generation_prompt"],
            **request["kwargs"],
        )
    rendered, _ = render_jinja_template(
        conversations=[request["messages"]],
        tools=request["tools"],
        chat_template=request["template"],
        add_generation_prompt=request["add_generation_prompt"],
        continue_final_message=request["continue_final_message"],
        **request["kwargs"],
    )
    return rendered[0]


def _address_space() -> int:
    """This process's virtual memory size in bytes (Linux), or 0 when unknown."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 0


def _exit_with_parent(parent: int) -> None:
    """End this process when the server that started it is gone (even mid-render)."""
    while True:
        time.sleep(0.5)
        if os.getppid() != parent:
            os._exit(0)


def main() -> None:
    """Render requests from stdin until it closes (see the module docstring)."""
    memory, max_output = int(sys.argv[1]), int(sys.argv[2])
    _render(
        {
            "template": "x",
            "messages": [],
            "tools": None,
            "add_generation_prompt": False,
            "continue_final_message": False,
            "kwargs": {},
        }
    )  # imports everything first
    used = _address_space()
    if used:
        resource.setrlimit(resource.RLIMIT_AS, (used + memory, used + memory))
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()
    out = sys.stdout
    out.write('{"ready": true}\n')
    out.flush()
    for line in sys.stdin:
        try:
            text = _render(json.loads(line))
            answer = (
                {"text": text}
                if len(text) <= max_output
                else {"error": f"the rendered prompt is over {max_output:,} characters"}
            )
        except MemoryError:
            answer = {"error": f"the template needed more than {memory >> 20} MiB of memory"}
        except Exception as exc:  # noqa: BLE001 - every template error is the request's
            answer = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        try:
            out.write(json.dumps(answer, ensure_ascii=False) + "\n")
        except MemoryError:
            out.write('{"error": "the rendered prompt did not fit in memory"}\n')
        out.flush()


if __name__ == "__main__":
    main()
