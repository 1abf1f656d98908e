"""Preemption notices on the real session cluster: a drained host's node suspends the step, which resumes elsewhere.

Each test drains one host of the v6e-16 the step runs on (Ray's `DrainNode`, reason preemption,
a deadline ahead, as `rayslice local preempt --worker 2` sends it), kills that node at the deadline
as the platform would, and starts it again at the end, so the session cluster keeps its two slices.

The training steps are `fed_fit` (tests/fed_training.py: `fit`, paced by the test rather than a
clock): they hold at a step the test chose, so the notice reaches a step the test has seen
running there, and they are let go as soon as the next attempt started.
"""

from __future__ import annotations

import json
import re
import textwrap
import threading
import time
from pathlib import Path

import pytest

from rayslice.core.accelerators import TpuSliceRequest
from rayslice.core.context import checkpoint_dir_for
from rayslice.core.step import Owner, StepSpec
from rayslice.local import local_cluster
from tests.conftest import wait_until
from tests.fed_training import Feed, fed_fit
from tests.rayslice.cluster.test_launcher import assert_all_released
from tests.training_reference import assert_matches, reference_fit

pytestmark = pytest.mark.timeout(600)

DATASET = {"features": 4, "rows_per_device": 8, "seed": 7}


def _slice_under(hosts_group: str, ray) -> str | None:
    """The slice the step's hosts placement group sits on, once it is placed."""
    from ray.util.placement_group import placement_group_table

    groups = [g for g in placement_group_table().values() if g["name"] == hosts_group and g["state"] == "CREATED"]
    if not groups:
        return None
    nodes = {n["NodeID"]: n["Labels"] for n in ray.nodes()}
    return nodes[groups[0]["bundles_to_node_id"][0]]["ray.io/tpu-slice-name"]


class Preemption:
    """Once `ready()` holds, drain host 2 of the slice under the step with `seconds` of notice; kill it at the deadline.

    A step that returned before the deadline has nothing left on the node: it is killed then (`__exit__`), as the
    platform would later, so the test does not wait out the rest of the notice. Afterwards the killed node is
    started again.
    """

    def __init__(self, cluster, ray, spec: StepSpec, ready, seconds: float) -> None:
        self.cluster, self.ray, self.spec, self.ready, self.seconds = cluster, ray, spec, ready, seconds
        self.victim: str | None = None
        self.index: int | None = None
        self.deadline = 0.0
        self.free_before_deadline: bool | None = None
        self._returned = threading.Event()  # the step under test returned
        self._thread = threading.Thread(target=self._run)

    def __enter__(self) -> Preemption:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._returned.set()
        self._thread.join()
        if self.index is not None:
            local_cluster.restart_node(self.cluster, self.index)

    def _run(self) -> None:
        group = f"rayslice:{self.spec.owner.submission_id}/hosts"
        name = wait_until(lambda: self._returned.is_set() or (self.ready() and _slice_under(group, self.ray)),
                          timeout=300, interval=0.2)
        if not isinstance(name, str):  # the step returned (or never got that far) before it could be drained
            return
        self.victim = name
        nodes = local_cluster.slice_nodes(self.cluster, name, [2])
        self.index = next(iter(nodes))
        self.deadline = local_cluster.drain(self.cluster, list(nodes.values()), self.seconds)
        # The platform's side: at the deadline the node is gone, whatever still runs there. Once the step
        # returned, nothing of it can still run there: the node goes at once.
        while time.time() < self.deadline and not self._returned.wait(0.1):
            pass
        self.free_before_deadline = bool(wait_until(lambda: _slice_free(self.ray, name),
                                                    timeout=max(0.0, self.deadline - time.time()), interval=0.1))
        local_cluster.kill_node(self.cluster, self.index)


def _slice_free(ray, slice_name: str) -> bool:
    """No placement group of ours holds a bundle on any node of this slice."""
    from ray.util.placement_group import placement_group_table

    nodes = {n["NodeID"] for n in ray.nodes() if n["Labels"].get("ray.io/tpu-slice-name") == slice_name}
    return not any(set(g["bundles_to_node_id"].values()) & nodes
                   for g in placement_group_table().values()
                   if g["name"].startswith("rayslice:") and g["state"] == "CREATED")


def _attempts(out: str) -> list[dict]:
    return [json.loads(line.split("[rayslice] phases: ", 1)[1]) for line in out.splitlines()
            if "[rayslice] phases: " in line]


ONE_SLICE = TpuSliceRequest(tpu="v6e-16")


def _fit(name: str, tmp_path: Path, feed: Feed, request: TpuSliceRequest = ONE_SLICE,
         priority: int = 3, preemptible: bool = False, **kwargs) -> StepSpec:
    """`fit`'s training (`fed_fit`), held by `feed`."""
    return StepSpec.for_function(
        fed_fit, request=request, checkpoint_root=f"file://{tmp_path / name}",
        kwargs={"feed": feed.path, "dataset": DATASET, "learning_rate": 0.05, **kwargs},
        owner=Owner(submission_id=f"test-{name}-{time.time_ns()}"), preemption_retries=1, priority=priority,
        preemptible=preemptible,
    )


def test_a_drained_host_suspends_a_training_step_which_checkpoints_frees_its_slice_and_resumes_on_the_other(
    cluster, ray_driver, tmp_path, capsys
):
    from rayslice.cluster import run_step

    steps, every, held = 10, 4, 5
    feed = Feed(tmp_path / "feed")
    spec = _fit("noticed", tmp_path, feed, steps=steps, checkpoint_every=every)
    feed.release(held)  # steps 0-4: the first checkpoint (4), then the training waits, running, before step 5
    with feed.releasing(lambda: feed.started(1), steps), \
            Preemption(cluster, ray_driver, spec, lambda: feed.waiting(0, held), seconds=30) as preemption:
        resumed = run_step(spec)
    out = capsys.readouterr().out
    assert preemption.victim, "the step ended before it waited, running, after its first checkpoint"
    first, second = _attempts(out)
    # The notice reached the step, which checkpointed the step it had just completed (not a periodic one).
    resumed_from = int(re.search(r"resumes from the checkpoint of step (\d+)", out).group(1))
    assert resumed_from % every != 0 and 0 < resumed_from < steps, out
    assert "no Airflow retry" in out and "priority 3" in out
    # The slice was free before the deadline, and the next attempt ran on the other slice.
    assert first["released"] < preemption.deadline and preemption.free_before_deadline
    assert first["notice_to_released_s"] < 30
    assert second["suspended"]["slice"] == preemption.victim
    other = [line for line in out.splitlines() if "[rayslice] reserved " in line][-1]
    assert preemption.victim not in other
    assert "resumed after" in out and "suspended" in out.split("[rayslice] timeline:")[-1]
    # Nothing was lost: the result is an uninterrupted run's.
    assert len(resumed) == 4
    assert_matches(resumed, reference_fit(DATASET, 0.05, steps, hosts=4))
    assert wait_until(lambda: ray_driver.available_resources().get("TPU-v6e-16-head") == 2, timeout=120)
    assert_all_released(ray_driver)


def test_a_step_that_ignores_the_notice_is_stopped_before_the_deadline_and_resumes_from_its_periodic_checkpoint(
    cluster, ray_driver, tmp_path, capsys
):
    from rayslice.cluster import run_step

    steps, every, held = 14, 4, 5
    feed = Feed(tmp_path / "feed")
    spec = _fit("ignored", tmp_path, feed, steps=steps, checkpoint_every=every, heed_notice=False)
    feed.release(held)  # the first checkpoint (4), then it waits, running, before step 5, ignoring the notice
    with feed.releasing(lambda: feed.started(1), steps), \
            Preemption(cluster, ray_driver, spec, lambda: feed.waiting(0, held), seconds=10) as preemption:
        resumed = run_step(spec)
    out = capsys.readouterr().out
    assert preemption.victim
    first, _ = _attempts(out)
    assert "was stopped" in out
    resumed_from = int(re.search(r"resumes from the checkpoint of step (\d+)", out).group(1))
    assert resumed_from % every == 0, out
    assert first["released"] < preemption.deadline and preemption.free_before_deadline
    assert len(resumed) == 4 and all(r["checkpoint"].endswith(f"/{steps}") for r in resumed)
    assert wait_until(lambda: ray_driver.available_resources().get("TPU-v6e-16-head") == 2, timeout=120)
    assert_all_released(ray_driver)


#: A command step as a MaxText-style program has it: on SIGTERM it saves where it is and exits non-zero.
LOOP = textwrap.dedent('''
    import json, os, signal, sys, time
    from pathlib import Path

    folder = Path(os.environ["RAYSLICE_CHECKPOINT_DIR"].removeprefix("file://"))
    worker = int(os.environ["RAYSLICE_PROCESS_INDEX"])
    folder.mkdir(parents=True, exist_ok=True)
    done = [int(p.stem) for p in folder.glob("*.step")]
    start = max(done) if done else 0
    noticed = []
    signal.signal(signal.SIGTERM, lambda *_: noticed.append(time.time()))
    for step in range(start, 10):
        time.sleep(1.0)
        if worker == 0 and (step + 1) % 4 == 0:
            (folder / f"{step + 1}.step").touch()
        if noticed:
            notice = json.loads(Path(os.environ["RAYSLICE_NOTICE_FILE"]).read_text())
            if worker == 0:
                (folder / f"{step + 1}.step").touch()
                print(f"notice (deadline in {notice['deadline'] - time.time():.0f} s): saved step {step + 1}")
            sys.exit(75)
    with open(os.environ["RAYSLICE_RESULT_FILE"], "w") as f:
        json.dump({"started_at": start, "worker": worker}, f)
''')


def test_a_command_step_gets_sigterm_and_the_notice_file_saves_and_resumes_on_the_other_slice(
    cluster, ray_driver, tmp_path, capsys
):
    from rayslice.cluster import run_step

    script = tmp_path / "loop.py"
    script.write_text(LOOP)
    spec = StepSpec(request=TpuSliceRequest(tpu="v6e-16"), command=["python", str(script)],
                    checkpoint_root=f"file://{tmp_path / 'command'}", preemption_retries=1,
                    owner=Owner(submission_id=f"test-command-notice-{time.time_ns()}"))
    folder = Path(checkpoint_dir_for(f"file://{tmp_path / 'command'}", spec.owner).removeprefix("file://"))
    with Preemption(cluster, ray_driver, spec, lambda: list(folder.glob("4.step")), seconds=30) as preemption:
        resumed = run_step(spec)
    out = capsys.readouterr().out
    assert preemption.victim
    first, _ = _attempts(out)
    steps = sorted(int(p.stem) for p in folder.glob("*.step"))
    saved_on_notice = [s for s in steps if s % 4]
    assert saved_on_notice, steps
    assert {r["started_at"] for r in resumed} == {saved_on_notice[0]}
    assert first["released"] < preemption.deadline and preemption.free_before_deadline
    assert wait_until(lambda: ray_driver.available_resources().get("TPU-v6e-16-head") == 2, timeout=120)
    assert_all_released(ray_driver)


def evaluate() -> float:
    """The urgent evaluation's body: when it started on this host."""
    return time.time()


def test_a_priority_10_evaluation_suspends_a_preemptible_two_slice_training_which_resumes_with_the_same_result(
    cluster, ray_driver, tmp_path, capsys
):
    """Issue 39's priority case: under `preemption: lower-priority`, a one-slice evaluation asking while a
    preemptible 2-slice training holds both v6e-16 starts within the grace plus its own start-up; the
    training checkpoints, releases, waits and resumes when a slice frees, ending as an uninterrupted run."""
    import asyncio

    from rayslice.client.jobs_client import RayJobsClient
    from rayslice.client.submission import run_step_job
    from rayslice.cluster import queue, run_step
    from rayslice.cluster.phases import parse_phases
    from rayslice.core.queue import QueueSettings

    two = TpuSliceRequest(tpu="v6e-16", num_slices=2, multislice=True)
    steps, every, grace, held = 8, 4, 20, 5
    feed = Feed(tmp_path / "feed")
    train = _fit("two-preemptible", tmp_path, feed, request=two, priority=0, preemptible=True, steps=steps,
                 checkpoint_every=every)
    urgent = StepSpec.for_function(evaluate, request=TpuSliceRequest(tpu="v6e-16"), priority=10,
                                   capacity_timeout=300, owner=Owner(submission_id=f"test-eval-{time.time_ns()}"))
    seen: dict = {}

    def evaluation_asks_after_the_first_checkpoint() -> None:  # while the training waits, running, before step 5
        if wait_until(lambda: feed.waiting(0, held), timeout=300, interval=0.2):
            seen["asked"] = time.time()
            seen["starts"] = asyncio.run(run_step_job(cluster.dashboard_url, urgent, token=cluster.token,
                                                      emit=lambda line: None))

    ray_driver.get(queue.broker().set_settings.remote(
        QueueSettings(preemption="lower-priority", preemption_grace_s=grace).model_dump()), timeout=10)
    asker = threading.Thread(target=evaluation_asks_after_the_first_checkpoint)
    feed.release(held)
    try:
        with feed.releasing(lambda: feed.started(1), steps):
            asker.start()
            resumed = run_step(train)
            asker.join()
    finally:
        ray_driver.get(queue.broker().set_settings.remote(QueueSettings().model_dump()), timeout=10)
    out = capsys.readouterr().out
    assert "asked" in seen, "the training ended before it waited, running, after its first checkpoint"
    with RayJobsClient(cluster.dashboard_url, token=cluster.token) as client:
        evaluation = parse_phases(client.logs(urgent.owner.submission_id))[-1]
    first, second = _attempts(out)
    # The training was suspended for the evaluation, by the queue, and kept its one try.
    assert "suspended for" in out and "priority 10" in out, out
    assert "no Airflow retry" in out
    # The evaluation started within the grace plus its own start-up (its reservation to its body's start),
    # with a few queue heartbeats of slack for the suspension to be asked and the release to be seen.
    own_startup = evaluation["step_started"] - evaluation["reserved"]
    assert evaluation["step_started"] - seen["asked"] <= grace + own_startup + 4 * queue.REPLAN_S + 5, (
        evaluation, seen["asked"])
    assert min(seen["starts"]) >= first["released"] - 1  # no step body ran on a slice the training still held
    # The training resumed only once a slice was free again (after the evaluation released it), and ended
    # exactly where an uninterrupted 2-slice run ends.
    assert second["reserved"] >= evaluation["released"] - 1
    assert len(resumed) == 8
    assert_matches(resumed, reference_fit(DATASET, 0.05, steps, hosts=8))
    assert wait_until(lambda: ray_driver.available_resources().get("TPU-v6e-16-head") == 2, timeout=120)
    assert_all_released(ray_driver)


EXPORT = textwrap.dedent('''
    import os, signal, sys, time
    from pathlib import Path

    rows = Path(sys.argv[1])
    signalled = []
    signal.signal(signal.SIGTERM, lambda *_: signalled.append(1))  # it would stop for the notice if told
    if int(os.environ["RAYSLICE_PROCESS_INDEX"]) == 0:
        (rows.parent / "started").touch()
    for row in range(8):
        time.sleep(1.0)
        if signalled:
            sys.exit(75)
        if int(os.environ["RAYSLICE_PROCESS_INDEX"]) == 0:
            with rows.open("a") as f:   # not idempotent: a second run would append every row again
                f.write(f"row {row}\\n")
''')


def test_with_no_preemption_retry_a_drain_notice_lets_a_command_step_finish_and_it_runs_once(
    cluster, ray_driver, tmp_path, capsys
):
    """Issue 49 finding 3: before, the default preemption_retries=0 sent SIGTERM at once under a 60 s notice, and a
    program that ended after it failed the step. Suspending cannot help a step with no retry: it runs on."""
    from rayslice.cluster import run_step

    rows = tmp_path / "rows"
    spec = StepSpec(request=TpuSliceRequest(tpu="v6e-16"), command=["python", "-c", EXPORT, str(rows)],
                    owner=Owner(submission_id=f"test-export-notice-{time.time_ns()}"))
    with Preemption(cluster, ray_driver, spec, lambda: (tmp_path / "started").exists(), seconds=60) as preemption:
        run_step(spec)
    assert preemption.victim
    assert rows.read_text().count("row 0") == 1 and "row 7" in rows.read_text()
    assert "its hosts are told 30 s before it is stopped" in capsys.readouterr().out
    assert_all_released(ray_driver)
