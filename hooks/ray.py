"""The `ray` connection: where the Ray dashboard (Jobs API) is and how to authenticate to it.

Airflow talks to Ray only over the Jobs REST API (`rayslice.client.jobs_client`), so workers,
triggerers and the API server need `httpx`, not `ray`. The connection holds:

- host: the dashboard URL, ``http://127.0.0.1:8265`` (the scheme may also come from
  ``schema`` and the port from ``port``, as URI-style connections split them);
- password: the cluster's auth token (``RAY_AUTH_MODE=token``), optional;
- extras: ``verify`` (bool, or a CA bundle path) and ``headers`` (a dict), e.g. for a proxy;
  ``checkpoint_root`` (a URL such as ``gs://bucket/ckpt``): where steps' checkpoint folders go;
  ``launcher``: ``"shipped"`` (default: each job uploads rayslice's cluster side) or ``"installed"``
  (the cluster's image has this same rayslice version: jobs carry only the step, and host processes
  start without a runtime env, about 1.5 CPU-seconds faster each);
  ``runtime_env`` (Ray's runtime_env format): the default of every step on this connection, under
  each task's own ``runtime_env`` (a task's keys replace it, its ``env_vars`` are merged);
  ``team``: the team this connection's steps count against in the cluster's admission queue (its
  quotas); a step may narrow it (``research`` -> ``research/vision``), never name another
  (docs/security.md). The queue's policy and quotas are the cluster operator's, never a connection's:
  a ``queue`` extra is refused;
  ``deployment``: this Airflow's name on the cluster (letters, digits, ``.``, ``_``, ``-``; e.g.
  ``"prod"``), stamped on every job and first in every checkpoint folder, so two Airflows sharing
  one Ray cluster never stop each other's jobs or share checkpoint folders. Unset, it is the Airflow
  Variable ``rayslice_deployment``, which the first step of a deployment creates (a random id)
  in its metadata DB: stable for that Airflow, different for any other;
  ``kuberay`` (a dict) names a KubeRay RayCluster instead of a host,
  ``{"namespace": "ml", "name": "rayslice", "in_cluster": true}`` or ``..., "kubeconfig": "/path"``:
  the dashboard URL is then looked up through the Kubernetes API (``rayslice.cloud.kuberay_client``)
  each time the connection is resolved, so it follows the cluster when it is recreated; with
  ``"token_secret": "rayslice-ray-token"`` the token is read from that Secret too (when the
  connection has no password), as clusters rendered by rayslice keep it there;
  ``clusters`` (a list of other `ray` connection ids, in order of preference) makes the connection a
  *cluster set*: a step on it runs on whichever of those clusters admits it first, and resumes on any
  of them after a suspension (``rayslice.client.cluster_set``). A set has no host of its own; its
  ``checkpoint_root`` must be one every member reads (``gs://...``); ``shared_root: true`` allows a
  local folder that every member mounts (the local clusters of one machine, NFS).

The token is kept out of reprs, logs and messages: Airflow masks connection passwords,
and the jobs clients scrub it from every error they raise.
"""

from __future__ import annotations

import asyncio
import difflib
import json
import re
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any, get_args

from airflow.sdk import BaseHook

from rayslice.client.jobs_client import AsyncRayJobsClient, RayJobsClient
from rayslice.client.urls import dashboard_url
from rayslice.core import runtime_env as runtime_envs
from rayslice.core.exceptions import InvalidRequestError, RaysliceError
from rayslice.core.queue import SETTINGS_ENV, TEAM_PATTERN
from rayslice.core.step import CHECKPOINT_ROOT_FORMS, DEPLOYMENT_VARIABLE, Launcher, checkpoint_root_problem

__all__ = ["DEPLOYMENT_VARIABLE", "EXTRAS", "ClusterSetSettings", "RayConnectionSettings", "RayHook", "RaysliceHook",
           "cluster_set_of", "dashboard_url"]

#: How long the step that creates the `rayslice_deployment` Variable waits before reading back the winner.
DEPLOYMENT_SETTLE_S = 2.0
_DEPLOYMENT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
#: Every extra the `ray` connection reads. Any other key is refused (a misspelled ``checkpoint-root`` would
#: otherwise be ignored without a word); docs/connection.md and the provider's form list exactly these.
EXTRAS = ("verify", "headers", "checkpoint_root", "launcher", "runtime_env", "deployment", "team", "kuberay",
          "cloud_tpu", "clusters", "shared_root")
#: The extras a cluster set reads: its members and where their shared checkpoints live (the rest are the members').
SET_EXTRAS = ("clusters", "checkpoint_root", "shared_root", "__extra__")
#: Extras the connection once read and now refuses with a message of their own (`queue`: the operator's now).
_RETIRED_EXTRAS = ("queue",)
#: Keys Airflow itself may leave in a connection's extra (a URI-style connection's raw extra).
_AIRFLOW_EXTRAS = ("__extra__",)
#: The fields astro-provider-ray's and Apache's `ray` connection forms save: their dashboard URL is the
#: extra ``address`` (the host is hidden). rayslice reads such a connection's ``address``, ``headers`` and
#: ``verify``; the other fields are theirs (cookies, Kubernetes settings) and rayslice has no use for them.
FOREIGN_RAY_EXTRAS = ("address", "cookies", "metadata", "kube_config_path", "kube_config", "kubeconfig", "namespace",
                      "cluster_context", "disable_verify_ssl", "disable_tcp_keepalive")


@dataclass(frozen=True)
class RayConnectionSettings:
    """A resolved `ray` connection; builds the jobs clients. The token never shows in its repr."""

    dashboard_url: str
    token: str | None = field(default=None, repr=False)
    verify: bool | str = True
    headers: dict[str, str] = field(default_factory=dict, repr=False)
    timeout: float = 10.0
    retries: int = 3
    checkpoint_root: str | None = None  # extra ``checkpoint_root``: the steps' checkpoint folders live under it
    launcher: Launcher = "shipped"  # extra ``launcher``: "shipped" or "installed" (rayslice is in the cluster's image)
    runtime_env: dict[str, Any] | None = None  # extra ``runtime_env``: under each step's own
    team: str | None = None  # extra ``team``: whose quota this connection's steps count against (the platform's)
    deployment: str | None = None  # extra ``deployment``: this Airflow's name on the cluster (else the Variable's)

    def _kwargs(self) -> dict[str, Any]:
        return {"token": self.token, "verify": self.verify, "headers": dict(self.headers),
                "timeout": self.timeout, "retries": self.retries}

    def client(self) -> RayJobsClient:
        return RayJobsClient(self.dashboard_url, **self._kwargs())

    def async_client(self) -> AsyncRayJobsClient:
        return AsyncRayJobsClient(self.dashboard_url, **self._kwargs())

    def job_url(self, submission_id: str) -> str:
        """The job's page in the Ray dashboard."""
        return f"{self.dashboard_url}/#/jobs/{submission_id}"


def _verify(value: Any) -> bool | str:
    if value is None or value == "":
        return True
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    if isinstance(value, str):
        return value.strip()
    raise InvalidRequestError(f"the `ray` connection's extra 'verify' must be true, false or a CA bundle "
                              f"path, got {type(value).__name__}")


def _headers(value: Any) -> dict[str, str]:
    if value in (None, ""):
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            value = None
    if not isinstance(value, dict):
        raise InvalidRequestError("the `ray` connection's extra 'headers' must be a JSON object of "
                                  'header names to values, e.g. {"X-Proxy-Key": "..."}')
    return {str(k): str(v) for k, v in value.items()}


def _kuberay_extra(conn: Any) -> Any:
    return (conn.extra_dejson if conn.extra else {}).get("kuberay")


def _resolve(conn: Any, timeout: float, cluster: str | None = None,
             owner: str | None = None) -> tuple[str, str | None]:
    """The dashboard URL and token: the host and password, or the RayCluster the ``kuberay`` extra names.

    For a RayCluster the URL is looked up through the Kubernetes API (blocking), and so is the token when
    the extra names its Secret (``token_secret``) and the connection has no password. ``cluster`` (a step's
    ``kuberay_cluster``) replaces the extra's name: a cluster a rayslice setup made is sent only its own token,
    never the connection's (``resolve_step_cluster``); any other is authenticated as the extra's cluster is.
    With ``owner`` it must be that DAG run's own cluster.
    """
    kuberay = _kuberay_extra(conn)
    extra = conn.extra_dejson if conn.extra else {}
    if cluster and kuberay in (None, "", {}):
        raise InvalidRequestError(f"kuberay_cluster={cluster!r} needs a `ray` connection with a 'kuberay' extra (the "
                                  "Kubernetes API and namespace to find the RayCluster in); this one has a fixed "
                                  'dashboard URL: give it the extra, e.g. {"namespace": "ml", "name": "rayslice", '
                                  '"in_cluster": true}, or drop kuberay_cluster')
    if kuberay in (None, "", {}) and not (conn.host or "").strip() and _foreign(extra):
        return dashboard_url(extra["address"], what="the `ray` connection's extra 'address'"), conn.password or None
    if kuberay in (None, "", {}):
        return dashboard_url(conn.host, conn.schema, conn.port), conn.password or None
    if (conn.host or "").strip():
        raise InvalidRequestError("the `ray` connection has both a host and a 'kuberay' extra: keep the host "
                                  "(a fixed dashboard URL) or the extra (a RayCluster to look up), not both")
    from rayslice.cloud.kuberay_client import ClusterRef, resolve, resolve_step_cluster

    ref = ClusterRef.from_extra(kuberay, name=cluster)
    if conn.password:
        ref = replace(ref, token_secret=None)  # the connection's own token wins
    if cluster:  # a cluster a rayslice setup made has a token of its own: the connection's is never sent to it
        url, token, own = resolve_step_cluster(ref, owner=owner, timeout=timeout)
        return url, token if own else (conn.password or token)
    url, token = resolve(ref, timeout=timeout)
    return url, conn.password or token


def _foreign(extra: dict[str, Any]) -> bool:
    """A `ray` connection saved by astro-provider-ray's or Apache's form: the dashboard URL in ``address``."""
    return "address" in extra and "kuberay" not in extra


def check_extras(extra: Any) -> None:
    """Refuse extras the connection does not read, naming the valid ones (and the closest, for a typo)."""
    if not isinstance(extra, dict):
        raise InvalidRequestError(f"the `ray` connection's extra must be a JSON object, got {type(extra).__name__}")
    allowed = (*EXTRAS, *_RETIRED_EXTRAS, *_AIRFLOW_EXTRAS, *(FOREIGN_RAY_EXTRAS if _foreign(extra) else ()))
    unknown = sorted(str(key) for key in extra if key not in allowed)
    if not unknown:
        return
    hints = []
    for key in unknown:
        close = difflib.get_close_matches(key.replace("-", "_").lower(), EXTRAS, n=1, cutoff=0.6)
        hints.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    raise InvalidRequestError(f"the `ray` connection has unknown extra {', '.join(hints)}: the valid extras are "
                              f"{', '.join(EXTRAS)} (docs/connection.md)")


def settings_from_connection(conn: Any, *, timeout: float = 10.0, retries: int = 3,
                             cluster: str | None = None, cluster_owner: str | None = None) -> RayConnectionSettings:
    extra = conn.extra_dejson if conn.extra else {}
    check_extras(extra)
    if (clusters := cluster_set_of(conn)) is not None:
        raise InvalidRequestError(
            f"the `ray` connection {conn.conn_id!r} is a cluster set ({', '.join(clusters.members)}): steps on it run "
            "on its member clusters, but this needs one cluster: name one of the member connections")
    url, token = _resolve(conn, timeout, cluster, cluster_owner)
    return RayConnectionSettings(
        dashboard_url=url,
        token=token,
        verify=_verify(extra.get("verify")),
        headers=_headers(extra.get("headers")),
        timeout=timeout,
        retries=retries,
        checkpoint_root=_checkpoint_root(extra.get("checkpoint_root")),
        launcher=_launcher(extra.get("launcher")),
        runtime_env=runtime_envs.validate(extra.get("runtime_env") or None,
                                          "the `ray` connection's extra 'runtime_env'"),
        deployment=check_deployment(extra.get("deployment"), "the `ray` connection's extra 'deployment'"),
        team=_team(extra.get("team")),
        **_no_queue(extra.get("queue")),
    )


@dataclass(frozen=True)
class ClusterSetSettings:
    """A `ray` connection with the extra ``clusters``: its member connections, in order of preference."""

    name: str
    members: tuple[str, ...]
    checkpoint_root: str | None = None
    shared_root: bool = False


def cluster_set_of(conn: Any) -> ClusterSetSettings | None:
    """The connection's cluster set, or None for a connection to one cluster; bad values are refused in words."""
    extra = conn.extra_dejson if conn.extra else {}
    if not isinstance(extra, dict) or extra.get("clusters") in (None, "", []):
        if isinstance(extra, dict) and "shared_root" in extra:
            raise InvalidRequestError(f"the `ray` connection {conn.conn_id!r} has the extra 'shared_root' but no "
                                      "'clusters': only a cluster set reads it")
        return None
    members = extra["clusters"]
    if isinstance(members, str):
        members = [part.strip() for part in members.split(",") if part.strip()]
    if not isinstance(members, list) or len(members) < 2 or not all(isinstance(m, str) and m for m in members):
        raise InvalidRequestError(
            f"the `ray` connection {conn.conn_id!r} extra 'clusters' must list two or more `ray` connection ids in "
            f'order of preference, e.g. ["ray_us_east5", "ray_europe_west4"], got {members!r}')
    if len(set(members)) != len(members) or conn.conn_id in members:
        raise InvalidRequestError(f"the cluster set {conn.conn_id!r} must name each member connection once, and not "
                                  f"itself: got {members}")
    others = sorted(set(extra) - set(SET_EXTRAS))
    if others or (conn.host or "").strip():
        raise InvalidRequestError(
            f"the cluster set {conn.conn_id!r} has {'a host' if (conn.host or '').strip() else ''}"
            f"{' and ' if others and (conn.host or '').strip() else ''}"
            f"{'the extras ' + ', '.join(others) if others else ''}, which belong on its member connections "
            f"({', '.join(members)}): a set reads only {', '.join(SET_EXTRAS[:-1])}")
    shared = extra.get("shared_root", False)
    if not isinstance(shared, bool):
        raise InvalidRequestError(f"the cluster set {conn.conn_id!r} extra 'shared_root' must be true or false, "
                                  f"got {shared!r}")
    root = extra.get("checkpoint_root") or None
    if root is not None:
        _checkpoint_root(root)
    return ClusterSetSettings(name=conn.conn_id, members=tuple(members), checkpoint_root=root, shared_root=shared)


def _no_queue(value: Any) -> dict[str, Any]:
    """A connection cannot set the cluster's queue policy: it is the operator's (every connection would race)."""
    if value not in (None, "", {}):
        raise InvalidRequestError(
            "the `ray` connection's extra 'queue' is no longer read: the admission queue's policy and quotas are the "
            f"cluster operator's, set on the head ({SETTINGS_ENV}) or with `rayslice queue --set '<json>'`; move it "
            "there and remove it from the connection (docs/security.md)")
    return {}


def _team(value: Any) -> str | None:
    if value in (None, ""):
        return None
    if not isinstance(value, str) or len(value) > 64 or not re.fullmatch(TEAM_PATTERN, value):
        raise InvalidRequestError("the `ray` connection's extra 'team' must be a team name of up to 64 letters, "
                                  f"digits, '.', '_', '-' (parts joined by '/'), e.g. 'research', got {value!r}")
    return value


def check_deployment(value: Any, what: str) -> str | None:
    """A deployment name as given (None when unset); a clear error for one that cannot name a folder."""
    if value in (None, ""):
        return None
    if not isinstance(value, str) or not _DEPLOYMENT.fullmatch(value):
        raise InvalidRequestError(f"{what} must be 1-64 letters, digits, '.', '_' or '-' (starting with a letter "
                                  f"or digit), e.g. 'prod', got {value!r}")
    return value


def _launcher(value: Any) -> Launcher:
    if value in (None, ""):
        return "shipped"
    if value not in get_args(Launcher):
        raise InvalidRequestError(f"the `ray` connection's extra 'launcher' must be 'shipped' (each job uploads "
                                  f"rayslice's cluster side) or 'installed' (the cluster's image has this rayslice), "
                                  f"got {value!r}")
    return value


def _checkpoint_root(value: Any) -> str | None:
    if value in (None, ""):
        return None
    problem = checkpoint_root_problem(value) if isinstance(value, str) else f"must be {CHECKPOINT_ROOT_FORMS}"
    if problem:  # the steps' own check would refuse it too, naming their parameter, not this extra
        raise InvalidRequestError(f"the `ray` connection's extra 'checkpoint_root' {problem}; got {value!r}")
    return value


class RayHook(BaseHook):
    """Reach a Ray cluster's Jobs API through an Airflow `ray` connection.

    ``client()`` / ``async_client()`` suit sync callers (operators); inside an event loop
    (triggers) use ``await hook.asettings()`` and its ``async_client()``, which fetch the
    connection without blocking the loop. ``cluster``: a RayCluster name that replaces the
    ``kuberay`` extra's (a step's ``kuberay_cluster``, resolved: never ``"per-run"``);
    ``cluster_owner``: the owner mark that cluster must carry (a run's own, ``kuberay_cluster="per-run"``).
    """

    conn_name_attr = "ray_conn_id"
    default_conn_name = "ray_default"
    conn_type = "ray"
    hook_name = "Ray"

    def __init__(self, ray_conn_id: str = default_conn_name, *, timeout: float = 10.0, retries: int = 3,
                 cluster: str | None = None, cluster_owner: str | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.ray_conn_id = ray_conn_id
        self.cluster = cluster or None
        self.cluster_owner = cluster_owner or None
        self.timeout = timeout
        self.retries = retries
        self._settings: RayConnectionSettings | None = None

    def __repr__(self) -> str:
        return f"RayHook(ray_conn_id={self.ray_conn_id!r}" + (f", cluster={self.cluster!r})" if self.cluster else ")")

    def settings(self) -> RayConnectionSettings:
        if self._settings is None:
            conn = self.get_connection(self.ray_conn_id)
            self._settings = settings_from_connection(conn, timeout=self.timeout, retries=self.retries,
                                                      cluster=self.cluster, cluster_owner=self.cluster_owner)
        return self._settings

    async def asettings(self) -> RayConnectionSettings:
        if self._settings is None:
            conn = await self.aget_connection(self.ray_conn_id)
            if _kuberay_extra(conn) in (None, "", {}):
                self._settings = settings_from_connection(conn, timeout=self.timeout, retries=self.retries,
                                                          cluster=self.cluster, cluster_owner=self.cluster_owner)
            else:  # the Kubernetes client blocks: keep it off the triggerer's event loop
                self._settings = await asyncio.to_thread(settings_from_connection, conn, timeout=self.timeout,
                                                         retries=self.retries, cluster=self.cluster,
                                                         cluster_owner=self.cluster_owner)
        return self._settings

    def cluster_set(self) -> ClusterSetSettings | None:
        """The connection's cluster set (the extra ``clusters``), or None when it names one cluster."""
        conn = self.get_connection(self.ray_conn_id)
        clusters = cluster_set_of(conn)
        if clusters is not None:
            for member in clusters.members:
                if cluster_set_of(self.get_connection(member)) is not None:
                    raise InvalidRequestError(f"the cluster set {self.ray_conn_id!r} names {member!r}, which is a "
                                              "cluster set itself: list its clusters instead (sets do not nest)")
        return clusters

    def deployment(self) -> str:
        """This Airflow's name on the cluster: the connection's ``deployment`` extra, else the Airflow Variable.

        The Variable (``rayslice_deployment``) lives in the metadata DB, so every worker of one
        Airflow reads the same name and another Airflow (its own DB) another one. It is created
        with a random id the first time a step runs without one. Runs in a task (Task SDK).
        """
        try:  # not `settings()`: a RayCluster being made has no URL yet
            conn = self.get_connection(self.ray_conn_id)
        except Exception:  # no such connection (a Cloud TPU DAG given a head address): the Variable names it
            conn = None
        extra = conn.extra_dejson if conn is not None and conn.extra else {}
        configured = check_deployment(extra.get("deployment"), "the `ray` connection's extra 'deployment'")
        if configured:
            return configured
        from airflow.sdk import Variable

        what = f"the Airflow Variable {DEPLOYMENT_VARIABLE!r}"
        value = Variable.get(DEPLOYMENT_VARIABLE, default=None)
        if value in (None, ""):
            Variable.set(DEPLOYMENT_VARIABLE, uuid.uuid4().hex[:12],
                         description="rayslice: this Airflow's name on shared Ray clusters (keep it stable)")
            # The first steps of a fresh Airflow, started at once, each set an id of their own (the Task SDK
            # has no create-if-absent): each waits until every one of them has written, then all read the
            # last write, so no job keeps a losing id.
            time.sleep(DEPLOYMENT_SETTLE_S)
            value = Variable.get(DEPLOYMENT_VARIABLE)
        return check_deployment(value, what) or ""

    def cluster_ref(self, **overrides: Any) -> Any:
        """The RayCluster the connection's ``kuberay`` extra names (a ``rayslice.cloud.kuberay_client.ClusterRef``).

        ``overrides`` (name, namespace, ...) that are not None replace the extra's values.
        """
        from rayslice.cloud.kuberay_client import ClusterRef

        conn = self.get_connection(self.ray_conn_id)
        kuberay = _kuberay_extra(conn)
        if kuberay in (None, "", {}):
            raise InvalidRequestError(f"the `ray` connection {self.ray_conn_id!r} names no RayCluster: set its extra "
                                      '\'kuberay\', e.g. {"namespace": "ml", "name": "rayslice", "in_cluster": true}')
        return ClusterRef.from_extra(kuberay, **overrides)

    def check_tpu_type(self, request: Any) -> None:
        """Fail early if the zone in the connection's ``cloud_tpu`` extra does not offer the slice type.

        Optional: without ``{"cloud_tpu": {"project": "...", "zone": "us-east5-b"}}`` this does nothing.
        The zone's types are cached (``rayslice.cloud.cloud_tpu``), so calling it at every submit is cheap.
        """
        conn = self.get_connection(self.ray_conn_id)
        where = (conn.extra_dejson if conn.extra else {}).get("cloud_tpu")
        if where in (None, "", {}):
            return
        if not isinstance(where, dict) or not {"project", "zone"} <= set(where) \
                or set(where) - {"project", "zone", "api_endpoint"}:
            raise InvalidRequestError("the `ray` connection's extra 'cloud_tpu' must be "
                                      '{"project": "...", "zone": "...", optionally "api_endpoint": "..."}')
        from rayslice.cloud.cloud_tpu import check_accelerator_type

        check_accelerator_type(request, where["project"], where["zone"], api_endpoint=where.get("api_endpoint"))

    def get_conn(self) -> RayJobsClient:
        return self.client()

    def client(self) -> RayJobsClient:
        """A blocking Jobs API client; close it (``with hook.client() as c:``)."""
        return self.settings().client()

    def async_client(self) -> AsyncRayJobsClient:
        """An async Jobs API client; close it (``async with hook.async_client() as c:``)."""
        return self.settings().async_client()

    def test_connection(self) -> tuple[bool, str]:
        """Ask the dashboard for its version: the UI's "Test" button."""
        try:
            with self.client() as client:
                info = client.version()
        except RaysliceError as exc:  # messages are scrubbed of the token and name the fix
            return False, str(exc)
        return True, (f"Ray {info.get('ray_version', '?')} at {self.settings().dashboard_url} "
                      f"(Jobs API version {info.get('version', '?')})")


class RaysliceHook(RayHook):
    """``RayHook`` under rayslice's own connection type, ``rayslice``.

    Why: astro-provider-ray (and Apache's unreleased Ray provider) register the connection type ``ray``
    too, and Airflow gives a type to one provider only (the first by package name: astro's). Next to
    them, make connections of type ``rayslice``; every rayslice operator reads a connection by its id,
    whatever its type, so ``ray`` connections (theirs included: the dashboard URL in ``address``) work too.
    """

    conn_type = "rayslice"
    hook_name = "Ray (rayslice)"
