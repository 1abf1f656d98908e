"""What reaches a host process: the user's runtime env, with rayslice's variables over it where they must be."""

from __future__ import annotations

import json
import os
import socket
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


@pytest.mark.parametrize("user_env", [
    {"conda": "training-env"},                                   # another Python: no rayslice in it
    {"image_uri": "us-docker.pkg.dev/p/r/trainer:1"},             # another image: none, or another version
    {"container": {"image": "trainer:1"}},
    {"py_executable": "/opt/trainer-venv/bin/python"},
    {"py_modules": ["gcs://_ray_pkg_users_cloudpickle2.zip"]},    # the user's cloudpickle over the installed one
    {"env_vars": {"PYTHONPATH": "/mnt/shared/vendored"}},         # the same through PYTHONPATH
    {"pip": ["cloudpickle==2.2.1"]},                              # the same through pip
], ids=lambda env: next(iter(env)))
def test_a_step_with_its_own_runtime_env_keeps_the_launcher_in_front_on_a_labelled_node(shipped, monkeypatch,
                                                                                           user_env):
    """The label vouches for the node's own Python; a runtime env may run the host in another, or put other
    copies in front of the installed ones. Such a host goes through Ray's setup_worker anyway: nothing to win."""
    import rayslice.cluster as cluster

    monkeypatch.setitem(sys.modules, "ray", FakeRay([node("a", "abc123"), node("b", "abc123")]))
    step = StepSpec(request=TpuSliceRequest(tpu="v6e-4"), command=["python", "train.py"], runtime_env=user_env)
    env, digest = cluster._hosts_runtime_env(step, ["a", "b"])
    assert env is not None and env["py_modules"][:2] == LAUNCHER, env
    assert digest is None  # the hosts import the shipped copy: nothing installed to check


def test_a_step_without_a_runtime_env_starts_bare_on_a_labelled_node_and_checks_the_label(shipped, monkeypatch):
    import rayslice.cluster as cluster

    monkeypatch.setitem(sys.modules, "ray", FakeRay([node("a", "abc123")]))
    assert cluster._hosts_runtime_env(spec(), ["a"]) == (None, "abc123")


def test_a_host_whose_installed_launcher_is_not_the_labelled_one_fails_saying_what_to_fix(monkeypatch):
    """The label is set once, at the node's start; an editable install edited since, or a label copied from
    another image, runs other files than the driver's under the same label."""
    monkeypatch.setattr(host_env, "running_digest", lambda: "edited")
    host_env.check_installed(None)  # the launcher shipped: nothing to check
    host_env.check_installed("edited")
    with pytest.raises(host_env.LauncherMismatchError, match=rf"node {socket.gethostname()}'s .*") as info:
        host_env.check_installed("abc123")
    assert sys.executable in str(info.value)  # which Python's install it read
    sent = r"digest edited, in .*\) is not the launcher this step was sent with \(abc123\).*rayslice launcher-label"
    with pytest.raises(host_env.LauncherMismatchError, match=sent):
        host_env.check_installed("abc123")


def test_the_host_process_checks_its_launcher_before_it_loads_the_step(monkeypatch):
    from rayslice.cluster import host_process

    monkeypatch.setattr(host_env, "running_digest", lambda: "edited")
    host = host_process.HostProcess.__ray_actor_class__("host0", launcher_digest="abc123")
    host._prepare(spec().model_dump_json(), None)
    assert isinstance(host._failed, host_env.LauncherMismatchError)


class Placed(Exception):
    pass


def test_a_fraction_without_the_launcher_can_only_land_on_a_labelled_node(shipped, monkeypatch):
    """Every GPU node alive at the check is labelled, so the launcher is left out; a GPU node that joins
    afterwards (an autoscaled group whose image has no rayslice) must not get the actor."""
    import rayslice.cluster as cluster
    from rayslice.cluster import autoscaler, host_process, phases
    from rayslice.core.accelerators import AcceleratorRequest

    fake = FakeRay([{**node("gpu-a", "abc123"), "Resources": {"GPU": 1.0, "CPU": 4.0}},
                    {**node("cpu-b"), "Resources": {"CPU": 4.0}}])
    monkeypatch.setitem(sys.modules, "ray", fake)
    monkeypatch.setattr(cluster, "ray", fake)
    captured = {}

    class FakeHostProcess:
        @staticmethod
        def options(**kwargs):
            captured.update(kwargs)
            raise Placed

    monkeypatch.setattr(host_process, "HostProcess", FakeHostProcess)
    request = AcceleratorRequest(resource="GPU", count=0.5)
    step = StepSpec(request=request, command=["python", "train.py"])
    # The actor's creation is inside the release's try: its `finally` gives the place back (a real one's calls).
    place = types.SimpleNamespace(entry=types.SimpleNamespace(part=0, preemptible=False), leave=lambda: None)
    monkeypatch.setattr(autoscaler, "may_add", lambda resource: False)
    with pytest.raises(Placed):
        cluster._place_and_run_fraction(step, request, host_process.Attempt(), phases.Timeline(),
                                         cluster.Waits(capacity=10, start=10), 0.0, place)
    assert captured["runtime_env"] is None
    assert captured["label_selector"][launcher.LABEL] == "abc123"
    # Where an autoscaler may add a node for it, nobody can know that node will carry the label (it is set as
    # the node starts): pinned, the step would wait out its capacity_timeout for a node never added. Shipped.
    captured.clear()
    monkeypatch.setattr(autoscaler, "may_add", lambda resource: True)
    with pytest.raises(Placed):
        cluster._place_and_run_fraction(step, request, host_process.Attempt(), phases.Timeline(),
                                         cluster.Waits(capacity=10, start=10), 0.0, place)
    assert captured["runtime_env"]["py_modules"] == LAUNCHER
    assert launcher.LABEL not in captured.get("label_selector", {})


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
