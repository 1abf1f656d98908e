"""Warm start: what host processes that already imported JAX would save, against starting them cold.

The cold path is what every step pays today below Ray: N fresh processes (one per host) that
start Python, import JAX and wire `jax.distributed` over gloo (the dispatch benchmark's floor).
The warm path is the best a pool of ready processes could do: per host, a keeper process that
imported JAX once (no backend initialized, so it holds no device) forks one child per step; the
child sets its JAX group, wires, answers `jax.device_count()` and exits (one fresh process per
host per step). Both run the same N processes, coordinator on 127.0.0.2, 4 CPU "chips" each.

Measured per group size: from "go" to every process having `jax.device_count()` (the moment a
step's function could start), and, for the warm path, the keepers' memory before and after
`--steps` single-host steps (a pool that grew would show it). No Ray is involved: this isolates the
part of a step's start-up a warm pool could remove; the Ray job, driver and reservation costs stay
(see the dispatch benchmark's phase table).

    .venv/bin/python bench/warm_start.py            # ~2 min
"""

from __future__ import annotations

import functools
import json
import os
import socket
import subprocess
import sys
import time

from _common import ROOT, Report, Series, Table, fmt_ratio, fmt_s, log, parse_args
from dispatch import FLOOR_PROCESS

NAME = "warm_start"
CHIPS = 4
SIZES = (1, 4, 8)

#: A keeper: imports JAX once, then per line on stdin forks a child that wires a group and exits.
KEEPER = r"""
import json, os, sys, time
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={sys.argv[1]}"
import jax
chips = int(sys.argv[1])
print(json.dumps({"ready": time.time()}), flush=True)
for line in sys.stdin:
    coordinator, num_processes, process_id = line.split()
    num_processes, process_id = int(num_processes), int(process_id)
    read, write = os.pipe()
    child = os.fork()
    if child == 0:
        os.close(read)
        first = time.time()
        if num_processes > 1:
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
            jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                                       process_id=process_id, local_device_ids=list(range(chips)),
                                       cluster_detection_method="deactivate", initialization_timeout=120)
        devices = jax.device_count()
        now = time.time()
        if num_processes > 1:
            jax.distributed.shutdown()
        os.write(write, json.dumps({"first": first, "t": now, "devices": devices}).encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        answer = pipe.read()
    os.waitpid(child, 0)
    print(answer, flush=True)
"""


def coordinator() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.2", 0))
        return f"127.0.0.2:{sock.getsockname()[1]}"


def clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "JAX_", "XLA_"))}


def cold(n: int) -> tuple[float, int]:
    """N fresh processes: start, import JAX, wire; seconds until the last has its device count."""
    address = coordinator()
    t0 = time.time()
    children = [subprocess.Popen([sys.executable, "-c", FLOOR_PROCESS, address, str(n), str(i), str(CHIPS)],
                                 stdout=subprocess.PIPE, env=clean_env(), cwd=ROOT) for i in range(n)]
    answers = [json.loads(child.communicate(timeout=300)[0].decode().splitlines()[-1]) for child in children]
    return max(a["t"] for a in answers) - t0, answers[0]["devices"]


class Keepers:
    """N keeper processes, one per simulated host, each with JAX imported and waiting."""

    def __init__(self, n: int) -> None:
        self.processes = [subprocess.Popen([sys.executable, "-c", KEEPER, str(CHIPS)], stdin=subprocess.PIPE,
                                           stdout=subprocess.PIPE, text=True, env=clean_env(), cwd=ROOT)
                          for _ in range(n)]
        for keeper in self.processes:
            json.loads(keeper.stdout.readline())  # JAX imported

    def step(self) -> tuple[float, int]:
        """One step: every keeper forks its child at once; seconds until the last has its device count."""
        address, n = coordinator(), len(self.processes)
        t0 = time.time()
        for i, keeper in enumerate(self.processes):
            keeper.stdin.write(f"{address} {n} {i}\n")
            keeper.stdin.flush()
        answers = [json.loads(keeper.stdout.readline()) for keeper in self.processes]
        return max(a["t"] for a in answers) - t0, answers[0]["devices"]

    def rss_mib(self) -> float:
        import psutil

        return sum(psutil.Process(k.pid).memory_info().rss for k in self.processes) / 2**20

    def close(self) -> None:
        for keeper in self.processes:
            keeper.stdin.close()
            keeper.wait(timeout=30)


def main() -> None:
    args = parse_args(__doc__.split("\n")[0], default_reps=5,
                      extra=lambda p: p.add_argument("--steps", type=int, default=100,
                                                     help="single-host warm steps for the memory check"))
    report = Report(NAME, args)
    table = Table("From go to jax.device_count() on every process (median / p90 over n reps)",
                  ["processes (hosts)", "n", "cold: start + import + wire", "p90", "warm: fork + wire", "p90",
                   "cold ÷ warm", "devices seen"])
    for n in SIZES:
        keepers = Keepers(n)
        try:
            cold_s, warm_s, seen = Series(), Series(), set()
            for rep in range(args.reps + 1):  # the first of each is an unrecorded warm-up
                for series, run in ((cold_s, functools.partial(cold, n)), (warm_s, keepers.step)):  # interleaved
                    took, devices = run()
                    seen.add(devices)
                    if rep:
                        series.add(took)
            log(f"{n} processes: cold {fmt_s(cold_s.median())}, warm {fmt_s(warm_s.median())}")
            table.add(n, cold_s.n, fmt_s(cold_s.median()), fmt_s(cold_s.p90()), fmt_s(warm_s.median()),
                      fmt_s(warm_s.p90()), fmt_ratio(cold_s.median(), warm_s.median()),
                      ", ".join(map(str, sorted(seen))))
        finally:
            keepers.close()
    table.notes += [
        f"{CHIPS} CPU devices per process (`--xla_force_host_platform_device_count`), one JAX group over gloo, "
        "coordinator on 127.0.0.2; each rep runs cold then warm; one unrecorded warm-up rep per size",
        "warm: the keepers are started and have imported JAX before the clock starts (that is the pool's idle cost)",
    ]
    report.add(table)

    keepers = Keepers(1)
    try:
        before = keepers.rss_mib()
        for _ in range(args.steps):
            keepers.step()
        after = keepers.rss_mib()
    finally:
        keepers.close()
    memory = Table(f"Keeper memory over {args.steps} warm single-host steps", ["keeper RSS before", "after", "growth"])
    memory.add(f"{before:.1f} MiB", f"{after:.1f} MiB", f"{after - before:+.1f} MiB")
    report.add(memory)
    report.write()


if __name__ == "__main__":
    main()
