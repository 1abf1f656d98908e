"""A Kubernetes API server fake for the KubeRay client: real HTTP, API-shaped JSON, KubeRay's status.

No API server can run here, so this stands in at the HTTP transport: the real `kubernetes`
client (loaded from a real kubeconfig file) talks to it. It serves RayClusters
(``/apis/ray.io/v1/.../rayclusters``) and the head Services KubeRay would make, answers errors as
``metav1.Status`` objects, checks the bearer token, serves the KubeRay CRDs it was given (the real
ones, from the reference files) at ``/apis/apiextensions.k8s.io/v1/customresourcedefinitions/<name>``,
validates every RayCluster it accepts *and* serves against those same CRDs
(``rayslice.cloud.kuberay.validate``), honours delete preconditions (uid) and Foreground deletion,
and plays the KubeRay operator: a cluster turns ``ready`` (status ``head``, ``endpoints``,
conditions, a head Service shaped like KubeRay's) after a few GETs.
"""

from __future__ import annotations

import base64
import json
import re
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml

from rayslice.cloud import kuberay
from rayslice.cloud.kuberay_crds import CRD_NAMES, KubeRayCrds
from tests.http_fake import JsonHttpFake, Request

_CLUSTERS = re.compile(r"^/apis/ray\.io/v1/namespaces/([^/]+)/rayclusters(?:/([^/]+))?$")
_SERVICE = re.compile(r"^/api/v1/namespaces/([^/]+)/services/([^/]+)$")
_SECRETS = re.compile(r"^/api/v1/namespaces/([^/]+)/secrets(?:/([^/]+))?$")
_CRD = re.compile(r"^/apis/apiextensions\.k8s\.io/v1/customresourcedefinitions/([^/]+)$")
_WEBHOOKS = "/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations"


def _rule_allows(rule: dict[str, Any], attrs: dict[str, Any]) -> bool:
    """Kubernetes' RBAC match of one PolicyRule (plus the ``namespace`` of its Role, None for a ClusterRole)."""
    if rule.get("namespace") is not None and rule["namespace"] != attrs.get("namespace"):
        return False
    names = rule.get("resourceNames")
    return (attrs.get("group", "") in rule["apiGroups"] and attrs.get("resource") in rule["resources"]
            and attrs.get("verb") in rule["verbs"] and (not names or attrs.get("name") in names))
_SSAR = "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews"


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _status(code: int, reason: str, message: str, **details: Any) -> dict[str, Any]:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": message,
            "reason": reason, "details": details, "code": code}


class FakeKubernetes(JsonHttpFake):
    """``with FakeKubernetes(crds=files) as kube:`` -> ``kube.url``, ``kube.write_kubeconfig(path)``, ``kube.clusters``.

    ``crds``: KubeRay CRD files, installed in the fake cluster (``installed_crds``, by CRD name: a
    test may replace or remove one before the first request).
    """

    def __init__(self, *, crds: list[Path], token: str = "fake-token", ready_after_gets: int = 2,
                 gone_after_gets: int = 1, load_balancer_ip: str = "127.0.0.1", cluster_ip: str = "10.12.0.7",
                 service_ports: dict[str, int] | None = None) -> None:
        self.token = token
        self.ready_after_gets = ready_after_gets  # None: never ready
        self.gone_after_gets = gone_after_gets
        self.load_balancer_ip = load_balancer_ip
        self.cluster_ip = cluster_ip  # every head Service's cluster IP (a test may point it at a local Ray)
        # Head Service ports by name, over the head container's (a test's Ray dashboard on another port).
        self.service_ports = dict(service_ports or {})
        # Mutating webhook configurations installed (by name): the TPU webhook's by default.
        self.mutating_webhooks: list[str] = ["kuberay-tpu-webhook-mutating-webhook-configuration"]
        # (verb, resource) pairs a SelfSubjectAccessReview answers "not allowed" for; everything else is allowed.
        self.denied: set[tuple[str, str]] = set()
        # Or, when set, RBAC as the API server evaluates it: the rules of Roles (``namespace``: theirs) and
        # ClusterRoles (``namespace`` None) bound to the caller; a rule with resourceNames allows only a request
        # naming one of them (a review without a name is not allowed by it).
        self.rbac_rules: list[dict[str, Any]] | None = None
        self.clusters: dict[tuple[str, str], dict[str, Any]] = {}
        self.services: dict[tuple[str, str], dict[str, Any]] = {}
        self.secrets: dict[tuple[str, str], dict[str, Any]] = {}  # as stored: ``data`` base64, like the API
        self.requests: list[tuple[str, str, Any]] = []  # method, path, JSON body
        self.failures: list[tuple[str, re.Pattern[str], int]] = []
        self._gets: dict[str, int] = {}
        files = KubeRayCrds.from_files(crds)
        self.installed_crds: dict[str, dict[str, Any]] = {name: files.crd(kind) for kind, name in CRD_NAMES.items()}
        # The API server's own check uses what is installed, as a real one does.
        self.schemas = KubeRayCrds("the fake API server's CRDs", lambda kind: self.installed_crds[CRD_NAMES[kind]],
                                   {kind: f"{name} in the fake API server" for kind, name in CRD_NAMES.items()})
        super().__init__()

    def write_kubeconfig(self, path: Path, *, token: str | None = None) -> Path:
        """A real kubeconfig file naming this server (context ``fake``)."""
        config = {
            "apiVersion": "v1", "kind": "Config", "current-context": "fake",
            "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
            "users": [{"name": "fake", "user": {"token": token or self.token}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake"}}],
        }
        path.write_text(yaml.safe_dump(config))
        return path

    def fail_next(self, method: str, path_pattern: str, code: int) -> None:
        """The next ``method`` request whose path matches answers ``code`` (a Status)."""
        self.failures.append((method, re.compile(path_pattern), code))

    # ---- objects

    def add_cluster(self, manifest: dict[str, Any], *, ready: bool = True) -> dict[str, Any]:
        """A RayCluster someone else created (as kubectl would), optionally already ready."""
        with self._lock:
            obj = json.loads(json.dumps(manifest))
            obj["metadata"].setdefault("namespace", "default")
            obj = self._store(obj)
            if ready:
                self._make_ready(obj)
            return obj

    def cluster(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self.clusters.get((namespace, name))

    def _store(self, obj: dict[str, Any]) -> dict[str, Any]:
        kuberay.validate(obj, self.schemas)  # what the API server's CRD validation would reject
        meta = obj["metadata"]
        meta.update(uid=str(uuid.uuid4()), creationTimestamp=_now(), generation=1, resourceVersion="1")
        obj["status"] = {"conditions": [{"type": "HeadPodReady", "status": "False", "reason": "HeadPodNotFound",
                                         "message": "Head Pod not found", "lastTransitionTime": _now()}]}
        self.clusters[(meta["namespace"], meta["name"])] = obj
        self._gets[meta["uid"]] = 0
        return obj

    def _make_ready(self, obj: dict[str, Any]) -> None:
        """What KubeRay writes once the head pod runs: status and a head Service from the head's ports."""
        meta, spec = obj["metadata"], obj["spec"]
        ns, name = meta["namespace"], meta["name"]
        svc_name = f"{name}-head-svc"
        head = spec["headGroupSpec"]["template"]["spec"]["containers"][0]
        ports = [{"name": p["name"], "port": self.service_ports.get(p["name"], p["containerPort"]), "protocol": "TCP",
                  "targetPort": p["containerPort"]} for p in head.get("ports") or [] if p.get("name")]
        svc_type = spec["headGroupSpec"].get("serviceType") or "ClusterIP"
        lb = {"ingress": [{"ip": self.load_balancer_ip, "ipMode": "VIP"}]} if svc_type == "LoadBalancer" else {}
        self.services[(ns, svc_name)] = {
            "apiVersion": "v1", "kind": "Service",
            "metadata": {"name": svc_name, "namespace": ns, "uid": str(uuid.uuid4()), "creationTimestamp": _now(),
                         "labels": {"ray.io/cluster": name, "ray.io/node-type": "head"},
                         "ownerReferences": [{"apiVersion": "ray.io/v1", "kind": "RayCluster", "name": name,
                                              "uid": meta["uid"], "controller": True}]},
            "spec": {"type": svc_type, "clusterIP": self.cluster_ip, "clusterIPs": [self.cluster_ip], "ports": ports,
                     "selector": {"ray.io/cluster": name, "ray.io/node-type": "head"},
                     "sessionAffinity": "None", "ipFamilies": ["IPv4"]},
            "status": {"loadBalancer": lb},
        }
        now = _now()
        obj["status"] = {
            "state": "ready", "reason": "", "observedGeneration": 1, "lastUpdateTime": now,
            "stateTransitionTimes": {"ready": now},
            "head": {"podIP": "10.8.0.5", "podName": f"{name}-head-x7k2p", "serviceIP": self.cluster_ip,
                     "serviceName": svc_name},
            "endpoints": {p["name"]: str(p["port"]) for p in ports},
            "availableWorkerReplicas": 0, "desiredWorkerReplicas": 0, "readyWorkerReplicas": 0,
            "minWorkerReplicas": 0, "maxWorkerReplicas": sum(g["maxReplicas"] for g in spec["workerGroupSpecs"]),
            "desiredCPU": "8", "desiredMemory": "40G", "desiredGPU": "0", "desiredTPU": "0",
            "conditions": [
                {"type": "HeadPodReady", "status": "True", "reason": "HeadPodRunningAndReady",
                 "message": "", "lastTransitionTime": now},
                {"type": "RayClusterProvisioned", "status": "True", "reason": "AllPodRunningAndReadyFirstTime",
                 "message": "", "lastTransitionTime": now},
            ],
        }

    def _remove(self, obj: dict[str, Any]) -> None:
        ns, name = obj["metadata"]["namespace"], obj["metadata"]["name"]
        self.clusters.pop((ns, name), None)
        self.services.pop((ns, f"{name}-head-svc"), None)

    def _served(self, obj: dict[str, Any]) -> dict[str, Any]:
        kuberay.validate(obj, self.schemas)  # the fake's own payloads keep to the CRD, status included
        return obj

    def _on_get(self, obj: dict[str, Any]) -> None:
        """Time passes in GETs: the operator readies new clusters and finishes Foreground deletions."""
        uid = obj["metadata"]["uid"]
        self._gets[uid] = self._gets.get(uid, 0) + 1
        meta = obj["metadata"]
        if meta.get("deletionTimestamp"):
            if self._gets[uid] > self.gone_after_gets:
                self._remove(obj)
        elif self.ready_after_gets is not None and obj["status"].get("state") != "ready" \
                and self._gets[uid] >= self.ready_after_gets:
            self._make_ready(obj)

    # ---- HTTP

    def _prune_unknown_auth_fields(self, body: dict[str, Any]) -> None:
        """What the API server does without ``fieldValidation=Strict`` (its default is Warn since Kubernetes 1.23):
        unknown fields are dropped, not refused. Here only ``authOptions``' (the field KubeRay releases differ in)."""
        known = self.schemas.auth_fields("RayCluster")
        auth = (body.get("spec") or {}).get("authOptions")
        if isinstance(auth, dict):
            for key in [k for k in auth if known is None or k not in known]:
                del auth[key]

    def _handle(self, method: str, path: str, body: Any, auth: str | None,
                query: dict[str, list[str]] | None = None) -> tuple[int, Any]:
        self.requests.append((method, path, body))
        for i, (m, pattern, code) in enumerate(self.failures):
            if m == method and pattern.search(path):
                del self.failures[i]
                return code, _status(code, "InternalError" if code >= 500 else "Forbidden", "injected failure")
        if auth != f"Bearer {self.token}":
            return 401, _status(401, "Unauthorized", "Unauthorized")
        if path == _WEBHOOKS and method == "GET":
            return 200, {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "MutatingWebhookConfigurationList",
                         "metadata": {}, "items": [
                             {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "MutatingWebhookConfiguration",
                              "metadata": {"name": name}, "webhooks": []} for name in self.mutating_webhooks]}
        if path == _SSAR and method == "POST":
            attrs = ((body or {}).get("spec") or {}).get("resourceAttributes") or {}
            if self.rbac_rules is not None:
                allowed = any(_rule_allows(rule, attrs) for rule in self.rbac_rules)
            else:
                allowed = (attrs.get("verb"), attrs.get("resource")) not in self.denied
            return 201, {**body, "status": {"allowed": allowed} | ({} if allowed else {
                "reason": f"RBAC: no rule allows {attrs.get('verb')} {attrs.get('resource')}"})}
        if m := _CRD.match(path):
            if method != "GET":
                return 405, _status(405, "MethodNotAllowed", "the fake serves GET on CRDs")
            crd = self.installed_crds.get(m[1])
            if crd is None:
                return 404, _status(404, "NotFound", f'customresourcedefinitions.apiextensions.k8s.io "{m[1]}" '
                                    "not found", name=m[1], group="apiextensions.k8s.io",
                                    kind="customresourcedefinitions")
            return 200, crd
        if m := _SECRETS.match(path):
            return self._secret(method, m[1], m[2], body)
        if m := _SERVICE.match(path):
            if method != "GET":
                return 405, _status(405, "MethodNotAllowed", "the fake serves GET on services")
            svc = self.services.get((m[1], m[2]))
            if svc is None:
                return 404, _status(404, "NotFound", f'services "{m[2]}" not found', name=m[2], kind="services")
            return 200, svc
        m = _CLUSTERS.match(path)
        if not m:
            return 404, _status(404, "NotFound", "the server could not find the requested resource")
        ns, name = m[1], m[2]
        not_found = _status(404, "NotFound", f'rayclusters.ray.io "{name}" not found', name=name,
                            group="ray.io", kind="rayclusters")
        if method == "POST" and name is None:
            meta = body.get("metadata") or {}
            if meta.get("namespace", ns) != ns:
                return 400, _status(400, "BadRequest", "the namespace of the provided object does not match "
                                    "the namespace sent on the request")
            if (ns, meta.get("name")) in self.clusters:
                return 409, _status(409, "AlreadyExists", f'rayclusters.ray.io "{meta.get("name")}" already exists',
                                    name=meta.get("name"), group="ray.io", kind="rayclusters")
            body["metadata"]["namespace"] = ns
            if (query or {}).get("fieldValidation") != ["Strict"]:
                self._prune_unknown_auth_fields(body)
            try:
                obj = self._store(body)
            except ValueError as exc:
                return 422, _status(422, "Invalid", f"RayCluster.ray.io is invalid: {exc}")
            return 201, self._served(obj)
        obj = self.clusters.get((ns, name)) if name else None
        if method == "GET" and name:
            if obj is None:
                return 404, not_found
            self._on_get(obj)
            obj = self.clusters.get((ns, name))
            return (200, self._served(obj)) if obj else (404, not_found)
        if method == "DELETE" and name:
            if obj is None:
                return 404, not_found
            want_uid = ((body or {}).get("preconditions") or {}).get("uid")
            if want_uid and want_uid != obj["metadata"]["uid"]:
                return 409, _status(409, "Conflict", f"Precondition failed: UID in precondition: {want_uid}, "
                                    f"UID in object meta: {obj['metadata']['uid']}")
            if (body or {}).get("propagationPolicy") == "Foreground" and self.gone_after_gets:
                obj["metadata"].update(deletionTimestamp=_now(), finalizers=["foregroundDeletion"])
                self._gets[obj["metadata"]["uid"]] = 0
            else:
                self._remove(obj)
            return 200, self._served(obj)
        return 405, _status(405, "MethodNotAllowed", f"the fake does not serve {method} {path}")

    def _secret(self, method: str, ns: str, name: str | None, body: Any) -> tuple[int, Any]:
        """Secrets as the API server keeps them: ``stringData`` folded into base64 ``data`` on create."""
        if method == "POST" and name is None:
            meta = body.get("metadata") or {}
            key = (ns, meta.get("name"))
            if key in self.secrets:
                return 409, _status(409, "AlreadyExists", f'secrets "{key[1]}" already exists', name=key[1],
                                    kind="secrets")
            data = dict(body.get("data") or {})
            data |= {k: base64.b64encode(str(v).encode()).decode() for k, v in (body.get("stringData") or {}).items()}
            obj = {"apiVersion": "v1", "kind": "Secret", "type": body.get("type", "Opaque"), "data": data,
                   "metadata": {**meta, "namespace": ns, "uid": str(uuid.uuid4()), "creationTimestamp": _now()}}
            self.secrets[key] = obj
            return 201, obj
        obj = self.secrets.get((ns, name or ""))
        if obj is None:
            return 404, _status(404, "NotFound", f'secrets "{name}" not found', name=name, kind="secrets")
        if method == "GET":
            return 200, obj
        if method == "DELETE":
            del self.secrets[(ns, name)]
            return 200, _status(200, "", "deleted") | {"status": "Success"}
        return 405, _status(405, "MethodNotAllowed", f"the fake does not serve {method} on secrets")

    def answer(self, request: Request) -> tuple[int, Any]:
        return self._handle(request.method, request.path, request.body, request.authorization, request.query)
