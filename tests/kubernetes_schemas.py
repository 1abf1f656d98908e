"""Kubernetes' own schemas, offline (`kubernetes-validate`), for what rayslice renders.

KubeRay's CRDs describe a RayCluster's pod templates only loosely; the kubelet and the API server
check them as Pods. Each template is checked here as the Pod it becomes, with `strict` on (an
unknown field fails, as `kubectl apply --validate=strict` would).
"""

from __future__ import annotations

from typing import Any

import kubernetes_validate

#: The Kubernetes version checked against: GKE's regular channel is at or above it.
KUBERNETES_VERSION = "1.33"


def pod_templates(manifest: dict[str, Any]) -> list[dict[str, Any]]:
    """Every pod template of a RayCluster or RayJob."""
    spec = manifest["spec"]
    if manifest["kind"] == "RayJob":
        spec = spec["rayClusterSpec"]
    return [spec["headGroupSpec"]["template"], *(g["template"] for g in spec.get("workerGroupSpecs") or [])]


def validate_object(obj: dict[str, Any]) -> None:
    """Raise ``AssertionError`` naming the object, path and reason when Kubernetes' schema refuses ``obj``."""
    try:
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as exc:
        where = "/".join(str(p) for p in exc.path)
        raise AssertionError(f"{obj.get('kind')} {obj.get('metadata', {}).get('name')}: {where}: "
                             f"{exc.message}") from None


def validate_manifest(manifest: dict[str, Any]) -> int:
    """Each pod template as a Pod; returns how many were checked."""
    templates = pod_templates(manifest)
    for i, template in enumerate(templates):
        validate_object({"apiVersion": "v1", "kind": "Pod",
                         "metadata": {"name": f"template-{i}", **template.get("metadata", {})},
                         "spec": template["spec"]})
    return len(templates)
