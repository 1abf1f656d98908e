"""The Cloud TPU startup script joins a token-auth Ray head, from a clean venv, for real.

A local head with Ray token auth (no other node), and the script as `rayslice cloud-tpu
startup-script --token-secret` prints it, run the way a booting VM runs it: stand-ins only for what
needs the cloud or the network (`gcloud` hands out the head's token as Secret Manager would; `uv`
makes the venv from the wheel's clean venv of tests/rayslice/local/test_wheel_venv.py instead of
downloading). Its `ray start` is real: the node must join the head, which refuses nodes without the
token. The script runs in its own process session; what it started is ended by PID.
"""

from __future__ import annotations

import shlex
import shutil
import signal
import subprocess
import time

import pytest

from rayslice.cloud import cloud_tpu
from rayslice.local import local_cluster, processes
from tests.conftest import private_cluster
from tests.rayslice.local.test_wheel_venv import wheel_python  # noqa: F401  (the clean venv fixture)

pytestmark = pytest.mark.cluster  # starts a head, and a node from the script


@pytest.fixture(scope="module")
def token_head(tmp_path_factory):
    name = "startup-join"
    with private_cluster(tmp_path_factory.mktemp("home"), name,
                         lambda: local_cluster.up(local_cluster.ClusterSpec(), name=name,
                                                  token=local_cluster.new_token())) as record:
        yield record


def test_the_startup_script_joins_a_token_auth_head_from_a_clean_venv(token_head, wheel_python, tmp_path):  # noqa: F811
    stubs, venv = tmp_path / "bin", tmp_path / "venv"
    stubs.mkdir()
    log = tmp_path / "calls"
    record = f'echo "$(basename "$0") $*" >> {shlex.quote(str(log))}'
    stand_ins = {
        "gcloud": f"echo {shlex.quote(token_head.token)}",
        # `uv venv --clear --python X DIR` makes a venv whose python is the wheel's clean venv; `uv pip install`
        # has nothing to add.
        "uv": (f'if [ "$1" = venv ]; then mkdir -p "$5/bin"; ln -s {wheel_python} "$5/bin/python"; '
               f'printf \'#!/bin/bash\\nexec {wheel_python} -m ray.scripts.scripts "$@"\\n\' > "$5/bin/ray"; '
               'chmod +x "$5/bin/ray"; fi'),
    }
    for name, body in stand_ins.items():
        (stubs / name).write_text(f"#!/bin/bash\n{record}\n{body}\n")
        (stubs / name).chmod(0o755)
    gcs = token_head.gcs_address
    args = " ".join(local_cluster.common_args()) + " --num-cpus 1"
    script = cloud_tpu.startup_script(gcs, token_secret="ray-token", venv=str(venv), ray_start_args=args)
    before = len(local_cluster.alive_nodes(token_head.dashboard_url, token_head.token))
    proc = subprocess.Popen([shutil.which("bash"), "-c", script], env={"PATH": f"{stubs}:/usr/bin:/bin",
                            "HOME": str(tmp_path)}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=240)
        assert proc.returncode == 0, out
        deadline = time.monotonic() + 120
        while len(local_cluster.alive_nodes(token_head.dashboard_url, token_head.token)) <= before:
            assert time.monotonic() < deadline, f"the node never joined:\n{out}"
            time.sleep(1)
        calls = log.read_text().splitlines()
        assert calls[0] == "gcloud secrets versions access latest --secret=ray-token"
        assert any(c.startswith("uv pip install") for c in calls)
    finally:
        for pid in processes.session_members({proc.pid}):
            processes.send_signal(pid, signal.SIGTERM)
        deadline = time.monotonic() + 20
        while processes.session_members({proc.pid}) and time.monotonic() < deadline:
            time.sleep(0.5)
        for pid in processes.session_members({proc.pid}):
            processes.send_signal(pid, signal.SIGKILL)

