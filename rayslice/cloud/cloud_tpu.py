"""Cloud TPU API (``google-cloud-tpu``, v2): zone accelerator types, and queued-resource slices for a Ray cluster.

Why: on GCE VMs without KubeRay nothing adds TPU hosts to a Ray cluster on demand. A queued
resource asks Cloud TPU for whole slices; their hosts run a startup script that joins the Ray
cluster (Ray detects the slice from the TPU VM's metadata), and deleting the queued resource
(``force``) removes the hosts again. Each queued resource carries an owner label on its nodes;
deleting checks it, so a teardown never removes capacity it did not ask for.

Each slice's nodes also carry a deployment label (a hash of the Airflow deployment), so ``sweep``
can find this deployment's queued resources whose teardown never ran (Airflow down, DAG deleted)
and delete those older than a limit, leaving every other deployment's and every hand-made one alone.

The VMs get the network, subnetwork, external-IP choice and service account the caller names:
the v2 API's defaults differ from gcloud's (no external IP, the default compute service account),
and a startup script that installs Ray needs egress and a service account that may read the token.

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
    "head_startup_script",
    "owner_label",
    "startup_script",
    "Swept",
    "sweep",
    "tpu_client",
    "zone_accelerator_types",
]

OWNER_LABEL = "rayslice-owner"
DEPLOYMENT_LABEL = "rayslice-deployment"
MANAGED_BY_LABEL = "managed-by"
#: The scope a TPU VM's service account gets unless told otherwise: IAM roles, not scopes, then decide
#: (Google's recommendation); narrower scopes can stop `gcloud secrets` and `gcloud storage` at boot.
DEFAULT_SCOPES = ("https://www.googleapis.com/auth/cloud-platform",)
ZONE_CACHE_SECONDS = 3600.0
_ZONE = re.compile(r"^[a-z]+-[a-z]+[0-9]+-[a-z]$")
_PROJECT = re.compile(r"^[a-z][-a-z0-9]{4,28}[a-z0-9]$")
_RESOURCE_ID = re.compile(r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")
_NETWORK = re.compile(r"^(projects/[a-z][-a-z0-9]{4,28}[a-z0-9]/global/networks/)?[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")
_SUBNETWORK = re.compile(r"^(projects/[a-z][-a-z0-9]{4,28}[a-z0-9]/regions/[a-z]+-[a-z]+[0-9]+/subnetworks/)?"
                         r"[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")
_SERVICE_ACCOUNT = re.compile(r"^[a-z0-9][-a-z0-9._]{0,99}@[a-z0-9][-a-z0-9.]*\.gserviceaccount\.com$")
_SCOPE = re.compile(r"^https://www\.googleapis\.com/auth/[a-z0-9._-]+$")
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


#: uv's release the startup scripts install (when the VM has no uv): its list of Python builds is fixed, so
#: ``HOST_PYTHON`` is always the same build.
UV_VERSION = "0.13.9"
#: The exact Python of the head and every TPU host: Ray refuses a node whose Python differs from the head's
#: at patch level. Its minor is the Airflow side's (``pins.PYTHON_VERSION``), for steps shipped by value.
HOST_PYTHON = f"{PYTHON_VERSION}.16"
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


def _check_versions(ray_version: str, jax_version: str, rayslice_version: str, python_version: str,
                    venv: str, wheel: str | None, token_secret: str | None) -> None:
    for name, value in (("ray_version", ray_version), ("jax_version", jax_version),
                        ("rayslice_version", rayslice_version)):
        if not isinstance(value, str) or not _VERSION.fullmatch(value):
            raise InvalidRequestError(f"{name} {value!r} is invalid: use a version such as '2.60.0'")
    if not isinstance(venv, str) or not venv.startswith("/"):
        raise InvalidRequestError(f"venv {venv!r} is invalid: give an absolute path, e.g. {VENV_DIR!r}")
    minor = re.fullmatch(r"3\.(\d+)(\.\d+)?", python_version) if isinstance(python_version, str) else None
    if not minor or int(minor[1]) < 12:
        raise InvalidRequestError(f"python_version {python_version!r} is invalid: rayslice needs Python 3.12 or "
                                  f"newer, e.g. {HOST_PYTHON!r} (the exact patch: Ray refuses a node whose Python "
                                  "differs from the head's; the minor is the Airflow side's, for steps shipped by "
                                  "value)")
    if wheel is not None and not _WHEEL.fullmatch(wheel or ""):
        raise InvalidRequestError(f"wheel {wheel!r} is invalid: give the URL or absolute path of rayslice's wheel, "
                                  "e.g. 'gs://my-bucket/wheels/rayslice-0.1.0-py3-none-any.whl'")
    if wheel and f"/rayslice-{rayslice_version}-" not in f"/{wheel.rsplit('/', 1)[-1]}":
        raise InvalidRequestError(f"wheel {wheel!r} is not rayslice {rayslice_version} (the Airflow side's "
                                  "version): build the wheel from the same release")
    if token_secret is not None and not _SECRET.fullmatch(token_secret or ""):
        raise InvalidRequestError(f"token_secret {token_secret!r} is invalid: give a Secret Manager secret, e.g. "
                                  "'ray-token' or 'projects/my-project/secrets/ray-token'")


def _start_args(ray_start_args: str) -> str:
    try:
        return " ".join(shlex.quote(a) for a in shlex.split(ray_start_args))
    except ValueError as exc:  # an unclosed quote
        raise InvalidRequestError(f"ray_start_args {ray_start_args!r} is invalid ({exc}): give `ray start` "
                                  "arguments as a shell would, e.g. '--resources \'{\"x\": 1}\''") from None


def _script(title: str, start: str, *, install: bool, packages: tuple[str, ...], python_version: str, venv: str,
            wheel: str | None, token_secret: str | None) -> str:
    """The shared body: the token from Secret Manager, the wheel, uv and the venv, then ``ray <start>``."""
    lines = ["#!/bin/bash", f"# rayslice: {title}", "set -euo pipefail"]
    if token_secret:
        # Read at every boot, so a rotated token reaches the VMs when they restart; `tr` drops the newline
        # a secret made with `openssl rand -hex 32 | gcloud secrets create` ends with.
        lines += ["export RAY_AUTH_MODE=token",
                  f"RAY_AUTH_TOKEN=\"$(gcloud secrets versions access latest --secret={shlex.quote(token_secret)} "
                  "| tr -d '\\n')\"",
                  "export RAY_AUTH_TOKEN"]
    # Ray refuses a node whose Python differs from the head's at patch level by default, and the joining node
    # checks itself. Head and hosts made by these scripts share one exact Python; this covers a head or an
    # image made another way (install=False) that differs at patch level only.
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
    quoted = " ".join(shlex.quote(p) for p in (*rayslice, *packages))
    # A venv of another Python (made by an older rayslice) is made again: Ray refuses mismatched nodes.
    wanted = shlex.quote(python_version)
    lines += [*fetch,
        f'export HOME="${{HOME:-/root}}" UV_PYTHON_INSTALL_DIR={PYTHON_DIR} UV_COMPILE_BYTECODE=1 '
        "UV_PYTHON_PREFERENCE=only-managed",
        f"venv={shlex.quote(venv)}",
        "if ! command -v uv >/dev/null 2>&1; then",
        f"  curl -LsSf https://astral.sh/uv/{UV_VERSION}/install.sh | env UV_INSTALL_DIR=/usr/local/bin "
        "UV_NO_MODIFY_PATH=1 sh",
        "fi",
        'have="$("$venv/bin/python" -c "import platform; print(platform.python_version())" 2>/dev/null || true)"',
        f'case "$have" in {wanted}|{wanted}.*) ;; *) uv venv --clear --python {wanted} "$venv" ;; esac',
        f'uv pip install --python "$venv/bin/python" {quoted}',
        # Ray runs a job's entrypoint (`python -m rayslice.cluster ...`) through the shell with this PATH: a
        # startup script's is the system's (Debian 12 has no `python`), so the venv's bin goes first.
        'export PATH="$venv/bin:$PATH" VIRTUAL_ENV="$venv"',
        f'"$venv/bin/ray" {start}',
    ]
    return "\n".join(lines) + "\n"


def startup_script(head_address: str, *, install: bool = True, ray_version: str = RAY_VERSION,
                   jax_version: str = JAX_VERSION, rayslice_version: str = RAYSLICE_VERSION,
                   python_version: str = HOST_PYTHON, ray_start_args: str = "", venv: str = VENV_DIR,
                   wheel: str | None = None, token_secret: str | None = None) -> str:
    """The TPU VM startup script: join the Ray cluster at ``head_address`` (GCS ``host:port``).

    With ``install`` (the default) it makes a Python ``python_version`` environment with uv (a pinned
    uv release, installed first when the VM lacks it; uv's own build of that Python) at ``venv``,
    installs ``rayslice[cluster]``, ``jax[tpu]`` and ``ray[default]`` at the given versions (default:
    the ones rayslice is tested with, ``rayslice.cloud.pins``) and starts Ray from it, so every Ray
    worker and step runs that Python. ``python_version`` defaults to an exact patch (``HOST_PYTHON``):
    Ray refuses a node whose Python differs from the head's at patch level, so the head
    (``head_startup_script``) and every slice, made weeks apart too, get the same one. It runs at every
    boot: an existing environment of that Python is reused and the install is a no-op once done.
    ``install=False``: the VM image already has all of it; only ``ray start``. Ray detects the slice
    (TPU_NAME, worker id, pod type) from the TPU VM's metadata itself.

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
    _check_versions(ray_version, jax_version, rayslice_version, python_version, venv, wheel, token_secret)
    args = _start_args(ray_start_args)
    start = f"start --address={shlex.quote(head_address)}" + (f" {args}" if args else "")
    return _script(f"join the Ray cluster at {head_address}", start, install=install,
                   packages=(f"jax[tpu]=={jax_version}", f"ray[default]=={ray_version}"),
                   python_version=python_version, venv=venv, wheel=wheel, token_secret=token_secret)


def head_startup_script(*, port: int = 6379, metrics_port: int = 8080, install: bool = True,
                        ray_version: str = RAY_VERSION, rayslice_version: str = RAYSLICE_VERSION,
                        python_version: str = HOST_PYTHON, ray_start_args: str = "", venv: str = VENV_DIR,
                        wheel: str | None = None, token_secret: str | None = None) -> str:
    """The head VM's startup script: the TPU hosts' recipe (same uv, Python patch, Ray), then ``ray start --head``.

    Why the same recipe: Ray refuses hosts whose Python differs from the head's at patch level, and
    Debian 12 / Ubuntu 24.04 refuse a system-wide ``pip install`` (PEP 668; Debian 12's Python is
    3.11 besides). As the VM's startup script it runs at every boot, so the head comes back after a
    reboot. It runs no steps (``--num-cpus 0``): only Ray's control store, the dashboard (on every
    interface: close it with the firewall) and the jobs' drivers; ``metrics_port`` serves Ray's metrics.
    No JAX: nothing on the head computes.
    """
    for name, value in (("port", port), ("metrics_port", metrics_port)):
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 65535:
            raise InvalidRequestError(f"{name} {value!r} is invalid: use a TCP port from 1 to 65535")
    _check_versions(ray_version, JAX_VERSION, rayslice_version, python_version, venv, wheel, token_secret)
    args = _start_args(ray_start_args)
    start = (f"start --head --port={port} --num-cpus=0 --dashboard-host=0.0.0.0 --metrics-export-port={metrics_port}"
             + (f" {args}" if args else ""))
    return _script(f"the Ray head (GCS port {port})", start, install=install,
                   packages=(f"ray[default]=={ray_version}",), python_version=python_version, venv=venv,
                   wheel=wheel, token_secret=token_secret)


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
    #: The VPC (name or ``projects/<p>/global/networks/<n>``); None: the project's ``default``.
    network: str | None = None
    #: The subnetwork (name or ``projects/<p>/regions/<r>/subnetworks/<s>``); None: the network's in the region.
    subnetwork: str | None = None
    #: An external IP on every host (as gcloud gives by default; the raw API does not). False: the hosts reach
    #: PyPI and uv's downloads only through Cloud NAT, and Google's APIs through Private Google Access.
    enable_external_ips: bool = True
    #: The hosts' service account (e-mail); None: the project's Compute Engine default service account.
    service_account: str | None = None
    scopes: tuple[str, ...] = DEFAULT_SCOPES

    def __post_init__(self) -> None:
        check_project_zone(self.project, self.zone)
        object.__setattr__(self, "scopes", tuple(self.scopes) if isinstance(self.scopes, (list, tuple)) else
                           self.scopes)
        if self.network is not None and (not isinstance(self.network, str) or not _NETWORK.match(self.network)):
            raise InvalidRequestError(f"network {self.network!r} is invalid: give a VPC name, e.g. 'ml-vpc', or "
                                      "'projects/my-project/global/networks/ml-vpc'")
        if self.subnetwork is not None and (not isinstance(self.subnetwork, str)
                                            or not _SUBNETWORK.match(self.subnetwork)):
            raise InvalidRequestError(f"subnetwork {self.subnetwork!r} is invalid: give a subnetwork name, e.g. "
                                      "'ml-us-east5', or "
                                      "'projects/my-project/regions/us-east5/subnetworks/ml-us-east5'")
        if not isinstance(self.enable_external_ips, bool):
            raise InvalidRequestError(f"enable_external_ips {self.enable_external_ips!r} is invalid: use True or "
                                      "False")
        if self.service_account is not None and (not isinstance(self.service_account, str)
                                                 or not _SERVICE_ACCOUNT.match(self.service_account)):
            raise InvalidRequestError(f"service_account {self.service_account!r} is invalid: give the service "
                                      "account's e-mail, e.g. 'ray-tpu@my-project.iam.gserviceaccount.com'")
        if not isinstance(self.scopes, tuple) or not self.scopes or \
                not all(isinstance(x, str) and _SCOPE.match(x) for x in self.scopes):
            raise InvalidRequestError(f"scopes {self.scopes!r} is invalid: give OAuth scope URLs, e.g. "
                                      f"[{DEFAULT_SCOPES[0]!r}] (the default: IAM roles then decide)")
        if not isinstance(self.queued_resource_id, str) or not _RESOURCE_ID.match(self.queued_resource_id):
            raise InvalidRequestError(f"queued_resource_id {self.queued_resource_id!r} is invalid: lowercase "
                                      "letters, digits and '-', starting with a letter, at most 63 characters")
        if isinstance(self.num_slices, int) and self.num_slices > 1:
            # The API names a multislice's nodes `<id>-0` .. `<id>-<n-1>`: each a resource id of <= 63 characters.
            last = f"{self.queued_resource_id}-{self.num_slices - 1}"
            if len(last) > 63:
                raise InvalidRequestError(
                    f"queued_resource_id {self.queued_resource_id!r} is too long for num_slices={self.num_slices}: "
                    f"its last node id {last!r} is {len(last)} characters, the API allows 63; shorten the id to "
                    f"{63 - len(last) + len(self.queued_resource_id)} characters")
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

    def body(self, *, owner: str, script: str, deployment: str | None = None) -> Any:
        """The ``QueuedResource`` message: nodes labelled with the owner (and deployment, for ``sweep``), the
        startup script in metadata, the network and service account asked for."""
        from google.cloud import tpu_v2

        labels = {MANAGED_BY_LABEL: "rayslice", OWNER_LABEL: owner_label(owner)}
        if deployment is not None:
            labels[DEPLOYMENT_LABEL] = owner_label(deployment)
        network = tpu_v2.NetworkConfig(enable_external_ips=self.enable_external_ips)
        if self.network:
            network.network = self.network
        if self.subnetwork:
            network.subnetwork = self.subnetwork
        node = tpu_v2.Node(
            accelerator_type=TpuSliceRequest(tpu=self.tpu).pod_type,
            runtime_version=self.runtime,
            labels=labels,
            metadata={"startup-script": script},
            description=f"rayslice slice for {owner}"[:512],
            network_config=network,
        )
        if self.service_account:
            node.service_account = tpu_v2.ServiceAccount(email=self.service_account, scope=list(self.scopes))
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

    def create(self, *, owner: str, script: str, deployment: str | None = None) -> Any:
        """Ask for the slices; a queued resource ``owner`` already made is returned as is (a retry)."""
        from google.api_core import exceptions as gexc

        try:
            operation = self.client.create_queued_resource(
                parent=self.queued.parent, queued_resource_id=self.queued.queued_resource_id,
                queued_resource=self.queued.body(owner=owner, script=script, deployment=deployment),
                timeout=self.timeout)
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


@dataclass(frozen=True)
class Swept:
    """One queued resource ``sweep`` found: its id, age in seconds, and what became of it."""

    queued_resource_id: str
    age_s: float
    outcome: Literal["deleted", "would delete", "kept: too young", "absent"]


def sweep(project: str, zone: str, *, deployment: str, older_than_s: float, delete: bool = False,
          client: Any = None, api_endpoint: str | None = None, now: float | None = None) -> list[Swept]:
    """The queued resources of ``deployment`` in ``zone`` (created by rayslice, labelled with its hash), and, with
    ``delete``, delete (``force``) those older than ``older_than_s``.

    Why: a teardown that never ran (Airflow down for good, the DAG deleted, a run marked failed by hand)
    leaves TPU VMs billing. Only resources carrying this deployment's label on every node are touched:
    another Airflow's, and any made by hand or by another tool, are never listed. A run still using
    its slices is as old as its run: pick ``older_than_s`` longer than any run lasts.
    """
    check_project_zone(project, zone)
    if not isinstance(deployment, str) or not deployment:
        raise InvalidRequestError("deployment is required: the Airflow deployment whose slices to sweep (its "
                                  "`ray` connection's 'deployment' extra, or its `rayslice_deployment` Variable)")
    if isinstance(older_than_s, bool) or not isinstance(older_than_s, (int, float)) or older_than_s < 0:
        raise InvalidRequestError(f"older_than {older_than_s!r} is invalid: use a duration of 0 s or more")
    from google.api_core import exceptions as gexc
    from google.cloud import tpu_v2

    client = client or tpu_client(api_endpoint)
    parent = f"projects/{project}/locations/{zone}"
    mark = owner_label(deployment)
    now = time.time() if now is None else now
    try:
        listed = list(client.list_queued_resources(parent=parent))
    except gexc.GoogleAPIError as exc:
        raise _api_error(f"listing the queued resources of {zone}", exc) from None
    found: list[Swept] = []
    for queued in listed:
        specs = list(queued.tpu.node_spec) if queued.tpu else []
        if not specs or not all(sp.node.labels.get(MANAGED_BY_LABEL) == "rayslice"
                                and sp.node.labels.get(DEPLOYMENT_LABEL) == mark for sp in specs):
            continue
        queued_id = queued.name.rsplit("/", 1)[-1]
        age = max(0.0, now - queued.create_time.timestamp()) if queued.create_time else 0.0
        if age < older_than_s:
            found.append(Swept(queued_id, age, "kept: too young"))
            continue
        if not delete:
            found.append(Swept(queued_id, age, "would delete"))
            continue
        try:
            client.delete_queued_resource(request=tpu_v2.DeleteQueuedResourceRequest(name=queued.name, force=True),
                                          timeout=30.0)
        except gexc.NotFound:
            found.append(Swept(queued_id, age, "absent"))
            continue
        except gexc.GoogleAPIError as exc:
            raise _api_error(f"delete {queued.name}", exc) from None
        found.append(Swept(queued_id, age, "deleted"))
    return found
