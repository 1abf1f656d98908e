"""KubeRay manifests for a GKE Ray cluster whose worker groups are whole TPU slices (and GPU nodes).

Plain dicts, no kubernetes client and no ray import, so they can be rendered anywhere (CI, a
laptop, the Airflow side). Each TPU pod type becomes one multi-host worker group: KubeRay and
the Ray autoscaler add and remove a group replica as a whole slice, which is what a step's gang
needs. ``validate`` checks a manifest against a KubeRay CRD schema (``kuberay_crds``: a file, or the
one installed in the target cluster; none ships with the package), plus the few KubeRay operator
rules that a schema cannot express, so a bad manifest fails here and not in the cluster.
The `rayslice kuberay` command, which also reads a live cluster's CRDs, is ``kuberay_cli``.
"""

from __future__ import annotations

import copy
import ipaddress
import re
from dataclasses import dataclass, field
from typing import Any

from rayslice.cloud.kuberay_crds import KubeRayCrds
from rayslice.cloud.pins import DEFAULT_GPU_IMAGE, DEFAULT_IMAGE, KUBERAY_FLOOR, KUBERAY_HELM_VERSION, RAY_VERSION
from rayslice.core.accelerators import TpuSliceRequest
from rayslice.core.context import CHECKPOINT_ROOT_ENV
from rayslice.core.exceptions import InvalidRequestError

#: Ray's own images carry the Ray version in their tag (``rayproject/ray:2.60.0-py312``, or a mirror's ``.../ray:``).
_RAY_IMAGE_TAG = re.compile(r"(?:^|/)ray:(\d+\.\d+\.\d+)")


def image_ray_version(image: str) -> str:
    """The Ray version an image runs: from a Ray image's tag, else the pinned one the `docker/` recipes install."""
    match = _RAY_IMAGE_TAG.search(image)
    return match[1] if match else RAY_VERSION


def default_image_note(image: str, gpu_image: str | None) -> str | None:
    """What to do when a manifest names the `docker/` recipes' default image names (None: it names its own)."""
    defaults = [i for i in (image, gpu_image) if i in (DEFAULT_IMAGE, DEFAULT_GPU_IMAGE)]
    if not defaults:
        return None
    return (f"the pods run {' and '.join(defaults)}, the image(s) docker/Dockerfile.tpu and docker/Dockerfile.gpu "
            "build (docs/deploying.md, Cluster image): build them, push them to a registry your nodes pull from, "
            "and pass that name with --image / --gpu-image")

#: GKE's node label for each TPU version (cloud.google.com/gke-tpu-accelerator).
#: v2/v3 have no GKE node pools, so they are missing on purpose.
GKE_TPU_ACCELERATORS = {
    "v4": "tpu-v4-podslice",
    "v5litepod": "tpu-v5-lite-podslice",
    "v5p": "tpu-v5p-slice",
    "v6e": "tpu-v6e-slice",
    "v7x": "tpu7x",
}
# Per chip: the sample's share of a v6e host (24 CPU, 200G for 4 chips); v5e hosts only have
# 48 GB a chip, so ask less there or the pod would never fit.
_CPU_PER_CHIP = 6
_MEMORY_GB_PER_CHIP = {"v5litepod": 40}
# Small enough for the smallest 1-GPU machines (g2-standard-4, n1-standard-4) after GKE's reserve.
_GPU_HOST = {"cpu": "3", "memory": "10G"}
# KubeRay: names become Services ("<name>-serve-svc" <= 63), RayJobs add a 6-char suffix.
_DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_MAX_NAME = {"RayCluster": 53, "RayJob": 47}
_DNS1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
_DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
#: The head Service types KubeRay accepts; only ClusterIP stays inside the Kubernetes cluster.
SERVICE_TYPES = ("ClusterIP", "NodePort", "LoadBalancer")
#: The key KubeRay reads the token from in the Secret that ``authOptions.secretName`` names.
TOKEN_SECRET_KEY = "auth_token"


def token_secret_name(cluster_name: str) -> str:
    """The default name of the Secret holding a cluster's Ray auth token (``<cluster>-ray-token``)."""
    return f"{cluster_name}-ray-token"


def exposure_warning(head_service_type: str, auth: bool) -> str | None:
    """What to tell the user about how the rendered head is exposed, or None when nothing is worth saying.

    Raises InvalidRequestError for the one combination never rendered: a dashboard (the Jobs API, which runs
    any code it is given) reachable from outside the Kubernetes cluster without a token.
    """
    if head_service_type not in SERVICE_TYPES:
        raise InvalidRequestError(f"head_service_type {head_service_type!r} is invalid: use ClusterIP, NodePort "
                                  "or LoadBalancer")
    external = head_service_type != "ClusterIP"
    if external and not auth:
        raise InvalidRequestError(f"a {head_service_type} head Service without Ray token auth would let anyone who "
                                  "reaches it run code on the cluster: keep auth on, or use ClusterIP")
    if external:
        return (f"warning: the head Service is {head_service_type}: the dashboard (Jobs API, port 8265) and the "
                "GCS (6379) are reachable from outside the Kubernetes cluster, guarded by the Ray token only and "
                "unencrypted; prefer ClusterIP with Airflow in the cluster, or an internal load balancer restricted to "
                "Airflow's addresses (loadBalancerSourceRanges), behind TLS")
    if not auth:
        return ("warning: Ray token auth is off: any pod that reaches the head Service can submit jobs (run code) "
                "on the cluster")
    return None


def _check_name(name: str, kind: str) -> None:
    limit = _MAX_NAME[kind]
    if not isinstance(name, str) or not _DNS1035.match(name) or len(name) > limit:
        raise InvalidRequestError(
            f"{kind} name {name!r} is invalid: KubeRay wants a DNS-1035 label of at most {limit} "
            "characters (lowercase letters, digits and '-', starting with a letter), e.g. 'rayslice'"
        )


def _at_least(least: int, **values: int) -> None:
    for name, value in values.items():
        if value < least:
            raise InvalidRequestError(f"{name}={value} is invalid: use {least} or more")


def _metadata(name: str, namespace: str | None) -> dict[str, Any]:
    return {"name": name, **({"namespace": namespace} if namespace else {})}


def _worker_group(name: str, max_replicas: int, container: dict[str, Any], selector: dict[str, str],
                  **extra: Any) -> dict[str, Any]:
    """Starts at zero: the autoscaler adds replicas on demand (the sample's fixed 1 would bill idle)."""
    return {"groupName": name, "replicas": 0, "minReplicas": 0, "maxReplicas": max_replicas, **extra,
            "template": {"spec": {"containers": [container], "nodeSelector": selector}}}


def _container(name: str, image: str, resources: dict[str, str], **extra: Any) -> dict[str, Any]:
    limits = dict(resources)  # requests == limits: extended resources (TPU, GPU) require it
    return {"name": name, "image": image, "imagePullPolicy": "IfNotPresent",
            "resources": {"limits": limits, "requests": dict(limits)}, **extra}


def _tpu_group(request: TpuSliceRequest, max_slices: int, image: str) -> dict[str, Any]:
    """One worker group per pod type: a replica is one slice of ``numOfHosts`` pods (the sample's shape)."""
    chips = request.chips_per_host or 0
    memory = _MEMORY_GB_PER_CHIP.get(request.version, 50) * chips
    env = [
        {"name": "NODE_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.hostIP"}}},
        {"name": "VBAR_CONTROL_SERVICE_URL", "value": "$(NODE_IP):8353"},
        {"name": "JAX_PLATFORMS", "value": "tpu,cpu"},
        {"name": "ENABLE_PJRT_COMPATIBILITY", "value": "true"},
    ]
    resources = {"cpu": str(_CPU_PER_CHIP * chips), "google.com/tpu": str(chips), "memory": f"{memory}G"}
    container = _container("ray-worker", image, resources, env=env,
                           ports=[{"containerPort": 8081, "name": "mxla"}])
    selector = {"cloud.google.com/gke-tpu-accelerator": GKE_TPU_ACCELERATORS[request.version],
                "cloud.google.com/gke-tpu-topology": str(request.topology)}
    # Ray's autoscaler derives the slice's TPU-<pod type>-head resource from these two selectors.
    return _worker_group(f"tpu-{request.pod_type}", max_slices, container, selector,
                         numOfHosts=request.hosts_per_slice,
                         # KubeRay's own form ('{"TPU":4}' in single quotes): one shell word for
                         # `ray start`, which Ray's autoscaler strips back to JSON.
                         rayStartParams={"resources": f"'{{\"TPU\": {chips}}}'"})


#: GKE's labels and taint for Spot VMs and for a specific reservation (cloud.google.com/kubernetes-engine/docs).
SPOT_SELECTOR = {"cloud.google.com/gke-spot": "true"}
SPOT_TOLERATION = {"key": "cloud.google.com/gke-spot", "operator": "Equal", "value": "true", "effect": "NoSchedule"}
#: GKE's annotation for an internal (VPC-only) passthrough load balancer.
INTERNAL_LB_ANNOTATION = {"networking.gke.io/load-balancer-type": "Internal"}
_LABEL_KEY = re.compile(r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
_LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$")
_QUANTITY = re.compile(r"^\d+(\.\d+)?(m|k|M|G|T|Ki|Mi|Gi|Ti)?$")
_EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")


@dataclass(frozen=True)
class PodSettings:
    """What a cluster's own Kubernetes environment decides about the pods (all optional).

    Node selectors and tolerations go on the worker pods (TPU and GPU), which is where spot or reserved
    capacity is chosen; the rest on every pod.
    """

    head_cpu: str = "8"
    head_memory: str = "40G"
    labels: dict[str, str] = field(default_factory=dict)
    service_account: str | None = None
    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: list[dict[str, str]] = field(default_factory=list)
    priority_class: str | None = None
    image_pull_secrets: list[str] = field(default_factory=list)
    internal_load_balancer: bool = False
    load_balancer_source_ranges: list[str] = field(default_factory=list)

    def check(self, head_service_type: str) -> None:
        for what, value in (("head_cpu", self.head_cpu), ("head_memory", self.head_memory)):
            if not isinstance(value, str) or not _QUANTITY.match(value):
                raise InvalidRequestError(f"{what} {value!r} is not a Kubernetes quantity, e.g. '8' CPUs or '40G'")
        for what, pairs in (("label", self.labels), ("node_selector", self.node_selector)):
            for key, value in pairs.items():
                if not _LABEL_KEY.match(key) or len(key) > 317 or not _LABEL_VALUE.match(value):
                    raise InvalidRequestError(f"{what} {key}={value} is not a Kubernetes label: keys like "
                                              "'team' or 'example.com/team', values of letters, digits, '-', '_', '.'")
        for toleration in self.tolerations:
            if toleration.get("effect") not in _EFFECTS or not _LABEL_KEY.match(toleration.get("key", "")):
                raise InvalidRequestError(f"toleration {toleration} is invalid: give KEY[=VALUE]:EFFECT with EFFECT "
                                          f"one of {', '.join(_EFFECTS)}")
        for what, value in (("service_account", self.service_account), ("priority_class", self.priority_class),
                            *(("image_pull_secret", v) for v in self.image_pull_secrets)):
            if value is not None and (not _DNS1123_SUBDOMAIN.match(value) or len(value) > 253):
                raise InvalidRequestError(f"{what} {value!r} is not a Kubernetes object name (lowercase letters, "
                                          "digits, '-' and '.')")
        if (self.internal_load_balancer or self.load_balancer_source_ranges) and head_service_type != "LoadBalancer":
            raise InvalidRequestError("internal_load_balancer and load_balancer_source_ranges apply to a "
                                      "LoadBalancer head Service: set head_service_type to LoadBalancer")
        for cidr in self.load_balancer_source_ranges:
            try:
                ipaddress.ip_network(cidr)
            except ValueError:
                raise InvalidRequestError(f"load_balancer_source_range {cidr!r} is not a CIDR, e.g. "
                                          "'10.0.0.0/8'") from None

    def apply(self, spec: dict[str, Any]) -> None:
        """Put these settings into a RayCluster ``spec`` (its head and worker groups)."""
        head = spec["headGroupSpec"]
        workers = spec["workerGroupSpecs"]
        for group in [head, *workers]:
            template = group["template"]
            pod = template["spec"]
            if self.labels:
                template.setdefault("metadata", {}).setdefault("labels", {}).update(self.labels)
            if self.service_account:
                pod["serviceAccountName"] = self.service_account
            if self.priority_class:
                pod["priorityClassName"] = self.priority_class
            if self.image_pull_secrets:
                pod["imagePullSecrets"] = [{"name": name} for name in self.image_pull_secrets]
        for group in workers:
            pod = group["template"]["spec"]
            pod["nodeSelector"] = {**pod.get("nodeSelector", {}), **self.node_selector}
            if self.tolerations:
                pod["tolerations"] = [dict(t) for t in self.tolerations]
        if self.internal_load_balancer:
            spec["headServiceAnnotations"] = dict(INTERNAL_LB_ANNOTATION)
        if self.load_balancer_source_ranges:
            head["headService"] = {"spec": {"loadBalancerSourceRanges": list(self.load_balancer_source_ranges)}}


def render_raycluster(
    name: str,
    *,
    tpus: list[str],
    max_slices: int = 1,
    gpu_nodes: int = 0,
    gpu_type: str = "nvidia-l4",
    image: str = DEFAULT_IMAGE,
    gpu_image: str = DEFAULT_GPU_IMAGE,
    idle_timeout_seconds: int = 60,
    namespace: str | None = None,
    checkpoint_root: str | None = None,
    auth: bool = True,
    token_secret: str | None = None,
    head_service_type: str = "ClusterIP",
    pods: PodSettings | None = None,
) -> dict[str, Any]:
    """A ``ray.io/v1`` RayCluster: a CPU-less head, autoscaler v2, and groups that start at zero.

    Nothing runs on the head (``num-cpus: "0"``), so every step lands on a TPU or GPU group the
    autoscaler adds on demand and removes after ``idle_timeout_seconds``. ``checkpoint_root``
    (a bucket URL) becomes ``RAYSLICE_CHECKPOINT_ROOT`` on every pod: the steps' checkpoint folders.

    ``image`` runs the head and the TPU hosts, ``gpu_image`` the GPU hosts; they need Python 3.12 with
    ``rayslice[cluster]`` and JAX (``jax[tpu]`` / ``jax[cuda12]``). The defaults are the names of what
    ``docker/Dockerfile.tpu`` and ``docker/Dockerfile.gpu`` build, which no public registry serves: build
    and push them, then pass the pushed names. ``rayVersion`` is a Ray image's tag's version, else the
    pinned Ray the recipes install.

    Secure by default: Ray token auth is on (``authOptions``, KubeRay >= 1.6.0, Ray >= 2.52), with the
    token in the Secret ``token_secret`` (default ``<name>-ray-token``, key ``auth_token``), which must
    exist before the pods start (``CreateRayClusterOperator`` makes it); the `ray` connection reads the
    same Secret. The head Service is ClusterIP unless ``head_service_type`` says otherwise, and an
    external one (NodePort, LoadBalancer) is refused without auth (``exposure_warning``).

    ``pods`` adjusts what the cluster's own environment decides: the head's size, labels, the service
    account (Workload Identity for ``gs://`` checkpoints), where workers may run (node selectors,
    tolerations: spot or reserved capacity), priority class, image pull Secrets, the head Service's
    internal load balancer and source ranges (``PodSettings``).
    """
    pods = pods or PodSettings()
    pods.check(head_service_type)
    if checkpoint_root is not None and "://" not in checkpoint_root:
        raise InvalidRequestError(f"checkpoint_root must be a URL every pod reaches, like 'gs://bucket/checkpoints', "
                                  f"got {checkpoint_root!r}")
    _check_name(name, "RayCluster")
    if namespace is not None and (not isinstance(namespace, str) or not _DNS1123_LABEL.match(namespace)
                                  or len(namespace) > 63):
        raise InvalidRequestError(f"namespace {namespace!r} is not a Kubernetes namespace (a DNS-1123 label: "
                                  "lowercase letters, digits and '-', at most 63 characters), e.g. 'ml'")
    for what, value in (("image", image), ("gpu_image", gpu_image)):
        if not isinstance(value, str) or not value or any(c.isspace() for c in value):
            raise InvalidRequestError(f"{what} {value!r} is not an image name, e.g. "
                                      "'us-docker.pkg.dev/my-project/ml/rayslice-cluster:0.1.0-tpu'")
    if gpu_nodes and (not isinstance(gpu_type, str) or not gpu_type or not _LABEL_VALUE.match(gpu_type)):
        raise InvalidRequestError(f"gpu_type {gpu_type!r} is not a GKE accelerator label value, e.g. 'nvidia-l4'")
    exposure_warning(head_service_type, auth)
    if token_secret is not None and not auth:
        raise InvalidRequestError("token_secret names the Secret of the Ray auth token: it needs auth on")
    token_secret = token_secret or token_secret_name(name)
    if not _DNS1123_SUBDOMAIN.match(token_secret) or len(token_secret) > 253:
        raise InvalidRequestError(f"token_secret {token_secret!r} is not a Kubernetes Secret name "
                                  "(lowercase letters, digits, '-' and '.')")
    tpus = [tpus] if isinstance(tpus, str) else list(tpus)
    _at_least(1, max_slices=max_slices)
    _at_least(0, gpu_nodes=gpu_nodes, idle_timeout_seconds=idle_timeout_seconds)
    if not tpus and not gpu_nodes:
        raise InvalidRequestError("a cluster with no TPU type and no GPU nodes can run nothing: "
                                  "give tpus=['v6e-16'] and/or gpu_nodes=1")
    requests = [TpuSliceRequest(tpu=tpu) for tpu in tpus]
    pod_types = [r.pod_type for r in requests]
    for request in requests:
        if request.version not in GKE_TPU_ACCELERATORS:
            raise InvalidRequestError(f"{request.pod_type} has no GKE node pools: use a "
                                      f"{', '.join(GKE_TPU_ACCELERATORS)} TPU, e.g. 'v6e-16'")
        if pod_types.count(request.pod_type) > 1:
            raise InvalidRequestError(f"{request.pod_type} is listed twice in tpus={tpus}: "
                                      "give each pod type once and raise max_slices instead")
    groups = [_tpu_group(r, max_slices, image) for r in requests]
    if gpu_nodes:
        gpu = _container("ray-worker", gpu_image, {**_GPU_HOST, "nvidia.com/gpu": "1"})
        # KubeRay turns the nvidia.com/gpu limit into --num-gpus itself.
        groups.append(_worker_group(f"gpu-{gpu_type}", gpu_nodes, gpu,
                                    {"cloud.google.com/gke-accelerator": gpu_type}, rayStartParams={}))
    head_ports = [(6379, "gcs"), (8265, "dashboard"), (10001, "client"), (8000, "serve"), (8888, "grpc")]
    head = _container("ray-head", image, {"cpu": "8", "memory": "40G"},
                      ports=[{"containerPort": port, "name": port_name} for port, port_name in head_ports])
    head["resources"]["limits"] |= {"cpu": pods.head_cpu, "memory": pods.head_memory}
    head["resources"]["requests"] |= {"cpu": pods.head_cpu, "memory": pods.head_memory}
    spec: dict[str, Any] = {}
    spec["rayVersion"] = version = image_ray_version(image)
    if auth and tuple(map(int, version.split("."))) < (2, 52, 0):
        raise InvalidRequestError(f"image {image!r} runs Ray {version}: Ray token auth needs Ray 2.52 or "
                                  "newer; use a newer image")
    if auth:
        # KubeRay sets RAY_AUTH_MODE=token and RAY_AUTH_TOKEN (from the Secret) on every Ray container.
        spec["authOptions"] = {"mode": "token", "secretName": token_secret}
    spec |= {
        "enableInTreeAutoscaling": True,
        # Only `version: v2`: KubeRay rejects it together with RAY_enable_autoscaler_v2 on the head.
        "autoscalerOptions": {"version": "v2", "upscalingMode": "Default",
                              "idleTimeoutSeconds": idle_timeout_seconds},
        "headGroupSpec": {
            "rayStartParams": {"num-cpus": "0", "dashboard-host": "0.0.0.0"},
            "serviceType": head_service_type,
            "template": {"spec": {"containers": [head]}},
        },
        "workerGroupSpecs": groups,
    }
    if checkpoint_root:
        for template in [spec["headGroupSpec"]["template"], *(g["template"] for g in groups)]:
            for container in template["spec"]["containers"]:
                container.setdefault("env", []).append({"name": CHECKPOINT_ROOT_ENV, "value": checkpoint_root})
    pods.apply(spec)
    metadata = _metadata(name, namespace)
    if pods.labels:
        metadata["labels"] = dict(pods.labels)
    return {"apiVersion": "ray.io/v1", "kind": "RayCluster", "metadata": metadata, "spec": spec}


def render_rayjob(
    name: str,
    *,
    entrypoint: str,
    cluster: dict[str, Any],
    shutdown_after_job_finishes: bool = True,
    ttl_seconds_after_finished: int = 60,
    namespace: str | None = None,
) -> dict[str, Any]:
    """A ``ray.io/v1`` RayJob that brings up ``cluster`` (a RayCluster or its spec) for one entrypoint.

    The TTL only applies when the cluster is shut down after the job: KubeRay rejects a TTL
    without ``shutdownAfterJobFinishes``, so it is left out then.
    """
    _check_name(name, "RayJob")
    if not entrypoint or not entrypoint.strip():
        raise InvalidRequestError("entrypoint is empty: give the command to run, e.g. 'python train.py'")
    _at_least(0, ttl_seconds_after_finished=ttl_seconds_after_finished)
    if cluster.get("kind") == "RayCluster":
        namespace = namespace or cluster.get("metadata", {}).get("namespace")
        cluster = cluster["spec"]
    spec: dict[str, Any] = {"entrypoint": entrypoint, "shutdownAfterJobFinishes": shutdown_after_job_finishes}
    if shutdown_after_job_finishes:
        spec["ttlSecondsAfterFinished"] = ttl_seconds_after_finished
    spec["rayClusterSpec"] = copy.deepcopy(cluster)
    return {"apiVersion": "ray.io/v1", "kind": "RayJob", "metadata": _metadata(name, namespace), "spec": spec}


def _operator_rules(manifest: dict[str, Any]) -> None:
    """KubeRay's own admission rules our manifests could break, which no CRD schema states."""
    kind, spec = manifest["kind"], manifest.get("spec") or {}
    if name := (manifest.get("metadata") or {}).get("name"):  # absent with generateName
        _check_name(name, kind)
    if kind == "RayJob":
        if not spec.get("shutdownAfterJobFinishes") and spec.get("ttlSecondsAfterFinished", 0) > 0:
            raise InvalidRequestError("$.spec.ttlSecondsAfterFinished: needs shutdownAfterJobFinishes: true")
        spec, where = spec.get("rayClusterSpec") or {}, "$.spec.rayClusterSpec"
    else:
        where = "$.spec"
    head = spec.get("headGroupSpec", {}).get("template", {}).get("spec", {}).get("containers") or [{}]
    head_env = head[0].get("env") or []
    if (spec.get("autoscalerOptions") or {}).get("version") and any(
            e.get("name") == "RAY_enable_autoscaler_v2" for e in head_env):
        raise InvalidRequestError(f"{where}.autoscalerOptions.version: KubeRay rejects it together with "
                                  "RAY_enable_autoscaler_v2 on the head; keep only version")
    for i, group in enumerate(spec.get("workerGroupSpecs") or []):
        if group.get("minReplicas", 0) > group.get("maxReplicas", 2**31 - 1):
            raise InvalidRequestError(f"{where}.workerGroupSpecs[{i}]: minReplicas > maxReplicas")


def check_rules(manifest: dict[str, Any]) -> None:
    """KubeRay's own rules, which hold whatever the CRD: a ray.io RayCluster or RayJob, names, autoscaler."""
    api_version, kind = str(manifest.get("apiVersion", "")), manifest.get("kind")
    if api_version.partition("/")[0] != "ray.io" or kind not in _MAX_NAME:
        raise InvalidRequestError(f"not a KubeRay manifest (apiVersion {api_version!r}, kind {kind!r}): "
                                  "validate handles ray.io RayCluster and RayJob")
    _operator_rules(manifest)


def validate(manifest: dict[str, Any], crds: KubeRayCrds) -> str:
    """Check ``manifest`` against ``crds`` and KubeRay's own rules; returns what it was checked against.

    Raises InvalidRequestError (a ValueError) naming the JSON path of the first problem, or
    CrdUnavailableError when ``crds`` has no CRD of the manifest's kind.
    """
    check_rules(manifest)
    crds.check_served(str(manifest["kind"]), str(manifest.get("apiVersion", "")).partition("/")[2])
    check_auth_floor(manifest, crds)
    return crds.validate(manifest)


def _auth_options(manifest: dict[str, Any]) -> dict[str, Any]:
    spec = manifest.get("spec") or {}
    if manifest.get("kind") == "RayJob":
        spec = spec.get("rayClusterSpec") or {}
    return spec.get("authOptions") or {}


def check_auth_floor(manifest: dict[str, Any], crds: KubeRayCrds) -> None:
    """Refuse, naming the version, a token-auth manifest for a KubeRay older than ``KUBERAY_FLOOR``.

    Why not let the schema say it: KubeRay 1.5.x's ``authOptions`` has ``mode`` only. ``kubectl apply``
    then rejects ``secretName`` with a bare schema error, and a client without strict field validation
    has it pruned: KubeRay 1.5 makes its own random token and every step gets a 401. Neither says that
    the operator is too old.
    """
    auth = _auth_options(manifest)
    if "secretName" not in auth:
        return
    kind = str(manifest.get("kind"))
    version = str(manifest.get("apiVersion", "")).partition("/")[2] or "v1"
    fields = crds.auth_fields(kind, version)
    if fields is not None and "secretName" in fields:
        return
    has = "no authOptions" if fields is None else f"authOptions with {', '.join(sorted(fields)) or 'no fields'} only"
    raise InvalidRequestError(
        f"{crds.describe(kind, version)} is from a KubeRay older than {KUBERAY_FLOOR} ({has}): rayslice's "
        f"token-auth clusters need authOptions.secretName, which first shipped in KubeRay {KUBERAY_FLOOR}. "
        f"Upgrade the operator (`helm upgrade --install kuberay-operator kuberay/kuberay-operator --version "
        f"{KUBERAY_HELM_VERSION}`, or a GKE version whose Ray add-on has KubeRay >= {KUBERAY_FLOOR}); nothing was "
        "created")
