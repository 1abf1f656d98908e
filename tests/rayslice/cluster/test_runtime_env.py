"""A step's runtime env reaches every host process (not only the job's driver), under rayslice's own needs."""

from __future__ import annotations

import os
import time

from rayslice.core.accelerators import TpuSliceRequest
from rayslice.core.step import Owner, StepSpec


def read_env():
    import jax

    return [os.environ.get("MODEL"), os.environ["XLA_FLAGS"], jax.local_device_count()]


def test_env_vars_reach_every_host_and_rayslices_device_count_still_wins(ray_driver, capfd):
    from rayslice.cluster import run_step

    spec = StepSpec.for_function(read_env, request=TpuSliceRequest(tpu="v6e-16"),
                                 runtime_env={"env_vars": {"MODEL": "tiny", "XLA_FLAGS": "--xla_dump_hlo_as_text"}},
                                 owner=Owner(submission_id=f"test-env-{time.time_ns()}"))
    results = run_step(spec)
    assert results == [["tiny", "--xla_dump_hlo_as_text --xla_force_host_platform_device_count=4", 4]] * 4
