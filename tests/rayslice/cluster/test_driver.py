"""`run_step` runs only in a driver connected to a cluster: it never lets Ray start an empty one."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

CALL_RUN_STEP = textwrap.dedent("""
    import sys
    import ray
    from rayslice import StepSpec, TpuSliceRequest
    from rayslice.cluster import run_step

    if sys.argv[1] == "init":
        ray.init(num_cpus=1, include_dashboard=False, logging_level="ERROR")
    elif sys.argv[1] == "connect":
        ray.init(logging_level="ERROR")  # RAY_ADDRESS
    try:
        run_step(StepSpec.for_function(len, request=TpuSliceRequest(tpu="v6e-4"), kwargs={"obj": []}))
    except Exception as exc:
        print(type(exc).__name__, exc)
    print("initialized after:", ray.is_initialized())
""")


def run_driver(mode: str, tmp_path, **ray_env: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    # A private HOME and explicit auth mode: a Ray started here must not write ~/.ray/auth_token.
    env |= {"HOME": str(tmp_path), "RAY_AUTH_MODE": "disabled"} | ray_env
    done = subprocess.run([sys.executable, "-c", CALL_RUN_STEP, mode], env=env, cwd=tmp_path, capture_output=True,
                          text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_without_ray_init_run_step_refuses_and_starts_no_ray(tmp_path):
    out = run_driver("plain", tmp_path)
    assert "InvalidRequestError run_step needs a Ray driver connected to a cluster, and none is" in out
    assert 'eval "$(rayslice local env)"' in out and "ray.init(address=...)" in out
    assert "initialized after: False" in out  # refused before anything could start a Ray


@pytest.mark.cluster  # starts a throwaway one-node Ray (its own, stopped when the driver exits)
def test_a_ray_that_ray_init_started_itself_is_refused(tmp_path):
    out = run_driver("init", tmp_path)
    assert "ray.init() started a new local Ray in this process (it found no RAY_ADDRESS), which has no slices" in out
    assert not (tmp_path / ".ray" / "auth_token").exists()


def test_a_token_auth_driver_on_a_cluster_without_auth_is_told_what_to_set(cluster, tmp_path):
    """Ray's own error here is a host process that "died unexpectedly"; ours names the setting, before reserving."""
    assert not cluster.token  # the session's cluster runs without auth
    (tmp_path / ".ray").mkdir()  # token mode needs a token to connect with
    (tmp_path / ".ray" / "auth_token").write_text("rs-test-" + "0" * 32)
    out = run_driver("connect", tmp_path, RAY_ADDRESS=cluster.gcs_address, RAY_AUTH_MODE="token")
    assert "InvalidRequestError this driver uses Ray token auth (RAY_AUTH_MODE=token)" in out, out
    assert f"the cluster at {cluster.dashboard_url.removeprefix('http://')} runs without auth" in out, out
    assert "set RAY_AUTH_MODE=disabled before ray.init()" in out and 'eval "$(rayslice local env)"' in out, out
    assert "waiting for capacity" not in out and "reserved" not in out, out  # refused before anything was reserved
