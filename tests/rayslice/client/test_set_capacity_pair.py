"""Capacity over a cluster set on two real local clusters (`set-a`, `set-b`, a v6e-4 each: tests/cluster_pair.py).

A step on the set waits in both clusters' queues while each is held by a step of its own; `rayslice capacity
--conn-id <set>` (the installed command, its members Airflow connections in `AIRFLOW_CONN_*`) shows both clusters
and that step once, waiting on both. Then set-a frees its slice: the step runs there and stands by on set-b, and
the view says so in one row, with set-b's own job record to show that it does stand by.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

from rayslice.client import set_capacity
from rayslice.client.cluster_set import run_on_set, spec_for_set
from rayslice.client.submission import run_step_job
from tests.cluster_pair import NAMES
from tests.conftest import wait_until
from tests.rayslice.client.test_cluster_set import step

SET = "tpus"
RAYSLICE = str(Path(sys.executable).with_name("rayslice"))


def _in_thread(coroutine_factory) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def go() -> None:
        try:
            out["result"] = asyncio.run(coroutine_factory())
        except BaseException as exc:  # noqa: BLE001 - the test reads it
            out["error"] = exc

    thread = threading.Thread(target=go, daemon=True)
    thread.start()
    return thread, out


def test_a_step_on_the_set_is_one_row_waiting_on_both_then_running_on_one_standing_by_on_the_other(
        cluster_pair, tmp_path):
    records = [cluster_pair.records[n] for n in NAMES]
    flags = {n: tmp_path / f"hold-{n}" for n in NAMES}
    body_flag = tmp_path / "set-step"
    threads = []
    for name, record in zip(NAMES, records, strict=True):  # each cluster's v6e-4 held by a step of its own
        spec = step(f"cap-hold-{name}", cluster_pair, flag=str(flags[name]))
        threads.append(_in_thread(lambda spec=spec, record=record: run_step_job(
            record.dashboard_url, spec, token=record.token, emit=lambda line: None)))
    sources = [set_capacity.Source(r.name, r.dashboard_url, r.token) for r in records]
    spec = spec_for_set(step("cap-on-set", cluster_pair, flag=str(body_flag)), SET, NAMES, shared_root=True)
    sid = spec.owner.submission_id
    try:
        assert wait_until(lambda: all(f.with_suffix(".started").exists() for f in flags.values()), timeout=180)

        async def on_set():
            members = cluster_pair.members(*NAMES)
            try:
                return await run_on_set(spec, members, emit=print)
            finally:
                for member in members:
                    await member.client.aclose()

        threads.append(on_set_thread := _in_thread(on_set))

        def rows() -> list[set_capacity.Across]:
            return [r for r in set_capacity.read(SET, sources).queue
                    if r.demand.holder and r.demand.holder.submission_id == sid]

        assert wait_until(lambda: [(r.waits_on, r.runs_on) for r in rows()] == [(list(NAMES), None)], timeout=120), \
            rows()
        conns = {f"AIRFLOW_CONN_{r.name.upper().replace('-', '_')}": json.dumps(
            {"conn_type": "ray", "host": r.dashboard_url, "extra": json.dumps({"launcher": "installed"})})
            for r in records}
        conns[f"AIRFLOW_CONN_{SET.upper()}"] = json.dumps(
            {"conn_type": "ray", "extra": json.dumps({"clusters": [n.replace("-", "_") for n in NAMES]})})
        environ = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW_CONN")} | conns | {"COLUMNS": "250"}

        def cli(*args: str) -> str:
            out = subprocess.run([RAYSLICE, *args, "--conn-id", SET], env=environ, capture_output=True, text=True,
                                 timeout=180)
            assert out.returncode == 0, out.stdout + out.stderr
            return out.stdout + out.stderr

        text = cli("capacity")
        assert "== cluster set_a ==" in text and "== cluster set_b ==" in text, text
        assert "v6e-4-a" in text and text.count("sets/cap-on-set (r1)") == 1, text  # one step, not two
        assert "waits on set_a (1st in line), set_b (1st in line)" in text, text
        assert "sets/cap-hold-set-a (r1)" in text and "sets/cap-hold-set-b (r1)" in text, text  # each one's holder
        queue = cli("queue")  # the brokers' own queues, read by a short job on each cluster
        assert queue.count("sets.cap-on-set") == 1 and "waits on set_a (rank 1), set_b (rank 1)" in queue, queue

        flags[NAMES[0]].write_text("go")  # set-a's slice comes free: the step runs there, set-b's job stands by
        assert wait_until(lambda: body_flag.with_suffix(".started").exists(), timeout=120)
        assert wait_until(lambda: [(r.runs_on, r.stands_by, r.waits_on) for r in rows()] == [
            (NAMES[0], [NAMES[1]], [])], timeout=60), rows()
        status_b, log_b = cluster_pair.jobs(NAMES[1], sid)  # set-b's own record: its job runs, out of its queue
        assert status_b == "RUNNING" and "stands by" in log_b, log_b
        queue = cli("queue")
        assert queue.count("sets.cap-on-set") == 1 and "runs on set_a; stands by on set_b" in queue, queue
        assert not [p for p in set_capacity.read(SET, sources).members[1].snapshot.pending
                    if p.holder and p.holder.submission_id == sid]
    finally:
        for flag in (*flags.values(), body_flag):
            flag.write_text("go")
        for thread, _ in threads:
            thread.join(180)
    assert "error" not in on_set_thread[1], on_set_thread[1]
    assert on_set_thread[1]["result"][0]["gcs"] == records[0].gcs_address
