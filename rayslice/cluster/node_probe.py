"""Is a lost host's node gone? Ask its raylet directly instead of waiting for the GCS's verdict.

The GCS declares a node dead only after several missed health checks (about 10 s on the local
cluster, up to 45 s with Ray's defaults). A node whose raylet no longer accepts a TCP connection
(refused: its processes are gone; timed out: its machine is gone) is lost now. A raylet that
accepts is alive: the host's process died on a live node, which its raylet reports at once.
"""

from __future__ import annotations

import socket

import ray

#: How long a connection attempt may take before the raylet counts as unreachable.
CONNECT_TIMEOUT_S = 1.0


def raylet_unreachable(node_id: str, timeout: float = CONNECT_TIMEOUT_S) -> bool:
    """True when the node's raylet refuses or does not answer a TCP connection within `timeout`."""
    node = next((n for n in ray.nodes() if n["NodeID"] == node_id), None)
    if node is None or not node.get("NodeManagerPort"):
        return False  # unknown here: leave the verdict to the GCS
    return not accepts(node["NodeManagerAddress"], int(node["NodeManagerPort"]), timeout)


def accepts(host: str, port: int, timeout: float = CONNECT_TIMEOUT_S) -> bool:
    """Whether something listens at host:port and accepts a connection within `timeout`."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:  # refused, unreachable, timed out
        return False
