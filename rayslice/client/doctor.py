"""`rayslice doctor`: a preflight of a live cluster, each check PASS or FAIL with the fix, before any DAG.

Why: the first DAG run is a bad place to learn that the token is wrong, a slice lacks a host, the
checkpoint bucket is read-only or the hosts' Ray differs from the head's. Every check here is one
fact and one rule: the facts come over HTTP (the dashboard, the state API through
``capacity.snapshot``) and from a short probe job (``rayslice.cluster.doctor_probe``: what each
node's own Python sees); the rules are the ``judge_*`` functions, which take those facts as plain
data so that each can be shown failing without breaking a cluster. The smoke step runs
``jax.device_count()`` on every host of one slice through the real launcher (``submit_step``).
The control-plane checks (KubeRay, Cloud TPU) live in ``rayslice.cloud.preflight`` and return the
same ``Check``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal

from rayslice.client import capacity
from rayslice.client.jobs_client import AsyncRayJobsClient, RayJobsClient
from rayslice.client.submission import launcher_packages, submit_step, wait_for_step
from rayslice.core import launcher as launcher_files
from rayslice.core.accelerators import TpuSliceRequest
from rayslice.core.exceptions import RayAuthError, RaysliceError
from rayslice.core.step import Launcher, Owner, StepSpec

__all__ = ["Check", "DEFAULT_EGRESS", "Doctor", "failed", "render"]

Status = Literal["PASS", "FAIL", "WARN", "SKIP"]
#: The probe job prints its facts on this line (the cluster side's ``doctor_probe.MARKER``).
PROBE_MARKER = "::rayslice-doctor::"
PROBE_ENTRYPOINT = "python -m rayslice.cluster.doctor_probe"
SMOKE_CALLABLE = "rayslice.cluster.doctor_probe:device_count"
#: What a Cloud TPU host's startup script fetches from (uv, PyPI, uv's Python builds, gcloud's APIs).
DEFAULT_EGRESS = ("astral.sh:443", "pypi.org:443", "files.pythonhosted.org:443", "github.com:443",
                  "storage.googleapis.com:443", "secretmanager.googleapis.com:443")


@dataclass(frozen=True)
class Check:
    """One check's outcome: ``name`` (what was checked), ``status``, what was seen, and the fix on a FAIL."""

    name: str
    status: Status
    detail: str
    fix: str = ""


def failed(checks: Iterable[Check]) -> list[Check]:
    return [c for c in checks if c.status == "FAIL"]


def render(checks: Iterable[Check]) -> str:
    """One line per check (``PASS name: detail``) and an indented ``fix:`` line under each failure."""
    lines = []
    for c in checks:
        lines.append(f"{c.status:<4} {c.name}: {c.detail}")
        if c.fix and c.status in ("FAIL", "WARN"):
            lines.append(f"     fix: {c.fix}")
    return "\n".join(lines)


# ---- the rules (facts in, Check out)


DASHBOARD_FIX = ("check the address (the Ray dashboard, port 8265), that the head runs, and that this machine may "
                 "reach it (firewall, Service type, VPN)")


def judge_dashboard(url: str, error: Exception | None, ray_version: str | None, *, refused: bool = False) -> Check:
    """PASS only on a Ray dashboard's own answer: some other server answering JSON on that port is no dashboard.

    ``refused``: /api/version asked for the token (the token check says the rest)."""
    if error is not None:
        return Check("dashboard", "FAIL", f"{url}: {error}", DASHBOARD_FIX)
    if refused:
        return Check("dashboard", "PASS", f"{url} answers (it wants a token: see the token check)")
    if not ray_version:
        return Check("dashboard", "FAIL", f"{url} answers /api/version, but with no ray_version: not a Ray "
                     "dashboard", DASHBOARD_FIX)
    return Check("dashboard", "PASS", f"{url} answers (Ray {ray_version})")


def judge_token(error: Exception | None, token_given: bool) -> Check:
    if error is None:
        return Check("token", "PASS", "the Jobs API accepts " + ("the token" if token_given else "requests without a "
                                                                 "token (the cluster has no token auth)"))
    if isinstance(error, RayAuthError):
        fix = ("give the cluster's Ray auth token (--token, RAYSLICE_RAY_TOKEN, or the `ray` connection's password; "
               "on KubeRay the `auth_token` key of the cluster's token Secret)")
        return Check("token", "FAIL", f"the Jobs API refused {'the token' if token_given else 'a request without one'}"
                     f": {error}", fix)
    return Check("token", "FAIL", f"the Jobs API did not answer: {error}", "see the dashboard check")


def _version_key(v: str) -> tuple[int, ...]:
    return tuple(int(p) for p in v.split(".")[:3] if p.isdigit())


def judge_versions(probe: dict[str, Any], *, client_python: str, client_rayslice: str, pinned_ray: str) -> Check:
    """Ray and Python the same on every node; the cluster's Python minor the Airflow side's (steps by value)."""
    nodes = probe["nodes"]
    answered = [n for n in nodes if "python" in n]
    if not answered:
        return Check("versions", "SKIP", "no node reported its versions (see the nodes check)")
    rays = {n["ray"] for n in answered}
    pythons = {n["python"] for n in answered}
    seen = ", ".join(sorted(f"{'head' if n['head'] else n.get('hostname', n['node_id'][:8])}: Ray {n['ray']}, "
                            f"Python {n['python']}" for n in answered))
    problems, fixes = [], []
    if len(rays) > 1:
        problems.append(f"Ray differs between nodes ({', '.join(sorted(rays))})")
        fixes.append(f"run one Ray version on the head and every host (rayslice is tested with {pinned_ray})")
    minors = {".".join(p.split(".")[:2]) for p in pythons}
    if len(minors) > 1:
        problems.append(f"Python's minor version differs between nodes ({', '.join(sorted(pythons))})")
        fixes.append("build every node from the same image / the same `python_version`")
    client_minor = ".".join(client_python.split(".")[:2])
    if minors and client_minor not in minors:
        problems.append(f"the cluster runs Python {', '.join(sorted(minors))}, this side {client_python}: functions "
                        "shipped by value cannot load there")
        fixes.append(f"run Python {client_minor} on the cluster (or submit `callable` / `command` steps only)")
    if problems:
        return Check("versions", "FAIL", "; ".join(problems) + f" [{seen}]", "; ".join(fixes))
    note = ""
    if len(pythons) > 1:
        note = (" (Python patch levels differ: these nodes joined with RAY_DEFAULT_PYTHON_VERSION_MATCH_LEVEL=minor; "
                "keep it in every new host's `ray start` environment)")
    ray = next(iter(rays), "?")
    off_pin = f"; rayslice is tested with Ray {pinned_ray}" if rays and ray != pinned_ray else ""
    return Check("versions", "PASS", f"Ray {ray}, Python {', '.join(sorted(pythons))} on {len(answered)} node(s), "
                 f"this side Python {client_python}, rayslice {client_rayslice}{off_pin}{note}")


NO_NODES = Check("nodes", "FAIL", "the probe reported no alive node at all (not even the head it ran on)",
                 "read the probe job's log in the dashboard (Jobs tab, id rayslice-doctor-...)")


def judge_nodes_answered(probe: dict[str, Any]) -> Check:
    if not probe["nodes"]:
        return NO_NODES
    silent = [n for n in probe["nodes"] if "python" not in n]
    if not silent:
        return Check("nodes", "PASS", f"all {len(probe['nodes'])} alive node(s) ran the probe")
    return Check("nodes", "FAIL", "; ".join(f"node {n['node_id'][:12]} ({n.get('address')}): {n.get('error')}"
                                            for n in silent),
                 "look at those nodes' raylet logs (/tmp/ray/session_latest/logs); a node that cannot run a task "
                 "cannot run a step")


def judge_launcher(probe: dict[str, Any], *, mode: Launcher, client_rayslice: str, client_digest: str | None) -> Check:
    """`installed`: the head (the job driver) and every host have this side's rayslice; `shipped`: the label says
    which nodes skip the upload."""
    nodes = [n for n in probe["nodes"] if "python" in n]
    if not nodes:
        return Check("launcher", "SKIP", "no node reported its rayslice (see the nodes check)")
    labelled = [n for n in nodes if n["labels"].get(launcher_files.LABEL)]
    same = [n for n in labelled if client_digest and n["labels"][launcher_files.LABEL] == client_digest]
    label = f"{len(same)} of {len(nodes)} node(s) carry this side's launcher label ({launcher_files.LABEL})"
    if mode == "installed":
        wrong = [n for n in nodes if n.get("rayslice_installed") != client_rayslice]
        if wrong:
            seen = ", ".join(f"{'head' if n['head'] else n.get('hostname')}: "
                             f"{n.get('rayslice_installed') or 'not installed'}" for n in wrong)
            return Check("launcher", "FAIL", f"installed, but rayslice {client_rayslice} is not installed "
                         f"on every node ({seen})",
                         f"install rayslice {client_rayslice}'s wheel (`rayslice[cluster]`) on the head and every "
                         "host, or drop `launcher` from the `ray` connection (default: shipped with each job)")
        return Check("launcher", "PASS", f"installed, rayslice {client_rayslice} on every node; {label}")
    stale = [n for n in labelled if n not in same]
    detail = f"shipped (each job uploads rayslice's cluster side); {label}"
    if stale:
        return Check("launcher", "WARN", detail + f"; {len(stale)} carry another launcher's label (they start host "
                     "processes with Ray's runtime env step, about a second slower)",
                     "restart those nodes with `ray start ... $(rayslice launcher-label)` from this release")
    return Check("launcher", "PASS", detail)


def expected_hosts(pod_type: str) -> int | None:
    try:
        return TpuSliceRequest(tpu=pod_type).hosts_per_slice
    except (RaysliceError, ValueError):
        return None


def judge_slices(snapshot: capacity.Snapshot) -> list[Check]:
    """Every slice with all its hosts (worker ids 0..n-1 of its pod type), and the TPUs/GPUs Ray sees."""
    checks = []
    for s in snapshot.slices:
        want = expected_hosts(s.pod_type)
        have = sorted(h.worker_id for h in s.hosts)
        if want is None:
            checks.append(Check(f"slice {s.name}", "WARN", f"pod type {s.pod_type!r} is not one rayslice knows; "
                                f"{len(have)} host(s), {s.chips} chips"))
        elif have != list(range(want)):
            missing = sorted(set(range(want)) - set(have))
            checks.append(Check(f"slice {s.name}", "FAIL",
                                f"{s.pod_type} has {len(have)} of its {want} hosts (missing worker id(s) "
                                f"{', '.join(map(str, missing)) or '?'}; seen {have})",
                                "a host is down or never joined: look at its VM/pod (preempted? startup script "
                                "log: `sudo journalctl -u google-startup-scripts`; on KubeRay `kubectl get pods -l "
                                "ray.io/group=...`); no step can reserve this slice until it is whole"))
        else:
            checks.append(Check(f"slice {s.name}", "PASS", f"{s.pod_type} ({s.topology}): {want} host(s), "
                                f"{s.chips} TPU chips, {s.state}"))
    gpus = sum(g.total for g in snapshot.gpu_nodes)
    if not snapshot.slices and not snapshot.gpu_nodes:
        checks.append(Check("accelerators", "FAIL", "Ray sees no TPU slice and no GPU",
                            "a slice's hosts must join with Ray's TPU detection (TPU VMs, or KubeRay with the TPU "
                            "webhook); GPU nodes with `ray start --num-gpus`; with an autoscaler, nothing shows "
                            "until a step asks (then this is expected)"))
    else:
        checks.append(Check("accelerators", "PASS", f"{len(snapshot.slices)} TPU slice(s), "
                            f"{sum(s.chips for s in snapshot.slices)} chips; {len(snapshot.gpu_nodes)} GPU node(s), "
                            f"{gpus:g} GPUs"))
    return checks


def judge_checkpoint(probe: dict[str, Any], root: str | None) -> Check:
    if not root:
        return Check("checkpoint root", "SKIP", "no checkpoint root (the connection's `checkpoint_root` extra, or "
                     "--checkpoint-root)")
    writer = next((n for n in probe["nodes"] if n.get("writer")), None)
    if writer is None or "python" not in writer:
        return Check("checkpoint root", "FAIL", f"no host answered to write {root}", "see the nodes check")
    where = writer.get("hostname") or writer["node_id"][:12]
    if "checkpoint" not in writer:  # no answer is no evidence: the probe that ran did not try the write
        return Check("checkpoint root", "FAIL", f"host {where} did not try to write {root} (its probe answered "
                     "without it)", "run the doctor with this release's launcher (--shipped, or install this "
                     "release on the cluster)")
    if writer["checkpoint"] is None:
        return Check("checkpoint root", "PASS", f"{root} is writable from host {where}")
    return Check("checkpoint root", "FAIL", f"host {where} cannot write {root}: {writer['checkpoint']}",
                 "give the hosts' identity write access (gs://: roles/storage.objectUser on the bucket for the "
                 "VMs' service account, or the KSA Workload Identity maps), install gcsfs on the hosts, or fix the "
                 "path")


def judge_metrics(probe: dict[str, Any]) -> Check:
    if not probe["nodes"]:
        return Check("metrics", "FAIL", "no node to ask (see the nodes check)", "see the nodes check")
    closed = [n for n in probe["nodes"] if n.get("metrics_error")]
    if not closed:
        ports = sorted({str(n.get("metrics_port")) for n in probe["nodes"]})
        return Check("metrics", "PASS", f"every node's metrics port answers /metrics (port(s) {', '.join(ports)})")
    seen = "; ".join(f"{'head' if n['head'] else n.get('hostname') or n['node_id'][:12]} "
                     f"{n.get('address')}:{n.get('metrics_port')}: {n['metrics_error']}" for n in closed)
    return Check("metrics", "FAIL", f"metrics port not answering: {seen}",
                 "start Ray with `--metrics-export-port 8080` (KubeRay's default) and let Prometheus reach it "
                 "(docs/metrics.md)")


def judge_egress(probe: dict[str, Any], endpoints: list[str]) -> Check:
    writer = next((n for n in probe["nodes"] if n.get("writer") and "python" in n), None)
    if writer is None:
        return Check("egress", "FAIL", "no host answered to try egress", "see the nodes check")
    tried = writer.get("egress") or {}
    # An endpoint missing from the host's answer was never tried: not evidence that it is reachable.
    blocked = {e: tried.get(e, "not tried") for e in endpoints if e not in tried or tried[e]}
    where = writer.get("hostname") or writer["node_id"][:12]
    if not blocked:
        return Check("egress", "PASS", f"host {where} reaches {', '.join(endpoints)}")
    return Check("egress", "FAIL", f"host {where} cannot reach "
                 + "; ".join(f"{e} ({why})" for e, why in blocked.items()),
                 "new TPU VMs run their startup script from there: give them an external IP "
                 "(enable_external_ips) or Cloud NAT on their subnetwork, and Private Google Access for Google APIs")


def judge_smoke(results: Any, slice_name: str, hosts: int, error: Exception | None) -> Check:
    if error is not None:
        return Check("smoke", "FAIL", f"jax.device_count() on {slice_name}: {error}",
                     "read the step's log above; the same failure would end every DAG's first step")
    rows = list(results or [])
    counts = ", ".join(f"worker {r['worker']} ({r['host']}): {r['device_count']} devices, "
                       f"{r['local_device_count']} local" for r in rows)
    if sorted(r["worker"] for r in rows) != list(range(hosts)) or len({r["device_count"] for r in rows}) != 1:
        return Check("smoke", "FAIL", f"{slice_name}: {len(rows)} of {hosts} host(s) answered, {counts}",
                     "every host must see the same JAX group; look at the hosts that differ")
    # Hosts that agree on their own chips only (4 each on a 16-chip slice) never formed one JAX group.
    local = sum(r["local_device_count"] for r in rows)
    if rows[0]["device_count"] != local:
        return Check("smoke", "FAIL", f"{slice_name}: each host sees {rows[0]['device_count']} devices, but the slice "
                     f"has {local} devices across its hosts: JAX is not wired across the hosts ({counts})",
                     "the hosts' JAX must join one group (jax.distributed through the launcher, TPU_WORKER_HOSTNAMES "
                     "and the slice's ports open between its hosts); read the step's log above")
    return Check("smoke", "PASS", f"jax.device_count() on every host of {slice_name}: {counts}")


# ---- gathering the facts


def client_digest() -> str | None:
    """This side's launcher digest (the label value `rayslice launcher-label` prints), without importing cloudpickle."""
    import importlib.util
    from pathlib import Path

    import rayslice

    spec = importlib.util.find_spec("cloudpickle")
    if spec is None or not spec.origin:
        return None
    return launcher_files.digest(Path(rayslice.__file__).parent, Path(spec.origin).parent)


def run_probe(client: RayJobsClient, *, launcher: Launcher, checkpoint_root: str | None, egress: list[str],
              timeout: float = 300.0) -> dict[str, Any]:
    """Submit the probe job and return its facts (raises RayJobsError when it ends without them)."""
    from rayslice.core.exceptions import RayJobsError

    runtime_env: dict[str, Any] = {}
    if launcher == "shipped":
        runtime_env["py_modules"] = [client.ensure_package(package) for package in launcher_packages()]
    args = json.dumps({"checkpoint_root": checkpoint_root, "egress": egress})
    sid = f"rayslice-doctor-{secrets.token_hex(6)}"
    import shlex

    deadline = time.monotonic() + timeout
    try:
        client.submit(f"{PROBE_ENTRYPOINT} {shlex.quote(args)}", submission_id=sid,
                      runtime_env=runtime_env or None, metadata={"rayslice-doctor": "1"})
        while not (job := client.get(sid)).status.is_terminal:
            if time.monotonic() > deadline:
                raise RayJobsError(f"the doctor's probe job {sid} did not finish within {timeout:g} s")
            time.sleep(0.2)
    except BaseException:
        # Ctrl-C, a lost poll or the deadline: the probe must not go on running on the cluster without us.
        _stop_quietly(client, sid)
        raise
    # The client's own scrubbing (token, secret headers): the doctor's output is made to be pasted into tickets.
    log = client._scrub(client.logs(sid))
    for line in reversed(log.splitlines()):
        if line.startswith(PROBE_MARKER):
            return json.loads(line[len(PROBE_MARKER):])
    raise RayJobsError(f"the doctor's probe job {sid} ended {job.status.value} without its facts: {log[-800:]}")


def _stop_quietly(client: RayJobsClient, sid: str) -> None:
    """Best effort: a dashboard that is gone cannot be asked, and the original error is what to report."""
    with contextlib.suppress(Exception):
        client.stop(sid)


@dataclass
class Doctor:
    """The cluster checks of one target; ``run()`` returns every Check in order (cloud checks are added by the CLI)."""

    url: str
    token: str | None = None
    headers: dict[str, str] | None = None
    verify: bool | str = True
    launcher: Launcher = "shipped"
    checkpoint_root: str | None = None
    egress: tuple[str, ...] = ()
    smoke: bool = True
    smoke_slice: str | None = None  # a slice name or pod type; default the first whole slice
    smoke_timeout: float = 120.0
    #: Past the step's own timeouts (capacity, then run): time for its job to start (runtime env) and end. A job
    #: that outlives them all (a driver stuck starting or hung) is given up on and stopped: the doctor never hangs.
    smoke_grace: float = 120.0
    pinned_ray: str = ""  # the Ray rayslice is tested with (rayslice.cloud.pins, which this side may not import)
    emit: Callable[[str], None] = lambda line: None

    def _client(self, retries: int = 1) -> RayJobsClient:
        """One attempt per call for the first looks (a dashboard that is not there fails fast); the probe's calls
        get the usual retries: on a loaded head one slow answer must not FAIL the probe and SKIP every check."""
        return RayJobsClient(self.url, token=self.token, headers=self.headers, verify=self.verify, retries=retries)

    def run(self) -> list[Check]:
        """Every cluster check in order; a check that needs an earlier one that failed is a SKIP naming it."""
        from rayslice import __version__

        checks: list[Check] = []
        with self._client() as client:
            version_error: Exception | None = None
            ray_version, refused = None, False
            try:
                ray_version = client.version().get("ray_version")
            except RayAuthError:  # the dashboard answered: the token check says the rest
                refused = True
            except RaysliceError as exc:
                version_error = exc
            checks.append(judge_dashboard(self.url, version_error, ray_version, refused=refused))
            if checks[-1].status == "FAIL":
                version_error = version_error or RaysliceError("not a Ray dashboard")
            if version_error is not None:
                return [*checks, *self._skipped("dashboard")]
            try:
                client.list_jobs()
                token_error = None
            except RaysliceError as exc:
                token_error = exc
            checks.append(judge_token(token_error, bool(self.token or (self.headers or {}).get("Authorization"))))
            if token_error is not None:
                return [*checks, *self._skipped("token")]
            try:
                with self._client(retries=3) as patient:
                    probe = run_probe(patient, launcher=self.launcher, checkpoint_root=self.checkpoint_root,
                                      egress=list(self.egress))
            except RaysliceError as exc:
                fix = "read the job's log in the dashboard (Jobs tab, id rayslice-doctor-...)"
                if self.launcher == "installed" and "No module named 'rayslice" in str(exc):
                    # Issue 50's first-day failure: the connection says installed, the head's Python has none.
                    fix = (f"launcher is `installed` but the head's Python has no rayslice: install rayslice "
                           f"{__version__}'s wheel (`rayslice[cluster]`) on the head and every host, or drop "
                           "`launcher` from the `ray` connection (default: shipped with each job); " + fix)
                checks.append(Check("probe", "FAIL", f"the probe job did not report: {exc}", fix))
                return [*checks, *self._skipped("probe")]
        checks.append(judge_nodes_answered(probe))
        checks.append(judge_versions(probe, client_python=_python(), client_rayslice=__version__,
                                     pinned_ray=self.pinned_ray))
        checks.append(judge_launcher(probe, mode=self.launcher, client_rayslice=__version__,
                                     client_digest=client_digest()))
        try:
            snap = capacity.snapshot(self.url, token=self.token, headers=self.headers, verify=self.verify)
            slices = judge_slices(snap)
        except RaysliceError as exc:
            snap, slices = None, [Check("slices", "FAIL", f"the state API did not answer: {exc}",
                                        "the head needs `ray[default]` (the dashboard's state API)")]
        checks.extend(slices)
        checks.append(judge_checkpoint(probe, self.checkpoint_root))
        checks.append(judge_metrics(probe))
        if self.egress:
            checks.append(judge_egress(probe, list(self.egress)))
        if self.smoke:
            checks.append(self._smoke(snap, slices))
        return checks

    def _skipped(self, after: str) -> list[Check]:
        names = ["token", "probe", "nodes", "versions", "launcher", "slices", "checkpoint root", "metrics"]
        names = names[names.index(after) + 1:] if after in names else names
        if self.smoke:
            names.append("smoke")
        return [Check(name, "SKIP", f"needs the {after} check to pass") for name in names]

    def _smoke(self, snap: capacity.Snapshot | None, slices: list[Check]) -> Check:
        whole = {c.name.removeprefix("slice ") for c in slices if c.name.startswith("slice ") and c.status == "PASS"}
        candidates = [s for s in (snap.slices if snap else []) if s.name in whole]
        if self.smoke_slice:
            candidates = [s for s in (snap.slices if snap else []) if self.smoke_slice in (s.name, s.pod_type)]
            if not candidates:
                return Check("smoke", "FAIL", f"--smoke-slice {self.smoke_slice!r}: no such slice or pod type "
                             f"(seen: {', '.join(s.name for s in snap.slices) if snap else 'none'})",
                             "name a slice or pod type `rayslice capacity` lists")
        if not candidates:
            return Check("smoke", "SKIP", "no whole TPU slice to run jax.device_count() on")
        chosen = next((s for s in candidates if s.state == "free"), candidates[0])
        request = TpuSliceRequest(tpu=chosen.pod_type, topology=chosen.topology or None)
        spec = StepSpec(request=request, callable=SMOKE_CALLABLE, capacity_timeout=self.smoke_timeout,
                        step_timeout=self.smoke_timeout, launcher=self.launcher, checkpoint_root=None,
                        owner=Owner(submission_id=f"rayslice-doctor-smoke-{secrets.token_hex(6)}"))
        self.emit(f"smoke: jax.device_count() on every host of a {chosen.pod_type} slice (one step, "
                  f"<= {self.smoke_timeout:g} s waiting for the slice)")

        async def go() -> Any:
            async with AsyncRayJobsClient(self.url, token=self.token, headers=self.headers,
                                          verify=self.verify) as client:
                sid = spec.owner.submission_id  # known before the POST: a Ctrl-C during it still finds the job
                limit = 2 * self.smoke_timeout + self.smoke_grace
                try:
                    follow = wait_for_step(client, await submit_step(client, spec, emit=self.emit), emit=self.emit)
                    try:
                        return await asyncio.wait_for(follow, timeout=limit)
                    except TimeoutError:
                        raise RaysliceError(f"the smoke step's job {sid} did not end within {limit:g} s (its "
                                            f"timeouts and {self.smoke_grace:g} s to start); it was stopped") from None
                except BaseException:
                    # Ctrl-C (the task cancelled), a follow that gave up, the step's own failure: the smoke
                    # step is the doctor's alone, so it must not hold a slice once the doctor stops watching.
                    with contextlib.suppress(Exception):
                        await asyncio.shield(client.stop(sid))
                    raise

        try:
            results, error = asyncio.run(go()), None
        except RaysliceError as exc:
            results, error = None, exc
        return judge_smoke(results, f"a {chosen.pod_type} slice", len(chosen.hosts), error)


def _python() -> str:
    return ".".join(map(str, sys.version_info[:3]))
