"""The KubeRay CRDs a manifest is checked against: files the user names, or the ones a cluster has installed.

Why: the schema that decides whether a RayCluster is accepted is the one in the cluster it is sent
to, and KubeRay versions differ; nothing is bundled with the package. ``KubeRayCrds.from_files``
reads CRD YAML (KubeRay's ``ray-operator/config/crd/bases``, or ``kubectl get crd rayclusters.ray.io
-o yaml``); ``KubeRayCrds.from_cluster`` reads ``rayclusters.ray.io`` / ``rayjobs.ray.io`` through the
Kubernetes API (apiextensions.k8s.io/v1), each the first time a manifest of that kind is checked.
Every check says what it was checked against (``source``), so a message never hides where the
schema came from.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import yaml
from jsonschema.exceptions import best_match

from rayslice.core.exceptions import InvalidRequestError, RaysliceError

__all__ = ["CRD_NAMES", "CrdUnavailableError", "KubeRayCrds"]

#: The CRD object name (``<plural>.<group>``) of each kind rayslice renders.
CRD_NAMES = {"RayCluster": "rayclusters.ray.io", "RayJob": "rayjobs.ray.io"}
HOW_TO_VALIDATE = ("pass --crd with KubeRay's CRD file (ray.io_rayclusters.yaml from ray-operator/config/crd/bases, "
                   "or `kubectl get crd rayclusters.ray.io -o yaml`), or --kubeconfig/--context of a cluster "
                   "that runs KubeRay")


class CrdUnavailableError(RaysliceError):
    """No CRD to check against: a file without the kind, a cluster without KubeRay, an unreachable API."""

    def __init__(self, message: str, *, status_code: int | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code


@cache
def _load_file(path: str, mtime_ns: int, size: int) -> tuple[dict[str, Any], ...]:
    """The ray.io CRDs in one YAML file (each ~1 MB: parsed once per version of the file)."""
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    with open(path, encoding="utf-8") as handle:
        docs = list(yaml.load_all(handle, Loader=loader))
    return tuple(doc for doc in docs if isinstance(doc, dict) and doc.get("kind") == "CustomResourceDefinition"
                 and (doc.get("spec") or {}).get("group") == "ray.io")


def _files(paths: Iterable[str | os.PathLike[str]]) -> list[Path]:
    found: list[Path] = []
    for raw in paths:
        path = Path(raw).expanduser()
        if path.is_dir():
            found.extend(sorted(p for p in path.iterdir() if p.suffix in (".yaml", ".yml", ".json")))
        elif path.is_file():
            found.append(path)
        else:
            raise CrdUnavailableError(f"no CRD file or folder at {path}")
    return found


def _to_json_schema(node: Any) -> Any:
    """Kubernetes structural schema -> JSON Schema, with the apiserver's meaning kept.

    int-or-string may come without a ``type`` (so allow both), ``nullable`` allows null, and
    unknown fields are rejected as ``kubectl apply`` (strict field validation) does.
    """
    if isinstance(node, list):
        return [_to_json_schema(item) for item in node]
    if not isinstance(node, dict):
        return node
    out = {key: value for key, value in node.items() if key != "description"}
    if isinstance(out.get("properties"), dict):
        out["properties"] = {key: _to_json_schema(value) for key, value in out["properties"].items()}
        if "additionalProperties" not in out and not out.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
    for key in ("items", "additionalProperties", "not", "anyOf", "allOf", "oneOf"):
        if isinstance(out.get(key), dict | list):
            out[key] = _to_json_schema(out[key])
    if out.get("x-kubernetes-int-or-string") and "anyOf" not in out:
        out.pop("type", None)
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if out.get("nullable"):
        if "type" in out:
            out["type"] = [out["type"], "null"]
        if "anyOf" in out:
            out["anyOf"] = [*out["anyOf"], {"type": "null"}]
        if "enum" in out:
            out["enum"] = [*out["enum"], None]
    return out


class KubeRayCrds:
    """The ray.io CRDs of one source; ``validate(manifest)`` checks a manifest's schema against them.

    ``fetch(kind)`` returns the CRD of a kind (a dict, as ``kubectl get crd -o json`` shows it) or
    raises ``CrdUnavailableError``; it is called once per kind. ``where`` names each kind's origin.
    """

    def __init__(self, source: str, fetch: Callable[[str], dict[str, Any]], where: dict[str, str]) -> None:
        self.source = source
        self._fetch = fetch
        self._where = where  # kind -> the file or cluster object its CRD comes from
        self._crds: dict[str, dict[str, Any]] = {}
        self._validators: dict[tuple[str, str], Any] = {}

    def __repr__(self) -> str:
        return f"KubeRayCrds({self.source!r})"

    @classmethod
    def from_files(cls, paths: Iterable[str | os.PathLike[str]]) -> KubeRayCrds:
        """CRDs from YAML/JSON files, or every ``*.yaml``/``*.yml``/``*.json`` of a folder."""
        files = _files(paths)
        by_kind: dict[str, tuple[dict[str, Any], Path]] = {}
        for path in files:
            stat = path.stat()
            for crd in _load_file(str(path.resolve()), stat.st_mtime_ns, stat.st_size):
                by_kind.setdefault(crd["spec"]["names"]["kind"], (crd, path))
        names = ", ".join(str(p) for p in files) or "no files"
        if not by_kind:
            raise CrdUnavailableError(f"no ray.io CustomResourceDefinition in {names}")

        def fetch(kind: str) -> dict[str, Any]:
            if kind not in by_kind:
                raise CrdUnavailableError(f"no {kind} CRD in {names} (they hold {sorted(by_kind)}): "
                                          f"add KubeRay's {CRD_NAMES.get(kind, kind)} file")
            return by_kind[kind][0]

        return cls(f"the KubeRay CRD file(s) {names}", fetch, {kind: str(path) for kind, (_, path) in by_kind.items()})

    @classmethod
    def from_cluster(cls, api_client: Any, *, timeout: float = 10.0) -> KubeRayCrds:
        """The CRDs installed in the cluster ``api_client`` (a ``kubernetes.client.ApiClient``) talks to."""
        host = getattr(api_client.configuration, "host", "?")

        def fetch(kind: str) -> dict[str, Any]:
            from kubernetes import client
            from kubernetes.client.exceptions import ApiException
            from urllib3.exceptions import HTTPError

            name = CRD_NAMES[kind]
            try:
                resp = client.ApiextensionsV1Api(api_client).read_custom_resource_definition(
                    name, _preload_content=False, _request_timeout=timeout)
                return json.loads(resp.data)
            except ApiException as exc:
                why = {404: "it is not installed there: install the KubeRay operator (its Helm chart installs "
                            "the CRDs)",
                       401: "the kubeconfig's credentials were refused",
                       403: "reading CRDs is not allowed: grant get on customresourcedefinitions."
                            "apiextensions.k8s.io"}.get(exc.status, f"HTTP {exc.status} ({exc.reason})")
                raise CrdUnavailableError(f"could not read the CRD {name} from the Kubernetes API at {host}: {why}",
                                          status_code=exc.status) from None
            except (HTTPError, OSError, ValueError) as exc:
                raise CrdUnavailableError(f"could not read the CRD {name} from the Kubernetes API at {host} "
                                          f"({type(exc).__name__}: {exc})") from None

        return cls(f"the CRDs installed in the cluster at {host}", fetch,
                   {kind: f"{name} in the cluster at {host}" for kind, name in CRD_NAMES.items()})

    def describe(self, kind: str, version: str) -> str:
        """What a manifest of ``kind`` was checked against, for messages."""
        return f"the {kind} CRD (ray.io/{version}) from {self._where.get(kind, self.source)}"

    def crd(self, kind: str) -> dict[str, Any]:
        if kind not in self._crds:
            self._crds[kind] = self._fetch(kind)
        return self._crds[kind]

    def auth_fields(self, kind: str, version: str = "v1") -> frozenset[str] | None:
        """The fields ``authOptions`` takes in this CRD (``secretName`` from KubeRay 1.6.0 on); None: no authOptions.

        KubeRay's CRDs carry no release number, so what a release can do is read from its schema.
        """
        versions = {v["name"]: v for v in self.crd(kind)["spec"]["versions"]}
        schema = (versions.get(version) or {}).get("schema", {}).get("openAPIV3Schema", {})
        spec = schema.get("properties", {}).get("spec", {})
        if kind == "RayJob":
            spec = spec.get("properties", {}).get("rayClusterSpec", {})
        auth = spec.get("properties", {}).get("authOptions")
        return None if auth is None else frozenset(auth.get("properties") or ())

    def check_served(self, kind: str, version: str) -> None:
        """Raise InvalidRequestError when this CRD does not serve ``ray.io/<version>`` (before any other check)."""
        self._validator(kind, version)

    def _validator(self, kind: str, version: str) -> Any:
        if (kind, version) not in self._validators:
            versions = {v["name"]: v for v in self.crd(kind)["spec"]["versions"] if v.get("served")}
            if version not in versions:
                raise InvalidRequestError(f"ray.io/{version} is not a served {kind} version in "
                                          f"{self.describe(kind, version)}: use {sorted(versions)}")
            schema = _to_json_schema(versions[version]["schema"]["openAPIV3Schema"])
            self._validators[kind, version] = jsonschema.Draft4Validator(schema)
        return self._validators[kind, version]

    def validate(self, manifest: dict[str, Any]) -> str:
        """Check ``manifest`` against its kind's schema; returns what it was checked against.

        Raises InvalidRequestError naming the JSON path of the first problem, or
        CrdUnavailableError when this source has no CRD for the manifest's kind.
        """
        kind = str(manifest.get("kind"))
        version = str(manifest.get("apiVersion", "")).partition("/")[2]
        error = best_match(self._validator(kind, version).iter_errors(manifest))
        if error is not None:
            raise InvalidRequestError(f"{kind} invalid at {error.json_path}: {error.message} "
                                      f"(checked against {self.describe(kind, version)})")
        return self.describe(kind, version)
