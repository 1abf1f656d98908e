"""Command steps on a real local cluster: an unmodified JAX program on every host of a simulated slice."""

from __future__ import annotations

import asyncio
import os
import sys
import textwrap
import time
from pathlib import Path

import pytest

from rayslice.client.submission import run_step_job
from rayslice.core.accelerators import AcceleratorRequest, TpuSliceRequest
from rayslice.core.exceptions import StepFailedError
from rayslice.core.step import Owner, StepSpec
from tests.conftest import TOTAL_TPU_CHIPS, wait_until

#: A program as a team would have it: it imports its own helper package and calls JAX's
#: initialize() with no arguments; it knows nothing of rayslice but the documented variables.
TRAIN = textwrap.dedent('''
    import json, os, sys
    import jax
    import jax.numpy as jnp
    from jax.experimental import multihost_utils
    from helpers.numbers import double

    jax.distributed.initialize()
    total = multihost_utils.process_allgather(jnp.array([jax.process_index() + 1]))
    print(f"process {jax.process_index()} sees {jax.device_count()} devices, MODEL={os.environ['MODEL']}")
    result = {"devices": jax.device_count(), "local": jax.local_device_count(), "sum": int(total.sum()),
              "doubled": double(jax.process_index()), "model": os.environ["MODEL"], "argv": sys.argv[1:],
              "worker": os.environ["RAYSLICE_WORKER_ID"], "try": os.environ["RAYSLICE_TRY_NUMBER"],
              "cwd_has_train": os.path.exists("train.py")}
    with open(os.environ["RAYSLICE_RESULT_FILE"], "w") as f:
        json.dump(result, f)
''')


@pytest.fixture
def program(tmp_path: Path) -> Path:
    folder = tmp_path / "program"
    (folder / "helpers").mkdir(parents=True)
    (folder / "train.py").write_text(TRAIN)
    (folder / "helpers" / "__init__.py").write_text("")
    (folder / "helpers" / "numbers.py").write_text("def double(x):\n    return 2 * x\n")
    (folder / "data.bin").write_bytes(os.urandom(64))  # this test's content: a package the cluster never saw
    return folder


def job(cluster, spec: StepSpec, lines: list[str]):
    return asyncio.run(run_step_job(cluster.dashboard_url, spec, token=cluster.token, emit=lines.append))


def test_an_unmodified_jax_program_runs_on_every_host_from_its_working_dir(cluster, program):
    lines: list[str] = []
    spec = StepSpec(request=TpuSliceRequest(tpu="v6e-16"), command="python train.py --steps 3",
                    runtime_env={"working_dir": str(program), "env_vars": {"MODEL": "tiny"}},
                    owner=Owner(submission_id=f"test-cmd-{time.time_ns()}", try_number=2),
                    launcher="installed")  # as a local connection sends it: the hosts still get the runtime env
    results = job(cluster, spec, lines)
    assert [r["worker"] for r in results] == ["0", "1", "2", "3"]
    for index, result in enumerate(results):
        assert result == {"devices": 16, "local": 4, "sum": 1 + 2 + 3 + 4, "doubled": 2 * index, "model": "tiny",
                          "argv": ["--steps", "3"], "worker": str(index), "try": "2", "cwd_has_train": True}
    for index in range(4):  # every host's own lines, with its prefix
        assert any("v6e-16-" in line and f"host{index}" in line and f"process {index} sees 16 devices" in line
                   for line in lines), lines


def exit_3_on(index: int) -> list[str]:
    """Host `index` exits 3 once its peers are running; the others would sleep for minutes, each noting its pid."""
    code = ("import os, sys, time, pathlib; w = os.environ['RAYSLICE_WORKER_ID']; "
            "folder = pathlib.Path(sys.argv[1]); (folder / str(os.getpid())).write_text(w); "
            f"print('host', w, 'about to exit', flush=True) if w == '{index}' else None; "
            f"(time.sleep(0.5), sys.exit(3)) if w == '{index}' else time.sleep(600)")
    return ["python", "-c", code]


@pytest.mark.parametrize("index", [0, 1, 2, 3])
def test_a_non_zero_exit_on_any_host_fails_the_gang_naming_it_and_frees_the_slice(ray_driver, tmp_path, index):
    from rayslice.cluster import run_step

    spec = StepSpec(request=TpuSliceRequest(tpu="v6e-16"), command=exit_3_on(index) + [str(tmp_path)],
                    owner=Owner(submission_id=f"test-cmd-exit-{time.time_ns()}"))
    started = time.monotonic()
    with pytest.raises(StepFailedError) as info:
        run_step(spec)
    message = str(info.value)
    assert info.value.worker_id == index
    assert f"host{index} (slice 0, worker {index}" in message and "exit code 3" in message, message
    assert f"host {index} about to exit" in message, message  # the host's last output lines
    assert "Traceback" not in message, message  # the program's failure, not the launcher's stack
    assert time.monotonic() - started < 120  # the sleeping peers were cancelled, not waited for
    assert wait_until(lambda: ray_driver.available_resources().get("TPU") == TOTAL_TPU_CHIPS, timeout=10)
    pids = [int(p.name) for p in tmp_path.iterdir()]
    assert wait_until(lambda: not any(_alive(pid) for pid in pids), timeout=10), "a host's program outlived its gang"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_fraction_runs_the_command_once_and_a_missing_result_file_is_none(ray_driver):
    from rayslice.cluster import run_step

    spec = StepSpec(request=AcceleratorRequest(resource="GPU", count=0.25),
                    command=[sys.executable, "-c", "import os; print(os.environ['XLA_PYTHON_CLIENT_MEM_FRACTION'])"],
                    owner=Owner(submission_id=f"test-cmd-gpu-{time.time_ns()}"))
    assert run_step(spec) is None

