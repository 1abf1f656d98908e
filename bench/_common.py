"""Shared helpers for the benchmarks: a private local cluster, a driver, timing and tables.

Every benchmark starts its own simulated cluster (`rayslice.local.local_cluster`) under a private
`RAYSLICE_HOME`, and stops it by name at the end, also on error, Ctrl-C or SIGTERM; or, with
`--cluster NAME` (or `RAYSLICE_BENCH_CLUSTER`), runs on that already running local cluster of the
current `RAYSLICE_HOME` and leaves it running (a warm cluster, and no second one competing for the
cores).
Results are printed as a rich table and written as markdown to `bench/results/<name>.md`.

Every benchmark takes its command line (`parse_args`), its cluster (`cluster`, `driver`), its
statistics (`median`, `percentile`, `Series`, `stopwatch`) and its tables (`Table`, `Report`) from
here, so that two benchmarks' numbers mean the same thing and read the same way. The cluster side is
imported only when a cluster is started: a benchmark without one (`seed_steps_bare.py`, run with
another venv's Python that has only JAX) still uses the statistics and the tables.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import importlib.util
import math
import os
import platform
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
if str(ROOT) not in sys.path:  # `python bench/x.py` puts bench/ first, not the repo root
    sys.path.insert(0, str(ROOT))

if TYPE_CHECKING:
    from rayslice.local import local_cluster

# ---------------------------------------------------------------------------------------------
# command line


def parse_args(
    description: str, default_reps: int = 10, extra: Callable[[argparse.ArgumentParser], None] | None = None,
    *, reps: bool = True, attach: bool = True,
):
    """The options every benchmark shares, then its own (`extra`). Without `reps`, it runs each scenario
    once (no `--reps`); without `attach`, it always starts its own cluster (no `--cluster`)."""
    parser = argparse.ArgumentParser(description=description)
    if reps:
        parser.add_argument("--reps", type=int, default=default_reps,
                            help=f"repetitions per row (default {default_reps})")
    parser.add_argument("--no-write", action="store_true", help="print only; do not write bench/results/*.md")
    parser.add_argument(
        "--boost-startup",
        action="store_true",
        help="start the cluster's nodes at nice -10 (then back to 0): for a machine too loaded for Ray's "
        "start-up deadlines; nothing is measured at the raised priority",
    )
    if attach:
        parser.add_argument(
            "--cluster",
            default=os.environ.get("RAYSLICE_BENCH_CLUSTER"),
            help="run on this running local cluster (a name recorded under RAYSLICE_HOME) instead of starting a "
            "private one; it is left running (default: $RAYSLICE_BENCH_CLUSTER, else a private cluster)",
        )
    if extra:
        extra(parser)
    args = parser.parse_args()
    global BOOST_STARTUP, ATTACH
    BOOST_STARTUP = args.boost_startup
    ATTACH = getattr(args, "cluster", None)
    return args


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


# ---------------------------------------------------------------------------------------------
# the cluster


class _Terminated(BaseException):
    pass


_terminated = False


def _raise_terminated(signum, frame):  # noqa: ARG001
    global _terminated
    if _terminated:  # already on our way out: let the clean-up finish
        return
    _terminated = True
    raise _Terminated(f"signal {signum}")


#: `--boost-startup`: start the cluster's nodes at nice STARTUP_NICE, then set them back to 0.
BOOST_STARTUP = False
#: `--cluster NAME`: the running local cluster to use instead of a private one.
ATTACH: str | None = None
STARTUP_NICE = -10


def _one_node_at_a_time() -> None:
    """Start each node only once the previous one's dashboard agent is up (wraps `local_cluster._launch`).

    `local_cluster.up` starts the next node as soon as a raylet has claimed its socket name, so
    on two cores several nodes' Python agents start together and each can miss the raylet's
    15 s deadline for the agent's port file (then the raylet aborts). Waiting for the agent's
    `dashboard_agent_listen_port_*` file keeps them from competing with each other.
    """
    from rayslice.local import local_cluster, processes

    if getattr(local_cluster._launch, "_serial", False):
        return
    launch = local_cluster._launch

    def serial(args: list[str], env: dict[str, str], log_path: Path, sockets: Path | None = None,
               python: str = "") -> int:
        session = sockets.parent if sockets else Path(args[args.index("--temp-dir") + 1]) / "session_latest"
        before = len(list(session.glob("dashboard_agent_listen_port_*")))
        pid = launch(args, env, log_path, sockets, python)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and processes.alive(pid):
            if len(list(session.glob("dashboard_agent_listen_port_*"))) > before:
                break
            time.sleep(0.2)
        return pid

    serial._serial = True  # type: ignore[attr-defined]
    local_cluster._launch = serial


@contextlib.contextmanager
def _startup_priority() -> Iterator[None]:
    """With BOOST_STARTUP, start nodes at a higher CPU priority (they inherit it from us).

    On a machine loaded by other work a node's start-up can miss Ray's hard-coded deadlines
    (15 s for the dashboard agent's port file, 30 s to register with the GCS) and abort.
    Nothing is measured at that priority: `_renice_cluster` puts every thread back to 0.
    """
    if not BOOST_STARTUP:
        yield
        return
    before = os.getpriority(os.PRIO_PROCESS, 0)
    try:
        os.setpriority(os.PRIO_PROCESS, 0, STARTUP_NICE)
    except PermissionError:
        yield
        return
    try:
        yield
    finally:
        os.setpriority(os.PRIO_PROCESS, 0, before)


def _renice_cluster(record: local_cluster.ClusterRecord) -> None:
    if not BOOST_STARTUP:
        return
    from rayslice.local import local_cluster

    for pid in local_cluster.owned_pids(record):
        with contextlib.suppress(OSError):
            for task in Path(f"/proc/{pid}/task").iterdir():  # nice is per thread on Linux
                with contextlib.suppress(OSError):
                    if os.getpriority(os.PRIO_PROCESS, int(task.name)) < 0:
                        os.setpriority(os.PRIO_PROCESS, int(task.name), 0)


@contextlib.contextmanager
def cluster(
    spec: local_cluster.ClusterSpec | None, name: str, attempts: int = 3, private: bool = False,
    up: Callable[[str], local_cluster.ClusterRecord] | None = None,
) -> Iterator[local_cluster.ClusterRecord]:
    """Start a private simulated cluster; always stop it by name (also on error or SIGTERM).

    With `--cluster NAME` (and not `private`), yield that running cluster instead and leave it
    running: it must hold the slices of `spec` (checked by the caller) and is not stopped here.
    `up(name)` starts another kind of local cluster under the same private home and clean-up (the
    autoscaling one, `local_autoscaler.up`); by default `local_cluster.up(spec)`.
    """
    from rayslice.local import local_cluster

    if ATTACH and not private:
        with _attached(ATTACH) as record:
            yield record
        return
    if up is None:
        assert spec is not None, "a cluster needs its spec, or how to start it (up)"

        def up(name: str) -> local_cluster.ClusterRecord:
            return local_cluster.up(spec, name=name, timeout=600)
    home = tempfile.mkdtemp(prefix="rayslice-bench-")
    ray_keys = local_cluster.ClusterRecord("", "", "", "").ray_env()
    saved_env = {k: os.environ.get(k) for k in ("RAYSLICE_HOME", *ray_keys)}
    os.environ["RAYSLICE_HOME"] = home
    name = f"{name}-{os.getpid()}"
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    started = time.monotonic()
    log(f"starting cluster {name}: " + (f"tpus={spec.tpus} gpus={spec.gpus}" if spec else "(its own start)"))
    _one_node_at_a_time()
    base = name
    for attempt in range(1, attempts + 1):
        name = base if attempt == 1 else f"{base}-retry{attempt}"
        try:
            with _startup_priority():
                record = up(name)
            _renice_cluster(record)
            break
        except Exception as exc:
            if _terminated:  # a SIGTERM interrupted `up` and its clean-up raised something else
                signal.signal(signal.SIGTERM, previous)
                subprocess.run(["rm", "-rf", home], check=False)
                raise
            # Under heavy load a raylet can abort at start-up: Ray waits at most 15 s (hard-coded)
            # for its dashboard agent's port file. `up` has already stopped what it started.
            log(f"cluster {name} failed to start (attempt {attempt}/{attempts}): {exc}")
            log_file = local_cluster.state_dir() / f"{name}.log"
            if log_file.exists() and attempt == attempts:
                print("".join(log_file.read_text().splitlines(keepends=True)[-40:]), file=sys.stderr)
            if attempt == attempts:
                signal.signal(signal.SIGTERM, previous)
                subprocess.run(["rm", "-rf", home], check=False)
                raise
        except BaseException:
            signal.signal(signal.SIGTERM, previous)
            subprocess.run(["rm", "-rf", home], check=False)
            raise
    log(f"cluster {name} up in {time.monotonic() - started:.0f} s ({len(record.nodes)} nodes)")
    try:
        for key, value in record.ray_env().items():
            os.environ[key] = value
        yield record
    finally:
        log(f"stopping cluster {name}")
        try:
            local_cluster.down(name)
        finally:
            signal.signal(signal.SIGTERM, previous)
            subprocess.run(["rm", "-rf", home], check=False)
            for key, value in saved_env.items():  # e.g. back to the attached cluster's RAYSLICE_HOME
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value


@contextlib.contextmanager
def _attached(name: str) -> Iterator[local_cluster.ClusterRecord]:
    from rayslice.local import local_cluster

    record = local_cluster.ClusterRecord.load(name)
    alive = len(local_cluster.alive_nodes(record.dashboard_url, record.token))
    log(f"using the running cluster {name!r} ({record.dashboard_url}, {alive} nodes alive); it is left running")
    previous = signal.signal(signal.SIGTERM, _raise_terminated)  # so a timeout still ends our driver cleanly
    try:
        for key, value in record.ray_env().items():
            os.environ[key] = value
        yield record
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def driver(record: local_cluster.ClusterRecord) -> Iterator[Any]:
    """This process as one long-lived Ray driver on the cluster."""
    import ray  # noqa: TID253

    ray.init(address=record.gcs_address, logging_level="ERROR", log_to_driver=False)
    try:
        yield ray
    finally:
        ray.shutdown()


def total_tpu_chips(ray: Any) -> float:
    return ray.cluster_resources().get("TPU", 0.0)


def wait_all_free(ray: Any, timeout: float = 30.0) -> bool:
    """Wait until every TPU chip of the cluster is available again (between repetitions)."""
    total = total_tpu_chips(ray)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ray.available_resources().get("TPU", 0.0) >= total:
            return True
        time.sleep(0.05)
    return False


def warm_up_workers(ray: Any, rounds: int = 2) -> None:
    """Run a trivial task on every node a few times, so 'warm cluster' means started workers."""

    @ray.remote(num_cpus=0)
    def noop():
        return os.getpid()

    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    for _ in range(rounds):
        refs = [
            noop.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node["NodeID"], soft=False)).remote()
            for node in ray.nodes()
            if node["Alive"]
        ]
        ray.get(refs)


# ---------------------------------------------------------------------------------------------
# polling the release of resources


class ReleaseWatcher:
    """Polls, in a thread, the free TPU chips and the GCS node status of the cluster's TPU hosts.

    `when_free(after)`: the first poll at or after `after` at which every TPU chip of the cluster
    was available, counted only once the chips were seen in use during this watch (a stale
    view from before the step cannot count as a release). `when_idle(after, since, nodes)`: the
    first poll at or after `after` at which every host in `nodes` (default: those given at
    construction) was IDLE in the GCS's cluster resource state (what Ray's autoscaler reads to
    scale down) *and* had been idle only since `since` or later (its `idle_duration_ms`), i.e.
    became idle after the step began. Every TPU host is polled, so the hosts a step landed on
    can be named after it ran (a cluster with two slices of one type).
    """

    def __init__(self, ray: Any, node_ids: Sequence[str] = (), interval: float = 0.01) -> None:
        from ray.autoscaler.v2.sdk import get_cluster_resource_state
        from ray.core.generated.autoscaler_pb2 import NodeStatus

        self._ray = ray
        self._state = get_cluster_resource_state
        self._idle = NodeStatus.IDLE
        self._gcs = ray._private.worker.global_worker.gcs_client
        self._total = total_tpu_chips(ray)
        self._nodes = set(node_ids)
        self._tpu_nodes = {n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get("TPU")}
        self._interval = interval
        # (time, all chips free, {TPU host: "idle since" time, or None when not IDLE})
        self.samples: list[tuple[float, bool, dict[str, float | None]]] = []
        self.activity: dict[str, list[str]] = {}  # last reported activity of non-idle hosts
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> ReleaseWatcher:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            free = self._ray.available_resources().get("TPU", 0.0) >= self._total
            now = time.time()
            idle: dict[str, float | None] = {}
            for node in self._state(self._gcs).node_states:
                node_id = node.node_id.hex()
                if node_id not in self._tpu_nodes:
                    continue
                if node.status == self._idle:
                    idle[node_id] = now - node.idle_duration_ms / 1000
                else:
                    idle[node_id] = None
                    self.activity[node_id] = list(node.node_activity)
            self.samples.append((now, free, idle))
            self._stop.wait(self._interval)

    def when_free(self, after: float) -> float | None:
        seen_busy = False
        for t, free, _ in list(self.samples):
            if not free:
                seen_busy = True
            elif t >= after and seen_busy:
                return t
        return None

    def when_idle(self, after: float, since: float, nodes: Sequence[str] | None = None) -> float | None:
        wanted = set(nodes) if nodes is not None else self._nodes
        for t, _, idle in list(self.samples):
            if t >= after and all((idle.get(n) or -math.inf) >= since for n in wanted):
                return t
        return None

    def activity_of(self, nodes: Sequence[str]) -> set[str]:
        return {a for n in nodes for a in self.activity.get(n, [])}

    def poll_interval(self) -> float:
        """Median time between two polls (the resolution of when_free / when_idle)."""
        times = [s[0] for s in list(self.samples)]
        return median([b - a for a, b in zip(times, times[1:], strict=False)]) if len(times) > 1 else math.nan

    def wait(
        self, after: float, since: float, timeout: float, nodes: Sequence[str] | None = None
    ) -> tuple[float | None, float | None]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            free, idle = self.when_free(after), self.when_idle(after, since, nodes)
            if free is not None and idle is not None:
                return free, idle
            time.sleep(0.02)
        return self.when_free(after), self.when_idle(after, since, nodes)


def slice_node_ids(ray: Any, slice_names: Sequence[str]) -> list[str]:
    return [
        node["NodeID"]
        for node in ray.nodes()
        if node["Alive"] and node.get("Labels", {}).get("ray.io/tpu-slice-name") in set(slice_names)
    ]


# ---------------------------------------------------------------------------------------------
# statistics and tables


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), q in [0, 100]."""
    data = sorted(values)
    if not data:
        return math.nan
    pos = (len(data) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    if data[lo] == data[hi] or pos == lo:  # also keeps inf (a run that never finished) from turning into nan
        return data[lo]
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


def median(values: Sequence[float]) -> float:
    return percentile(values, 50)


@dataclass
class Series:
    """Measurements of one metric for one row; `None` entries are 'did not happen within the cap'."""

    values: list[float | None] = field(default_factory=list)

    def add(self, value: float | None) -> None:
        self.values.append(value)

    @property
    def done(self) -> list[float]:
        return [v for v in self.values if v is not None]

    @property
    def n(self) -> int:
        return len(self.values)

    @property
    def misses(self) -> int:
        return self.n - len(self.done)

    def median(self) -> float | None:
        # With misses, the median is only known if more than half the runs finished.
        if not self.values or self.misses * 2 >= self.n:
            return None
        return median([v if v is not None else math.inf for v in self.values])

    def p90(self) -> float | None:
        if not self.values:
            return None
        value = percentile([v if v is not None else math.inf for v in self.values], 90)
        return None if math.isinf(value) else value


def fmt_s(value: float | None, cap: str = "n/a") -> str:
    if value is None:
        return cap
    if value < 1:
        return f"{value * 1000:.0f} ms"
    return f"{value:.2f} s"


def fmt_ratio(value: float | None, base: float | None, cap: float | None = None) -> str:
    """`value` ÷ `base`. With `cap` (what every measurement was capped at), a base that never got there
    (None) reads as an upper bound: "< value / cap ×"."""
    if value is None:
        return "n/a"
    if base is None and cap:
        return f"< {value / cap:.2f}×"
    if base is None or base <= 0:
        return "n/a"
    return f"{value / base:.2f}×"


@dataclass
class Table:
    title: str
    columns: list[str]
    rows: list[list[str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def add(self, *cells: Any) -> None:
        self.rows.append([str(c) for c in cells])

    def section(self, label: str) -> None:
        self.rows.append([f"**{label}**", *[""] * (len(self.columns) - 1)])

    def render(self) -> None:
        try:
            from rich.console import Console
            from rich.table import Table as RichTable
        except ImportError:  # another venv's Python (seed_steps_bare.py): the markdown itself
            print(self.markdown(), flush=True)
            return

        table = RichTable(title=self.title, show_lines=False)
        for i, column in enumerate(self.columns):
            table.add_column(column, justify="left" if i == 0 else "right")
        for row in self.rows:
            table.add_row(*[c.replace("**", "") for c in row])
        console = Console(width=200)
        console.print(table)
        for note in self.notes:
            console.print(f"  - {note}", highlight=False)

    def markdown(self) -> str:
        lines = [
            "| " + " | ".join(self.columns) + " |",
            "|" + "|".join(["---"] + ["---:"] * (len(self.columns) - 1)) + "|",
        ]
        lines += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in self.rows]
        text = f"**{self.title}**\n\n" + "\n".join(lines) + "\n"
        if self.notes:
            text += "\n" + "\n".join(f"- {note}" for note in self.notes) + "\n"
        return text


def loadavg() -> str:
    one, five, fifteen = os.getloadavg()
    return f"{one:.2f}, {five:.2f}, {fifteen:.2f}"


def machine() -> str:
    import jax  # noqa: TID253

    try:
        import ray  # noqa: TID253
    except ImportError:  # another venv's Python, with JAX only (seed_steps_bare.py)
        ray = None

    model = "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    # Without cached bytecode every Ray worker and JAX process compiles ray and jax from source:
    # about twice the CPU per process start (scripts/bootstrap compiles it).
    compiled = all(Path(importlib.util.cache_from_source(m.__file__)).exists() for m in (jax, ray) if m)
    return (
        f"{os.cpu_count()} CPUs ({model}), {mem_gib:.1f} GiB RAM, Python {platform.python_version()}, "
        f"Ray {ray.__version__ if ray else 'not installed'}, JAX {jax.__version__}, "
        f"{'venv bytecode compiled' if compiled else 'venv bytecode NOT compiled'}"
    )


class Report:
    """Collects tables for one benchmark, prints them, and writes bench/results/<name>.md."""

    def __init__(self, name: str, args: argparse.Namespace) -> None:
        self.name = name
        self.args = args
        self.started = dt.datetime.now().astimezone()
        self.load_start = loadavg()
        self.tables: list[Table] = []
        self.text: list[str] = []

    def add(self, table: Table) -> None:
        self.tables.append(table)
        table.render()

    def note(self, text: str) -> None:
        self.text.append(text)
        print(text, flush=True)

    def write(self) -> Path | None:
        finished = dt.datetime.now().astimezone()
        command = ".venv/bin/python " + shlex.join([f"bench/{Path(sys.argv[0]).name}", *sys.argv[1:]])
        if ATTACH and "RAYSLICE_HOME" in os.environ:
            command = f"RAYSLICE_HOME={os.environ['RAYSLICE_HOME']} {command}"
        header = [
            f"# {self.name}",
            "",
            f"- command: `{command}`",
            f"- commit: {commit()}",
            f"- date: {self.started:%Y-%m-%d %H:%M %Z} ({(finished - self.started).total_seconds():.0f} s)",
            f"- machine: {machine()}",
            f"- load average (1, 5, 15 min): {self.load_start} at start, {loadavg()} at end",
            "",
        ]
        body = "\n".join(header + self.text + [""] + [t.markdown() for t in self.tables])
        if self.args.no_write:
            return None
        RESULTS.mkdir(parents=True, exist_ok=True)
        path = RESULTS / f"{self.name}.md"
        path.write_text(body)
        log(f"wrote {path.relative_to(ROOT)}")
        return path


def commit() -> str:
    """The commit measured, and whether the working tree differed from it."""
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True,
                           text=True)
    name = head.stdout.strip() or "unknown"
    return f"{name} (with uncommitted changes)" if dirty.stdout.strip() else name


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Silence the launcher's progress lines (`[rayslice] ...`) during a measurement."""
    with open(os.devnull, "w") as devnull, contextlib.redirect_stdout(devnull):
        yield


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    start = time.time()
    result = fn()
    return time.time() - start, result


@dataclass
class Lap:
    """A block's wall time, once it ended (`s`)."""

    s: float = math.nan


@contextlib.contextmanager
def stopwatch() -> Iterator[Lap]:
    """Wall time of a block, on the monotonic high-resolution clock: `with stopwatch() as took: ...`, then `took.s`.

    One clock for every benchmark's durations (`time.perf_counter`); `timed` is for epoch
    times compared with other processes' `time.time()`.
    """
    lap = Lap()
    start = time.perf_counter()
    try:
        yield lap
    finally:
        lap.s = time.perf_counter() - start
