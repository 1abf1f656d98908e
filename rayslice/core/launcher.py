"""What the shipped launcher is made of, and how a node says it already has the very same copy.

A shipped launcher (`launcher: shipped`, the default) goes with every job as `py_modules`:
rayslice's cluster side and cloudpickle. Ray then starts each host process through its
`setup_worker` step (a second Python start and `ray` import per process, on every host of every
step). A node whose own Python has these same files installed needs none of that: the node is
started with the label `rayslice.io/launcher=<digest>`, and a driver whose own (shipped) files give
the same digest starts the step's host processes there without the launcher's runtime env. Any
difference, one byte in one file, gives another digest, and the hosts get the shipped copy.

`rayslice local up` labels its nodes; an operator whose image has rayslice installed can label
theirs with `rayslice launcher-label` (docs/connection.md).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

#: The node label that names the launcher installed in the node's Python (its digest).
LABEL = "rayslice.io/launcher"
#: What the cluster imports of rayslice: its public names, the request model, the launcher.
CLUSTER_SIDE = ("__init__.py", "core", "cluster")
#: Hex digits of the digest kept in the label (Ray's label values are at most 63 characters).
DIGEST_HEX = 32


def is_cluster_side(rel: str) -> bool:
    """Python sources of the cluster side, and the folders that hold them (`rel`: under `rayslice/`)."""
    parts = rel.split("/")
    if parts[0] not in CLUSTER_SIDE or any(p.startswith((".", "__pycache__")) for p in parts):
        return False
    return "." not in parts[-1] or parts[-1].endswith(".py")


def _is_source(rel: str) -> bool:
    parts = rel.split("/")
    return not any(p.startswith((".", "__pycache__")) for p in parts) and parts[-1].endswith(".py")


def digest(rayslice_dir: Path, cloudpickle_dir: Path) -> str:
    """One digest of the launcher's files: rayslice's cluster side and cloudpickle, path and bytes."""
    h = hashlib.sha256()
    for name, root, keep in (("rayslice", rayslice_dir, is_cluster_side), ("cloudpickle", cloudpickle_dir, _is_source)):
        files = sorted(p for p in root.rglob("*") if p.is_file() and keep(p.relative_to(root).as_posix()))
        for path in files:
            rel = f"{name}/{path.relative_to(root).as_posix()}"
            data = path.read_bytes()
            h.update(f"{rel}\0{len(data)}\0".encode())
            h.update(data)
    return h.hexdigest()[:DIGEST_HEX]
