"""The HTTP side of the control-plane fakes: a JSON API on a free local port, served from a thread.

A subclass answers `answer(request)` with (status, JSON payload); requests are answered one at a
time (under `self._lock`), so the subclass's state needs no locking of its own.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    query: dict[str, list[str]]
    body: Any  # parsed JSON, or None
    authorization: str | None


@dataclass(frozen=True)
class Text:
    """An answer that is text, not JSON (a job log's lines)."""

    text: str


class JsonHttpFake:
    """``with Fake() as fake:`` -> a real HTTP server at ``fake.url`` until the block ends."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,), daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    def answer(self, request: Request) -> tuple[int, Any]:
        raise NotImplementedError

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def _serve(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                try:
                    body = json.loads(raw) if raw else None
                except json.JSONDecodeError:
                    body = None
                url = urlsplit(self.path)
                request = Request(self.command, url.path, parse_qs(url.query), body, self.headers.get("Authorization"))
                with fake._lock:
                    code, payload = fake.answer(request)
                raw = isinstance(payload, Text)  # a log, as the state API serves it: not JSON
                data = payload.text.encode() if raw else json.dumps(payload).encode()
                self.send_response(code)
                self.send_header("Content-Type", "text/plain" if raw else "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_DELETE = do_PUT = do_PATCH = _serve

            def log_message(self, *args: Any) -> None:
                pass

        return Handler
