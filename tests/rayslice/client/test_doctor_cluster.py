"""`rayslice doctor` against the session's local cluster: it passes and its smoke step runs on every host of a
slice; broken in ways that do not harm the shared cluster (an unwritable checkpoint root, blocked egress, a
smoke slice that does not exist), it names each and its fix. The rules, each broken alone: test_doctor.py."""

from __future__ import annotations

import re
import socket

from typer.testing import CliRunner

from rayslice.cli import app
from rayslice.client import capacity
from tests.conftest import wait_until

runner = CliRunner()


def doctor(*args: str) -> tuple[int, str]:
    result = runner.invoke(app, ["doctor", *args])
    return result.exit_code, result.output


def test_doctor_passes_on_the_local_cluster_and_smokes_every_host(cluster):
    code, out = doctor("--name", cluster.name)
    assert code == 0, out
    lines = out.splitlines()
    assert not [line for line in lines if line.startswith("FAIL")], out
    for check in ("dashboard", "token", "nodes", "versions", "accelerators", "checkpoint root", "metrics", "smoke"):
        assert any(line.startswith(f"PASS {check}:") for line in lines), (check, out)
    # A WARN where a reused cluster (RAYSLICE_TEST_CLUSTER) was started from other launcher files: only slower.
    assert any(line.startswith(("PASS launcher:", "WARN launcher:")) for line in lines), out
    slices = [line for line in lines if line.startswith("PASS slice ")]
    assert slices and all(" 4 host(s)" in line or " 1 host(s)" in line for line in slices), out
    smoke = " ".join(next(line for line in lines if line.startswith("PASS smoke:")).split())
    pod_type = re.search(r"on every host of a (\S+) slice", smoke)[1]
    hosts = {int(re.search(r"(\d+) host\(s\)", line)[1]) for line in slices if f": {pod_type} (" in line}
    rows = re.findall(r"worker (\d+) \([^)]*\): (\d+) devices, (\d+) local", smoke)
    assert rows and [int(w) for w, _, _ in rows] == list(range(len(rows))), smoke
    assert len({total for _, total, _ in rows}) == 1 and int(rows[0][1]) == sum(int(local) for *_, local in rows)
    assert hosts == {len(rows)}, (hosts, smoke)  # every host of the slice answered
    # Nothing leaks: the smoke step's slice is released (the launcher removes its placement groups before it ends).
    held = wait_until(lambda: not [s.name for s in capacity.snapshot(cluster.dashboard_url, cluster.token).slices
                                   if s.state != "free"], timeout=30)
    assert held, capacity.snapshot(cluster.dashboard_url, cluster.token).slices


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_doctor_names_an_unwritable_checkpoint_root_blocked_egress_and_a_missing_smoke_slice(cluster):
    port = closed_port()
    code, out = doctor("--name", cluster.name, "--checkpoint-root", "file:///proc/rayslice-doctor",
                       "--egress", f"127.0.0.1:{port}", "--smoke-slice", "v5p-8")
    flat = " ".join(out.split())
    assert code == 1, out
    assert "FAIL checkpoint root: host " in flat and "cannot write file:///proc/rayslice-doctor" in flat
    assert "FAIL egress: host " in flat and f"cannot reach 127.0.0.1:{port} (ConnectionRefusedError" in flat
    assert "fix: new TPU VMs run their startup script from there" in flat
    assert "FAIL smoke: --smoke-slice 'v5p-8': no such slice or pod type" in flat
    assert "PASS versions:" in flat and "PASS dashboard:" in flat  # only what was broken fails
