"""Cloud TPU API (``google-cloud-tpu``, v2): zone accelerator types, and queued-resource slices for a Ray cluster.

Why: on GCE VMs without KubeRay nothing adds TPU hosts to a Ray cluster on demand. A queued
resource asks Cloud TPU for whole slices; their hosts run a startup script that joins the Ray
cluster (Ray detects the slice from the TPU VM's metadata), and deleting the queued resource
(``force``) removes the hosts again. Each queued resource carries an owner label on its nodes;
deleting checks it, so a teardown never removes capacity it did not ask for.

``check_accelerator_type`` fails early when a zone does not offer the requested slice type; the
zone's list is cached (per project and zone, an hour), and the check is optional.

The client is imported lazily (it costs seconds) and uses the REST transport. ``api_endpoint``
points it elsewhere (a private endpoint, or a local fake in tests); a plain-``http://`` endpoint
gets anonymous credentials, as Google's emulators do, so no token travels unencrypted.
"""

from __future__ import annotations

import hashlib
import ipaddress
import re
import shlex
import threading
import time
from dataclasses import dataclass
from typing import Any, Literal

from rayslice.cloud.pins import JAX_VERSION, PYTHON_MATCH_LEVEL_ENV, PYTHON_VERSION, RAY_VERSION, RAYSLICE_VERSION
from rayslice.core.accelerators import TpuSliceRequest
from rayslice.core.exceptions import InvalidRequestError, RaysliceError

__all__ = [
    "CloudTpuError",
    "QueuedSlice",
    "check_accelerator_type",
    "check_project_zone",
    "owner_label",
    "startup_script",
    "tpu_client",
    "zone_accelerator_types",
]

OWNER_LABEL = "rayslice-owner"
MANAGED_BY_LABEL = "managed-by"
ZONE_CACHE_SECONDS = 3600.0
_ZONE = re.compile(r"^[a-z]+-[a-z]+[0-9]+-[a-z]$")
_PROJECT = re.compile(r"^[a-z][-a-z0-9]{4,28}[a-z0-9]$")
_RESOURCE_ID = re.compile(r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")
#: Google's documented TPU VM base images per version (cloud.google.com/tpu/docs/runtimes).
RUNTIME_VERSIONS = {"v2": "tpu-ubuntu2204-base", "v3": "tpu-ubuntu2204-base", "v4": "tpu-ubuntu2204-base",
                    "v5litepod": "v2-alpha-tpuv5-lite", "v5p": "v2-alpha-tpuv5", "v6e": "v2-alpha-tpuv6e"}
#: TPU versions the Cloud TPU API (and so queued resources) does not serve: GKE and Compute Engine only
#: (cloud.google.com/tpu/docs/v6e-training: "The Cloud TPU API is not supported on TPU7x and later TPU versions").
NOT_IN_CLOUD_TPU_API = frozenset({"v7x"})
_zone_cache: dict[tuple[str, str, str], tuple[float, tuple[str, ...]]] = {}
_zone_lock = threading.Lock()

Deleted = Literal["deleted", "absent", "not-owned"]


class CloudTpuError(RaysliceError):
    """A Cloud TPU API call failed, or a queued resource did not become ACTIVE."""

    #: a passing API failure (set by `_api_error`): asking again may succeed
    transient: bool = False


def check_project_zone(project: str, zone: str) -> None:
    """A project ID and a zone as the Cloud TPU API takes them: a typo is refused before any call."""
    if not isinstance(project, str) or not _PROJECT.match(project):
        raise InvalidRequestError(f"GCP project {project!r} is invalid: use the project ID, e.g. 'my-project-123'")
    if not isinstance(zone, str) or not _ZONE.match(zone):
        raise InvalidRequestError(f"zone {zone!r} is invalid: use a zone, e.g. 'us-east5-b'")


def tpu_client(api_endpoint: str | None = None, *, credentials: Any = None) -> Any:
    """A ``tpu_v2.TpuClient`` over REST (Application Default Credentials unless the endpoint is plain http)."""
    from google.api_core.client_options import ClientOptions
    from google.cloud import tpu_v2

    if credentials is None and api_endpoint and api_endpoint.startswith("http://"):
        from google.auth.credentials import AnonymousCredentials

        credentials = AnonymousCredentials()
    options = ClientOptions(api_endpoint=api_endpoint) if api_endpoint else None
    try:
        return tpu_v2.TpuClient(transport="rest", client_options=options, credentials=credentials)
    except Exception as exc:  # google.auth.exceptions.DefaultCredentialsError and friends
        raise CloudTpuError(f"cannot build a Cloud TPU client ({type(exc).__name__}: {exc}); set up Application "
                            "Default Credentials (gcloud auth application-default login, or a service account)"
                            ) from None


def _api_error(what: str, exc: Exception) -> CloudTpuError:
    code = getattr(exc, "code", None)
    hint = {403: ": the credentials need roles/tpu.admin (or tpu.queuedResources.*) in the project",
            429: ": quota exhausted; retry later or ask for more TPU quota"}.get(code, "")
    message = getattr(exc, "message", None) or str(exc)
    error = CloudTpuError(f"{what}: Cloud TPU API answered {code or type(exc).__name__} ({message}){hint}")
    # A passing failure (overload, a reset connection, a deadline): asking again may succeed.
    error.transient = code in (429, 500, 502, 503, 504) or type(exc).__name__ in ("RetryError", "DeadlineExceeded")
    return error


def zone_accelerator_types(project: str, zone: str, *, client: Any = None, api_endpoint: str | None = None,
                           max_age: float = ZONE_CACHE_SECONDS) -> tuple[str, ...]:
    """The accelerator types (``v6e-16``, ...) the zone offers, cached per project and zone for ``max_age`` s."""
    check_project_zone(project, zone)
    key = (api_endpoint or "", project, zone)
    with _zone_lock:
        hit = _zone_cache.get(key)
        if hit and time.monotonic() - hit[0] < max_age:
            return hit[1]
    from google.api_core import exceptions as gexc

    client = client or tpu_client(api_endpoint)
    try:
        types = tuple(sorted({t.type_ for t in client.list_accelerator_types(
            parent=f"projects/{project}/locations/{zone}") if t.type_}))
    except gexc.GoogleAPIError as exc:
        raise _api_error(f"listing the accelerator types of {zone}", exc) from None
    with _zone_lock:
        _zone_cache[key] = (time.monotonic(), types)
    return types


def check_accelerator_type(request: TpuSliceRequest | str, project: str, zone: str, **kwargs: Any) -> str:
    """Raise InvalidRequestError unless ``zone`` offers the request's slice type; returns the type."""
    request = TpuSliceRequest(tpu=request) if isinstance(request, str) else request
    offered = zone_accelerator_types(project, zone, **kwargs)
    if request.pod_type not in offered:
        same = [t for t in offered if t.startswith(f"{request.version}-")]
        raise InvalidRequestError(
            f"{request.pod_type} is not offered in zone {zone}: "
            + (f"{request.version} there comes as {', '.join(same)}" if same else
               f"it has no {request.version} TPUs (it offers {', '.join(offered) or 'none'})")
            + "; pick another type or zone")
    return request.pod_type


def owner_label(owner: str) -> str:
    """GCP label values are short and plain: the owner (``dag/run``) as a stable hash."""
    return hashlib.sha256(owner.encode()).hexdigest()[:32]


#: Where the startup script puts the hosts' Python environment (and the Python uv downloads for it).
VENV_DIR = "/opt/rayslice/venv"
PYTHON_DIR = "/opt/rayslice/python"
#: What the cluster side imports besides Ray and JAX (the `cluster` extra): enough for the shipped launcher.
SHIPPED_LAUNCHER_NEEDS = ("pydantic>=2.10", "fsspec>=2024.1")
#: fsspec's Cloud Storage driver (the `gcs` extra): gs:// checkpoint roots, the usual ones on Cloud TPU.
GCS_NEEDS = ("gcsfs>=2024.1",)
_WHEEL = re.compile(r"(gs://|https://|/)[A-Za-z0-9._/\-]+/rayslice-[A-Za-z0-9._+]+-py3-none-any\.whl")
_SECRET = re.compile(r"(projects/[a-z0-9-]+/secrets/)?[A-Za-z0-9_-]{1,255}")
_VERSION = re.compile(r"\d+(\.\d+)+((a|b|rc|\.dev|\.post)\d+)?")


def _head_address_ok(value: object) -> bool:
    """``host:port``: a DNS name, an IPv4 address or a bracketed IPv6 one, and a port from 1 to 65535."""
    if not isinstance(value, str):
        return False
    match = re.fullmatch(r"(?:\[(?P<v6>[0-9A-Fa-f:.]+)\]|(?P<host>[A-Za-z0-9](?:[A-Za-z0-9.-]*[A-Za-z0-9])?)):"
                         r"(?P<port>\d{1,5})", value)
    if not match or not 1 <= int(match["port"]) <= 65535:
        return False
    if match["v6"]:
        try:
            ipaddress.IPv6Address(match["v6"])
        except ValueError:
            return False
    return True


def startup_script(head_address: str, *, install: bool = True, ray_version: str = RAY_VERSION,
                   jax_version: str = JAX_VERSION, rayslice_version: str = RAYSLICE_VERSION,
                   python_version: str = PYTHON_VERSION, ray_start_args: str = "", venv: str = VENV_DIR,
                   wheel: str | None = None, token_secret: str | None = None) -> str:
    """The TPU VM startup script: join the Ray cluster at ``head_address`` (GCS ``host:port``).

    With ``install`` (the default) it makes a Python ``python_version`` environment with uv (installed
    first when the VM lacks it; uv downloads that Python when the image has another) at ``venv``,
    installs ``rayslice[cluster]``, ``jax[tpu]`` and ``ray[default]`` at the given versions (default:
    the ones rayslice is tested with, ``rayslice.cloud.pins``) and starts Ray from it, so every Ray
    worker and step runs that Python. It runs at every boot: an existing environment is reused and
    the install is a no-op once done. ``install=False``: the VM image already has all of it; only
    ``ray start``. Ray's Python check, made by the joining node, is set to the minor version
    (``RAY_DEFAULT_PYTHON_VERSION_MATCH_LEVEL=minor``), or ``python_version`` may name the head's exact
    patch (``"3.12.12"``).
    Ray detects the slice (TPU_NAME, worker id, pod type) from the TPU VM's metadata itself.

    rayslice is in no package registry, so it is installed only from ``wheel`` (a ``gs://`` or ``https://``
    URL, or a path on the VM, of the wheel ``uv build`` makes), for a ``launcher: installed`` connection.
    Without it the hosts get what the default shipped launcher needs (Ray, JAX, pydantic, fsspec): each
    job carries rayslice's cluster side. Either way gcsfs comes too, for ``gs://`` checkpoint roots.

    ``token_secret`` (a Secret Manager secret, ``name`` or ``projects/<p>/secrets/<name>``) holds the Ray
    auth token of a token-auth head: the script reads it with ``gcloud`` (the VM's service account needs
    ``roles/secretmanager.secretAccessor`` on it) and starts Ray with ``RAY_AUTH_MODE=token``, so the token
    is never written into the VM's metadata.
    """
    if not _head_address_ok(head_address):
        raise InvalidRequestError(f"head_address {head_address!r} is invalid: give the Ray head's GCS address "
                                  "as host:port, e.g. '10.0.0.2:6379'")
    for name, value in (("ray_version", ray_version), ("jax_version", jax_version),
                        ("rayslice_version", rayslice_version)):
        if not isinstance(value, str) or not _VERSION.fullmatch(value):
            raise InvalidRequestError(f"{name} {value!r} is invalid: use a version such as '2.60.0'")
    if not isinstance(venv, str) or not venv.startswith("/"):
        raise InvalidRequestError(f"venv {venv!r} is invalid: give an absolute path, e.g. {VENV_DIR!r}")
    minor = re.fullmatch(r"3\.(\d+)(\.\d+)?", python_version) if isinstance(python_version, str) else None
    if not minor or int(minor[1]) < 12:
        raise InvalidRequestError(f"python_version {python_version!r} is invalid: rayslice needs Python 3.12 or "
                                  "newer, e.g. '3.12' or the head's exact '3.12.12' (the Airflow side's minor "
                                  "version, for steps shipped by value)")
    if wheel is not None and not _WHEEL.fullmatch(wheel or ""):
        raise InvalidRequestError(f"wheel {wheel!r} is invalid: give the URL or absolute path of rayslice's wheel, "
                                  "e.g. 'gs://my-bucket/wheels/rayslice-0.1.0-py3-none-any.whl'")
    if wheel and f"/rayslice-{rayslice_version}-" not in f"/{wheel.rsplit('/', 1)[-1]}":
        raise InvalidRequestError(f"wheel {wheel!r} is not rayslice {rayslice_version} (the Airflow side's "
                                  "version): build the wheel from the same release")
    if token_secret is not None and not _SECRET.fullmatch(token_secret or ""):
        raise InvalidRequestError(f"token_secret {token_secret!r} is invalid: give a Secret Manager secret, e.g. "
                                  "'ray-token' or 'projects/my-project/secrets/ray-token'")
    try:
        args = " ".join(shlex.quote(a) for a in shlex.split(ray_start_args))
    except ValueError as exc:  # an unclosed quote
        raise InvalidRequestError(f"ray_start_args {ray_start_args!r} is invalid ({exc}): give `ray start` "
                                  "arguments as a shell would, e.g. '--resources \'{\"x\": 1}\''") from None
    start = f"start --address={shlex.quote(head_address)}" + (f" {args}" if args else "")
    lines = ["#!/bin/bash", f"# rayslice: join the Ray cluster at {head_address}", "set -euo pipefail"]
    if token_secret:
        # Read at every boot, so a rotated token reaches the hosts when they restart.
        lines += ["export RAY_AUTH_MODE=token",
                  f"RAY_AUTH_TOKEN=\"$(gcloud secrets versions access latest --secret={shlex.quote(token_secret)})\"",
                  "export RAY_AUTH_TOKEN"]
    # Ray refuses a node whose Python differs from the head's at patch level by default; uv's 3.12.x may not
    # be the head's. The joining node checks itself, so the hosts' setting is what counts.
    lines.append(f"export {PYTHON_MATCH_LEVEL_ENV}=minor")
    if not install:
        return "\n".join([*lines, f"ray {start}"]) + "\n"
    if wheel:
        local = f"{venv}-wheels/{wheel.rsplit('/', 1)[-1]}"
        rayslice = [f"rayslice[cluster,gcs] @ file://{local}"]
        if wheel.startswith("gs://"):
            fetch = [f"mkdir -p {shlex.quote(venv)}-wheels",
                     f"gcloud storage cp {shlex.quote(wheel)} {shlex.quote(local)}"]
        elif wheel.startswith("https://"):
            fetch = [f"mkdir -p {shlex.quote(venv)}-wheels",
                     f"curl -fsSL -o {shlex.quote(local)} {shlex.quote(wheel)}"]
        else:
            fetch, rayslice = [], [f"rayslice[cluster,gcs] @ file://{wheel}"]
    else:
        fetch, rayslice = [], [*SHIPPED_LAUNCHER_NEEDS, *GCS_NEEDS]
    packages = " ".join(shlex.quote(p) for p in (*rayslice, f"jax[tpu]=={jax_version}",
                                                  f"ray[default]=={ray_version}"))
    lines += [*fetch,
        f'export HOME="${{HOME:-/root}}" UV_PYTHON_INSTALL_DIR={PYTHON_DIR} UV_COMPILE_BYTECODE=1',
        f"venv={shlex.quote(venv)}",
        "if ! command -v uv >/dev/null 2>&1; then",
        "  curl -LsSf https://astral.sh/uv/install.sh | env UV_INSTALL_DIR=/usr/local/bin UV_NO_MODIFY_PATH=1 sh",
        "fi",
        f'[ -x "$venv/bin/python" ] || uv venv --python {shlex.quote(python_version)} "$venv"',
        f'uv pip install --python "$venv/bin/python" {packages}',
        f'"$venv/bin/ray" {start}',
    ]
    return "\n".join(lines) + "\n"


def served_version(tpu: str, num_slices: int = 1) -> str:
    """The TPU version of ``tpu``; refuses a bad slice type and one the Cloud TPU API does not serve."""
    version = TpuSliceRequest(tpu=tpu, num_slices=num_slices).version
    if version in NOT_IN_CLOUD_TPU_API:
        raise InvalidRequestError(
            f"tpu={tpu!r}: TPU v7x (Ironwood) cannot be created through the Cloud TPU API (queued resources), "
            "which Google does not serve for TPU7x and later; run it on GKE (docs/deploying-gke.md)")
    return version


@dataclass(frozen=True)
class QueuedSlice:
    """One queued resource in ``project``/``zone`` holding ``num_slices`` slices of ``tpu``."""

    project: str
    zone: str
    queued_resource_id: str
    tpu: str
    num_slices: int = 1
    runtime_version: str | None = None  # None: the TPU VM image Google documents for the version
    spot: bool = False

    def __post_init__(self) -> None:
        check_project_zone(self.project, self.zone)
        if not isinstance(self.queued_resource_id, str) or not _RESOURCE_ID.match(self.queued_resource_id):
            raise InvalidRequestError(f"queued_resource_id {self.queued_resource_id!r} is invalid: lowercase "
                                      "letters, digits and '-', starting with a letter, at most 63 characters")
        version = served_version(self.tpu, self.num_slices)  # raises when bad
        if self.runtime_version is None and version not in RUNTIME_VERSIONS:
            raise InvalidRequestError(f"no default TPU VM runtime for {version}: pass runtime_version "
                                      "(`gcloud compute tpus tpu-vm versions list --zone ...`)")

    @property
    def runtime(self) -> str:
        return self.runtime_version or RUNTIME_VERSIONS[TpuSliceRequest(tpu=self.tpu).version]

    @property
    def parent(self) -> str:
        return f"projects/{self.project}/locations/{self.zone}"

    @property
    def name(self) -> str:
        return f"{self.parent}/queuedResources/{self.queued_resource_id}"

    def body(self, *, owner: str, script: str) -> Any:
        """The ``QueuedResource`` message: nodes labelled with the owner, the startup script in metadata."""
        from google.cloud import tpu_v2

        node = tpu_v2.Node(
            accelerator_type=TpuSliceRequest(tpu=self.tpu).pod_type,
            runtime_version=self.runtime,
            labels={MANAGED_BY_LABEL: "rayslice", OWNER_LABEL: owner_label(owner)},
            metadata={"startup-script": script},
            description=f"rayslice slice for {owner}"[:512],
        )
        spec = tpu_v2.QueuedResource.Tpu.NodeSpec(parent=self.parent, node=node)
        if self.num_slices > 1:
            spec.multislice_params = tpu_v2.QueuedResource.Tpu.NodeSpec.MultisliceParams(
                node_count=self.num_slices, node_id_prefix=self.queued_resource_id)
        else:
            spec.node_id = self.queued_resource_id
        queued = tpu_v2.QueuedResource(tpu=tpu_v2.QueuedResource.Tpu(node_spec=[spec]))
        if self.spot:
            queued.spot = tpu_v2.QueuedResource.Spot()
        return queued


def _owned(queued: Any, owner: str) -> bool:
    specs = list(queued.tpu.node_spec) if queued.tpu else []
    return bool(owner) and bool(specs) and all(s.node.labels.get(OWNER_LABEL) == owner_label(owner) for s in specs)


class QueuedSliceClient:
    """Create, wait for and delete one queued resource (blocking calls on a ``tpu_v2.TpuClient``)."""

    def __init__(self, queued: QueuedSlice, *, client: Any = None, api_endpoint: str | None = None,
                 timeout: float = 30.0) -> None:
        self.queued = queued
        self.client = client or tpu_client(api_endpoint)
        self.timeout = timeout

    def get(self) -> Any | None:
        from google.api_core import exceptions as gexc

        try:
            return self.client.get_queued_resource(name=self.queued.name, timeout=self.timeout)
        except gexc.NotFound:
            return None
        except gexc.GoogleAPIError as exc:
            raise _api_error(f"get {self.queued.name}", exc) from None

    def create(self, *, owner: str, script: str) -> Any:
        """Ask for the slices; a queued resource ``owner`` already made is returned as is (a retry)."""
        from google.api_core import exceptions as gexc

        try:
            operation = self.client.create_queued_resource(
                parent=self.queued.parent, queued_resource_id=self.queued.queued_resource_id,
                queued_resource=self.queued.body(owner=owner, script=script), timeout=self.timeout)
            return operation.result(timeout=self.timeout)
        except gexc.Conflict:  # 409 ALREADY_EXISTS
            existing = self.get()
            if existing is not None and _owned(existing, owner):
                return existing
            raise CloudTpuError(f"queued resource {self.queued.name} already exists and was not made by {owner}: "
                                "it is left alone; pick another queued_resource_id") from None
        except gexc.GoogleAPIError as exc:
            raise _api_error(f"create {self.queued.name}", exc) from None

    def active_state(self) -> tuple[Any | None, str]:
        """One look: (the queued resource, "ACTIVE") once every host is up, else (None, its state).

        FAILED or SUSPENDED raise, with the reason.
        """
        from google.cloud import tpu_v2

        states = tpu_v2.QueuedResourceState.State
        queued = self.get()
        if queued is None:
            raise CloudTpuError(f"queued resource {self.queued.name} disappeared while waiting for it")
        state = queued.state.state
        if state in (states.FAILED, states.SUSPENDED, states.SUSPENDING):
            detail = queued.state.failed_data.error.message if state == states.FAILED else ""
            raise CloudTpuError(f"queued resource {self.queued.name} is {state.name}"
                                + (f": {detail}" if detail else ""))
        return (queued if state == states.ACTIVE else None), state.name

    def not_active_in_time(self, timeout: float, state: str) -> CloudTpuError:
        return CloudTpuError(f"queued resource {self.queued.name} not ACTIVE after {timeout:g} s "
                             f"(state {state}): capacity may be short in {self.queued.zone}")

    def wait_active(self, *, timeout: float = 3600.0, poll_interval: float = 30.0) -> Any:
        """Poll until ACTIVE (every host up); FAILED or SUSPENDED end the wait with the reason."""
        deadline = time.monotonic() + timeout
        while True:
            active, state = self.active_state()
            if active is not None:
                return active
            if time.monotonic() >= deadline:
                raise self.not_active_in_time(timeout, state)
            time.sleep(poll_interval)

    def delete(self, *, owner: str, wait: bool = True) -> Deleted:
        """Delete it (``force``: its nodes too) only if ``owner`` made it."""
        from google.api_core import exceptions as gexc

        queued = self.get()
        if queued is None:
            return "absent"
        if not _owned(queued, owner):
            return "not-owned"
        try:
            from google.cloud import tpu_v2

            request = tpu_v2.DeleteQueuedResourceRequest(name=self.queued.name, force=True)
            operation = self.client.delete_queued_resource(request=request, timeout=self.timeout)
            if wait:
                operation.result(timeout=self.timeout)
        except gexc.NotFound:
            return "absent"
        except gexc.GoogleAPIError as exc:
            raise _api_error(f"delete {self.queued.name}", exc) from None
        return "deleted"

    def wait_gone(self, *, timeout: float = 1800.0, poll_interval: float = 15.0) -> None:
        deadline = time.monotonic() + timeout
        while self.get() is not None:
            if time.monotonic() >= deadline:
                raise CloudTpuError(f"queued resource {self.queued.name} still exists {timeout:g} s after deletion")
            time.sleep(poll_interval)
