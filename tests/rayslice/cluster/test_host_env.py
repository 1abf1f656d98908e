"""What reaches a host process: the user's runtime env, with rayslice's variables over it where they must be."""

from __future__ import annotations

from rayslice.cluster import host_env
from rayslice.core.accelerators import TpuSliceRequest
from rayslice.core.step import StepSpec

LAUNCHER = ["gcs://_ray_pkg_launcher.zip", "gcs://_ray_pkg_cloudpickle.zip"]


def spec(**runtime_env):
    return StepSpec(request=TpuSliceRequest(tpu="v6e-4"), command=["python"], runtime_env=runtime_env or None)


def test_without_a_runtime_env_hosts_inherit_the_jobs():
    assert host_env.actor_runtime_env(spec(), {"py_modules": LAUNCHER}) is None


def test_the_shipped_launcher_stays_in_front_of_the_users_py_modules():
    env = host_env.actor_runtime_env(spec(py_modules=["gcs://_ray_pkg_mine.zip"], env_vars={"A": "1"},
                                          excludes=["*.ckpt"]), {"py_modules": LAUNCHER, "working_dir": "gcs://spec"})
    assert env == {"py_modules": [*LAUNCHER, "gcs://_ray_pkg_mine.zip"], "env_vars": {"A": "1"}}


def test_an_installed_launcher_gives_hosts_the_users_env_alone():
    assert host_env.actor_runtime_env(spec(env_vars={"A": "1"}), {}) == {"env_vars": {"A": "1"}}


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
