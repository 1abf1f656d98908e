"""A TCP proxy the fault tests control: stands between a Jobs API client and the Ray dashboard.

`down()` makes the dashboard unreachable the way a restart or a network cut does: the listener
closes (new connections are refused) and every open connection is cut. `up()` listens again on
the same port. `lose_next_response()` forwards the next job submission to the dashboard but
cuts the connection before its answer gets back: the client cannot know whether it was taken.
"""

from __future__ import annotations

import socket
import threading
from urllib.parse import urlsplit


class FaultProxy:
    def __init__(self, target_url: str) -> None:
        parts = urlsplit(target_url)
        self.target = (parts.hostname or "127.0.0.1", parts.port or 80)
        self.port = 0
        self._listener: socket.socket | None = None
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._lose_response = False
        self._lost = threading.Event()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def up(self) -> FaultProxy:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self.port = listener.getsockname()[1]
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()
        return self

    def down(self) -> None:
        """Refuse new connections and cut the open ones (both directions, at once)."""
        listener, self._listener = self._listener, None
        if listener is not None:
            _close(listener)
        with self._lock:
            conns, self._conns = self._conns, set()
        for conn in conns:
            _close(conn)

    def lose_next_response(self) -> threading.Event:
        """Forward the next `POST /api/jobs/` but cut its connection before the answer; the event says it happened."""
        self._lost.clear()
        self._lose_response = True
        return self._lost

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # closed by down()
            try:
                upstream = socket.create_connection(self.target, timeout=10)
            except OSError:
                _close(client)
                continue
            with self._lock:
                self._conns |= {client, upstream}
            submitted = threading.Event()
            threading.Thread(target=self._pipe, args=(client, upstream, submitted, True), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client, submitted, False), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, submitted: threading.Event, to_dashboard: bool) -> None:
        try:
            while data := src.recv(65536):
                if to_dashboard and self._lose_response and b"POST /api/jobs/ " in data:
                    self._lose_response = False
                    submitted.set()
                elif not to_dashboard and submitted.is_set():
                    # The dashboard answered the submission: drop the answer and the connection.
                    self._lost.set()
                    break
                dst.sendall(data)
        except OSError:
            pass
        finally:
            _close(src)
            _close(dst)
            with self._lock:
                self._conns -= {src, dst}


def _close(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    try:
        sock.close()
    except OSError:
        pass

