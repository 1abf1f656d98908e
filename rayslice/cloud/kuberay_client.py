"""A KubeRay RayCluster through the Kubernetes API: its dashboard URL, and create/delete with an owner mark.

Why: a `ray` connection may name a RayCluster (namespace/name) instead of a dashboard URL, so the
address follows the cluster wherever KubeRay puts its head. Setup/teardown operators create a
cluster per DAG run; every cluster created here carries an owner annotation, and deleting checks
it (and the uid it read, as a precondition), so a teardown never removes a cluster it did not make.

The ``kubernetes`` client is imported lazily (it costs seconds): DAG files that import the hook or
the operators stay fast to parse. Airflow-free; no ``ray`` import.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from dataclasses import dataclass, fields
from typing import Any, Literal

from rayslice.cloud import kuberay
from rayslice.cloud.cluster_names import owner_for_run
from rayslice.cloud.kuberay_crds import CrdUnavailableError, KubeRayCrds
from rayslice.core.exceptions import InvalidRequestError, RaysliceError

__all__ = [
    "MANAGED_BY_LABEL",
    "CLUSTER_ANNOTATION",
    "OWNER_ANNOTATION",
    "ClusterRef",
    "KubeRayClient",
    "KubeRayError",
    "KubeRayNotReadyError",
    "load_api_client",
    "owner_for_run",
    "resolve",
    "resolve_dashboard_url",
    "resolve_step_cluster",
]

logger = logging.getLogger(__name__)

GROUP, VERSION, PLURAL = "ray.io", "v1", "rayclusters"
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
OWNER_ANNOTATION = "rayslice.io/owner"
#: On a token Secret a setup made: the RayCluster it was made for (only who may write Secrets can forge it).
CLUSTER_ANNOTATION = "rayslice.io/cluster"
DEFAULT_DASHBOARD_PORT = 8265
ADDRESS_MODES = ("auto", "load-balancer", "service-dns", "cluster-ip")
_DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_EXTRA_HINT = ('e.g. {"namespace": "ml", "name": "rayslice", "in_cluster": true} or '
               '{"namespace": "ml", "name": "rayslice", "kubeconfig": "/path/to/kubeconfig"}')

Deleted = Literal["deleted", "absent", "not-owned"]


#: HTTP answers that say "not now" (overload, a control-plane upgrade), not "never".
TRANSIENT_HTTP = frozenset({429, 500, 502, 503, 504})


class KubeRayError(RaysliceError):
    """A Kubernetes API call about a RayCluster failed, or the cluster is not what we need."""

    def __init__(self, message: str, *, status_code: int | None = None, transient: bool = False) -> None:
        super().__init__(message)
        self.status_code = status_code
        #: a passing API failure (5xx, 429, an unreachable or reset connection): asking again may succeed
        self.transient = transient


class KubeRayNotReadyError(KubeRayError):
    """The RayCluster exists but its head is not ready (or did not become ready in time)."""


@dataclass(frozen=True)
class ClusterRef:
    """Where a RayCluster is and how to reach the API server: the `ray` connection's ``kuberay`` extra.

    ``address`` picks the dashboard address: ``load-balancer`` (the head Service's external IP),
    ``service-dns`` (``<svc>.<namespace>.svc``, from inside the cluster), ``cluster-ip``, or
    ``auto``: a load balancer when the Service has one, else the Service DNS name in-cluster.
    """

    name: str
    namespace: str = "default"
    kubeconfig: str | None = None
    context: str | None = None
    in_cluster: bool = False
    address: str = "auto"
    scheme: str = "http"
    token_secret: str | None = None  # the Secret (key ``auth_token``) holding the cluster's Ray token

    def __post_init__(self) -> None:
        kuberay._check_name(self.name, "RayCluster")
        if not isinstance(self.namespace, str) or not _DNS1123_LABEL.match(self.namespace) \
                or len(self.namespace) > 63:
            raise InvalidRequestError(f"kuberay namespace {self.namespace!r} is invalid: a Kubernetes namespace is "
                                      "a DNS-1123 label (lowercase letters, digits, '-'), e.g. 'default'")
        if not isinstance(self.in_cluster, bool):
            raise InvalidRequestError(f"kuberay in_cluster must be true or false, got {self.in_cluster!r}")
        if self.in_cluster and (self.kubeconfig or self.context):
            raise InvalidRequestError("kuberay in_cluster=true uses the pod's service account: "
                                      "drop kubeconfig/context, or set in_cluster to false")
        if self.address not in ADDRESS_MODES:
            raise InvalidRequestError(f"kuberay address {self.address!r} is invalid: use one of "
                                      f"{', '.join(ADDRESS_MODES)}")
        if self.scheme not in ("http", "https"):
            raise InvalidRequestError(f"kuberay scheme {self.scheme!r} is invalid: use http or https")

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name}"

    @classmethod
    def from_extra(cls, value: Any, **overrides: Any) -> ClusterRef:
        """From the connection's ``kuberay`` extra (a dict or its JSON); ``overrides`` that are not None win."""
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError:
                value = None
        if not isinstance(value, dict):
            raise InvalidRequestError(f"the `ray` connection's extra 'kuberay' must be a JSON object, {_EXTRA_HINT}")
        value = {**value, **{k: v for k, v in overrides.items() if v is not None}}
        known = {f.name for f in fields(cls)}
        if unknown := sorted(set(value) - known):
            raise InvalidRequestError(f"unknown key(s) {unknown} in the `ray` connection's extra 'kuberay': "
                                      f"use {sorted(known)}")
        if not value.get("name"):
            raise InvalidRequestError(f"the `ray` connection's extra 'kuberay' has no 'name': {_EXTRA_HINT}")
        return cls(**value)


def default_kubeconfig() -> str:
    """``$KUBECONFIG`` (one path or several joined by ':') or ``~/.kube/config``, read now (kubectl's rule)."""
    return os.environ.get("KUBECONFIG") or "~/.kube/config"


def load_api_client(*, kubeconfig: str | None = None, context: str | None = None, in_cluster: bool = False,
                    retries: int = 2, hint: str = "pass --kubeconfig/--context") -> Any:
    """A ``kubernetes.client.ApiClient`` from a kubeconfig (default ``~/.kube/config``) or the pod's service account."""
    import yaml
    from kubernetes import client, config

    cfg = client.Configuration()
    try:
        if in_cluster:
            config.load_incluster_config(client_configuration=cfg)
        else:
            # The client's own default is read once at import: take $KUBECONFIG as it is now.
            config.load_kube_config(config_file=kubeconfig or default_kubeconfig(), context=context,
                                    client_configuration=cfg,
                                    persist_config=False)
    except (config.ConfigException, OSError, yaml.YAMLError, TypeError, AttributeError) as exc:
        # YAMLError, TypeError, AttributeError: a file that is not a kubeconfig (bad YAML, a list, a string); the
        # kubernetes client does not check its shape and fails inside.
        where = ("the pod's service account (in_cluster)" if in_cluster
                 else f"kubeconfig {kubeconfig or '~/.kube/config'}")
        raise KubeRayError(f"cannot load Kubernetes credentials from {where}: {exc}; {hint}") from None
    cfg.retries = retries
    return client.ApiClient(cfg)


def _owner_of(obj: dict[str, Any]) -> str | None:
    return ((obj.get("metadata") or {}).get("annotations") or {}).get(OWNER_ANNOTATION)


def _condition(obj: dict[str, Any], kind: str) -> dict[str, Any] | None:
    for cond in (obj.get("status") or {}).get("conditions") or []:
        if cond.get("type") == kind:
            return cond
    return None


def is_ready(obj: dict[str, Any]) -> bool:
    """KubeRay marks a usable cluster with ``state: ready``; newer versions add a HeadPodReady condition."""
    status = obj.get("status") or {}
    head_ready = _condition(obj, "HeadPodReady")
    if head_ready is not None and head_ready.get("status") != "True":
        return False
    return status.get("state") == "ready"


def _describe(obj: dict[str, Any]) -> str:
    status = obj.get("status") or {}
    parts = [f"state {status.get('state') or 'unset'!r}"]
    if status.get("reason"):
        parts.append(f"reason {status['reason']!r}")
    for cond in status.get("conditions") or []:
        if cond.get("status") != "True" or cond.get("type") == "RayClusterReplicaFailure":
            parts.append(f"{cond.get('type')}={cond.get('status')} ({cond.get('reason')}: {cond.get('message')})")
    return ", ".join(parts)


class KubeRayClient:
    """Blocking calls about one RayCluster (``ref``); ``with KubeRayClient(ref) as kube:`` closes it.

    ``api_client`` (a ``kubernetes.client.ApiClient``) replaces the one built from ``ref``'s
    kubeconfig or in-cluster service account.
    """

    def __init__(self, ref: ClusterRef, *, api_client: Any = None, timeout: float = 10.0) -> None:
        self.ref = ref
        self.timeout = timeout
        self._own_client = api_client is None
        self._deleted_uid: str | None = None
        self._api = api_client if api_client is not None else self._build_api_client()
        self._crds: KubeRayCrds | None = None

    def _build_api_client(self) -> Any:
        return load_api_client(kubeconfig=self.ref.kubeconfig, context=self.ref.context, in_cluster=self.ref.in_cluster,
                               hint="set the `ray` connection's kuberay 'kubeconfig' or 'in_cluster'")

    def close(self) -> None:
        if self._own_client:
            self._api.close()

    def __enter__(self) -> KubeRayClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- the API calls, errors turned into KubeRayError

    def _call(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError

        try:
            return fn(*args, _request_timeout=self.timeout, **kwargs)
        except ApiException as exc:
            detail = exc.reason
            try:
                detail = json.loads(exc.body).get("message") or detail
            except (TypeError, ValueError, AttributeError):
                pass
            hint = {401: ": check the kubeconfig's credentials",
                    403: ": grant the service account what `rayslice kuberay rbac` prints",
                    }.get(exc.status, "")
            raise KubeRayError(f"{what} {self.ref}: Kubernetes API answered HTTP {exc.status} ({detail}){hint}",
                               status_code=exc.status, transient=exc.status in TRANSIENT_HTTP) from None
        except (HTTPError, OSError) as exc:
            host = getattr(self._api.configuration, "host", "?")
            raise KubeRayError(f"{what} {self.ref}: cannot reach the Kubernetes API at {host} "
                               f"({type(exc).__name__}: {exc})", transient=True) from None

    def _custom(self) -> Any:
        from kubernetes import client

        return client.CustomObjectsApi(self._api)

    def get(self) -> dict[str, Any] | None:
        """The RayCluster object, or None when there is none."""
        try:
            return self._call("get RayCluster", self._custom().get_namespaced_custom_object,
                              GROUP, VERSION, self.ref.namespace, PLURAL, self.ref.name)
        except KubeRayError as exc:
            if exc.status_code == 404:
                return None
            raise

    def _service(self, name: str) -> Any:
        from kubernetes import client

        return self._call("get the head Service of", client.CoreV1Api(self._api).read_namespaced_service,
                          name, self.ref.namespace)

    # ---- the dashboard

    def dashboard_url(self, obj: dict[str, Any] | None = None) -> str:
        """The Ray dashboard (Jobs API) URL of a ready cluster, from its status and head Service."""
        obj = obj if obj is not None else self.get()
        if obj is None:
            raise KubeRayError(f"no RayCluster {self.ref}: create it (CreateRayClusterOperator, kubectl apply) "
                               "or fix the `ray` connection's kuberay name/namespace", status_code=404)
        if not is_ready(obj):
            raise KubeRayNotReadyError(f"RayCluster {self.ref} is not ready ({_describe(obj)}): wait for it, or "
                                       f"see `kubectl describe raycluster -n {self.ref.namespace} {self.ref.name}`")
        status = obj.get("status") or {}
        head = status.get("head") or {}
        svc_name = head.get("serviceName") or f"{self.ref.name}-head-svc"
        svc = self._service(svc_name)
        port = next((p.port for p in svc.spec.ports or [] if p.name == "dashboard"), None)
        port = port or int((status.get("endpoints") or {}).get("dashboard") or DEFAULT_DASHBOARD_PORT)
        ingress = [i for i in ((svc.status and svc.status.load_balancer and svc.status.load_balancer.ingress) or [])
                   if i.ip or i.hostname]
        mode = self.ref.address
        if mode == "auto":
            mode = "load-balancer" if ingress else "service-dns" if self.ref.in_cluster else ""
        if mode == "load-balancer":
            if not ingress:
                raise KubeRayNotReadyError(f"the head Service {self.ref.namespace}/{svc_name} has no load balancer "
                                           f"address (type {svc.spec.type}): set the RayCluster's "
                                           "headGroupSpec.serviceType to LoadBalancer, or pick another address mode")
            host = ingress[0].ip or ingress[0].hostname
        elif mode == "service-dns":
            host = f"{svc_name}.{self.ref.namespace}.svc"
        elif mode == "cluster-ip":
            host = svc.spec.cluster_ip or head.get("serviceIP")
            if not host or host == "None":
                raise KubeRayError(f"the head Service {self.ref.namespace}/{svc_name} has no cluster IP")
        else:
            raise KubeRayError(
                f"the head Service {self.ref.namespace}/{svc_name} is {svc.spec.type} and Airflow runs outside the "
                "cluster (kubeconfig): set headGroupSpec.serviceType to LoadBalancer, run Airflow in the cluster "
                "with in_cluster=true, or set the kuberay 'address' to service-dns/cluster-ip if this network "
                "reaches them")
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"  # IPv6
        return f"{self.ref.scheme}://{host}:{port}"

    # ---- the Ray token's Secret

    def _core(self) -> Any:
        from kubernetes import client

        return client.CoreV1Api(self._api)

    def read_token(self, secret: str, *, owner: str | None = None, made_for: str | None = None) -> str:
        """The Ray auth token in ``secret`` (key ``auth_token``), for the `ray` connection.

        ``owner``: read it only if it carries that owner mark (a Secret a DAG run made for its own cluster).
        ``made_for``: only if a setup made it for the RayCluster of that name (its cluster annotation).
        """
        import base64

        try:
            obj = self._call("read the Ray token Secret of", self._core().read_namespaced_secret,
                             secret, self.ref.namespace)
        except KubeRayError as exc:
            if exc.status_code == 404:
                raise KubeRayError(f"no Secret {self.ref.namespace}/{secret} with the Ray token of {self.ref}: "
                                   "create it, or fix the kuberay extra's 'token_secret'", status_code=404) from None
            raise
        marks = (obj.metadata and obj.metadata.annotations) or {}
        if owner is not None and marks.get(OWNER_ANNOTATION) != owner:
            raise KubeRayError(f"the Secret {self.ref.namespace}/{secret} was not made by the DAG run that made "
                               f"{self.ref} ({owner}): its token is not used for that cluster")
        if made_for is not None and marks.get(CLUSTER_ANNOTATION) != made_for:
            raise KubeRayError(f"the Secret {self.ref.namespace}/{secret}, which RayCluster {self.ref} names, was not "
                               f"made by a setup for that cluster: its token is not sent there (name it in the "
                               "kuberay extra's 'token_secret' if it is meant for it)")
        value = (obj.data or {}).get(kuberay.TOKEN_SECRET_KEY)
        if not value:
            raise KubeRayError(f"the Secret {self.ref.namespace}/{secret} has no '{kuberay.TOKEN_SECRET_KEY}' key")
        return base64.b64decode(value).decode()

    def ensure_token_secret(self, secret: str, *, owner: str) -> bool:
        """Make ``secret`` with a fresh random token unless it exists; True when this call made it.

        An existing Secret is used as it is (a token the operator rotates or shares: name it in the kuberay
        extra's ``token_secret`` too, so that steps may read it); a new one carries the owner mark, so
        ``delete_token_secret`` removes only what this owner made, and the cluster it is for.
        """
        import secrets as random

        from kubernetes import client

        body = client.V1Secret(
            metadata=client.V1ObjectMeta(name=secret, namespace=self.ref.namespace,
                                         labels={MANAGED_BY_LABEL: "rayslice"},
                                         annotations={OWNER_ANNOTATION: owner,
                                                      CLUSTER_ANNOTATION: self.ref.name}),
            type="Opaque", string_data={kuberay.TOKEN_SECRET_KEY: random.token_hex(32)})
        try:
            self._call("create the Ray token Secret of", self._core().create_namespaced_secret,
                       self.ref.namespace, body)
        except KubeRayError as exc:
            if exc.status_code == 409:
                return False
            raise
        return True

    def delete_token_secret(self, secret: str, *, owner: str) -> Deleted:
        """Delete ``secret`` only if ``owner`` made it: 'deleted', 'absent' or 'not-owned'."""
        try:
            obj = self._call("read the Ray token Secret of", self._core().read_namespaced_secret,
                             secret, self.ref.namespace)
        except KubeRayError as exc:
            if exc.status_code == 404:
                return "absent"
            raise
        if not owner or ((obj.metadata and obj.metadata.annotations) or {}).get(OWNER_ANNOTATION) != owner:
            return "not-owned"
        try:
            self._call("delete the Ray token Secret of", self._core().delete_namespaced_secret,
                       secret, self.ref.namespace)
        except KubeRayError as exc:
            if exc.status_code == 404:
                return "absent"
            raise
        return "deleted"

    # ---- lifecycle

    def create(self, manifest: dict[str, Any], *, owner: str) -> dict[str, Any]:
        """Create the RayCluster marked as ``owner``'s; a cluster ``owner`` already made is returned as is.

        The manifest gets ``ref``'s name and namespace and is checked against the RayCluster CRD installed
        in this cluster (read once per client), so a bad manifest fails with its JSON path before it is
        sent. Where reading the CRD is not allowed (no RBAC on customresourcedefinitions) that is logged
        and the API server's own check is the only one.
        """
        if not owner:
            raise InvalidRequestError("create needs an owner (e.g. '<deployment>/<dag_id>/<run_id>') to mark the "
                                      "cluster with")
        body = json.loads(json.dumps(manifest))  # a deep copy that is plain JSON
        meta = body.setdefault("metadata", {})
        meta["name"], meta["namespace"] = self.ref.name, self.ref.namespace
        meta.setdefault("labels", {})[MANAGED_BY_LABEL] = "rayslice"
        meta.setdefault("annotations", {})[OWNER_ANNOTATION] = owner
        self.check(body)
        try:
            # Strict: an API server whose KubeRay lacks a field (authOptions.secretName before 1.6.0) refuses the
            # cluster; its default (Warn) would drop the field, and KubeRay would run on a token nobody has.
            return self._call("create RayCluster", self._custom().create_namespaced_custom_object,
                              GROUP, VERSION, self.ref.namespace, PLURAL, body, field_validation="Strict")
        except KubeRayError as exc:
            if exc.status_code != 409:
                raise
        existing = self.get()
        if existing is not None and _owner_of(existing) == owner:
            return existing  # a retry of the same setup: adopt what it made
        made_by = _owner_of(existing or {}) or "someone else (no rayslice owner mark)"
        raise KubeRayError(f"RayCluster {self.ref} already exists and was made by {made_by}, not {owner}: it is "
                           "left alone; pick another name, or delete it yourself "
                           f"(`kubectl delete raycluster -n {self.ref.namespace} {self.ref.name}`)", status_code=409)

    def check(self, manifest: dict[str, Any]) -> None:
        """Validate ``manifest`` against the cluster's KubeRay CRD (see ``create``); KubeRay's own rules always."""
        if self._crds is None:
            self._crds = KubeRayCrds.from_cluster(self._api, timeout=self.timeout)
        try:
            checked = kuberay.validate(manifest, self._crds)
        except CrdUnavailableError as exc:
            if exc.status_code == 404:
                raise KubeRayError(f"cannot create RayCluster {self.ref}: {exc}", status_code=404) from None
            kuberay.check_rules(manifest)
            logger.warning("RayCluster %s not validated before sending (%s); the API server validates it",
                           self.ref, exc)
            return
        logger.info("RayCluster %s validated against %s", self.ref, checked)

    def ready_url(self) -> tuple[str | None, str]:
        """One look: (the dashboard URL, "") once the cluster is ready, else (None, why not yet)."""
        obj = self.get()
        if obj is None:
            raise KubeRayError(f"RayCluster {self.ref} disappeared while waiting for it to become ready",
                               status_code=404)
        try:
            return self.dashboard_url(obj), ""
        except KubeRayNotReadyError as exc:
            return None, str(exc)

    def wait_ready(self, *, timeout: float = 900.0, poll_interval: float = 5.0) -> str:
        """Poll until the cluster is ready and its dashboard has an address; returns the dashboard URL."""
        deadline = time.monotonic() + timeout
        while True:
            url, why = self.ready_url()
            if url is not None:
                return url
            if time.monotonic() >= deadline:
                raise not_ready_in_time(self.ref, timeout, why)
            time.sleep(poll_interval)

    def delete(self, *, owner: str) -> Deleted:
        """Delete the cluster only if ``owner`` made it: 'deleted', 'absent' (nothing there) or 'not-owned'."""
        obj = self.get()
        if obj is None:
            return "absent"
        if not owner or _owner_of(obj) != owner:
            return "not-owned"
        from kubernetes import client

        uid = (obj.get("metadata") or {}).get("uid")
        body = client.V1DeleteOptions(propagation_policy="Foreground",
                                      preconditions=client.V1Preconditions(uid=uid) if uid else None)
        try:
            self._call("delete RayCluster", self._custom().delete_namespaced_custom_object,
                       GROUP, VERSION, self.ref.namespace, PLURAL, self.ref.name, body=body)
        except KubeRayError as exc:
            if exc.status_code == 404:
                return "absent"
            if exc.status_code == 409:  # the uid precondition failed: the name now holds another cluster
                return "not-owned"
            raise
        self._deleted_uid = uid
        return "deleted"

    def wait_gone(self, *, timeout: float = 600.0, poll_interval: float = 5.0) -> None:
        """Poll until the cluster ``delete`` removed is gone (with Foreground deletion: after its pods)."""
        deadline = time.monotonic() + timeout
        while (obj := self.get()) is not None:
            if self._deleted_uid and (obj.get("metadata") or {}).get("uid") != self._deleted_uid:
                return  # another cluster took the name since: ours is gone
            if time.monotonic() >= deadline:
                raise KubeRayError(f"RayCluster {self.ref} still exists {timeout:g} s after its deletion "
                                   "(finalizers or pods stuck terminating?)")
            time.sleep(poll_interval)


def not_ready_in_time(ref: ClusterRef, timeout: float, why: str) -> KubeRayNotReadyError:
    return KubeRayNotReadyError(f"RayCluster {ref} not ready after {timeout:g} s: {why or 'not found'}")


def resolve_dashboard_url(ref: ClusterRef, *, timeout: float = 10.0, api_client: Any = None) -> str:
    """The dashboard URL of the RayCluster ``ref`` names (one GET of the cluster, one of its Service)."""
    return resolve(ref, timeout=timeout, api_client=api_client)[0]


def resolve(ref: ClusterRef, *, timeout: float = 10.0, api_client: Any = None) -> tuple[str, str | None]:
    """The dashboard URL of ``ref``'s RayCluster, and its Ray token when ``ref.token_secret`` names its Secret."""
    with KubeRayClient(ref, timeout=timeout, api_client=api_client) as kube:
        url = kube.dashboard_url()
        return url, kube.read_token(ref.token_secret) if ref.token_secret else None


def resolve_step_cluster(ref: ClusterRef, *, owner: str | None = None, timeout: float = 10.0,
                         api_client: Any = None) -> tuple[str, str | None, bool]:
    """A step's ``kuberay_cluster``: its dashboard URL, its token, and whether that token is the cluster's own.

    A cluster a rayslice setup made (it carries an owner mark) has a token of its own: the one in the Secret
    its ``authOptions`` name, used only if a setup made that Secret for a cluster of this name (its cluster
    annotation: writing it takes the right to write Secrets, not only RayClusters), or if the connection's
    admin named it (the extra's ``token_secret``). A cluster's spec may thus not choose another team's
    Secret for Airflow to read, and the connection's password (a shared cluster's token) is never sent to it.
    Any other cluster is authenticated as the connection's own (``ref.token_secret``, or the caller's password).
    ``owner``: the cluster must be this DAG run's own (``kuberay_cluster="per-run"``) and carry that mark,
    else it is refused before any token is read or sent.
    """
    with KubeRayClient(ref, timeout=timeout, api_client=api_client) as kube:
        obj = kube.get()
        if obj is None:
            raise KubeRayError(f"no RayCluster {ref}: create it (CreateRayClusterOperator, kubectl apply) or fix the "
                               "step's kuberay_cluster", status_code=404)
        mark = _owner_of(obj)
        if owner is not None and mark != owner:
            raise KubeRayError(f"RayCluster {ref} was made by {mark or 'someone else (no rayslice owner mark)'}, not "
                               f"by this DAG run ({owner}): a step with kuberay_cluster='per-run' runs only on the "
                               "cluster its own run's CreateRayClusterOperator made, and is sent no token otherwise")
        url = kube.dashboard_url(obj)
        if mark is None:
            return url, kube.read_token(ref.token_secret) if ref.token_secret else None, False
        options = (obj.get("spec") or {}).get("authOptions") or {}
        if options.get("mode") != "token":
            return url, None, True
        secret = options.get("secretName") or kuberay.token_secret_name(ref.name)
        if owner is not None:  # a run's own: made by that run, for this cluster
            return url, kube.read_token(secret, owner=owner, made_for=ref.name), True
        return url, kube.read_token(secret, made_for=None if secret == ref.token_secret else ref.name), True
