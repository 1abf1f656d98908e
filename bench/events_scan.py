"""What a local cluster's shared events folder costs its dashboard agents, at Ray's pace and at the local cluster's.

Every node's dashboard agent, and the dashboard's event module, open every file of the session's events
folder every `SCAN_EVENT_DIR_INTERVAL_SECONDS` (Ray: 2 s) to forward new events. The simulated nodes of a
local cluster share the head's folder, which gains a file per worker process ever started, so each
reader reads every node's files (`IDLE_CPU_SETTINGS` in rayslice/local/local_cluster.py). For each
interval, this starts a private idle cluster, plants `--files` core-worker event files in its folder (as
a day of steps leaves there), and measures the CPU its agents and dashboard processes use over
`--window` seconds, with no files and with them.

    .venv/bin/python bench/events_scan.py --files 800 --window 60
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from _common import Report, Table, cluster, fmt_ratio, log, parse_args

from rayslice.local import local_cluster

SHAPE = local_cluster.ClusterSpec(tpus=("v6e-8",))  # a head and two hosts: three agents
EVENT = json.dumps({"event_id": "x", "source_type": "CORE_WORKER", "message": "m", "severity": "INFO",
                    "timestamp": 1})
READERS = (b"DashboardAgent", b"dashboard/dashboard.py", b"ray-dashboard-")


def _flags(parser) -> None:
    parser.add_argument("--files", type=int, default=800, help="event files to plant (default 800)")
    parser.add_argument("--window", type=float, default=60.0, help="seconds measured (default 60)")


def _cpu_s(pids: set[int]) -> float:
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
        except OSError:
            continue
    return total / 100.0


def _readers(record: local_cluster.ClusterRecord) -> set[int]:
    found = set()
    for pid in local_cluster.owned_pids(record):
        try:
            if any(name in Path(f"/proc/{pid}/cmdline").read_bytes() for name in READERS):
                found.add(pid)
        except OSError:
            continue
    return found


def measure(record: local_cluster.ClusterRecord, files: int, window: float) -> tuple[float, float]:
    """The readers' CPU-s over `window` without planted files, then with `files` of them."""
    events = Path(record.temp_dir) / "session_latest" / "logs" / "events"
    readers = _readers(record)
    time.sleep(10)  # past the start-up's own work
    before = _cpu_s(readers)
    time.sleep(window)
    empty = _cpu_s(readers) - before
    for i in range(files):
        (events / f"event_CORE_WORKER_{7_000_000 + i}.log").write_text(EVENT + "\n")
    time.sleep(5)
    before = _cpu_s(readers)
    time.sleep(window)
    return empty, _cpu_s(readers) - before


def main() -> None:
    args = parse_args(__doc__, reps=False, attach=False, extra=_flags)
    table = Table(f"dashboard agents + dashboard, CPU-s over {args.window:g} s, idle 3-node cluster",
                  ["events folder scan", "no files", f"{args.files} files", "vs every 60 s"])
    rows = {}
    ours = local_cluster.IDLE_CPU_SETTINGS["SCAN_EVENT_DIR_INTERVAL_SECONDS"]
    for interval in ("2", ours):  # Ray's default first, then the local cluster's
        local_cluster.IDLE_CPU_SETTINGS["SCAN_EVENT_DIR_INTERVAL_SECONDS"] = interval
        try:
            with cluster(SHAPE, f"events-{interval}", private=True) as record:
                rows[interval] = measure(record, args.files, args.window)
        finally:
            local_cluster.IDLE_CPU_SETTINGS["SCAN_EVENT_DIR_INTERVAL_SECONDS"] = ours
        log(f"every {interval} s: {rows[interval]}")
    for interval, (empty, planted) in rows.items():
        table.add(f"every {interval} s" + (" (Ray)" if interval == "2" else " (local cluster)"),
                  f"{empty:.2f}", f"{planted:.2f}", fmt_ratio(planted, rows[ours][1]))
    table.render()
    report = Report("events_scan", args)
    report.add(table)
    report.write()


if __name__ == "__main__":
    main()
