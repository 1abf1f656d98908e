"""Setup/teardown operators: a KubeRay RayCluster that lives exactly as long as one DAG run.

Why: a per-run cluster bills only while the run needs it. ``CreateRayClusterOperator(...).as_setup()``
renders the cluster (``rayslice.cloud.kuberay``), creates it marked with the run as owner, waits
until its dashboard answers to an address (in the triggerer, deferrable by default), and deletes it
again if anything in that fails (a failed setup skips its teardown).
``DeleteRayClusterOperator(...).as_teardown(setups=create)`` runs even when steps fail, deletes only
a cluster this run made (a pre-existing one is left alone), and is a no-op when the cluster is
already gone. Both find the cluster through the `ray` connection's ``kuberay`` extra, the same
connection the steps use, so the steps reach the new cluster with no other wiring.

``name="per-run"`` (``rayslice.cloud.cluster_names.PER_RUN``) gives each DAG run a cluster of its own
(``rs-<dag>-<hash of the run>``), so runs of one DAG may overlap; the steps between take
``kuberay_cluster="per-run"`` and reach the same name, computed from the same run.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict
from datetime import timedelta
from typing import Any

from airflow.sdk import BaseOperator, Context
from airflow.sdk.exceptions import AirflowFailException
from rayslice.hooks.ray import RayHook
from rayslice.operators.setup_triggers import DEFERRAL_GRACE_S, RayClusterReadyTrigger
from rayslice.operators.templating import is_templated

from rayslice.cloud import cluster_names, kuberay
from rayslice.core.exceptions import InvalidRequestError

__all__ = ["CreateRayClusterOperator", "DeleteRayClusterOperator"]

#: On a RayCluster this run created: the Secret holding its Ray token, which the teardown deletes too.
TOKEN_SECRET_ANNOTATION = "rayslice.io/token-secret"


def _owner(context: Context, deployment: str) -> str:
    from rayslice.cloud.kuberay_client import owner_for_run

    return owner_for_run(context["dag_run"].dag_id, context["dag_run"].run_id, deployment)


class _ClusterOperator(BaseOperator):
    template_fields: Sequence[str] = ("name", "namespace")
    ui_color = "#ede7f6"

    def __init__(self, *, ray_conn_id: str = RayHook.default_conn_name, name: str | None = None,
                 namespace: str | None = None, poll_interval: float = 5.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if name is not None and not is_templated(name):
            cluster_names.check_name(name, f"name of {self.task_id!r}")
        if poll_interval <= 0:
            raise InvalidRequestError(f"poll_interval={poll_interval} of {self.task_id!r} is invalid: use > 0")
        self.ray_conn_id = ray_conn_id
        self.name = name
        self.namespace = namespace
        self.poll_interval = poll_interval

    def _client(self, context: Context, deployment: str) -> Any:
        """The client of this run's cluster: ``name`` as rendered (the run's own for "per-run"), else the extra's."""
        from rayslice.cloud.kuberay_client import KubeRayClient

        run = context["dag_run"]
        try:
            name = cluster_names.resolve_name(self.name, run.dag_id, run.run_id, deployment,
                                              what=f"name of {self.task_id!r}")
        except InvalidRequestError as exc:  # a templated name rendered to something no cluster can be called
            raise AirflowFailException(str(exc)) from None
        ref = RayHook(self.ray_conn_id).cluster_ref(name=name, namespace=self.namespace or None)
        return KubeRayClient(ref)


class CreateRayClusterOperator(_ClusterOperator):
    """Create a RayCluster for this DAG run and wait until it is ready; XCom: name, namespace, dashboard_url.

    :param ray_conn_id: the `ray` connection whose ``kuberay`` extra names the cluster (and the API server).
    :param name: / :param namespace: override the connection's (templated). ``name="per-run"``: a name of
        this DAG run's own (``rs-<dag>-<hash>``), the one the steps' ``kuberay_cluster="per-run"`` reach.
    :param tpus: / max_slices / gpu_nodes / gpu_type / image / gpu_image / idle_timeout_seconds: as ``rayslice
        kuberay manifest`` (``rayslice.cloud.kuberay.render_raycluster``), checked when the DAG file is parsed.
        ``image`` / ``gpu_image`` default to the names of what ``docker/Dockerfile.tpu`` / ``.gpu`` build; push
        them to a registry the nodes pull from and pass those names (docs/deploying.md, Cluster image).
    :param head_service_type: the head Service type: ``ClusterIP`` (default), or ``NodePort`` /
        ``LoadBalancer`` to reach the dashboard from outside the Kubernetes cluster (refused without auth,
        and logged as a warning with it); with ``manifest``, it replaces the manifest's own when given.
    :param auth: Ray token auth (default on). The token lives in the Secret ``token_secret`` (default
        ``<name>-ray-token``, key ``auth_token``): created with a random token before the cluster unless it
        exists, deleted by the teardown when this run made it. Give the `ray` connection's kuberay extra the
        same ``token_secret`` so the steps authenticate. Not with ``name="per-run"``: a run's own cluster
        always keeps its token in ``<name>-ray-token``, which only its steps read.
    :param pods: ``rayslice.cloud.kuberay.PodSettings``: the pods' service account, labels, node selectors,
        tolerations, priority class, pull Secrets, head size (as the CLI's pod flags).
    :param manifest: a complete RayCluster instead of the rendering arguments (its ``authOptions`` and
        head ``serviceType`` are honoured and checked the same way).
    :param ready_timeout: seconds to wait for the cluster's head to be ready.
    :param deferrable: wait in the triggerer (default), holding no worker slot; a wait that fails or
        runs out resumes on a worker to delete the cluster and fail. False: wait on the worker.
    """

    def __init__(self, *, tpus: Sequence[str] = (), max_slices: int = 1, gpu_nodes: int = 0,
                 gpu_type: str = "nvidia-l4", image: str = kuberay.DEFAULT_IMAGE,
                 gpu_image: str = kuberay.DEFAULT_GPU_IMAGE, idle_timeout_seconds: int = 60,
                 head_service_type: str | None = None, auth: bool = True, token_secret: str | None = None,
                 manifest: dict[str, Any] | None = None, ready_timeout: float = 900.0, deferrable: bool = True,
                 pods: kuberay.PodSettings | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.deferrable = deferrable
        if manifest is not None and (tpus or gpu_nodes):
            raise InvalidRequestError(f"{self.task_id!r}: give either manifest or tpus/gpu_nodes, not both")
        if ready_timeout <= 0:
            raise InvalidRequestError(f"ready_timeout={ready_timeout} of {self.task_id!r} is invalid: use > 0")
        if token_secret and self.name == cluster_names.PER_RUN:
            raise InvalidRequestError(
                f"token_secret={token_secret!r} of {self.task_id!r} cannot be used with name='per-run': each run's "
                "cluster keeps its token in a Secret of its own (<name>-ray-token), made and deleted with it, and its "
                "steps read only that one; drop token_secret")
        self.render_kwargs = {"tpus": list(tpus), "max_slices": max_slices, "gpu_nodes": gpu_nodes,
                              "gpu_type": gpu_type, "image": image, "gpu_image": gpu_image,
                              "idle_timeout_seconds": idle_timeout_seconds,
                              "auth": auth, "token_secret": token_secret,
                              "head_service_type": head_service_type or "ClusterIP", "pods": pods}
        self.head_service_type = head_service_type  # with `manifest`: replaces its head serviceType when given
        self.manifest = manifest
        self.ready_timeout = ready_timeout
        if manifest is not None and (not isinstance(manifest, dict) or manifest.get("kind") != "RayCluster"):
            raise InvalidRequestError(f"manifest of {self.task_id!r} must be a RayCluster dict (kind: RayCluster)")
        try:  # bad TPU types, counts, an unauthenticated external head... fail when the DAG file is parsed
            self._manifest(self.name if self.name and not is_templated(self.name) else "rayslice")
        except InvalidRequestError as exc:
            raise InvalidRequestError(f"{self.task_id!r}: {exc}") from None
        self._kube: Any = None
        self._owner: str | None = None

    def _manifest(self, name: str) -> dict[str, Any]:
        """The manifest to create, and the exposure check both paths (rendered or given) go through."""
        if self.manifest is None:
            return kuberay.render_raycluster(name, **self.render_kwargs)
        manifest = dict(self.manifest)
        spec = manifest.get("spec") or {}
        if self.head_service_type:
            spec = manifest["spec"] = {**spec, "headGroupSpec": {**(spec.get("headGroupSpec") or {}),
                                                                 "serviceType": self.head_service_type}}
        auth = (spec.get("authOptions") or {}).get("mode") == "token"
        if auth and self.name == cluster_names.PER_RUN:  # each run's token in a Secret of its own, deleted with it
            spec = manifest["spec"] = {**spec, "authOptions": {**spec["authOptions"],
                                                               "secretName": kuberay.token_secret_name(name)}}
        kuberay.exposure_warning((spec.get("headGroupSpec") or {}).get("serviceType") or "ClusterIP", auth)
        return manifest

    @staticmethod
    def _token_secret(manifest: dict[str, Any]) -> str | None:
        options = manifest["spec"].get("authOptions") or {}
        return options.get("secretName") if options.get("mode") == "token" else None

    def execute(self, context: Context) -> dict[str, str]:
        deployment = RayHook(self.ray_conn_id).deployment()
        owner = self._owner = _owner(context, deployment)
        with self._client(context, deployment) as kube:
            self._kube = kube
            manifest = self._manifest(kube.ref.name)
            if self.manifest is None and (note := kuberay.default_image_note(
                    self.render_kwargs["image"], self.render_kwargs["gpu_image"] if self.render_kwargs["gpu_nodes"]
                    else None)):
                self.log.warning("[rayslice] %s", note)
            options = manifest["spec"].get("authOptions") or {}
            if warning := kuberay.exposure_warning(manifest["spec"]["headGroupSpec"].get("serviceType") or "ClusterIP",
                                                   options.get("mode") == "token"):
                self.log.warning("[rayslice] %s", warning)
            try:
                kube.check(manifest)  # a cluster without KubeRay (or a bad manifest) fails before the Secret is made
                if secret := self._token_secret(manifest):
                    made = kube.ensure_token_secret(secret, owner=owner)
                    if not made and self.name == cluster_names.PER_RUN:  # only this run's own (an earlier try's)
                        kube.read_token(secret, owner=owner)
                    self.log.info("[rayslice] Ray token auth on: the token is in Secret %s/%s (%s)",
                                  kube.ref.namespace, secret, "made now" if made else "already there, used as is")
                    # The teardown deletes the Secret this names (a given manifest may name any).
                    manifest = {**manifest, "metadata": {**manifest.get("metadata", {}), "annotations": {
                        **(manifest.get("metadata", {}).get("annotations") or {}), TOKEN_SECRET_ANNOTATION: secret}}}
                kube.create(manifest, owner=owner)
                self.log.info("[rayslice] created RayCluster %s (owner %s); waiting for its head%s", kube.ref, owner,
                              " in the triggerer" if self.deferrable else "")
                url = None if self.deferrable else kube.wait_ready(timeout=self.ready_timeout,
                                                                   poll_interval=self.poll_interval)
            except BaseException:
                # A failed setup skips its teardown: never leave a cluster of ours behind.
                self._delete_own(kube, owner)
                raise
            finally:
                self._kube = None
        if url is None:
            self.defer(trigger=RayClusterReadyTrigger(
                ref=asdict(kube.ref), token_secret=self._token_secret(manifest), owner=owner,
                deadline=time.time() + self.ready_timeout, timeout=self.ready_timeout,
                poll_interval=self.poll_interval),
                method_name="execute_complete", timeout=timedelta(seconds=self.ready_timeout + DEFERRAL_GRACE_S))
        return self._ready(kube.ref.namespace, kube.ref.name, url)

    def execute_complete(self, context: Context, event: dict[str, Any]) -> dict[str, str]:
        """Back from the triggerer: the ready cluster's address, or its deletion and the reason it failed."""
        if event.get("status") == "ready":
            return self._ready(event["namespace"], event["name"], event["dashboard_url"])
        deployment = RayHook(self.ray_conn_id).deployment()
        with self._client(context, deployment) as kube:
            self._delete_own(kube, _owner(context, deployment))
        from rayslice.cloud.kuberay_client import KubeRayError, KubeRayNotReadyError

        error = KubeRayNotReadyError if event.get("status") == "timeout" else KubeRayError
        raise error(event.get("message", event))

    def _ready(self, namespace: str, name: str, url: str) -> dict[str, str]:
        self.log.info("[rayslice] RayCluster %s/%s is ready; dashboard %s", namespace, name, url)
        return {"namespace": namespace, "name": name, "dashboard_url": url}

    def _delete_own(self, kube: Any, owner: str) -> None:
        from rayslice.operators.setup_triggers import retry_passing

        try:
            outcome = retry_passing(lambda: kube.delete(owner=owner))
            secret = self._token_secret(self._manifest(kube.ref.name))
            secret_outcome = retry_passing(lambda: kube.delete_token_secret(secret, owner=owner)) if secret else None
        except Exception as exc:  # report the original failure, and this one
            self.log.error("[rayslice] could not delete RayCluster %s after the failure: %s", kube.ref, exc)
            return
        self.log.warning("[rayslice] RayCluster %s after the failed setup: %s%s", kube.ref, outcome,
                         f"; its token Secret {secret}: {secret_outcome}" if secret else "")

    def on_kill(self) -> None:
        if self._kube is not None and self._owner:
            self._delete_own(self._kube, self._owner)


class DeleteRayClusterOperator(_ClusterOperator):
    """Delete the RayCluster this DAG run created; returns 'deleted', 'absent' or 'not-owned' (left alone).

    :param wait: wait until the cluster (and, Foreground deletion, its pods) is gone.
    :param delete_timeout: seconds to wait for that.
    :param token_secret: the Secret of the cluster's Ray token (default ``<name>-ray-token``), deleted too
        when this run made it.
    """

    def __init__(self, *, wait: bool = True, delete_timeout: float = 600.0, token_secret: str | None = None,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.wait = wait
        self.delete_timeout = delete_timeout
        self.token_secret = token_secret

    def execute(self, context: Context) -> str:
        deployment = RayHook(self.ray_conn_id).deployment()
        owner = _owner(context, deployment)
        with self._client(context, deployment) as kube:
            existing = kube.get() or {}
            named = ((existing.get("metadata") or {}).get("annotations") or {}).get(TOKEN_SECRET_ANNOTATION)
            outcome = kube.delete(owner=owner)
            if outcome == "not-owned":
                self.log.warning("[rayslice] RayCluster %s was not created by %s: left alone", kube.ref, owner)
            elif outcome == "absent" and self.name == cluster_names.PER_RUN:  # its setup made another name?
                self.log.warning("[rayslice] RayCluster %s (this run's own) is not there: already gone, or its setup "
                                 "did not create it under name='per-run' on connection %r", kube.ref, self.ray_conn_id)
            elif outcome == "absent":
                self.log.info("[rayslice] RayCluster %s is already gone", kube.ref)
            else:
                self.log.info("[rayslice] deleting RayCluster %s", kube.ref)
                if self.wait:
                    kube.wait_gone(timeout=self.delete_timeout, poll_interval=self.poll_interval)
                    self.log.info("[rayslice] RayCluster %s is gone", kube.ref)
            secret = self.token_secret or named or kuberay.token_secret_name(kube.ref.name)
            self.log.info("[rayslice] Ray token Secret %s/%s: %s", kube.ref.namespace, secret,
                          kube.delete_token_secret(secret, owner=owner))
        return outcome
