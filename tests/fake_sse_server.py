"""A stand-in OpenAI server for the serving benchmark's tests (standard library only, so it starts at once).

`python -m tests.fake_sse_server PORT FIRST_DELAY_S GAP_S` serves on 127.0.0.1:
- GET /health and GET /v1/models (one model, MODEL);
- POST /v1/chat/completions, streamed only: a role chunk without text, then max_tokens one-token text
  chunks, the first after FIRST_DELAY_S and each next one GAP_S later, then a usage chunk when
  stream_options.include_usage is set, then [DONE]. A request for another model gets a 404, one that
  would stop at EOS (neither ignore_eos nor min_tokens >= max_tokens) a 400: the benchmark must ask
  every engine for exactly max_tokens tokens. A request whose `user` is "drop" ends without [DONE].
"""

from __future__ import annotations

import json
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

MODEL = "fake-model"
PROMPT_TOKENS = 128


def make_server(port: int, first_delay: float, gap: float) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.0"  # the body ends when the connection closes: no chunked encoding needed

        def log_message(self, *args: Any) -> None:
            pass

        def _json(self, status: int, obj: Any) -> None:
            raw = json.dumps(obj).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def do_GET(self) -> None:
            if self.path == "/health":
                self._json(200, {"status": "ok"})
            elif self.path == "/v1/models":
                self._json(200, {"object": "list", "data": [{"id": MODEL, "object": "model"}]})
            else:
                self._json(404, {"error": {"message": f"no route {self.path}"}})

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            n = int(body["max_tokens"])
            if body.get("model") != MODEL:
                self._json(404, {"error": {"message": f"unknown model {body.get('model')!r}"}})
                return
            if not (body.get("ignore_eos") or int(body.get("min_tokens", 0)) >= n) or not body.get("stream"):
                self._json(400, {"error": {"message": "expected a stream of exactly max_tokens tokens"}})
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()

            def send(obj: Any) -> None:
                self.wfile.write(f"data: {json.dumps(obj)}\n\n".encode())
                self.wfile.flush()

            send({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
            time.sleep(first_delay)
            for i in range(n):
                if i:
                    time.sleep(gap)
                send({"choices": [{"index": 0, "delta": {"content": f" t{i}"}, "finish_reason": None}]})
            if body.get("user") == "drop":  # as llama-cpp-python's server cuts off a stream: no [DONE]
                return
            if (body.get("stream_options") or {}).get("include_usage"):
                send({"choices": [], "usage": {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": n,
                                               "total_tokens": PROMPT_TOKENS + n}})
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()

    return ThreadingHTTPServer(("127.0.0.1", port), Handler)


if __name__ == "__main__":
    make_server(int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])).serve_forever()
