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


# ---- review of issue 50's doctor: each test below was seen failing before its fix


def test_zero_nodes_is_not_a_pass():
    """A probe that reports no node (nothing ran) must not read as "all 0 nodes answered" and "every port answers"."""
    empty = {"driver_python": "3.12.1", "nodes": []}
    assert doctor.judge_nodes_answered(empty).status == "FAIL"
    assert doctor.judge_metrics(empty).status == "FAIL"


def test_a_checkpoint_write_or_egress_the_host_never_tried_is_not_a_pass(probe):
    """Facts missing from the writer's answer (an older probe, a wrong writer) are no evidence of access."""
    probe["nodes"][1].pop("checkpoint")
    check = doctor.judge_checkpoint(probe, "gs://b/ckpt")
    assert check.status == "FAIL" and "did not try" in check.detail
    # pypi.org was tried and reached; astral.sh was never tried.
    check = doctor.judge_egress(probe, ["pypi.org:443", "astral.sh:443"])
    assert check.status == "FAIL" and "astral.sh:443 (not tried)" in check.detail


def test_a_smoke_step_whose_hosts_each_see_only_their_own_chips_fails():
    """JAX not wired across the slice: every host agrees on 4 devices, but the slice has 16."""
    rows = [{"worker": i, "host": f"h{i}", "device_count": 4, "local_device_count": 4} for i in range(4)]
    check = doctor.judge_smoke(rows, "a v6e-16 slice", 4, None)
    assert check.status == "FAIL" and "16 devices across its hosts" in check.detail
    twice = [{"worker": 0, "host": "h0", "device_count": 16, "local_device_count": 4}] * 4
    assert doctor.judge_smoke(twice, "a v6e-16 slice", 4, None).status == "FAIL"  # one host answered 4 times


class JobsDashboard(JsonHttpFake):
    """A Ray dashboard's Jobs API as far as the doctor goes: jobs stay RUNNING until stopped (or ``end`` says how they
    end), and every stop is recorded."""

    def __init__(self, *, version: object = None, end: tuple[str, str] | None = None) -> None:
        super().__init__()
        self.version = version if version is not None else {"version": "4", "ray_version": "2.60.0"}
        self.end = end  # (status, log) every submitted job reaches at once
        self.jobs: dict[str, dict] = {}
        self.stopped: list[str] = []

    def answer(self, request: Request) -> tuple[int, object]:
        path = request.path
        if path == "/api/version":
            return 200, self.version
        if path.startswith("/api/packages/"):
            return 200, {}
        if path == "/api/jobs/" and request.method == "GET":
            return 200, list(self.jobs.values())
        if path == "/api/jobs/" and request.method == "POST":
            sid = request.body["submission_id"]
            status, log = self.end or ("RUNNING", "")
            self.jobs[sid] = {"submission_id": sid, "status": status, "entrypoint": request.body["entrypoint"],
                              "metadata": request.body.get("metadata"), "logs": log}
            return 200, {"submission_id": sid}
        sid, _, action = path.removeprefix("/api/jobs/").partition("/")
        job = self.jobs.get(sid)
        if job is None:
            return 404, {"error": f"Job {sid} does not exist"}
        if action == "stop":
            self.stopped.append(sid)
            was = job["status"] in ("PENDING", "RUNNING")
            job["status"] = "STOPPED" if was else job["status"]
            return 200, {"stopped": was}
        if action == "logs":
            return 200, {"logs": job["logs"]}
        return 200, {k: v for k, v in job.items() if k != "logs"}


def test_a_ctrl_c_while_the_probe_runs_stops_the_probe_job(monkeypatch):
    with JobsDashboard() as dash:
        monkeypatch.setattr(doctor.time, "sleep", lambda s: (_ for _ in ()).throw(KeyboardInterrupt()))
        with pytest.raises(KeyboardInterrupt), doctor.RayJobsClient(dash.url) as client:
            doctor.run_probe(client, launcher="installed", checkpoint_root=None, egress=[])
        (sid,) = dash.jobs
        assert dash.stopped == [sid] and dash.jobs[sid]["status"] == "STOPPED"


def whole_slice() -> tuple[Snapshot, list[doctor.Check]]:
    snap = snapshot()
    return snap, doctor.judge_slices(snap)


@pytest.mark.parametrize("when", ["after the submit", "while following"])
def test_a_smoke_step_interrupted_or_lost_is_stopped(monkeypatch, when):
    """Ctrl-C (a cancelled task) right after the POST, before its answer came back, or a follow that gives up: the
    doctor's step would otherwise hold a whole slice until its own timeouts."""
    from rayslice.core.exceptions import RayUnreachableError

    real_submit = doctor.submit_step

    async def submit_then_cancelled(client, spec, *, emit):
        await real_submit(client, spec, emit=emit)
        raise __import__("asyncio").CancelledError()

    async def follow_lost(client, sid, *, emit):
        raise RayUnreachableError("the dashboard went away")

    if when == "after the submit":
        monkeypatch.setattr(doctor, "submit_step", submit_then_cancelled)
    else:
        monkeypatch.setattr(doctor, "wait_for_step", follow_lost)
    with JobsDashboard() as dash:
        smoke = doctor.Doctor(dash.url, launcher="installed", smoke_timeout=5)
        try:
            check = smoke._smoke(*whole_slice())
        except BaseException:  # noqa: BLE001 - the interrupt goes on up; what matters is the job
            check = None
        (sid,) = dash.jobs
        assert sid.startswith("rayslice-doctor-smoke-")
        assert dash.stopped == [sid] and dash.jobs[sid]["status"] == "STOPPED", (check, dash.stopped)


def test_a_server_that_is_not_a_ray_dashboard_fails_the_dashboard_check():
    with JobsDashboard(version={"status": "ok"}) as dash:
        result = runner.invoke(app, ["doctor", "--address", dash.url, "--no-smoke"])
    out = " ".join(result.output.split())
    assert result.exit_code == 1, out
    assert "FAIL dashboard:" in out and "no ray_version" in out, out
    assert "Ray None" not in out


def test_an_installed_launcher_missing_on_the_head_names_the_launcher_fix():
    """Issue 50's first-day failure: `launcher: installed` but no rayslice on the head. The probe job cannot start;
    the doctor must say which setting and which fix, not only "read the job's log"."""
    log = "Traceback (most recent call last):\nModuleNotFoundError: No module named 'rayslice'\n"
    with JobsDashboard(end=("FAILED", log)) as dash:
        result = runner.invoke(app, ["doctor", "--address", dash.url, "--installed", "--no-smoke"])
    out = " ".join(result.output.split())
    assert result.exit_code == 1, out
    assert "FAIL probe:" in out and "No module named 'rayslice'" in out
    assert "install rayslice" in out and "drop `launcher`" in out, out


def test_a_malformed_zone_or_project_is_refused_early_in_the_flags_words():
    out = refused("--project", "my-project", "--zone", "us-east5")
    assert "error: --zone 'us-east5' is invalid" in out and "us-east5-b" in out, out
    assert "gcloud auth" not in out
    out = refused("--project", "My Project", "--zone", "us-east5-b")
    assert "error: --project 'My Project' is invalid" in out, out


def test_the_token_never_shows_in_the_doctors_output():
    secret = "s3cr3t-t0ken-value"
    with TokenDashboard() as dash:
        result = runner.invoke(app, ["doctor", "--address", dash.url, "--token", secret])
    assert result.exit_code == 1 and secret not in result.output, result.output
    log = f"RAY_AUTH_TOKEN={secret}\nboom"
    with JobsDashboard(end=("FAILED", log)) as dash:
        result = runner.invoke(app, ["doctor", "--address", dash.url, "--token", secret, "--no-smoke"])
    assert result.exit_code == 1 and "FAIL probe:" in result.output
    assert secret not in result.output, result.output


def _doc_doctor_commands() -> list[tuple[str, list[str]]]:
    import re
    import shlex
    from pathlib import Path

    repo = Path(__file__).resolve().parents[3]
    found = []
    for page in [repo / "README.md", *sorted((repo / "docs").glob("*.md"))]:
        for block in re.findall(r"```bash\n(.*?)```", page.read_text(), re.S):
            for line in block.replace("\\\n", " ").splitlines():
                line = line.split("  #")[0].strip()
                if line.startswith("rayslice doctor") and " [" not in line:  # not cli.md's synopsis
                    found.append((f"{page.name}: {line}", shlex.split(line)[2:]))
        for span in re.findall(r"`(rayslice doctor[^`]*)`", page.read_text()):
            found.append((f"{page.name}: {span}", shlex.split(span)[2:]))
    return found


def test_every_rayslice_doctor_command_in_the_docs_parses_with_the_real_cli():
    import click
    import typer

    commands = _doc_doctor_commands()
    assert len(commands) >= 5, commands
    command = typer.main.get_command(app).commands["doctor"]
    for where, args in commands:
        try:
            command.make_context("doctor", list(args))
        except click.UsageError as exc:
            pytest.fail(f"{where}: {exc}")
        # A control-plane check shown without a Ray target would run against a local cluster (`--name default`)
        # that a GKE or Cloud TPU admin does not have: it must name its target, or --no-cluster.
        if {"--kuberay-namespace", "--project"} & set(args):
            assert {"--address", "--conn-id", "--name", "--no-cluster"} & set(args), where


def test_a_smoke_step_that_never_ends_is_given_up_on_and_stopped():
    """A job whose driver never ends it (stuck starting, a hung driver): the doctor may not wait for ever. Past the
    smoke step's own timeouts and a grace it gives up, says so, and stops the job."""
    with JobsDashboard() as dash:  # jobs stay RUNNING until stopped
        smoke = doctor.Doctor(dash.url, launcher="installed", smoke_timeout=0.5, smoke_grace=0.5)
        check = smoke._smoke(*whole_slice())
        (sid,) = dash.jobs
        assert check.status == "FAIL" and "did not end within" in check.detail, check
        assert dash.stopped == [sid] and dash.jobs[sid]["status"] == "STOPPED"


def test_flags_that_would_be_silently_ignored_or_misread_are_refused():
    """Seen failing first: a port out of range passed the flag check (and the host's connect wraps it: 99999 tries
    port 34463, so the check answers for another port); cluster-only flags with --no-cluster, and --smoke-slice
    with --no-smoke, were dropped without a word."""
    assert "--egress 'pypi.org:99999': give host:port" in refused("--egress", "pypi.org:99999")
    out = refused("--kuberay-namespace", "ml", "--checkpoint-root", "gs://b/c", "--egress", "pypi.org:443")
    assert "--checkpoint-root, --egress check the Ray cluster: drop --no-cluster" in out, out
    result = runner.invoke(app, ["doctor", "--address", "http://127.0.0.1:1", "--no-smoke", "--smoke-slice", "v6e-16"])
    assert result.exit_code == 1 and "--smoke-slice names the smoke step's slice: drop --no-smoke" in result.output


class BusyOnceDashboard(JobsDashboard):
    """A loaded head: the first look at the probe job gets a 503 (as a read timeout would), then it has ended with
    its facts."""

    def __init__(self, facts: dict) -> None:
        super().__init__(end=("SUCCEEDED", doctor.PROBE_MARKER + __import__("json").dumps(facts) + "\n"))
        self.busy = 1

    def answer(self, request: Request) -> tuple[int, object]:
        if request.method == "GET" and request.path.startswith("/api/jobs/rayslice-doctor-") and self.busy:
            self.busy -= 1
            return 503, {"error": "busy"}
        return super().answer(request)


def test_one_slow_answer_while_the_probe_runs_does_not_fail_it(probe):
    """Seen failing first, on the local cluster under load: the doctor's client makes one attempt per call (so that
    the dashboard check fails fast), and the probe polls through it, so one timed-out poll FAILed the probe and
    SKIPped every cluster check. The probe's calls get the usual retries."""
    with BusyOnceDashboard(probe) as dash:
        checks = doctor.Doctor(dash.url, launcher="installed", smoke=False).run()
    assert not [c for c in checks if c.name == "probe"], doctor.render(checks)
    assert one(checks, "nodes").status == "PASS" and one(checks, "versions").status == "PASS", doctor.render(checks)


def test_an_endless_smoke_timeout_is_refused():
    """Seen failing first: `--smoke-timeout inf` was taken, and the smoke step then waits for ever (its own timeouts
    and the doctor's limit are all infinite)."""
    result = runner.invoke(app, ["doctor", "--address", "http://127.0.0.1:1", "--smoke-timeout", "inf"])
    assert result.exit_code == 2 and "--smoke-timeout" in result.output, result.output
