"""rayslice.client.doctor's rules, each broken one thing at a time, without a cluster.

The facts are what the probe job (rayslice.cluster.doctor_probe) and the state API report; a healthy
set passes every rule, and each test breaks one fact and sees that rule FAIL, name it and give the fix.
The same doctor against a live cluster: tests/rayslice/client/test_doctor_cluster.py.
"""

from __future__ import annotations

import copy
import socket
from datetime import UTC, datetime

import pytest
from typer.testing import CliRunner

from rayslice.cli import app
from rayslice.client import doctor
from rayslice.client.capacity import GpuNode, Host, Slice, Snapshot
from rayslice.core import launcher as launcher_files
from tests.http_fake import JsonHttpFake, Request

runner = CliRunner()
DIGEST = "d" * 32


def node(node_id: str, *, head: bool = False, **extra) -> dict:
    return {"node_id": node_id, "head": head, "address": "10.0.0.1", "labels": {}, "resources": {},
            "writer": False, "metrics_port": 8080, "metrics_error": None, "hostname": f"host-{node_id}",
            "python": "3.12.1", "ray": "2.60.0", "rayslice_imported": "0.1.0", "rayslice_installed": "0.1.0", **extra}


@pytest.fixture
def probe() -> dict:
    return {"driver_python": "3.12.1", "nodes": [
        node("head", head=True),
        node("w0", writer=True, checkpoint=None, egress={"pypi.org:443": None},
             labels={launcher_files.LABEL: DIGEST}),
        node("w1")]}


def snapshot(hosts: int = 4, pod_type: str = "v6e-16") -> Snapshot:
    return Snapshot(slices=[Slice(name="v6e-16-a", pod_type=pod_type, topology="4x4", chips=4 * hosts, state="free",
                                  hosts=[Host(worker_id=i, node_id=f"n{i}", chips=4) for i in range(hosts)])],
                    gpu_nodes=[GpuNode(node_id="g", total=1, used=0, shares=[])], pending=[],
                    taken_at=datetime.now(UTC))


def one(checks: list[doctor.Check], name: str) -> doctor.Check:
    (found,) = [c for c in checks if c.name == name]
    return found


def test_a_healthy_set_of_facts_passes_every_rule(probe):
    checks = [doctor.judge_nodes_answered(probe),
              doctor.judge_versions(probe, client_python="3.12.1", client_rayslice="0.1.0", pinned_ray="2.60.0"),
              doctor.judge_launcher(probe, mode="installed", client_rayslice="0.1.0", client_digest=DIGEST),
              *doctor.judge_slices(snapshot()), doctor.judge_checkpoint(probe, "gs://b/ckpt"),
              doctor.judge_metrics(probe), doctor.judge_egress(probe, ["pypi.org:443"])]
    assert not doctor.failed(checks), doctor.render(checks)
    assert "4 host(s), 16 TPU chips" in one(checks, "slice v6e-16-a").detail
    assert "1 GPU node(s), 1 GPUs" in one(checks, "accelerators").detail


def test_a_ray_version_mismatch_is_named_with_the_fix(probe):
    probe["nodes"][2]["ray"] = "2.59.0"
    check = doctor.judge_versions(probe, client_python="3.12.1", client_rayslice="0.1.0", pinned_ray="2.60.0")
    assert check.status == "FAIL" and "Ray differs between nodes (2.59.0, 2.60.0)" in check.detail
    assert "host-w1: Ray 2.59.0" in check.detail and "one Ray version" in check.fix


def test_the_airflow_sides_python_minor_must_be_the_clusters(probe):
    check = doctor.judge_versions(probe, client_python="3.13.2", client_rayslice="0.1.0", pinned_ray="2.60.0")
    assert check.status == "FAIL" and "shipped by value" in check.detail and "Python 3.13" in check.fix
    # A patch difference between nodes that joined anyway (match level minor) passes with a note.
    probe["nodes"][1]["python"] = "3.12.12"
    check = doctor.judge_versions(probe, client_python="3.12.1", client_rayslice="0.1.0", pinned_ray="2.60.0")
    assert check.status == "PASS" and "RAY_DEFAULT_PYTHON_VERSION_MATCH_LEVEL=minor" in check.detail


def test_an_installed_launcher_missing_on_a_node_fails(probe):
    probe["nodes"][0]["rayslice_installed"] = None
    check = doctor.judge_launcher(probe, mode="installed", client_rayslice="0.1.0", client_digest=DIGEST)
    assert check.status == "FAIL" and "head: not installed" in check.detail
    assert "drop `launcher`" in check.fix
    shipped = doctor.judge_launcher(probe, mode="shipped", client_rayslice="0.1.0", client_digest=DIGEST)
    assert shipped.status == "PASS" and f"1 of 3 node(s) carry this side's launcher label ({launcher_files.LABEL})" \
        in shipped.detail
    stale = doctor.judge_launcher(probe, mode="shipped", client_rayslice="0.1.0", client_digest="e" * 32)
    assert stale.status == "WARN" and "rayslice launcher-label" in stale.fix


def test_a_slice_missing_a_host_is_named(probe):
    snap = snapshot()
    del snap.slices[0].hosts[2]
    check = one(doctor.judge_slices(snap), "slice v6e-16-a")
    assert check.status == "FAIL" and "has 3 of its 4 hosts (missing worker id(s) 2" in check.detail
    assert "no step can reserve this slice" in check.fix


def test_no_accelerator_at_all_fails():
    empty = Snapshot(slices=[], gpu_nodes=[], pending=[], taken_at=datetime.now(UTC))
    check = one(doctor.judge_slices(empty), "accelerators")
    assert check.status == "FAIL" and "TPU webhook" in check.fix


def test_an_unwritable_checkpoint_root_fails(probe):
    probe["nodes"][1]["checkpoint"] = "PermissionError: [Errno 13] Permission denied: '/ckpt/.rayslice-doctor'"
    check = doctor.judge_checkpoint(probe, "file:///ckpt")
    assert check.status == "FAIL" and "host host-w0 cannot write file:///ckpt: PermissionError" in check.detail
    assert "write access" in check.fix
    assert doctor.judge_checkpoint(probe, None).status == "SKIP"


def test_a_closed_metrics_port_fails(probe):
    probe["nodes"][2]["metrics_error"] = "URLError: <urlopen error [Errno 111] Connection refused>"
    check = doctor.judge_metrics(probe)
    assert check.status == "FAIL" and "host-w1 10.0.0.1:8080: URLError" in check.detail
    assert "--metrics-export-port 8080" in check.fix


def test_blocked_egress_fails(probe):
    probe["nodes"][1]["egress"] = {"pypi.org:443": "TimeoutError: timed out"}
    check = doctor.judge_egress(probe, ["pypi.org:443"])
    assert check.status == "FAIL" and "pypi.org:443 (TimeoutError" in check.detail and "Cloud NAT" in check.fix


def test_a_node_that_did_not_answer_fails(probe):
    for key in ("python", "ray"):
        probe["nodes"][2].pop(key)
    probe["nodes"][2]["error"] = "did not answer within 30 s"
    check = doctor.judge_nodes_answered(probe)
    assert check.status == "FAIL" and "did not answer within 30 s" in check.detail
    for other in probe["nodes"]:
        other.pop("python", None)
    # With no node answering, the rules that need their facts say so instead of passing on nothing.
    assert doctor.judge_versions(probe, client_python="3.12.1", client_rayslice="0.1.0",
                                 pinned_ray="2.60.0").status == "SKIP"
    assert doctor.judge_launcher(probe, mode="shipped", client_rayslice="0.1.0", client_digest=DIGEST).status == "SKIP"


def test_a_smoke_step_with_a_host_short_fails():
    rows = [{"worker": i, "host": f"h{i}", "device_count": 16, "local_device_count": 4} for i in range(4)]
    assert doctor.judge_smoke(rows, "a v6e-16 slice", 4, None).status == "PASS"
    short = doctor.judge_smoke(rows[:3], "a v6e-16 slice", 4, None)
    assert short.status == "FAIL" and "3 of 4 host(s) answered" in short.detail
    odd = copy.deepcopy(rows)
    odd[1]["device_count"] = 4
    assert doctor.judge_smoke(odd, "a v6e-16 slice", 4, None).status == "FAIL"


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_unreachable_dashboard_fails_and_skips_the_rest():
    result = runner.invoke(app, ["doctor", "--address", f"http://127.0.0.1:{closed_port()}"])
    assert result.exit_code == 1, result.output
    assert "FAIL dashboard:" in result.output and "fix: check the address" in result.output
    assert "SKIP token: needs the dashboard check to pass" in result.output
    assert "SKIP smoke" in result.output


def refused(*args: str) -> str:
    result = runner.invoke(app, ["doctor", "--no-cluster", *args])
    assert result.exit_code == 1, result.output
    return " ".join(result.output.split())


def test_flags_that_need_others_are_refused_in_their_words():
    assert "give --project and --zone together" in refused("--project", "my-project")
    assert "need --kuberay-namespace" in refused("--kubeconfig", "/k")
    assert "nothing to check" in refused()
    assert "--egress 'pypi.org': give host:port" in refused("--egress", "pypi.org")


class TokenDashboard(JsonHttpFake):
    """A Ray dashboard with token auth as far as the doctor's first calls go: the version for anyone, jobs by token."""

    def answer(self, request: Request) -> tuple[int, object]:
        if request.path == "/api/version":
            return 200, {"version": "4", "ray_version": "2.60.0", "ray_commit": "x", "session_name": "s"}
        if request.authorization != "Bearer right":
            return 401, {"error": "Unauthorized"}
        return 200, []


def test_a_wrong_token_is_named_with_where_the_token_lives():
    with TokenDashboard() as dash:
        result = runner.invoke(app, ["doctor", "--address", dash.url, "--token", "wrong"])
    out = " ".join(result.output.split())
    assert result.exit_code == 1, out
    assert "PASS dashboard:" in out and "FAIL token: the Jobs API refused the token" in out
    assert "fix: give the cluster's Ray auth token (--token, RAYSLICE_RAY_TOKEN" in out
    assert "SKIP versions: needs the token check to pass" in out
