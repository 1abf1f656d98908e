"""Preemption with a notice against today's kill-and-retry: notice -> slice free, notice -> resumed, work lost.

A v6e-16 training step (40 steps of 1.5 s, orbax checkpoints every 8 steps, `preemption_retries=1`) is preempted
after its first checkpoint: the platform gives host 2's node a 30 s notice (Ray's `DrainNode`,
reason preemption) and kills the node at the deadline. Two rows, in one run on one cluster:

- `notice`: rayslice hears the drain, every host is told, the step checkpoints the step it just
  completed and stops; the launcher releases and resumes it on the other v6e-16.
- `kill-and-retry` (the baseline: what the launcher did before notices): the same platform, but
  the drain is not heard (no notice is sent: the node is only killed, at the same deadline), so
  the gang fails when the node dies and retries from the last periodic checkpoint.

Times count from the notice (the drain call). "Work lost" is the training steps run twice: steps
completed in all (each host 0 records its completed steps) minus the steps the run needed.

    RAYSLICE_HOME=... .venv/bin/python bench/preemption_notice.py --cluster NAME   # two v6e-16 needed
"""

from __future__ import annotations

import contextlib
import io
import threading
import time
from pathlib import Path

from _common import Report, Table, cluster, driver, fmt_ratio, fmt_s, log, median, parse_args, wait_all_free

from rayslice.core.accelerators import TpuSliceRequest
from rayslice.core.step import Owner, StepSpec
from rayslice.local import local_cluster

NAME = "preemption_notice"
SPEC = local_cluster.ClusterSpec(tpus=("v6e-16", "v6e-16"))
#: The run must outlast its first checkpoint plus the notice, or the kill finds nothing running.
STEPS, EVERY, SECONDS_PER_STEP, NOTICE_S = 40, 8, 1.5, 30


def train(steps: int, every: int, seconds_per_step: float, progress: str) -> int:
    """A data-parallel orbax-checkpointed loop that heeds notices (as `dags/training_pipeline.py:fit`).

    Host 0 appends each completed step to `progress`, so the benchmark counts the steps run twice.
    """
    import jax
    import jax.numpy as jnp
    import numpy as np
    import orbax.checkpoint as ocp
    from jax.experimental import multihost_utils
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from rayslice import StepSuspended, get_step_context

    context = get_step_context()
    manager = ocp.CheckpointManager(context.checkpoint_path,
                                    options=ocp.CheckpointManagerOptions(enable_async_checkpointing=False))
    # A global array replicated over every host's devices: orbax saves only global arrays in a multi-host run.
    replicated = NamedSharding(Mesh(np.array(jax.devices()), ("data",)), P())
    w = jax.device_put(jnp.zeros(4), replicated)
    start = manager.latest_step() or 0
    if start:
        w = manager.restore(start, args=ocp.args.StandardRestore({"w": w}))["w"]
    for i in range(start, steps):
        w = jax.jit(lambda w, d: w + d, out_shardings=replicated)(
            w, float(multihost_utils.process_allgather(np.array([i], dtype=np.int32)).sum()))
        if jax.process_index() == 0:
            with open(progress, "a") as f:
                f.write(f"{i}\n")
        if (i + 1) % every == 0:
            manager.save(i + 1, args=ocp.args.StandardSave({"w": w}))
        noticed = multihost_utils.process_allgather(np.array([int(context.preempted)], dtype=np.int32)).any()
        if noticed and i + 1 < steps:
            if manager.latest_step() != i + 1:
                manager.save(i + 1, args=ocp.args.StandardSave({"w": w}), force=True)
            manager.wait_until_finished()
            raise StepSuspended(f"saved step {i + 1}")
        time.sleep(seconds_per_step)
    manager.wait_until_finished()
    return int(float(w.addressable_data(0)[0]))  # replicated: every host holds the whole value


def _slice_under(ray, group: str) -> str | None:
    from ray.util.placement_group import placement_group_table

    groups = [g for g in placement_group_table().values() if g["name"] == group and g["state"] == "CREATED"]
    if not groups:
        return None
    labels = {n["NodeID"]: n["Labels"] for n in ray.nodes()}
    return labels[groups[0]["bundles_to_node_id"][0]]["ray.io/tpu-slice-name"]


def one(record, ray, mode: str, root: Path) -> dict:
    from rayslice.cluster import run_step
    from rayslice.core.context import checkpoint_dir_for

    run = f"bench-{mode}-{time.time_ns()}"
    progress = root / f"{run}.progress"  # one file per run: "steps run twice" counts this run's alone
    spec = StepSpec.for_function(
        train, request=TpuSliceRequest(tpu="v6e-16"), checkpoint_root=f"file://{root / mode}",
        kwargs={"steps": STEPS, "every": EVERY, "seconds_per_step": SECONDS_PER_STEP, "progress": str(progress)},
        owner=Owner(submission_id=run), preemption_retries=1)
    folder = Path(checkpoint_dir_for(f"file://{root / mode}", spec.owner).removeprefix("file://"))
    seen: dict = {}

    def platform() -> None:
        group = f"rayslice:{spec.owner.submission_id}/hosts"
        while not (any(p.name.isdigit() for p in folder.glob("*")) and (name := _slice_under(ray, group))):
            time.sleep(0.1)
        nodes = local_cluster.slice_nodes(record, name, [2])
        seen["index"] = next(iter(nodes))
        seen["notice"] = time.time()
        if mode == "notice":
            deadline = local_cluster.drain(record, list(nodes.values()), NOTICE_S)
        else:  # before notices the launcher heard nothing: the node just dies at the deadline
            deadline = seen["notice"] + NOTICE_S
        time.sleep(max(0.0, deadline - time.time()))
        local_cluster.kill_node(record, seen["index"])

    thread = threading.Thread(target=platform, daemon=True)
    thread.start()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        run_step(spec)
    thread.join()
    local_cluster.restart_node(record, seen["index"])
    from rayslice.cluster.phases import parse_phases

    attempts = parse_phases(out.getvalue())
    if len(attempts) < 2:
        raise SystemExit(f"{mode}: the step ran in one attempt; its log:\n{out.getvalue()[-6000:]}")
    first, second = attempts[:2]
    done = [int(line) for line in progress.read_text().split()]
    return {"free": first["released"] - seen["notice"], "resumed": second["step_started"] - seen["notice"],
            "lost": len(done) - STEPS}


def main() -> None:
    args = parse_args(__doc__.split("\n", 1)[0], default_reps=1)
    report = Report(NAME, args)
    results: dict[str, list[dict]] = {"kill-and-retry": [], "notice": []}
    with cluster(SPEC, NAME) as record, driver(record) as ray:
        root = Path(record.checkpoint_root.removeprefix("file://") or "/tmp") / f"bench-{NAME}-{time.time_ns()}"
        for rep in range(args.reps):
            for mode in results:
                log(f"{mode} {rep + 1}/{args.reps}")
                results[mode].append(one(record, ray, mode, root))
                wait_all_free(ray, timeout=120)
    table = Table(f"v6e-16 training, {STEPS} steps of {SECONDS_PER_STEP} s, checkpoint every {EVERY}, "
                  f"{NOTICE_S} s notice on host 2 (medians of {args.reps})",
                  ["path", "notice → slice free", "notice → resumed", "steps run twice", "vs kill-and-retry"])

    def of(mode: str, key: str) -> float:
        return median([r[key] for r in results[mode]])

    for mode in results:
        table.add(mode, fmt_s(of(mode, "free")), fmt_s(of(mode, "resumed")), f"{of(mode, 'lost'):g}",
                  "" if mode == "kill-and-retry" else
                  f"free {fmt_ratio(of(mode, 'free'), of('kill-and-retry', 'free'))}, resumed "
                  f"{fmt_ratio(of(mode, 'resumed'), of('kill-and-retry', 'resumed'))}")
    table.notes.append("kill-and-retry: the node dies at the deadline unannounced; its slice frees once Ray declares "
                       "the node dead, and the retry resumes from the last periodic checkpoint")
    report.add(table)
    report.write()


if __name__ == "__main__":
    main()
