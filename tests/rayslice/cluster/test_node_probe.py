"""The raylet probe's connection check, on real sockets (no cluster)."""

from __future__ import annotations

import socket

from rayslice.cluster.node_probe import accepts


def test_a_listening_port_accepts():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        assert accepts("127.0.0.1", server.getsockname()[1])


def test_a_port_nobody_listens_on_does_not():
    with socket.socket() as sock:  # bound, never listening: connections to it are refused
        sock.bind(("127.0.0.1", 0))
        assert not accepts("127.0.0.1", sock.getsockname()[1], timeout=0.5)
