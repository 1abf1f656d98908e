"""The Ray Jobs REST client, against a real single-node Ray head (plus MockTransport for what
a real cluster cannot produce: malformed bodies, flaky proxies, a dead address)."""

from __future__ import annotations

import asyncio
import inspect
import io
import json
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from rayslice.client.jobs_client import (
    AsyncRayJobsClient,
    JobDetails,
    JobStatus,
    RayJobsClient,
    package_name_for,
    zip_directory,
)
from rayslice.core.exceptions import (
    InvalidRequestError,
    JobNotFoundError,
    RayAuthError,
    RayJobsError,
    RayUnreachableError,
)
from rayslice.local import processes
from rayslice.local.local_cluster import free_port

CLIENTS = [pytest.param(RayJobsClient, id="sync"), pytest.param(AsyncRayJobsClient, id="async")]


# --------------------------------------------------------------------------- helpers


async def do(client, method: str, *args, **kwargs):
    """Call ``method`` on a sync or async client alike."""
    result = getattr(client, method)(*args, **kwargs)
    return await result if inspect.isawaitable(result) else result


async def close(client) -> None:
    if isinstance(client, AsyncRayJobsClient):
        await client.aclose()
    else:
        client.close()


async def wait_status(client, submission_id: str, want, timeout: float = 60.0) -> JobDetails:
    """Poll until the job's status is in ``want`` (or terminal, which then must be in ``want``)."""
    want = {want} if isinstance(want, JobStatus) else set(want)
    deadline = time.monotonic() + timeout
    while True:
        job = await do(client, "get", submission_id)
        if job.status in want or job.status.is_terminal:
            assert job.status in want, f"job {submission_id} ended {job.status}: {job.message}"
            return job
        assert time.monotonic() < deadline, f"job {submission_id} still {job.status} after {timeout}s"
        await asyncio.sleep(0.25)


def new_id(tag: str) -> str:
    return f"rsjc-{tag}-{uuid.uuid4().hex[:8]}"


def mock_client(cls, handler, **kwargs):
    kwargs.setdefault("backoff", 0.0)
    transport = httpx.MockTransport(handler)
    return cls("http://ray-head.invalid:8265", transport=transport, **kwargs)


# --------------------------------------------------------------------------- local Ray head
# TODO: replace with the shared local-cluster fixture (`ray_head` in tests/conftest.py) once it
# lands; until then this module starts its own single-node heads and stops exactly those.

RAY_BIN = Path(sys.prefix) / "bin" / "ray"


@dataclass
class LocalHead:
    dashboard_url: str
    token: str | None
    pid: int
    temp_dir: str


def _free_ports(n: int) -> list[int]:
    """n distinct free ports, from below the ephemeral range (see `local_cluster.free_port`)."""
    ports: list[int] = []
    while len(ports) < n:
        port = free_port()
        if port not in ports:
            ports.append(port)
    return ports


def _stop_head(proc: subprocess.Popen, temp_dir: str) -> None:
    sid = proc.pid  # start_new_session: the leader's pid is the group's and the session's id
    try:
        os.killpg(sid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass
    # SIGKILL the group, then whatever else of ours is left in the session (Ray's workers put
    # themselves in their own process groups, but not in another session).
    try:
        os.killpg(sid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + 15
    while (left := processes.session_members({sid})) and time.monotonic() < deadline:
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.2)
    proc.wait(timeout=10)
    shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def _head_factory() -> Iterator:
    started: list[tuple[subprocess.Popen, str]] = []

    def start(token: str | None = None) -> LocalHead:
        if not RAY_BIN.exists():
            pytest.skip(f"no Ray CLI at {RAY_BIN}")
        gcs, dashboard, client_server, agent = _free_ports(4)
        temp_dir = tempfile.mkdtemp(prefix="rsjc-", dir="/tmp")
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        env["PATH"] = f"{RAY_BIN.parent}{os.pathsep}{env.get('PATH', '')}"
        env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # keeps Ray on 127.0.0.1
        env["RAY_AUTH_MODE"] = "token" if token else "disabled"
        if token:
            env["RAY_AUTH_TOKEN"] = token
        cmd = [
            str(RAY_BIN), "start", "--head", "--block",
            "--node-ip-address", "127.0.0.1",
            "--port", str(gcs),
            "--dashboard-host", "127.0.0.1",
            "--dashboard-port", str(dashboard),
            "--ray-client-server-port", str(client_server),
            "--dashboard-agent-listen-port", str(agent),
            "--num-cpus", "1",
            "--object-store-memory", "80000000",
            "--temp-dir", temp_dir,
            "--disable-usage-stats",
            "--min-worker-port", "0",
            "--max-worker-port", "0",
        ]  # fmt: skip
        log = open(os.path.join(temp_dir, "head.log"), "wb")  # noqa: SIM115
        proc = subprocess.Popen(
            cmd, env=env, start_new_session=True, stdout=log, stderr=subprocess.STDOUT
        )
        log.close()
        started.append((proc, temp_dir))
        url = f"http://127.0.0.1:{dashboard}"
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                with open(os.path.join(temp_dir, "head.log"), errors="replace") as f:
                    tail = f.read()[-3000:]
                pytest.fail(f"ray start exited with {proc.returncode}:\n{tail}")
            try:
                if httpx.get(f"{url}/api/version", headers=headers, timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"the Ray dashboard at {url} did not come up within 120s")
            time.sleep(0.5)
        return LocalHead(dashboard_url=url, token=token, pid=proc.pid, temp_dir=temp_dir)

    yield start
    for proc, temp_dir in reversed(started):
        _stop_head(proc, temp_dir)


@pytest.fixture(scope="module")
def ray_head(_head_factory) -> LocalHead:
    return _head_factory()


@pytest.fixture(scope="module")
def ray_head_with_token(_head_factory) -> LocalHead:
    return _head_factory(token=f"rsjc-{secrets.token_hex(16)}")


# --------------------------------------------------------------------------- pure parts


def test_import_does_not_import_ray():
    code = (
        "import sys, rayslice.client.jobs_client\n"
        "bad = sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.'))\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_job_status_terminal():
    assert [s for s in JobStatus if s.is_terminal] == [
        JobStatus.STOPPED, JobStatus.SUCCEEDED, JobStatus.FAILED,
    ]  # fmt: skip
    assert str(JobStatus.RUNNING) == "RUNNING"


def test_zip_directory_is_deterministic(tmp_path):
    def make(root: Path) -> Path:
        (root / "pkg" / "sub").mkdir(parents=True)
        (root / "pkg" / "__pycache__").mkdir()
        (root / "pkg" / "__init__.py").write_text("X = 1\n")
        (root / "pkg" / "sub" / "b.py").write_text("B = 2\n")
        (root / "pkg" / "sub" / "a.txt").write_text("a\n")
        (root / "pkg" / "__pycache__" / "x.cpython-311.pyc").write_bytes(os.urandom(16))
        return root / "pkg"

    one = make(tmp_path / "one")
    two = make(tmp_path / "two")
    os.utime(two / "__init__.py", (1_000_000_000, 1_000_000_000))  # different mtime
    assert zip_directory(one) == zip_directory(two)

    names = zipfile.ZipFile(io.BytesIO(zip_directory(one))).namelist()
    assert names == ["__init__.py", "sub/", "sub/a.txt", "sub/b.py"]  # sorted, no __pycache__
    with_parent = zipfile.ZipFile(io.BytesIO(zip_directory(one, include_parent_dir=True))).namelist()
    assert with_parent == ["pkg/", "pkg/__init__.py", "pkg/sub/", "pkg/sub/a.txt", "pkg/sub/b.py"]
    only_py = zip_directory(one, include=lambda rel: rel == "sub" or rel.endswith(".py"))
    assert zipfile.ZipFile(io.BytesIO(only_py)).namelist() == ["__init__.py", "sub/", "sub/b.py"]

    data = zip_directory(one)
    assert package_name_for(data).startswith("_ray_pkg_") and package_name_for(data).endswith(".zip")
    with pytest.raises(InvalidRequestError):
        zip_directory(one / "__init__.py")


def test_clients_share_one_tls_context_per_verify_setting():
    """httpx loads the CA bundle for every client it builds (about 40 ms); a triggerer builds one per step."""
    import ssl

    first, second = RayJobsClient("https://127.0.0.1:8265"), AsyncRayJobsClient("https://127.0.0.1:8265")
    assert isinstance(first._verify, ssl.SSLContext) and first._verify is second._verify
    assert first._verify.verify_mode == ssl.CERT_REQUIRED and first._verify.check_hostname
    insecure = RayJobsClient("https://127.0.0.1:8265", verify=False)
    assert insecure._verify is not first._verify and insecure._verify.verify_mode == ssl.CERT_NONE
    assert insecure._ws_ssl() is insecure._verify  # the log stream's TLS: the same settings


def test_bad_inputs_fail_before_any_request():
    with pytest.raises(InvalidRequestError):
        RayJobsClient("ray://127.0.0.1:10001")
    with pytest.raises(InvalidRequestError, match="CA bundle"):
        RayJobsClient("https://127.0.0.1:8265", verify="/no/such/ca.pem")
    with RayJobsClient("127.0.0.1:1") as client:  # scheme defaults to http
        assert client.address == "http://127.0.0.1:1"
        with pytest.raises(InvalidRequestError, match="must be URIs"):
            client.submit("python x.py", submission_id="x", runtime_env={"working_dir": "./src"})
        with pytest.raises(InvalidRequestError):
            client.get("")
        with pytest.raises(InvalidRequestError):
            client.package_exists("gcs://not-a-package.txt")


# --------------------------------------------------------------------------- mocked transport


@pytest.mark.parametrize("cls", CLIENTS)
async def test_retries_503_then_succeeds(cls):
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if len(seen) < 3:
            return httpx.Response(503, text="upstream restarting")
        return httpx.Response(200, json={"version": "4", "ray_version": "2.60.0"})

    client = mock_client(cls, handler, retries=3, token="tok-123")
    try:
        assert (await do(client, "version"))["ray_version"] == "2.60.0"
    finally:
        await close(client)
    assert len(seen) == 3
    assert all(r.headers["authorization"] == "Bearer tok-123" for r in seen)


@pytest.mark.parametrize("cls", CLIENTS)
async def test_persistent_502_is_unreachable(cls):
    client = mock_client(cls, lambda request: httpx.Response(502, text="bad gateway"), retries=2)
    try:
        with pytest.raises(RayUnreachableError, match="after 2 attempts: HTTP 502") as err:
            await do(client, "get", "job-1")
    finally:
        await close(client)
    assert err.value.status_code == 502


@pytest.mark.parametrize("cls", CLIENTS)
async def test_malformed_bodies(cls):
    bodies = {
        "/api/jobs/not-json": httpx.Response(200, text="<html>proxy login</html>"),
        "/api/jobs/no-status": httpx.Response(200, json={"submission_id": "no-status"}),
        "/api/jobs/extra": httpx.Response(
            200, json={"submission_id": "extra", "status": "RUNNING", "future_field": {"a": 1}}
        ),
        "/api/jobs/": httpx.Response(200, json={"not": "a list"}),
        "/api/jobs/x/logs": httpx.Response(200, json={"text": "no logs key"}),
    }
    client = mock_client(cls, lambda request: bodies[request.url.path])
    try:
        with pytest.raises(RayJobsError, match="not JSON"):
            await do(client, "get", "not-json")
        with pytest.raises(RayJobsError, match="status"):
            await do(client, "get", "no-status")
        job = await do(client, "get", "extra")
        assert job.status is JobStatus.RUNNING and not job.is_terminal
        assert job.model_extra == {"future_field": {"a": 1}}
        with pytest.raises(RayJobsError, match="not a list"):
            await do(client, "list_jobs")
        with pytest.raises(RayJobsError, match="logs"):
            await do(client, "logs", "x")
    finally:
        await close(client)


@pytest.mark.parametrize("cls", CLIENTS)
async def test_4xx_and_500_carry_trimmed_server_text(cls):
    traceback_500 = (
        "Traceback (most recent call last):\n  File \"job_head.py\", line 500, in delete_job\n"
        "RuntimeError: Request failed with status code 500: Traceback (most recent call last):\n"
        "  File \"job_manager.py\", line 655, in delete_job\n"
        "RuntimeError: Attempted to delete job 'j', but it is in a non-terminal state RUNNING.\n.\n"
    )

    def handler(request: httpx.Request) -> httpx.Response:
        if request.method == "DELETE":
            return httpx.Response(500, text=traceback_500)
        return httpx.Response(422, text="x" * 5000)

    client = mock_client(cls, handler)
    try:
        with pytest.raises(RayJobsError) as err:
            await do(client, "delete", "j")
        assert err.value.status_code == 500
        assert str(err.value).endswith("non-terminal state RUNNING.")
        assert "Traceback" not in str(err.value)
        with pytest.raises(RayJobsError) as err:
            await do(client, "stop", "j")
        assert err.value.status_code == 422 and not isinstance(err.value, RayUnreachableError)
        assert len(str(err.value)) < 800
    finally:
        await close(client)


@pytest.mark.parametrize("cls", CLIENTS)
async def test_submit_retry_after_lost_answer_reattaches(cls):
    """The first POST reaches Ray but its answer is lost; the retry meets 'already exists'."""
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(json.loads(request.content))
        if len(calls) == 1:
            raise httpx.ReadTimeout("timed out", request=request)
        return httpx.Response(
            500,
            text="Traceback (most recent call last):\nValueError: Job with submission_id "
            "sub-1 already exists. Please use a different submission_id.\n.",
        )

    client = mock_client(cls, handler)
    try:
        assert await do(client, "submit", "python -c pass", submission_id="sub-1") == "sub-1"
    finally:
        await close(client)
    assert calls == [{"entrypoint": "python -c pass", "submission_id": "sub-1"}] * 2


@pytest.mark.parametrize("cls", CLIENTS)
async def test_token_never_leaks(cls, caplog):
    caplog.set_level(logging.DEBUG)
    token = f"sekrit-{uuid.uuid4().hex}"

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/api/version":  # a proxy that echoes what it got
            return httpx.Response(403, text=f"bad credentials {request.headers['authorization']}")
        raise httpx.ConnectError(f"proxy refused {request.headers['authorization']}", request=request)

    client = mock_client(cls, handler, token=token, retries=2)
    try:
        assert token not in repr(client) and "auth='token'" in repr(client)
        with pytest.raises(RayAuthError) as auth_err:
            await do(client, "version")
        with pytest.raises(RayUnreachableError) as net_err:
            await do(client, "list_jobs")
    finally:
        await close(client)
    for err in (auth_err.value, net_err.value):
        assert token not in str(err) and token not in repr(err)
    assert "password" in str(auth_err.value)
    assert "retrying" in caplog.text and token not in caplog.text


@pytest.mark.parametrize("cls", CLIENTS)
async def test_unreachable_address_after_retries(cls):
    (port,) = _free_ports(1)  # nothing listens there
    client = cls(f"http://127.0.0.1:{port}", retries=3, backoff=0.05, timeout=2)
    t0 = time.monotonic()
    try:
        with pytest.raises(RayUnreachableError) as err:
            await do(client, "version")
    finally:
        await close(client)
    msg = str(err.value)
    assert f"http://127.0.0.1:{port}" in msg and "after 3 attempts" in msg and "ConnectError" in msg
    assert "check the `ray` connection's host" in msg
    assert 0.15 <= time.monotonic() - t0 < 5  # slept 0.05 + 0.1 between the three attempts


@pytest.mark.parametrize("cls", CLIENTS)
async def test_silent_server_times_out(cls):
    """A server that accepts but never answers must not hang the caller (or its event loop)."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        port = listener.getsockname()[1]
        client = cls(f"http://127.0.0.1:{port}", retries=2, backoff=0.0, timeout=0.3)
        t0 = time.monotonic()
        try:
            with pytest.raises(RayUnreachableError, match="after 2 attempts: ReadTimeout"):
                await do(client, "get", "anything")
        finally:
            await close(client)
        assert time.monotonic() - t0 < 5


# --------------------------------------------------------------------------- real cluster


@pytest.mark.parametrize("cls", CLIENTS)
async def test_version_and_unknown_job(ray_head, cls):
    client = cls(ray_head.dashboard_url)
    try:
        version = await do(client, "version")
        assert version["version"] == "4" and version["ray_version"]
        for method in ("get", "stop", "delete", "logs"):
            with pytest.raises(JobNotFoundError, match="no-such-job") as err:
                await do(client, method, "no-such-job")
            assert err.value.status_code == 404
        assert await do(client, "package_exists", "gcs://_ray_pkg_0000.zip") is False
    finally:
        await close(client)


async def test_job_succeeds_with_logs(ray_head):
    async with AsyncRayJobsClient(ray_head.dashboard_url) as client:
        sid = new_id("hello")
        returned = await client.submit(
            "python -c \"print('hello')\"", submission_id=sid, metadata={"owner": "rsjc"}
        )
        assert returned == sid
        job = await wait_status(client, sid, JobStatus.SUCCEEDED)
        assert job.submission_id == sid and job.driver_exit_code == 0 and job.is_terminal
        assert job.metadata == {"owner": "rsjc"} and job.start_time and job.end_time
        assert "hello" in await client.logs(sid)
        assert await client.stop(sid) is False  # nothing left to stop
        assert await client.delete(sid) is True
        with pytest.raises(JobNotFoundError):
            await client.get(sid)


async def test_job_fails_with_exit_code(ray_head):
    with RayJobsClient(ray_head.dashboard_url) as client:
        sid = client.submit("python -c \"import sys; sys.exit(3)\"", submission_id=new_id("fail"))
        job = await wait_status(client, sid, JobStatus.FAILED)
        assert job.driver_exit_code == 3
        assert job.error_type == "JOB_ENTRYPOINT_COMMAND_ERROR"


@pytest.mark.parametrize("cls", CLIENTS)
async def test_submit_is_idempotent(ray_head, cls):
    client = cls(ray_head.dashboard_url)
    sid = new_id("twice")
    try:
        assert await do(client, "submit", "python -c pass", submission_id=sid) == sid
        assert await do(client, "submit", "python -c pass", submission_id=sid) == sid
        jobs = [j for j in await do(client, "list_jobs") if j.submission_id == sid]
        assert len(jobs) == 1 and jobs[0].entrypoint == "python -c pass"
    finally:
        await close(client)


async def test_stop_running_job(ray_head):
    async with AsyncRayJobsClient(ray_head.dashboard_url) as client:
        sid = await client.submit("sleep 60", submission_id=new_id("sleep"))
        await wait_status(client, sid, JobStatus.RUNNING)
        with pytest.raises(RayJobsError, match="non-terminal") as err:  # Ray: 500 while running
            await client.delete(sid)
        assert err.value.status_code == 500
        assert await client.stop(sid) is True
        job = await wait_status(client, sid, JobStatus.STOPPED)
        assert job.is_terminal


async def test_package_upload_and_py_modules(ray_head, tmp_path):
    pkg = tmp_path / "rsjc_probe_mod"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("VALUE = 'from-the-package'\n")
    data = zip_directory(pkg, include_parent_dir=True)
    with RayJobsClient(ray_head.dashboard_url) as client:
        uri = f"gcs://{package_name_for(data)}"
        assert client.package_exists(uri) is False
        assert client.ensure_package(data) == uri
        assert client.package_exists(uri) is True
        assert client.ensure_package(data) == uri  # second time: found, not uploaded again
        sid = client.submit(
            "python -c \"import rsjc_probe_mod as m; print('got', m.VALUE)\"",
            submission_id=new_id("pkg"),
            runtime_env={"py_modules": [uri]},
        )
        job = await wait_status(client, sid, JobStatus.SUCCEEDED, timeout=90)
        assert job.runtime_env == {"py_modules": [uri]}
        assert "got from-the-package" in client.logs(sid)


@pytest.mark.parametrize("cls", CLIENTS)
async def test_token_auth(ray_head_with_token, cls):
    token = ray_head_with_token.token
    url = ray_head_with_token.dashboard_url
    errors = []
    for kwargs, status in (({}, 401), ({"token": "wrong-token"}, 403)):
        client = cls(url, **kwargs)
        try:
            with pytest.raises(RayAuthError, match="set the `ray` connection's password") as err:
                await do(client, "version")
        finally:
            await close(client)
        assert err.value.status_code == status
        errors.append(err.value)

    client = cls(url, token=token)
    try:
        assert (await do(client, "version"))["version"] == "4"
        sid = await do(client, "submit", "python -c pass", submission_id=new_id("tok"))
        assert (await do(client, "get", sid)).submission_id == sid
        with pytest.raises(JobNotFoundError) as err:
            await do(client, "get", "no-such-job")
        errors.append(err.value)
        assert token not in repr(client)
    finally:
        await close(client)
    for e in errors:
        assert token not in str(e) and token not in repr(e)


async def test_log_tail_streams_with_the_token_and_refuses_without(ray_head_with_token):
    url, token = ray_head_with_token.dashboard_url, ray_head_with_token.token
    async with AsyncRayJobsClient(url, token=token) as client:
        sid = await client.submit("python -c \"print('streamed-line')\"", submission_id=new_id("tail"))
        await wait_status(client, sid, JobStatus.SUCCEEDED)
        text = ""
        async with client.tail_logs(sid) as tail:  # opened after the end: the whole log, then a normal close
            while (chunk := await asyncio.wait_for(tail.next(), 30)) is not None:
                text += chunk
        assert "streamed-line" in text and client.bytes_streamed == len(text.encode())
        assert text == await client.logs(sid)
        with pytest.raises(JobNotFoundError):
            async with client.tail_logs("no-such-job"):
                pass
    for kwargs, status in (({}, 401), ({"token": "wrong-token"}, 403)):
        async with AsyncRayJobsClient(url, **kwargs) as client:
            with pytest.raises(RayAuthError, match="set the `ray` connection's password") as err:
                async with client.tail_logs(sid):
                    pass
        assert err.value.status_code == status and token not in str(err.value)
