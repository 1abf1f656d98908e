"""Losing a host's whole node (preemption) on a cluster of its own: four single-host v6e-4 slices, two v4-16.

The tests run in file order and each removes one slice's node: mid-step with a retry (a function
step, then a command step that resumes from its checkpoint), between reservation and step start
with a retry, then mid-step without one; last, a worker host of a two-host v4-16 mid-step.
"""

from __future__ import annotations

import os
import re
import signal
import tempfile
import threading
import time
from pathlib import Path

import pytest

from rayslice.core.accelerators import TpuSliceRequest
from rayslice.core.exceptions import PreemptedError
from rayslice.core.step import Owner, StepSpec
from rayslice.local import local_cluster
from tests.conftest import private_cluster, wait_until


@pytest.fixture(scope="module")
def small_cluster(tmp_path_factory: pytest.TempPathFactory):
    spec = local_cluster.ClusterSpec(tpus=("v6e-4", "v6e-4", "v6e-4", "v6e-4", "v4-16", "v4-16"))
    home = tmp_path_factory.mktemp("preemption-home")
    with private_cluster(home, "preemption", lambda: local_cluster.up(spec, name="preemption")) as record:
        yield record


def wait_then_report(folder: str):
    """Marks which slice it runs on, then waits: the test removes that slice's node."""
    import os
    import time

    Path(folder, os.environ["TPU_NAME"]).touch()
    for _ in range(600):
        if Path(folder, "done").exists():
            return os.environ["TPU_NAME"]
        time.sleep(0.1)
    return "timed out"


def remove_node_under_the_step(record, folder: str) -> str:
    """The first slice the step lands on loses its node: every process of that `ray start` session dies."""
    deadline = time.monotonic() + 120
    while not os.listdir(folder) and time.monotonic() < deadline:
        time.sleep(0.1)
    victim = os.listdir(folder)[0]
    remove_node(next(n.pid for n in record.nodes if n.slice_name == victim))
    return victim


def remove_node(session: int) -> None:
    """SIGKILL every process of one node's `ray start` session, as a preempted VM would vanish."""
    import psutil

    for process in psutil.process_iter():
        try:
            if os.getsid(process.pid) == session:
                process.send_signal(signal.SIGKILL)
        except (ProcessLookupError, PermissionError, psutil.NoSuchProcess):
            pass


def run_as_job(record, spec):
    """Through the Jobs API: this test process may already be a Ray driver of the main test cluster."""
    import asyncio

    from rayslice.client.submission import run_step_job

    return asyncio.run(run_step_job(record.dashboard_url, spec, emit=print))


def free_chips_match_alive_hosts(record) -> bool:
    nodes = local_cluster.alive_nodes(record.dashboard_url)
    total = sum(n["resources_total"].get("TPU", 0) for n in nodes)
    from rayslice.client.capacity import snapshot

    return total > 0 and all(s.state == "free" for s in snapshot(record.dashboard_url).slices)


def test_a_lost_node_is_a_preemption_and_the_gang_retries_on_a_fresh_slice(small_cluster):
    with tempfile.TemporaryDirectory() as folder:
        spec = StepSpec.for_function(
            wait_then_report,
            request=TpuSliceRequest(tpu="v6e-4"),
            kwargs={"folder": folder},
            preemption_retries=1,
            owner=Owner(run_id=f"preempt-{time.time_ns()}"),
        )
        victim: dict[str, str] = {}
        killer = threading.Thread(
            target=lambda: victim.setdefault("name", remove_node_under_the_step(small_cluster, folder))
        )
        releaser = threading.Thread(
            target=lambda: (wait_until(lambda: len(os.listdir(folder)) >= 2, 180), Path(folder, "done").touch())
        )
        killer.start()
        releaser.start()
        result = run_as_job(small_cluster, spec)
        killer.join()
        releaser.join()
    assert len(result) == 1 and result[0] != victim["name"]
    assert wait_until(lambda: free_chips_match_alive_hosts(small_cluster), timeout=10)


#: An unmodified program as a team would bring it: it resumes from the last step its checkpoint
#: folder holds (`RAYSLICE_CHECKPOINT_DIR`, the same folder for every preemption attempt), marks
#: which slice it runs on, and saves a step every 0.1 s until the test says it is done.
RESUMING_PROGRAM = """
import json, os, pathlib, sys, time

folder = pathlib.Path(sys.argv[1])
checkpoints = pathlib.Path(os.environ["RAYSLICE_CHECKPOINT_DIR"].removeprefix("file://"))
state = checkpoints / "step.json"
start = json.loads(state.read_text())["step"] if state.exists() else 0
(folder / os.environ["TPU_NAME"]).touch()
step = start
while not (folder / "done").exists():
    step += 1
    checkpoints.mkdir(parents=True, exist_ok=True)
    (checkpoints / "step.tmp").write_text(json.dumps({"step": step}))
    (checkpoints / "step.tmp").replace(state)
    time.sleep(0.1)
with open(os.environ["RAYSLICE_RESULT_FILE"], "w") as out:
    json.dump({"resumed_from": start, "attempt": int(os.environ["RAYSLICE_PREEMPTION_ATTEMPT"]),
               "slice": os.environ["TPU_NAME"]}, out)
"""


def test_a_command_step_resumes_from_its_checkpoint_on_a_fresh_slice_after_a_lost_node(small_cluster, tmp_path):
    import sys

    folder, root = tmp_path / "markers", tmp_path / "checkpoints"
    folder.mkdir()
    spec = StepSpec(
        command=[sys.executable, "-c", RESUMING_PROGRAM, str(folder)],
        request=TpuSliceRequest(tpu="v6e-4"),
        preemption_retries=1,
        checkpoint_root=root.as_uri(),
        owner=Owner(run_id=f"preempt-command-{time.time_ns()}"),
    )
    victim: dict[str, str] = {}

    def kill_after_a_few_steps() -> None:
        wait_until(lambda: any(root.rglob("step.json")), 120)
        time.sleep(0.5)  # a few steps saved
        victim["name"] = remove_node_under_the_step(small_cluster, str(folder))

    killer = threading.Thread(target=kill_after_a_few_steps)
    releaser = threading.Thread(
        target=lambda: (wait_until(lambda: len(os.listdir(folder)) >= 2, 180), Path(folder, "done").touch())
    )
    killer.start()
    releaser.start()
    [result] = run_as_job(small_cluster, spec)
    killer.join()
    releaser.join()
    assert result["attempt"] == 1 and result["slice"] != victim["name"]
    assert result["resumed_from"] >= 1, result  # the first attempt's last saved step, not a fresh start
    assert wait_until(lambda: free_chips_match_alive_hosts(small_cluster), timeout=10)


#: A Ray driver that removes the reserved slice's node the moment the reservation is done, before
#: any host process is created: the window in which the launcher starts processes, picks the
#: coordinator port and wires JAX. It patches only *when* the node dies; Ray and the launcher are real.
KILL_BEFORE_START = """
import json, sys
from pathlib import Path

import ray

import rayslice.cluster as launcher
from rayslice.core.step import StepSpec
from tests.rayslice.cluster.test_preemption import remove_node

spec = StepSpec.model_validate_json(Path(sys.argv[1]).read_text())
sessions = json.loads(sys.argv[2])
ray.init(address=sys.argv[3], logging_level="ERROR")
reserve, removed = launcher.reserve_slices, []


def reserve_then_remove(*args, **kwargs):
    reservation = reserve(*args, **kwargs)
    if not removed:  # before any host process of this attempt exists
        removed.append(reservation.hosts[0].slice_name)
        remove_node(sessions[removed[0]])
    return reservation


launcher.reserve_slices = reserve_then_remove
print("OUTCOME " + json.dumps({"result": launcher.run_step(spec), "removed": removed}), flush=True)
"""


def test_a_node_lost_before_the_step_starts_is_a_preemption_too(small_cluster, tmp_path):
    import json
    import subprocess
    import sys

    alive = {n["labels"].get("ray.io/tpu-slice-name") for n in local_cluster.alive_nodes(small_cluster.dashboard_url)}
    sessions = {n.slice_name: n.pid for n in small_cluster.nodes if n.slice_name in alive}
    assert len(sessions) >= 2, f"needs two intact slices, has {sorted(sessions)}"
    spec = StepSpec.for_function(
        wait_then_report,
        request=TpuSliceRequest(tpu="v6e-4"),
        kwargs={"folder": str(tmp_path)},
        preemption_retries=1,
        owner=Owner(submission_id=f"test-before-start-{time.time_ns()}"),
    )
    (tmp_path / "done").touch()  # the step returns as soon as it runs
    spec_file = tmp_path.parent / f"{tmp_path.name}-spec.json"
    spec_file.write_text(spec.model_dump_json())
    env = {**os.environ, **small_cluster.ray_env()}
    started = time.monotonic()
    driver = subprocess.run(
        [sys.executable, "-c", KILL_BEFORE_START, str(spec_file), json.dumps(sessions), small_cluster.gcs_address],
        capture_output=True, text=True, timeout=240, env=env, cwd=Path(__file__).parents[3],
    )
    took = time.monotonic() - started
    assert driver.returncode == 0, driver.stdout[-3000:] + driver.stderr[-3000:]
    outcome = json.loads(driver.stdout.split("OUTCOME ", 1)[1])
    [removed] = outcome["removed"]
    survivor = outcome["result"][0]
    assert survivor != removed and outcome["result"] == [survivor]
    # Ray may report the loss from the host process's creation or from the node watch: both are a preemption.
    assert "its node was preempted or removed" in driver.stdout, driver.stdout
    assert "retrying the whole gang (1 of 1)" in driver.stdout
    assert not (tmp_path / removed).exists(), "the step started on the removed host"
    print(f"\n[preemption] node of {removed} removed before the step started; retried on {survivor} in {took:.1f} s")
    assert wait_until(lambda: free_chips_match_alive_hosts(small_cluster), timeout=10)


def test_without_retries_a_lost_node_fails_the_step_naming_the_host(small_cluster):
    with tempfile.TemporaryDirectory() as folder:
        spec = StepSpec.for_function(
            wait_then_report,
            request=TpuSliceRequest(tpu="v6e-4"),
            kwargs={"folder": folder},
            owner=Owner(run_id=f"preempt-{time.time_ns()}"),
        )
        killer = threading.Thread(target=remove_node_under_the_step, args=(small_cluster, folder))
        killer.start()
        started = time.monotonic()
        with pytest.raises(PreemptedError, match=r"v6e-4-[a-d]/host0 .*node was preempted or removed"):
            run_as_job(small_cluster, spec)
        killer.join()
    assert time.monotonic() - started < 60


def mark_host_then_wait(folder: str):
    """Marks `<slice>-<worker>` for its host, then waits until the test says it is done."""
    import os
    import time

    Path(folder, f"{os.environ['TPU_NAME']}-{os.environ['TPU_WORKER_ID']}").touch()
    for _ in range(600):
        if Path(folder, "done").exists():
            return os.environ["TPU_NAME"]
        time.sleep(0.1)
    return "timed out"


def test_a_retry_after_a_lost_worker_host_takes_the_other_slice_not_the_damaged_one(small_cluster, tmp_path, capsys):
    """A v4-16 (two hosts) loses worker 1's node mid-step: the retry runs on the other v4-16 at once.

    The launcher knows of the loss within a second or two (the raylet stops answering); the GCS
    shows the node alive for about 10 s more. The damaged slice's head is free then, and Ray picks
    among free heads at random: a retry that asked Ray only held it half the time, and waited out
    `capacity_timeout` for a host that never comes back.
    """
    spec = StepSpec.for_function(
        mark_host_then_wait,
        request=TpuSliceRequest(tpu="v4-16"),
        kwargs={"folder": str(tmp_path)},
        preemption_retries=1,
        capacity_timeout=45,
        owner=Owner(run_id=f"preempt-worker-{time.time_ns()}"),
    )
    victim: dict[str, str] = {}

    def remove_worker_1() -> None:
        wait_until(lambda: any(tmp_path.glob("v4-16-*-1")), 120)
        victim["name"] = next(tmp_path.glob("v4-16-*-1")).name.removesuffix("-1")
        remove_node(next(n.pid for n in small_cluster.nodes if n.slice_name == victim["name"] and n.worker_id == 1))

    def release_on_the_other_slice() -> None:
        wait_until(lambda: "name" in victim and {p.name for p in tmp_path.iterdir()} - {
            f"{victim['name']}-0", f"{victim['name']}-1"}, 120)
        (tmp_path / "done").touch()

    killer, releaser = threading.Thread(target=remove_worker_1), threading.Thread(target=release_on_the_other_slice)
    killer.start()
    releaser.start()
    result = run_as_job(small_cluster, spec)
    killer.join()
    releaser.join()
    assert len(result) == 2 and len(set(result)) == 1 and result[0] != victim["name"], result
    # The retry's own wait for capacity, not the whole step's time: on a loaded machine the job's start alone
    # took 21 s of the 45 (a whole-step bound failed a retry that reserved at once).
    out = capsys.readouterr().out
    waits = [int(ms) / 1000 for ms in re.findall(r"\[rayslice\] reserved v4-16-\w+ in (\d+) ms", out)]
    assert len(waits) == 2, out
    print(f"\n[preemption] {victim['name']} lost worker 1; retried on {result[0]}, reserved in {waits[1]:.1f} s")
    assert waits[1] < spec.capacity_timeout, f"the retry waited {waits[1]:.1f} s on the damaged slice"
    assert wait_until(lambda: free_chips_match_alive_hosts(small_cluster), timeout=10)
