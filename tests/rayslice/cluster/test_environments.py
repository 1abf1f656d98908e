"""The simulated slice's host environment: what a real JAX process on it reports, per TPU type."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from rayslice.cluster.environments import HostPlan, SimulatedTpuSlice
from rayslice.core.accelerators import TpuSliceRequest

PROBE = "import jax, json; print(json.dumps([jax.local_device_count(), jax.device_count()]))"


@pytest.mark.parametrize(("tpu", "chips", "devices"), [
    ("tpu7x-8", 4, 8),  # TPU7x: two devices per chip, as JAX shows them on a real TPU7x host
    ("v6e-4", 4, 4),
    ("v5p-8", 4, 4),  # two TensorCores per chip, one device (megacore)
])
def test_a_simulated_host_shows_the_devices_jax_shows_on_that_tpu(tpu, chips, devices):
    request = TpuSliceRequest(tpu=tpu)
    plan = HostPlan(slice_index=0, slice_name=f"{request.pod_type}-a", worker_id=0, ip="127.0.0.1", process_id=0,
                    num_processes=1, coordinator="", megascale_coordinator="")
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env |= SimulatedTpuSlice.env(request, plan)
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert request.chips_per_host == chips and json.loads(out.stdout.splitlines()[-1]) == [devices, devices]
