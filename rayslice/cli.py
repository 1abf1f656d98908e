"""The `rayslice` command: a local simulated cluster, the Airflow UI over it, capacity, the demo, KubeRay manifests."""

from __future__ import annotations

import contextlib
import json
import logging
import shlex
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from rayslice.core.exceptions import RaysliceError
from rayslice.local import local_cluster

app = typer.Typer(help="Run accelerator steps of Airflow pipelines on Ray.", no_args_is_help=True)
local = typer.Typer(help="A local Ray cluster whose nodes look like TPU hosts and GPU machines.", no_args_is_help=True)
app.add_typer(local, name="local")
airflow = typer.Typer(help="A real Airflow 3 UI on this machine, over the local simulated cluster.",
                      no_args_is_help=True)
app.add_typer(airflow, name="airflow")
console = Console()


def _flags_without_placeholders() -> None:
    """On/off flags take no value, so their help shows none.

    Typer's help prints each option's type, ``<bool>`` for flags too (``--token <bool>``, even
    ``--help <bool>``), which reads as if the flag wanted a value. Its help has no setting for this.
    """
    from typer.core import TyperOption

    shown = TyperOption.display_type_rich
    if getattr(shown, "rayslice", False):
        return

    def display_type_rich(self: TyperOption, ctx: object) -> str | None:
        return None if self.is_flag else shown(self, ctx)

    display_type_rich.rayslice = True  # type: ignore[attr-defined]
    TyperOption.display_type_rich = display_type_rich  # type: ignore[method-assign]


_flags_without_placeholders()


def _kuberay() -> None:
    try:
        from rayslice.cloud.kuberay_cli import app as kuberay_app
    except ImportError:  # pragma: no cover - module is part of the package
        return
    app.add_typer(kuberay_app, name="kuberay")


_kuberay()

Name = Annotated[str, typer.Option("--name", help="Which local cluster (several can coexist).")]
Address = Annotated[str | None, typer.Option(
    "--address", help="The Ray dashboard URL, e.g. http://head:8265 (default: the local cluster --name).")]
Token = Annotated[str | None, typer.Option(
    "--token", envvar="RAYSLICE_RAY_TOKEN", help="The Ray auth token of a cluster with RAY_AUTH_MODE=token.")]
ConnId = Annotated[str | None, typer.Option(
    "--conn-id", help="Read the dashboard URL, token and headers from this Airflow `ray` connection.")]


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import version

        typer.echo(f"rayslice {version('rayslice')}")
        raise typer.Exit()


@app.callback()
def _main(
    version: Annotated[bool, typer.Option("--version", is_eager=True, callback=_version,
                                          help="Print rayslice's version and exit.")] = False,
) -> None:
    """Run accelerator steps of Airflow pipelines on Ray."""


def fail(message: str) -> typer.Exit:
    """Print ``message`` as the CLI's error (no traceback) and return the exit to raise."""
    console.print(f"[red]error:[/red] {message}", highlight=False)
    return typer.Exit(1)


@dataclass(frozen=True)
class Target:
    """The cluster a command talks to, and which flag named it (for error messages)."""

    url: str
    token: str | None
    flag: str
    headers: dict[str, str] | None = None
    verify: bool | str = True
    deployment: str | None = None  # the connection's `deployment` extra, with --conn-id


def target(address: str | None, token: str | None, conn_id: str | None, name: str) -> Target:
    """Resolve --address / --conn-id / --name (the local cluster) into a dashboard URL and token."""
    if address and conn_id:
        raise fail("give --address or --conn-id, not both")
    if conn_id:
        try:
            from rayslice.hooks.ray import RayHook
        except ImportError:
            raise fail("--conn-id reads an Airflow connection: install rayslice[airflow], or use --address") from None
        try:
            settings = RayHook(conn_id).settings()
        except Exception as exc:  # noqa: BLE001 - Airflow raises its own types for a missing connection
            raise fail(f"--conn-id {conn_id!r}: {exc}") from None
        return Target(settings.dashboard_url, token or settings.token, f"--conn-id {conn_id}",
                      dict(settings.headers), settings.verify, settings.deployment)
    if address:
        # The connection's URL rules, from the client side: --address needs no Airflow.
        from rayslice.client.urls import dashboard_url

        try:
            return Target(dashboard_url(address, what="--address", hint="give the Ray dashboard URL, e.g. "
                                        "--address http://127.0.0.1:8265"), token, "--address")
        except RaysliceError as exc:
            raise fail(str(exc)) from None
    try:
        record = local_cluster.ClusterRecord.load(name)
    except RaysliceError as exc:
        raise fail(f"{exc}: start it (`rayslice local up`), or point at a cluster with --address or --conn-id") \
            from None
    return Target(record.dashboard_url, token or record.token, f"--name {name} (the local cluster)")


@contextlib.contextmanager
def json_only_on_stdout(as_json: bool) -> Iterator[None]:
    """With --json, stdout carries the JSON alone: log lines (the Jobs client's retry warnings, which Airflow's
    logging setup, loaded with --conn-id, prints to stdout) go to stderr meanwhile."""
    moved = [h for h in logging.getLogger().handlers
             if as_json and isinstance(h, logging.StreamHandler) and getattr(h, "stream", None) is sys.stdout]
    for handler in moved:
        handler.setStream(sys.stderr)
    try:
        yield
    finally:
        for handler in moved:
            handler.setStream(sys.stdout)


def cluster_set_sources(conn_id: str | None, address: str | None) -> tuple[str, list] | None:
    """With --conn-id naming a cluster set (the extra `clusters`): the set's name and one source per member,
    each from its own connection (a member whose connection fails keeps why); None for any other target.

    The members' tokens are their own connections' (--token names one cluster's)."""
    if not conn_id or address:
        return None
    try:
        from rayslice.hooks.ray import RayHook, cluster_set_of
    except ImportError:
        return None  # `target` says what is missing
    try:  # not `RayHook.cluster_set()`, which refuses the whole set for one missing member
        clusters = cluster_set_of(RayHook(conn_id).get_connection(conn_id))
    except Exception as exc:  # noqa: BLE001 - Airflow raises its own types for a missing connection
        raise fail(f"--conn-id {conn_id!r}: {exc}") from None
    if clusters is None:
        return None
    from rayslice.client.set_capacity import Source

    sources = []
    for member in clusters.members:
        try:
            settings = RayHook(member).settings()
        except Exception as exc:  # noqa: BLE001 - a missing or broken member connection is that member's line
            sources.append(Source(member, problem=f"its connection: {exc}"))
            continue
        sources.append(Source(member, settings.dashboard_url, settings.token, settings.verify, dict(settings.headers),
                              launcher=settings.launcher))
    return clusters.name, sources


def in_flag_words(message: str, where: Target) -> str:
    """A client error in the command's words: the clients speak of the `ray` connection's fields, which
    only --conn-id used; with --address or --name the host and token came from flags."""
    if where.flag.startswith("--conn-id"):
        return message
    return (message.replace("set the `ray` connection's password to the cluster's token",
                            "give the cluster's token with --token (or RAYSLICE_RAY_TOKEN)")
            .replace("the `ray` connection's host", where.flag.split(" (")[0]))


def unreachable(where: Target, exc: Exception) -> typer.Exit:
    message = in_flag_words(str(exc), where)
    if where.flag not in message:
        message += f"\n(the cluster was named by {where.flag}: check that flag, and that the cluster is up)"
    return fail(message)


@local.command("up")
def local_up(
    tpu: Annotated[list[str], typer.Option("--tpu", help="A slice by pod type, e.g. v6e-16; repeat for more.")] = [],  # noqa: B006
    gpus: Annotated[int, typer.Option("--gpus", min=0, help="Logical GPUs on one GPU node (0 for none).")] = 0,
    token: Annotated[bool, typer.Option("--token", help="Turn on Ray token authentication.")] = False,
    name: Name = "default",
    python: Annotated[str | None, typer.Option(
        "--python", help="The nodes' Python (e.g. a venv with only rayslice[cluster]); default: this one.")] = None,
) -> None:
    """Start the cluster; prints its dashboard URL (the `ray` connection's host)."""
    spec = local_cluster.ClusterSpec(tpus=tuple(tpu), gpus=gpus)
    with console.status(f"starting {1 + sum(r.hosts_per_slice for _, r in spec.slices()) + bool(gpus)} Ray nodes"):
        record = local_cluster.up(spec, name=name, token=local_cluster.new_token() if token else None, python=python)
    console.print(f"dashboard: [bold]{record.dashboard_url}[/bold]")
    console.print(f"gcs:       {record.gcs_address}")
    console.print(f"checkpoints: {record.checkpoint_root}")
    if record.token:
        console.print(f"token:     stored in {record.path} (mode 600)")
    flag = "" if name == "default" else f" --name {name}"
    console.print(f'drivers:   eval "$(rayslice local env{flag})"   # RAY_ADDRESS, auth mode, ray_default connection')


@local.command("env")
def local_env(name: Name = "default") -> None:
    """Print `export` lines that point ray.init(), the examples and Airflow's ray_default at the cluster."""
    record = local_cluster.ClusterRecord.load(name)
    for key, value in record.driver_env().items():
        typer.echo(f"export {key}={shlex.quote(value)}")


@local.command("down")
def local_down(name: Name = "default") -> None:
    """Stop exactly the processes `up` started (by PID); other Ray clusters are untouched."""
    if not (local_cluster.state_dir() / f"{name}.json").exists():
        console.print(f"no local cluster {name!r} is running: nothing to stop")
        return
    stopped = local_cluster.down(name)
    console.print(f"stopped cluster {name!r} ({stopped} processes)")


def _seconds(text: str) -> float:
    """`30s`, `2m`, `45` (seconds): the CLI's durations."""
    value = text.strip().lower()
    scale = 60.0 if value.endswith("m") else 1.0
    try:
        seconds = float(value.rstrip("sm")) * scale
    except ValueError:
        raise typer.BadParameter(f"{text!r} is not a duration: give seconds like 30s or 45, or minutes like 2m") \
            from None
    if seconds < 0:
        raise typer.BadParameter(f"{text!r} is negative: give 0s or more")
    return seconds


@local.command("preempt")
def local_preempt(
    slice_name: Annotated[str, typer.Argument(metavar="SLICE", help="The slice, e.g. v6e-16-a.")],
    within: Annotated[str, typer.Option("--in", help="The notice's deadline from now, e.g. 30s or 2m.")] = "30s",
    worker: Annotated[list[int], typer.Option("--worker", help="Only this host of the slice; repeat for more.")] = [],  # noqa: B006
    no_kill: Annotated[bool, typer.Option("--no-kill",
                                          help="Only send the notice; kill nothing at the deadline.")] = False,
    name: Name = "default",
) -> None:
    """Preempt a slice as a platform would: a preemption notice (Ray drains its nodes), then its hosts killed."""
    seconds = _seconds(within)
    try:
        record = local_cluster.ClusterRecord.load(name)
        if no_kill:
            nodes = local_cluster.slice_nodes(record, slice_name, worker or None)
            local_cluster.drain(record, list(nodes.values()), seconds)
            console.print(f"notice sent: {len(nodes)} host(s) of {slice_name} drain with a {seconds:.0f} s deadline")
            return
        console.print(f"notice sent to {slice_name}: its hosts are killed in {seconds:.0f} s")
        nodes = local_cluster.preempt(record, slice_name, seconds, worker or None)
    except RaysliceError as exc:
        raise fail(str(exc)) from None
    console.print(f"preempted {slice_name}: {len(nodes)} host node(s) killed")


@local.command("status")
def local_status(name: Name = "default") -> None:
    """Say whether the local cluster runs: its dashboard URL and how many of its processes are alive."""
    try:
        record = local_cluster.ClusterRecord.load(name)
    except RaysliceError:
        console.print(f"no local cluster {name!r} is running")
        raise typer.Exit(1) from None
    alive = len(local_cluster.owned_pids(record))
    console.print(f"{name}: {record.dashboard_url} ({len(record.nodes)} nodes recorded, {alive} processes alive)")


UiName = Annotated[str, typer.Option("--name", help="Which local Airflow (several can coexist).")]


@airflow.command("up")
def airflow_up(
    name: UiName = "default",
    cluster: Annotated[str, typer.Option("--cluster", help="The local cluster to use; started if it is not up.")]
    = "default",
    port: Annotated[int, typer.Option("--port", min=0, max=65535, help="The UI's port (0: any free port).")] = 8080,
    adopt_cluster: Annotated[bool, typer.Option("--adopt-cluster", hidden=True,
                                                help="`down` also stops a reused cluster.")] = False,
    dags: Annotated[Path | None, typer.Option(
        "--dags", "--dags-folder", exists=True, file_okay=False, resolve_path=True,
        help="Your own DAG folder to serve (default: rayslice's example DAGs).")] = None,
    examples: Annotated[bool | None, typer.Option(
        "--examples/--no-examples", help="Serve the example DAGs too (default: only without --dags).")] = None,
    team_connection: Annotated[list[str] | None, typer.Option(
        "--team-connection", metavar="CONN_ID=TEAM",
        help="One more `ray` connection to the cluster whose steps count against TEAM's quota "
             "(e.g. ray_research=research); repeat it for several teams.")] = None,
    cluster_set: Annotated[list[str] | None, typer.Option(
        "--cluster-set", metavar="CONN_ID=A,B",
        help="A cluster set over local clusters already up (`rayslice local up --name A`), in order of "
             "preference: connection CONN_ID, and ray_A, ray_B for each cluster (docs/cluster-sets.md).")] = None,
) -> None:
    """Start Airflow (api-server, scheduler, dag-processor, triggerer) on your DAGs or the examples; print the login."""
    from rayslice.local import airflow_ui

    teams = {}
    for item in team_connection or []:
        conn_id, sep, team = item.partition("=")
        if not sep or not conn_id or not team:
            raise fail(f"--team-connection {item!r}: give CONN_ID=TEAM, e.g. ray_research=research")
        teams[conn_id] = team
    sets = {}
    for item in cluster_set or []:
        conn_id, sep, names = item.partition("=")
        if not sep or not conn_id or not names:
            raise fail(f"--cluster-set {item!r}: give CONN_ID=A,B (local cluster names), e.g. tpus=a,b")
        sets[conn_id] = names.split(",")
    try:
        record, already = airflow_ui.up(name, cluster=cluster, port=port, adopt_cluster=adopt_cluster,
                                        dags_folder=dags, examples=examples if examples is not None else dags is None,
                                        team_connections=teams, cluster_sets=sets,
                                        emit=lambda line: console.print(f"[dim]{line}[/dim]"))
    except RaysliceError as exc:
        if "--team-connection" in str(exc) or "--cluster-set" in str(exc):
            raise fail(str(exc)) from None
        raise
    if already:
        console.print(f"Airflow {name!r} is already up.")
    console.print(airflow_ui.describe(record), highlight=False)
    console.print(f"stop it with: rayslice airflow down{'' if name == 'default' else f' --name {name}'}",
                  highlight=False)


@airflow.command("down")
def airflow_down(name: UiName = "default") -> None:
    """Stop exactly what `up` started (by PID): Airflow, and the local cluster if `up` started it."""
    from rayslice.local import airflow_ui

    record = airflow_ui.UiRecord.load(name)
    if record is None:
        console.print(f"no Airflow {name!r} is running: nothing to stop")
        return
    stopped = airflow_ui.down(name)
    cluster = f" and the local cluster {record.cluster!r}" if record and record.started_cluster else ""
    console.print(f"stopped Airflow {name!r} ({stopped} processes){cluster}")


@airflow.command("status")
def airflow_status(name: UiName = "default") -> None:
    """Say whether the local Airflow runs and is healthy, with its URL and login."""
    from rayslice.local import airflow_ui

    record = airflow_ui.UiRecord.load(name)
    if record is None:
        console.print(f"Airflow {name!r} is not up")
        raise typer.Exit(1)
    alive = len(airflow_ui.processes(record))
    state = "healthy" if alive and airflow_ui.healthy(record) else "not healthy"
    console.print(f"{name}: {state}, {alive} processes\n{airflow_ui.describe(record)}", highlight=False)


@app.command()
def capacity(
    address: Address = None,
    token: Token = None,
    conn_id: ConnId = None,
    name: Name = "default",
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
) -> None:
    """Every TPU slice (free/busy, who holds it) and GPU node (free share); of a cluster set, each member's and
    the queue across them."""
    from rayslice.client import capacity as cap

    if (found := cluster_set_sources(conn_id, address)) is not None:
        from rayslice.client import set_capacity

        with json_only_on_stdout(as_json):
            joined = set_capacity.read(*found)
        if as_json:
            console.print_json(json.dumps(joined.model_dump(mode="json")))
        else:
            console.print(set_capacity.render(joined))
        return
    where = target(address, token, conn_id, name)
    try:
        with json_only_on_stdout(as_json):
            snapshot = cap.snapshot(where.url, token=where.token, headers=where.headers, verify=where.verify)
    except RaysliceError as exc:
        raise unreachable(where, exc) from None
    if as_json:
        console.print_json(json.dumps(snapshot.model_dump(mode="json")))
    else:
        console.print(cap.render(snapshot))


@app.command("usage")
def usage_(
    address: Address = None,
    token: Token = None,
    conn_id: ConnId = None,
    name: Name = "default",
    hours: Annotated[float, typer.Option("--hours", min=0.01, max=24 * 90,
                                         help="The window: the last HOURS hours (steps overlapping it).")] = 24.0,
    dag_id: Annotated[str | None, typer.Option("--dag", help="Only this DAG's steps.")] = None,
    task_id: Annotated[str | None, typer.Option("--task", help="Only this task's steps (with --dag: of that DAG).")
                       ] = None,
    team: Annotated[str | None, typer.Option("--team", help="Only this team's steps (and its sub-teams').")] = None,
    per: Annotated[str, typer.Option("--per", help="Rows per 'task' or per 'dag'.")] = "task",
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
) -> None:
    """Chip-hours and goodput per DAG or task over the last hours: where every chip-hour went (docs/goodput.md).

    With --conn-id of a cluster set, every member is read and joined: each row says on which clusters its
    attempts held capacity (a member's job that stood by holds none and counts for nothing)."""
    from rayslice.client import usage

    if per not in ("task", "dag"):
        raise fail(f"--per {per!r}: use --per task or --per dag")
    found_set = cluster_set_sources(conn_id, address)
    members = None if found_set is None else [source.name for source in found_set[1]]
    if found_set is None:
        where = target(address, token, conn_id, name)
        read = lambda: usage.usage(where.url, token=where.token, headers=where.headers,  # noqa: E731
                                   verify=where.verify, hours=hours)
    else:  # each member's own connection: its URL, token and headers (one that does not resolve is left out)
        where = Target("", None, f"--conn-id {conn_id} (the cluster set of {', '.join(members or ())})")

        def member_usage(source) -> usage.Usage:
            if source.problem:
                raise RaysliceError(source.problem)
            return usage.usage(source.dashboard_url, token=source.token, headers=source.headers,
                               verify=source.verify, hours=hours)

        read = lambda: usage.usage_of_set(  # noqa: E731
            {source.name: (lambda source=source: member_usage(source)) for source in found_set[1]})
    try:
        found = read()
    except RaysliceError as exc:
        raise unreachable(where, exc) from None
    for member, why in found.unread.items() if not as_json else ():
        console.print(f"[yellow]cluster {member} of the set left out:[/yellow] {why}", highlight=False)
    bars = usage.select(found, dag_id=dag_id, task_id=task_id, team=team)
    by_dag, by_task = usage.totals(bars, found.goodput, found.attempts)
    rows = by_task if per == "task" else by_dag
    if as_json:
        console.print_json(json.dumps({"since": found.since.isoformat(), "until": found.until.isoformat(),
                                       "rows": [row.model_dump(mode="json") for row in rows],
                                       **({"clusters": list(members), "unread": found.unread} if members else {})}))
        return
    chosen = ", ".join(f"{flag} {value}" for flag, value in (("--dag", dag_id), ("--task", task_id),
                                                             ("--team", team)) if value)
    console.print(usage.render(rows, title=f"last {hours:g} h, {found.since:%Y-%m-%d %H:%M} to "
                                           f"{found.until:%H:%M} UTC" + (f" ({chosen})" if chosen else "")))
    if not rows:
        console.print("no steps in that window" + (f" for {chosen}" if chosen else ""), highlight=False)


@app.command("queue")
def queue_(
    address: Address = None,
    token: Token = None,
    conn_id: ConnId = None,
    name: Name = "default",
    installed: Annotated[bool, typer.Option("--installed", help="The cluster's image has this rayslice: "
                                            "upload nothing (the connection's `launcher: installed`).")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
    set_: Annotated[str | None, typer.Option(
        "--set", help="The cluster operator's queue policy and quotas, as JSON, e.g. "
                      "'{\"policy\": \"strict\", \"quotas\": {\"research\": {\"v6e-16\": 32}}}'. "
                      "Needs the cluster's token; kept until set again (over RAYSLICE_QUEUE on the head).")] = None,
) -> None:
    """The cluster's admission queue in order: rank, state, priority, team, time waited, what each waits for."""
    from rayslice.client.jobs_client import RayJobsClient
    from rayslice.client.queue import read_queue
    from rayslice.core.queue import QueueSettings, format_queue

    settings = None if set_ is None else QueueSettings.checked(set_, "--set")
    if (found_set := cluster_set_sources(conn_id, address)) is not None:
        if settings is not None:
            raise fail(f"--conn-id {conn_id!r} is a cluster set: each cluster's queue policy is its own; set it with "
                       "--conn-id of a member connection")
        with json_only_on_stdout(as_json):
            _set_queue(*found_set, installed=installed, as_json=as_json)
        return
    where = target(address, token, conn_id, name)
    try:
        with (json_only_on_stdout(as_json),
              RayJobsClient(where.url, token=where.token, headers=where.headers, verify=where.verify) as client):
            found = read_queue(client, installed=installed, set_settings=settings)
    except RaysliceError as exc:
        raise unreachable(where, exc) from None
    if as_json:
        console.print_json(json.dumps(found))
    else:
        settings = found["settings"]
        console.print(f"policy {settings['policy']}, aging {settings['aging_s']} s"
                      + (f", quotas {json.dumps(settings['quotas'])}" if settings["quotas"] else ""), highlight=False)
        console.print(format_queue(found["entries"]), highlight=False, markup=False)


def _set_queue(set_name: str, sources: list, *, installed: bool, as_json: bool) -> None:
    """`rayslice queue --conn-id <set>`: every member's queue read (a short job each), then one row per step."""
    from rayslice.client.jobs_client import RayJobsClient
    from rayslice.client.queue import format_set_queue, join_queues, read_queue, standing_by

    queues: list[tuple[str, dict | None]] = []
    problems: dict[str, str] = {}
    clients: dict[str, RayJobsClient] = {}
    try:
        for source in sources:
            if source.problem:
                queues.append((source.name, None))
                problems[source.name] = source.problem
                continue
            client = clients[source.name] = RayJobsClient(source.dashboard_url, token=source.token,
                                                          headers=source.headers, verify=source.verify)
            try:
                queues.append((source.name, read_queue(client, installed=installed or source.launcher == "installed")))
            except RaysliceError as exc:
                queues.append((source.name, None))
                problems[source.name] = str(exc)
                clients.pop(source.name).close()
        rows = join_queues(queues)
        rows = join_queues(queues, standing_by(clients, rows))
    finally:
        for client in clients.values():
            client.close()
    if as_json:
        console.print_json(json.dumps({"set": set_name, "members": [
            {"name": n, **({"error": problems[n]} if found is None else {"settings": found["settings"]})}
            for n, found in queues], "entries": rows}))
        return
    console.print(f"cluster set {set_name}: {', '.join(n for n, _ in queues)}", highlight=False)
    for n, found in queues:
        if found is None:
            console.print(f"cluster {n}: unreachable ({problems[n]})", highlight=False, markup=False)
        else:
            settings = found["settings"]
            console.print(f"cluster {n}: policy {settings['policy']}, aging {settings['aging_s']} s"
                          + (f", quotas {json.dumps(settings['quotas'])}" if settings["quotas"] else ""),
                          highlight=False, markup=False)
    console.print(format_set_queue(rows), highlight=False, markup=False)


@app.command()
def reap(
    address: Address = None,
    token: Token = None,
    conn_id: ConnId = None,
    name: Name = "default",
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Only say what would be stopped and removed.")] = False,
    airflow_url: Annotated[str | None, typer.Option(envvar="RAYSLICE_AIRFLOW_URL",
                                                    help="Airflow's URL: also stop jobs whose task has ended.")] = None,
    airflow_token: Annotated[str | None, typer.Option(envvar="RAYSLICE_AIRFLOW_TOKEN",
                                                      help="A bearer token for Airflow's REST API.")] = None,
    deployment: Annotated[str | None, typer.Option(
        envvar="RAYSLICE_DEPLOYMENT", help="That Airflow's deployment name (its `ray` connection's 'deployment' "
        "extra); default: its `rayslice_deployment` Variable. Jobs of other deployments are left alone.")] = None,
) -> None:
    """Free what dead steps hold: jobs whose Airflow task ended, and leftovers named `rayslice:` of ended jobs."""
    import asyncio

    from rayslice.client import orphans

    where = target(address, token, conn_id, name)
    try:
        report = asyncio.run(orphans.reap(where.url, token=where.token, airflow_url=airflow_url,
                                          airflow_token=airflow_token, deployment=deployment or where.deployment,
                                          dry_run=dry_run,
                                          emit=console.print))
    except RaysliceError as exc:
        raise unreachable(where, exc) from None
    verb = "would free" if dry_run else "freed"
    console.print(f"{verb}: {len(report.stopped)} job(s) stopped, {len(report.reaped)} leftover(s) removed")
    if not airflow_url:
        console.print("(no --airflow-url: running jobs were not checked against Airflow)")


@app.command()
def doctor(
    address: Address = None,
    token: Token = None,
    conn_id: ConnId = None,
    name: Name = "default",
    installed: Annotated[bool | None, typer.Option(
        "--installed/--shipped", help="The launcher mode to check: rayslice installed in the cluster's image, or "
        "shipped with each job (default: the connection's `launcher` extra, else shipped).")] = None,
    checkpoint_root: Annotated[str | None, typer.Option(
        "--checkpoint-root", help="The checkpoint root a host must write (default: the connection's "
        "`checkpoint_root` extra, or the local cluster's).")] = None,
    smoke: Annotated[bool, typer.Option("--smoke/--no-smoke",
                                        help="Run jax.device_count() on every host of one slice.")] = True,
    smoke_slice: Annotated[str | None, typer.Option(
        "--smoke-slice", help="The slice (name or pod type, e.g. v6e-16) for the smoke step; default: a whole one.")
    ] = None,
    smoke_timeout: Annotated[float, typer.Option(
        "--smoke-timeout", min=5, max=3600, help="Seconds the smoke step may wait for its slice and run (5-3600).")
    ] = 120.0,
    kuberay_namespace: Annotated[str | None, typer.Option(
        "--kuberay-namespace", help="Also check KubeRay in this namespace: CRD version, TPU webhook, RBAC.")] = None,
    kuberay_cluster: Annotated[str | None, typer.Option(
        "--kuberay-cluster", help="With --kuberay-namespace: this RayCluster must be ready with its token Secret.")
    ] = None,
    kuberay_manage: Annotated[bool, typer.Option(
        "--kuberay-manage", help="RBAC for creating/deleting RayClusters too (CreateRayClusterOperator), not only "
        "lookups.")] = False,
    kubeconfig: Annotated[str | None, typer.Option("--kubeconfig", help="With --kuberay-namespace.")] = None,
    context: Annotated[str | None, typer.Option("--context", help="With --kuberay-namespace.")] = None,
    in_cluster: Annotated[bool, typer.Option("--in-cluster", help="With --kuberay-namespace: this pod's service "
                                                                  "account.")] = False,
    project: Annotated[str | None, typer.Option("--project", help="Also check Cloud TPU in this GCP project "
                                                                  "(with --zone).")] = None,
    zone: Annotated[str | None, typer.Option("--zone", help="The Cloud TPU zone, e.g. us-east5-b.")] = None,
    tpu_type: Annotated[str | None, typer.Option("--tpu-type", help="With --zone: the zone must offer it, "
                                                                    "e.g. v6e-16.")] = None,
    service_account: Annotated[str | None, typer.Option(
        "--service-account", help="With --project: the TPU VMs' service account must exist.")] = None,
    egress: Annotated[list[str], typer.Option(
        "--egress", help="host:port a host must reach (repeat; with --project the startup script's endpoints "
        "are checked by default).")] = [],  # noqa: B006
    tpu_api_endpoint: Annotated[str | None, typer.Option("--tpu-api-endpoint", hidden=True)] = None,
    iam_endpoint: Annotated[str | None, typer.Option("--iam-endpoint", hidden=True)] = None,
    cluster_checks: Annotated[bool, typer.Option(
        "--cluster/--no-cluster", help="Check the Ray cluster (default); --no-cluster: only the control planes.")
    ] = True,
) -> None:
    """Preflight: each check PASS or FAIL with the fix (dashboard, token, versions, launcher, slices, checkpoint
    root, metrics, a jax.device_count() smoke step; KubeRay and Cloud TPU with their flags). Exits 1 on a FAIL."""
    from rayslice.client.doctor import DEFAULT_EGRESS, Check, Doctor, failed, render
    from rayslice.cloud.pins import RAY_VERSION

    if (project is None) != (zone is None):
        raise fail("give --project and --zone together (the Cloud TPU checks need both)")
    if project is not None and zone is not None:
        from rayslice.cloud.cloud_tpu import check_project_zone

        try:  # a typo is the user's, in their flag's words: not a failed API call with a credentials fix
            check_project_zone(project, zone)
        except RaysliceError as exc:
            raise fail(str(exc).replace("GCP project ", "--project ").replace("zone ", "--zone ", 1)) from None
    if (tpu_type or service_account) and project is None:
        raise fail("--tpu-type and --service-account are Cloud TPU checks: give --project and --zone too")
    if (kubeconfig or context or in_cluster or kuberay_manage or kuberay_cluster) and not kuberay_namespace:
        raise fail("--kubeconfig, --context, --in-cluster, --kuberay-manage and --kuberay-cluster need "
                   "--kuberay-namespace")
    for endpoint in egress:
        host, _, port = endpoint.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise fail(f"--egress {endpoint!r}: give host:port (port 1-65535), e.g. pypi.org:443")
    # Flags only the Ray cluster's checks read: silently dropping them would report on something not checked.
    unused = [flag for flag, given in (("--address", address), ("--conn-id", conn_id),
                                       ("--installed/--shipped", installed is not None),
                                       ("--checkpoint-root", checkpoint_root), ("--egress", egress),
                                       ("--smoke-slice", smoke_slice)) if given]
    if not cluster_checks and unused:
        raise fail(f"{', '.join(unused)} check the Ray cluster: drop --no-cluster, or drop them")
    if smoke_slice and not smoke:
        raise fail("--smoke-slice names the smoke step's slice: drop --no-smoke, or drop --smoke-slice")
    checks: list[Check] = []
    if cluster_checks:
        where = target(address, token, conn_id, name)
        launcher, root = "shipped", checkpoint_root
        if where.flag.startswith("--conn-id"):
            from rayslice.hooks.ray import RayHook

            settings = RayHook(conn_id).settings()
            launcher, root = settings.launcher, root or settings.checkpoint_root
        elif where.flag.startswith("--name"):
            root = root or local_cluster.ClusterRecord.load(name).checkpoint_root or None
        if installed is not None:
            launcher = "installed" if installed else "shipped"
        console.print(f"rayslice doctor: {where.url} ({where.flag})", highlight=False)
        checks += Doctor(where.url, token=where.token, headers=where.headers, verify=where.verify,
                         launcher=launcher, checkpoint_root=root,
                         egress=tuple(egress) or (DEFAULT_EGRESS if project else ()), smoke=smoke,
                         smoke_slice=smoke_slice, smoke_timeout=smoke_timeout, pinned_ray=RAY_VERSION,
                         emit=lambda line: console.print(line, style="dim", highlight=False, markup=False)).run()
    if kuberay_namespace:
        from rayslice.cloud.preflight import kuberay_checks

        checks += kuberay_checks(namespace=kuberay_namespace, kubeconfig=kubeconfig, context=context,
                                 in_cluster=in_cluster, manage=kuberay_manage, cluster=kuberay_cluster)
    if project and zone:
        from rayslice.cloud.preflight import cloud_tpu_checks

        checks += cloud_tpu_checks(project=project, zone=zone, tpu_type=tpu_type, service_account=service_account,
                                   api_endpoint=tpu_api_endpoint, iam_endpoint=iam_endpoint)
    if not checks:
        raise fail("nothing to check: drop --no-cluster, or add --kuberay-namespace or --project/--zone")
    console.print(render(checks), highlight=False, markup=False, soft_wrap=True)
    bad = failed(checks)
    console.print(f"{len(bad)} check(s) failed" if bad else "all checks passed", highlight=False)
    if bad:
        raise typer.Exit(1)


cloud_tpu = typer.Typer(help="Cloud TPU VMs (no KubeRay) whose hosts join a Ray cluster.", no_args_is_help=True)
app.add_typer(cloud_tpu, name="cloud-tpu")


_SCRIPT_FLAGS = (("head_address", "--head-address"), ("token_secret", "--token-secret"), ("wheel", "--wheel"),
                 ("ray_start_args", "--ray-start-args"), ("python_version", "--python-version"),
                 ("metrics_port", "--metrics-port"), ("port", "--port"))
PythonVersion = Annotated[str | None, typer.Option(
    "--python-version", help="The exact Python (e.g. 3.12.16) of the head and every host: Ray refuses a node whose "
    "Python differs from the head's. Default: rayslice's.")]
TokenSecret = Annotated[str | None, typer.Option(
    "--token-secret", help="The Secret Manager secret with the head's Ray auth token (read at boot).")]
Wheel = Annotated[str | None, typer.Option(
    "--wheel", help="rayslice's wheel (gs:// or https:// URL) for a `launcher: installed` connection.")]
Install = Annotated[bool, typer.Option(
    "--install/--no-install", help="Install Python, Ray (and JAX) at boot (default), or only `ray start`.")]
RayStartArgs = Annotated[str, typer.Option("--ray-start-args", help="More `ray start` arguments.")]


def _script_error(exc: RaysliceError) -> typer.Exit:
    message = str(exc)
    for word, flag in _SCRIPT_FLAGS:
        message = message.replace(f"{word} ", f"{flag} ", 1) if message.startswith(f"{word} ") else message
    return fail(message)


@cloud_tpu.command("startup-script")
def startup_script(
    head_address: Annotated[str, typer.Option("--head-address", help="The Ray head's GCS address, host:6379.")],
    token_secret: TokenSecret = None,
    wheel: Wheel = None,
    install: Install = True,
    ray_start_args: RayStartArgs = "",
    python_version: PythonVersion = None,
) -> None:
    """Print the TPU VMs' startup script: rayslice's Python, Ray and JAX, then join the head."""
    from rayslice.cloud.cloud_tpu import HOST_PYTHON
    from rayslice.cloud.cloud_tpu import startup_script as render

    try:
        typer.echo(render(head_address, install=install, wheel=wheel, token_secret=token_secret,
                          ray_start_args=ray_start_args, python_version=python_version or HOST_PYTHON), nl=False)
    except RaysliceError as exc:
        raise _script_error(exc) from None


@cloud_tpu.command("head-script")
def head_script(
    token_secret: TokenSecret = None,
    wheel: Wheel = None,
    install: Install = True,
    ray_start_args: RayStartArgs = "",
    python_version: PythonVersion = None,
    port: Annotated[int, typer.Option("--port", help="Ray's control store (GCS) port.")] = 6379,
    metrics_port: Annotated[int, typer.Option("--metrics-port", help="Ray's metrics port, for Prometheus.")] = 8080,
) -> None:
    """Print the head VM's startup script: the hosts' Python and Ray, then `ray start --head` (at every boot)."""
    from rayslice.cloud.cloud_tpu import HOST_PYTHON, head_startup_script

    try:
        typer.echo(head_startup_script(port=port, metrics_port=metrics_port, install=install, wheel=wheel,
                                       token_secret=token_secret, ray_start_args=ray_start_args,
                                       python_version=python_version or HOST_PYTHON), nl=False)
    except RaysliceError as exc:
        raise _script_error(exc) from None


def _duration(text: str) -> float:
    """``90``, ``90s``, ``30m``, ``12h`` or ``2d`` in seconds; a clear error naming --older-than otherwise."""
    import re

    match = re.fullmatch(r"(\d+(?:\.\d+)?)([smhd]?)", text.strip())
    if not match:
        raise fail(f"--older-than {text!r} is invalid: give a duration such as 12h, 90m, 2d or 3600 (seconds)")
    return float(match[1]) * {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}[match[2]]


@cloud_tpu.command("sweep")
def sweep(
    project: Annotated[str, typer.Option("--project", help="The GCP project.")],
    zone: Annotated[str, typer.Option("--zone", help="The zone of the slices.")],
    older_than: Annotated[str, typer.Option(
        "--older-than", help="Only queued resources older than this (12h, 90m, 2d): longer than any run lasts.")],
    deployment: Annotated[str, typer.Option(
        envvar="RAYSLICE_DEPLOYMENT", help="That Airflow's deployment name (its `ray` connection's 'deployment' "
        "extra, or its `rayslice_deployment` Variable); other deployments' slices are never touched.")],
    delete: Annotated[bool, typer.Option("--delete", help="Delete them (default: only list them).")] = False,
    api_endpoint: Annotated[str | None, typer.Option(
        "--api-endpoint", help="Another Cloud TPU API endpoint (a private one).")] = None,
) -> None:
    """List (or, with --delete, delete) one Airflow's TPU slices whose teardown never ran."""
    from rayslice.cloud.cloud_tpu import sweep as run_sweep

    seconds = _duration(older_than)
    try:
        found = run_sweep(project, zone, deployment=deployment, older_than_s=seconds, delete=delete,
                          api_endpoint=api_endpoint)
    except RaysliceError as exc:
        message = str(exc)
        for word, flag in (("GCP project", "--project"), ("zone", "--zone"), ("deployment", "--deployment")):
            message = message.replace(word, flag, 1) if message.startswith(word) else message
        raise fail(message) from None
    for swept in found:
        console.print(f"{swept.queued_resource_id}\t{swept.age_s / 3600:.1f} h\t{swept.outcome}", highlight=False)
    acted = sum(s.outcome in ("deleted", "would delete") for s in found)
    console.print(f"{'deleted' if delete else 'would delete (add --delete)'}: {acted} of {len(found)} queued "
                  f"resource(s) of deployment {deployment!r} in {zone}", highlight=False)


@app.command("launcher-label")
def launcher_label() -> None:
    """The node label that says this Python has rayslice's launcher installed (for `ray start --labels`).

    A node started with it runs the host processes of a shipped-launcher step whose files are the
    same as these without Ray's runtime env step (about a second less per host start).
    """
    from rayslice.local.local_cluster import launcher_label as label

    args = label()
    if not args:
        raise fail("this Python cannot import rayslice and cloudpickle, so it has no launcher to label")
    console.print(args[1], highlight=False, soft_wrap=True)


@app.command()
def demo(
    name: Annotated[str, typer.Option(help="Name of the demo's own local cluster.")] = "demo",
    ui: Annotated[bool, typer.Option("--ui", help="End with the Airflow UI running on the demo's cluster "
                                     "(`rayslice airflow down` stops both).")] = False,
    port: Annotated[int, typer.Option("--port", min=0, max=65535, help="The UI's port, with --ui.")] = 8080,
) -> None:
    """Start a local cluster, run the example pipeline through Airflow, show capacity, stop the cluster."""
    from rayslice.local.demo import run_demo

    raise typer.Exit(run_demo(name, ui_port=port if ui else None))


def main() -> None:
    try:
        app(prog_name="rayslice")
    except RaysliceError as exc:
        console.print(f"[red]error:[/red] {exc}", highlight=False)
        raise SystemExit(1) from None
