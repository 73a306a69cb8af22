"""A stand-in for ``vllm serve``: the OpenAI completions API of a model that streams zeros.

``serve MODEL --port P [flags]`` records its command line (``$FAKE_VLLM_RECORD``),
writes its own pid and that of a child it starts (as vLLM starts its engine core)
to ``$FAKE_VLLM_PIDS``, and serves ``/health``, ``/v1/models``, ``/metrics`` and
streaming ``/v1/completions`` (one chunk per token, then the usage chunk).
``$FAKE_VLLM_FAIL``: ``serve`` exits at once with an error; ``hang`` never answers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from vllm import _record


def _flag(argv: list[str], name: str, default: str | None = None) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else default


def main() -> None:
    argv = sys.argv[1:]
    assert argv[0] == "serve", argv
    model, port = argv[1], int(_flag(argv, "--port"))
    max_len = int(_flag(argv, "--max-model-len", "4096"))
    _record("serve", argv)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    pids = os.environ.get("FAKE_VLLM_PIDS")
    if pids:
        with open(pids, "w") as f:
            f.write(f"{os.getpid()} {child.pid}\n")
    fail = os.environ.get("FAKE_VLLM_FAIL")
    if fail == "serve":
        print("ValueError: fake vLLM cannot serve this model", flush=True)
        sys.exit(1)
    if fail == "hang":
        time.sleep(600)
    served = {"requests": 0}

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:
            pass

        def _send(self, code: int, body: bytes, ctype: str = "application/json") -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            if self.path == "/health":
                self._send(200, b"")
            elif self.path == "/v1/models":
                card = {"id": model, "root": model, "max_model_len": max_len}
                self._send(200, json.dumps({"object": "list", "data": [card]}).encode())
            elif self.path == "/metrics":
                text = (
                    f'vllm:prefix_cache_queries_total{{model_name="m"}} {100 * served["requests"]}\n'
                    f'vllm:prefix_cache_hits_total{{model_name="m"}} {25 * served["requests"]}\n'
                    "vllm:num_preemptions_total 0\n"
                )
                self._send(200, text.encode(), "text/plain")
            else:
                self._send(404, b'{"error": "not found"}')

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            assert self.path == "/v1/completions", self.path
            served["requests"] += 1
            n, prompt = body["max_tokens"], body["prompt"]
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()

            def event(obj: object) -> None:
                data = f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n".encode()
                self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                self.wfile.flush()

            for i in range(n):
                time.sleep(0.002)
                reason = "length" if i == n - 1 else None
                event({"choices": [{"index": 0, "text": "", "finish_reason": reason}]})
            usage = {"prompt_tokens": len(prompt), "completion_tokens": n}
            event({"choices": [], "usage": usage})
            event("[DONE]")
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()

    ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()


if __name__ == "__main__":
    main()
