"""What reaches a host process: the user's runtime env, with rayslice's variables over it where they must be."""

from __future__ import annotations

import json
import os
import sys
import types

import pytest
from ray._private.runtime_env.constants import RAY_JOB_CONFIG_JSON_ENV_VAR

from rayslice.cluster import host_env
from rayslice.core import launcher
from rayslice.core.accelerators import TpuSliceRequest
from rayslice.core.step import StepSpec

LAUNCHER = ["gcs://_ray_pkg_launcher.zip", "gcs://_ray_pkg_cloudpickle.zip"]


def spec(**runtime_env):
    return StepSpec(request=TpuSliceRequest(tpu="v6e-4"), command=["python"], runtime_env=runtime_env or None)


def test_without_a_runtime_env_hosts_get_the_launcher_alone_or_nothing():
    assert host_env.actor_runtime_env(spec(), []) is None  # no runtime env: no setup_worker step
    assert host_env.actor_runtime_env(spec(), LAUNCHER) == {"py_modules": LAUNCHER}


def test_the_shipped_launcher_stays_in_front_of_the_users_py_modules():
    env = host_env.actor_runtime_env(spec(py_modules=["gcs://_ray_pkg_mine.zip"], env_vars={"A": "1"},
                                          excludes=["*.ckpt"]), LAUNCHER)
    assert env == {"py_modules": [*LAUNCHER, "gcs://_ray_pkg_mine.zip"], "env_vars": {"A": "1"}}


def test_an_installed_launcher_gives_hosts_the_users_env_alone():
    assert host_env.actor_runtime_env(spec(env_vars={"A": "1"}), []) == {"env_vars": {"A": "1"}}


class FakeRay:
    def __init__(self, nodes, job_env=None):
        self._nodes, self._job_env = nodes, job_env or {}

    def nodes(self):
        return self._nodes

    def get_runtime_context(self):
        return types.SimpleNamespace(runtime_env=self._job_env)


def node(node_id, label=None, alive=True):
    return {"NodeID": node_id, "Alive": alive, "Labels": {launcher.LABEL: label} if label else {}}


@pytest.fixture
def shipped(monkeypatch):
    """A job driver of a shipped launcher: `leave_job_env` took the job's env off its workers."""
    config = {"runtime_env": {"working_dir": "gcs://spec", "py_modules": LAUNCHER, "env_vars": {"RAY_DEDUP_LOGS": "0"}},
              "metadata": {"rayslice": "1"}}
    monkeypatch.setenv(RAY_JOB_CONFIG_JSON_ENV_VAR, json.dumps(config))
    monkeypatch.setattr(host_env, "_shipped", None)
    host_env.leave_job_env()
    assert json.loads(os.environ[RAY_JOB_CONFIG_JSON_ENV_VAR]) == {"metadata": {"rayslice": "1"}}  # workers: no env
    monkeypatch.setattr(host_env, "running_digest", lambda: "abc123")


def test_hosts_on_nodes_with_this_very_launcher_installed_start_without_it(shipped, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", FakeRay([node("a", "abc123"), node("b", "abc123"), node("c")]))
    assert host_env.launcher_modules(["a", "b"]) == []
    assert host_env.service_runtime_env("a") is None


@pytest.mark.parametrize("labels", [("abc123", None), ("abc123", "another-digest"), ("abc123",)])
def test_one_node_without_the_same_copy_gets_the_shipped_launcher(shipped, monkeypatch, labels):
    """A node with no label, another copy's digest, or one Ray no longer lists alive gets the shipped launcher."""
    nodes = [node(f"n{i}", label) for i, label in enumerate(labels)]
    monkeypatch.setitem(sys.modules, "ray", FakeRay(nodes))
    assert host_env.launcher_modules(["n0", "n1"]) == LAUNCHER
    assert host_env.service_runtime_env("n1") == {"py_modules": LAUNCHER}
    assert host_env.service_runtime_env(None) == {"py_modules": LAUNCHER}  # no node known: ship it


def test_a_direct_callers_driver_keeps_its_own_env(monkeypatch):
    """Not a job driver of ours (`reserve_slices` from a user's script): its workers inherit its env, as before."""
    monkeypatch.setattr(host_env, "_shipped", None)
    monkeypatch.setitem(sys.modules, "ray", FakeRay([node("a", "abc123")], {"py_modules": ["gcs://theirs.zip"]}))
    assert host_env.launcher_modules(["a"]) == ["gcs://theirs.zip"]
    assert host_env.service_runtime_env("a") is None


def test_an_installed_launcher_ships_nothing(monkeypatch):
    monkeypatch.setenv(RAY_JOB_CONFIG_JSON_ENV_VAR, json.dumps({"runtime_env": {"working_dir": "gcs://spec"}}))
    monkeypatch.setattr(host_env, "_shipped", None)
    host_env.leave_job_env()
    monkeypatch.setitem(sys.modules, "ray", FakeRay([node("a")]))
    assert host_env.launcher_modules(["a"]) == []


def test_flag_lists_are_joined_and_other_variables_replaced_with_a_note():
    current = {"XLA_FLAGS": "--xla_dump_to=/tmp/x", "JAX_PLATFORMS": "tpu"}
    ours = {"XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu", "OTHER": "1"}
    values, notes = host_env.merged(current, ours, user=current)
    assert values == {"XLA_FLAGS": "--xla_dump_to=/tmp/x --xla_force_host_platform_device_count=4",
                      "JAX_PLATFORMS": "cpu", "OTHER": "1"}
    assert notes == ["XLA_FLAGS: rayslice appends '--xla_force_host_platform_device_count=4' to the runtime_env's "
                     "value",
                     "JAX_PLATFORMS: rayslice sets 'cpu' over the runtime_env's 'tpu' (it must, here)"]
    assert host_env.merged({}, ours, user={})[1] == []
