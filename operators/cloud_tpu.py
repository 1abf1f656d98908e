"""Setup/teardown operators: TPU slices from a Cloud TPU queued resource that join a Ray cluster on GCE VMs.

Why: without KubeRay nothing adds TPU hosts to a Ray cluster for a step. ``CreateTpuSliceOperator``
(``.as_setup()``) checks the zone offers the type, asks for a queued resource whose hosts run
``ray start --address=<head>`` at boot, and waits until it is ACTIVE (in the triggerer, deferrable
by default), deleting it again if that fails (a failed setup skips its teardown).
``DeleteTpuSliceOperator`` (``.as_teardown(setups=...)``) deletes it after the steps, whatever they
did, but only if this DAG run made it.

The queued resource's id defaults to ``"per-run"``: a name of the run's own (a hash of deployment,
DAG and run id, as KubeRay's per-run clusters), computed alike by the setup and the teardown with no
XCom, defined for every run (asset-triggered ones have no logical date, so no ``ts``), and never
shared by two DAGs or two Airflows.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict
from datetime import timedelta
from typing import Any

from airflow.sdk import BaseOperator, Context
from rayslice.hooks.ray import RayHook
from rayslice.operators.setup_triggers import DEFERRAL_GRACE_S, QueuedSliceActiveTrigger
from rayslice.operators.templating import is_templated

from rayslice.cloud import pins
from rayslice.cloud.cloud_tpu import DEFAULT_SCOPES, HOST_PYTHON, QueuedSlice, startup_script
from rayslice.cloud.cluster_names import PER_RUN, per_run_name
from rayslice.core.exceptions import InvalidRequestError

__all__ = ["CreateTpuSliceOperator", "DeleteTpuSliceOperator"]

_TEMPLATED = ("project", "zone", "queued_resource_id")


def _owner(context: Context, deployment: str) -> str:
    """`<deployment>/<dag>/<run>`: another Airflow with the same DAGs and run ids is another owner."""
    return f"{deployment}/{context['dag_run'].dag_id}/{context['dag_run'].run_id}"


class _QueuedOperator(BaseOperator):
    template_fields: Sequence[str] = ("project", "zone", "queued_resource_id")
    ui_color = "#e8f5e9"

    def __init__(self, *, project: str, zone: str, queued_resource_id: str = PER_RUN, tpu: str = "v6e-16",
                 num_slices: int = 1, runtime_version: str | None = None, spot: bool = False,
                 api_endpoint: str | None = None, poll_interval: float = 30.0,
                 ray_conn_id: str = RayHook.default_conn_name, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.ray_conn_id = ray_conn_id  # its `deployment` (else the Airflow Variable) is in the owner mark
        self.project, self.zone, self.queued_resource_id = project, zone, queued_resource_id
        self.tpu, self.num_slices, self.runtime_version, self.spot = tpu, num_slices, runtime_version, spot
        self.api_endpoint = api_endpoint
        if poll_interval <= 0:
            raise InvalidRequestError(f"poll_interval={poll_interval} of {self.task_id!r} is invalid: use > 0")
        self.poll_interval = poll_interval
        if not any(is_templated(getattr(self, f, None)) for f in _TEMPLATED):
            self._queued(None)  # bad project, zone, id, type or count fail when the DAG file is parsed
        elif not is_templated(tpu) and isinstance(num_slices, int):
            from rayslice.cloud.cloud_tpu import served_version

            served_version(tpu, num_slices)  # a type Cloud TPU cannot make fails then too (the id is often templated)

    def _queued_id(self, context: Context | None) -> str:
        """The id as given, or for ``"per-run"`` the run's own (``rs-<dag>-<hash>``; a placeholder at parse time)."""
        if self.queued_resource_id != PER_RUN:
            return self.queued_resource_id
        if context is None:
            return per_run_name("dag", "run")
        run = context["dag_run"]
        return per_run_name(run.dag_id, run.run_id, RayHook(self.ray_conn_id).deployment())

    def _slice_settings(self) -> dict[str, Any]:
        return {}

    def _queued(self, context: Context | None) -> QueuedSlice:
        return QueuedSlice(project=self.project, zone=self.zone, queued_resource_id=self._queued_id(context),
                           tpu=self.tpu, num_slices=self.num_slices, runtime_version=self.runtime_version,
                           spot=self.spot, **self._slice_settings())

    def _client(self, context: Context | None) -> Any:
        from rayslice.cloud.cloud_tpu import QueuedSliceClient

        return QueuedSliceClient(self._queued(context), api_endpoint=self.api_endpoint)


class CreateTpuSliceOperator(_QueuedOperator):
    """Provision ``num_slices`` slices of ``tpu`` whose hosts join the Ray cluster; wait until ACTIVE.

    :param project: / zone / queued_resource_id: where, and the queued resource's id (templated); default
        ``"per-run"``: the run's own id, unique per deployment, DAG and run (give the teardown the same).
    :param network: / subnetwork: the hosts' VPC and subnetwork (default: the ``default`` network).
    :param enable_external_ips: an external IP on every host (default, as gcloud does; the raw API does not).
        False: the startup script reaches PyPI and uv's downloads only through Cloud NAT, and Google's APIs
        through Private Google Access on the subnetwork.
    :param service_account: the hosts' service account e-mail (default: the project's Compute Engine default
        account); it needs the token's secret and the bucket. ``scopes``: its OAuth scopes (``cloud-platform``).
    :param head_address: the Ray head's GCS address ``host:6379`` (templated); default: the host of the
        `ray` connection's dashboard URL, port 6379.
    :param install: at boot, make a Python ``python_version`` environment with uv and install
        ``rayslice[cluster]`` (this version), ``jax[tpu]==<jax_version>`` and ``ray[default]==<ray_version>``
        into it, then start Ray from it (default). False: the VM image has all of it; only ``ray start``.
    :param ray_version: / jax_version / python_version: default the versions rayslice is tested with
        (``rayslice.cloud.pins``); Ray's must be the head's.
    :param ray_start_args: more ``ray start`` arguments.
    :param wheel: rayslice's wheel (``gs://``/``https://`` URL or a path on the VM) to install on the hosts, for
        a ``launcher: installed`` connection; without it they get only what the shipped launcher needs.
    :param token_secret: the Secret Manager secret holding the head's Ray auth token (read at boot).
    :param check_zone: first check that the zone offers ``tpu`` (the list is cached per zone).
    :param active_timeout: seconds to wait for ACTIVE (a queued resource can wait long for capacity).
    :param deferrable: wait in the triggerer (default), holding no worker slot; a wait that fails or
        runs out resumes on a worker to delete the queued resource and fail. False: wait on the worker.
    """

    template_fields: Sequence[str] = (*_QueuedOperator.template_fields, "head_address")

    def __init__(self, *, head_address: str | None = None, ray_conn_id: str = RayHook.default_conn_name,
                 install: bool = True, ray_version: str = pins.RAY_VERSION, jax_version: str = pins.JAX_VERSION,
                 python_version: str = HOST_PYTHON, ray_start_args: str = "", wheel: str | None = None,
                 token_secret: str | None = None, check_zone: bool = True,
                 active_timeout: float = 3600.0, deferrable: bool = True, network: str | None = None,
                 subnetwork: str | None = None, enable_external_ips: bool = True,
                 service_account: str | None = None, scopes: Sequence[str] = DEFAULT_SCOPES,
                 **kwargs: Any) -> None:
        self.network, self.subnetwork, self.enable_external_ips = network, subnetwork, enable_external_ips
        self.service_account, self.scopes = service_account, tuple(scopes)
        super().__init__(ray_conn_id=ray_conn_id, **kwargs)
        self.deferrable = deferrable
        self.head_address = head_address
        self.ray_conn_id = ray_conn_id
        self.script_kwargs = {"install": install, "ray_version": ray_version, "jax_version": jax_version,
                              "python_version": python_version, "ray_start_args": ray_start_args,
                              "wheel": wheel, "token_secret": token_secret}
        self.check_zone = check_zone
        if active_timeout <= 0:
            raise InvalidRequestError(f"active_timeout={active_timeout} of {self.task_id!r} is invalid: use > 0")
        self.active_timeout = active_timeout
        if head_address and not is_templated(head_address):
            startup_script(head_address, **self.script_kwargs)
        else:  # the versions are checked now all the same
            startup_script("0.0.0.0:6379", **self.script_kwargs)

    def _slice_settings(self) -> dict[str, Any]:
        return {"network": self.network, "subnetwork": self.subnetwork, "enable_external_ips": self.enable_external_ips,
                "service_account": self.service_account, "scopes": self.scopes}

    def _head_address(self) -> str:
        if self.head_address:
            return self.head_address
        import httpx

        return f"{httpx.URL(RayHook(self.ray_conn_id).settings().dashboard_url).host}:6379"

    def execute(self, context: Context) -> dict[str, str]:
        from rayslice.cloud.cloud_tpu import check_accelerator_type

        queued = self._queued(context)
        script = startup_script(self._head_address(), **self.script_kwargs)
        if self.check_zone:
            check_accelerator_type(self.tpu, queued.project, queued.zone, api_endpoint=self.api_endpoint)
        deployment = RayHook(self.ray_conn_id).deployment()
        owner = _owner(context, deployment)
        client = self._client(context)
        try:
            client.create(owner=owner, script=script, deployment=deployment)
            self.log.info("[rayslice] queued %s (%d x %s); waiting for ACTIVE%s", queued.name, self.num_slices,
                          self.tpu, " in the triggerer" if self.deferrable else "")
            if not self.deferrable:
                client.wait_active(timeout=self.active_timeout, poll_interval=self.poll_interval)
        except BaseException:
            # A failed setup skips its teardown: never leave slices of ours behind.
            self._delete_own(client, owner)
            raise
        if self.deferrable:
            self.defer(trigger=QueuedSliceActiveTrigger(
                queued=asdict(queued), api_endpoint=self.api_endpoint, owner=owner,
                deadline=time.time() + self.active_timeout, timeout=self.active_timeout,
                poll_interval=self.poll_interval),
                method_name="execute_complete", timeout=timedelta(seconds=self.active_timeout + DEFERRAL_GRACE_S))
        return self._active(queued)

    def execute_complete(self, context: Context, event: dict[str, Any]) -> dict[str, str]:
        """Back from the triggerer: the ACTIVE slices, or their deletion and the reason the wait failed."""
        if event.get("status") == "ready":
            return self._active(self._queued(context))
        self._delete_own(self._client(context), _owner(context, RayHook(self.ray_conn_id).deployment()))
        from rayslice.cloud.cloud_tpu import CloudTpuError

        raise CloudTpuError(event.get("message", event))

    def _active(self, queued: QueuedSlice) -> dict[str, str]:
        self.log.info("[rayslice] %s is ACTIVE; its hosts join the Ray cluster as they boot", queued.name)
        return {"name": queued.name, "tpu": self.tpu, "num_slices": str(self.num_slices)}

    def _delete_own(self, client: Any, owner: str) -> None:
        from rayslice.operators.setup_triggers import retry_passing

        try:
            self.log.warning("[rayslice] after the failed setup, %s: %s", client.queued.name,
                             retry_passing(lambda: client.delete(owner=owner, wait=False)))
        except Exception as exc:
            self.log.error("[rayslice] could not delete %s after the failure: %s", client.queued.name, exc)


class DeleteTpuSliceOperator(_QueuedOperator):
    """Delete the queued resource (and its TPU VMs) if this DAG run made it: 'deleted', 'absent', 'not-owned'."""

    def __init__(self, *, wait: bool = True, delete_timeout: float = 1800.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.wait = wait
        self.delete_timeout = delete_timeout

    def execute(self, context: Context) -> str:
        client = self._client(context)
        owner = _owner(context, RayHook(self.ray_conn_id).deployment())
        outcome = client.delete(owner=owner, wait=self.wait)
        if outcome == "not-owned":
            self.log.warning("[rayslice] %s was not made by %s: left alone", client.queued.name, owner)
        elif outcome == "deleted" and self.wait:
            client.wait_gone(timeout=self.delete_timeout, poll_interval=self.poll_interval)
        self.log.info("[rayslice] %s: %s", client.queued.name, outcome)
        return outcome
