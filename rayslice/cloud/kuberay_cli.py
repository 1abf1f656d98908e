"""`rayslice kuberay`: print a RayCluster (or RayJob) manifest, validated against a KubeRay CRD, and the RBAC.

Apart from ``kuberay`` (the manifests, plain dicts) because the command also reads the CRDs installed
in a live cluster through ``kuberay_client``, which itself builds on ``kuberay``'s rules: one module
holding both would import the client and be imported by it. Errors speak of the command's flags.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer
import yaml

from rayslice.cloud.kuberay import (
    _LABEL_VALUE,
    SPOT_SELECTOR,
    SPOT_TOLERATION,
    TOKEN_SECRET_KEY,
    PodSettings,
    check_rules,
    default_image_note,
    exposure_warning,
    render_raycluster,
    render_rayjob,
    token_secret_name,
    validate,
)
from rayslice.cloud.kuberay_crds import HOW_TO_VALIDATE, CrdUnavailableError, KubeRayCrds
from rayslice.cloud.pins import DEFAULT_GPU_IMAGE, DEFAULT_IMAGE
from rayslice.core.exceptions import InvalidRequestError


def _cluster_crds(kubeconfig: str | None, context: str | None) -> tuple[KubeRayCrds, Callable[[], None]]:
    """The CRDs of the cluster the kubeconfig (or the pod's service account) names, and how to close the client."""
    try:
        from rayslice.cloud.kuberay_client import KubeRayError, default_kubeconfig, load_api_client
    except ImportError:
        raise CrdUnavailableError("reading the cluster's CRDs needs the kubernetes package: "
                                  "pip install 'rayslice[kubernetes]'") from None
    in_cluster = False
    if not kubeconfig and not context:
        default = [Path(p).expanduser() for p in default_kubeconfig().split(os.pathsep) if p]
        if not any(p.is_file() for p in default):
            if not os.environ.get("KUBERNETES_SERVICE_HOST"):
                raise CrdUnavailableError(f"no Kubernetes cluster to read the CRDs from (no kubeconfig at "
                                          f"{', '.join(map(str, default))}, not running in a pod)")
            in_cluster = True
    try:
        api = load_api_client(kubeconfig=kubeconfig, context=context, in_cluster=in_cluster, retries=1)
    except KubeRayError as exc:
        raise CrdUnavailableError(str(exc)) from None
    return KubeRayCrds.from_cluster(api), api.close


def _validate_as_told(manifest: dict[str, Any], crd: list[Path], kubeconfig: str | None, context: str | None, *,
                      require: bool) -> str:
    """Validate against the CRD the options name (or the default cluster's); the line saying against what.

    A source the user named that cannot be used raises, and so does a missing one with ``require``;
    otherwise the line says that the manifest was not validated, why, and how to validate it.
    """
    close: Callable[[], None] = lambda: None  # noqa: E731
    try:
        crds = KubeRayCrds.from_files(crd) if crd else None
        if crds is None:
            crds, close = _cluster_crds(kubeconfig, context)
        return f"validated against {validate(manifest, crds)}"
    except CrdUnavailableError as exc:
        if crd or kubeconfig or context or require:
            raise
        return f"NOT validated against a KubeRay CRD: {exc}. To validate, {HOW_TO_VALIDATE}"
    finally:
        close()


#: The command's flag for each rendering argument, so that its errors speak of what the user typed.
_FLAGS = {"tpus": "--tpu", "max_slices": "--max-slices", "gpu_nodes": "--gpu-nodes", "checkpoint_root":
          "--checkpoint-root", "token_secret": "--token-secret", "head_service_type": "--head-service-type",
          "idle_timeout_seconds": "--idle-timeout", "head_cpu": "--head-cpu", "head_memory": "--head-memory",
          "label": "--label", "node_selector": "--node-selector", "toleration": "--toleration",
          "service_account": "--service-account", "priority_class": "--priority-class",
          "image_pull_secret": "--image-pull-secret", "internal_load_balancer": "--internal-load-balancer",
          "load_balancer_source_ranges": "--load-balancer-source-range",
          "load_balancer_source_range": "--load-balancer-source-range", "namespace": "--namespace",
          "gpu_image": "--gpu-image", "image": "--image", "gpu_type": "--gpu-type"}


def in_flag_words(message: str) -> str:
    """A rendering error (worded for ``render_raycluster``'s arguments) in ``rayslice kuberay manifest``'s flags."""
    message = re.sub(r"\btpus=\[([^\]]*)\]", lambda m: " ".join(
        f"--tpu {t.strip(chr(39) + ' ')}" for t in m[1].split(",") if t.strip()) or "--tpu", message)
    # The command has no --topology: drop the operator's "tpu='v6e' with topology='4x4'" alternative.
    message = re.sub(r",? or tpu='[^']*',? (?:with )?topology='[^']*'", "", message)
    message = re.sub(r"\btpu='([^']*)'", r"--tpu \1", message)
    message = re.sub(r"^invalid TPU slice request: ", "--tpu: ", message)
    message = re.sub(r"\b(" + "|".join(_FLAGS) + r")=", lambda m: _FLAGS[m[1]] + " ", message)
    message = re.sub(r"\bset head_service_type to LoadBalancer\b", "add --head-service-type LoadBalancer", message)
    message = message.replace("it needs auth on", "it needs --auth (the default), not --no-auth")
    message = re.sub(r"^(label|toleration|namespace|image|gpu_image|gpu_type) ", lambda m: _FLAGS[m[1]] + " ",
                     message)
    message = re.sub(r"^(RayCluster|RayJob) name ", "--name ", message)
    return re.sub(r"\b(" + "|".join(k for k in _FLAGS if "_" in k) + r")\b", lambda m: _FLAGS[m[1]], message)


def _pairs(values: list[str], flag: str) -> dict[str, str]:
    """``KEY=VALUE`` flags as a dict."""
    out = {}
    for value in values:
        key, sep, val = value.partition("=")
        if not sep or not key:
            raise InvalidRequestError(f"{flag} {value!r} is invalid: give KEY=VALUE, e.g. {flag} team=research")
        out[key] = val
    return out


def _toleration(value: str) -> dict[str, str]:
    """``KEY[=VALUE]:EFFECT`` (kubectl taint's own form) as a toleration."""
    taint, sep, effect = value.rpartition(":")
    if not sep or not taint:
        raise InvalidRequestError(f"--toleration {value!r} is invalid: give KEY[=VALUE]:EFFECT, e.g. "
                                  "--toleration cloud.google.com/gke-spot=true:NoSchedule")
    key, has_value, val = taint.partition("=")
    if has_value:
        return {"key": key, "operator": "Equal", "value": val, "effect": effect}
    return {"key": key, "operator": "Exists", "effect": effect}


app = typer.Typer(help="KubeRay: a GKE Ray cluster with whole-TPU-slice worker groups, and the RBAC Airflow needs.",
                  no_args_is_help=True)


@app.callback()
def _group() -> None:
    """KubeRay manifests and the RBAC Airflow needs for them."""


@app.command()
def manifest(
    tpu: Annotated[list[str], typer.Option("--tpu", help="A pod type, e.g. v6e-16; repeat for more.")] = [],  # noqa: B006
    max_slices: Annotated[int, typer.Option("--max-slices", min=1, help="Most slices of each TPU type.")] = 1,
    gpu_nodes: Annotated[int, typer.Option("--gpu-nodes", min=0, help="Most 1-GPU nodes (0: no GPU group).")] = 0,
    gpu_type: Annotated[str, typer.Option("--gpu-type", help="GKE accelerator label.")] = "nvidia-l4",
    name: Annotated[str, typer.Option("--name", help="RayCluster (or RayJob) name.")] = "rayslice",
    namespace: Annotated[str | None, typer.Option("--namespace", help="The Kubernetes namespace (default: none "
                                                  "in the manifest, so kubectl's current one).")] = None,
    image: Annotated[str, typer.Option("--image", help="The image of the head and TPU pods: docker/Dockerfile.tpu "
                                       "built and pushed (Ray >= 2.52 for token auth).")] = DEFAULT_IMAGE,
    gpu_image: Annotated[str, typer.Option("--gpu-image", help="The image of the GPU pods: docker/Dockerfile.gpu "
                                           "built and pushed.")] = DEFAULT_GPU_IMAGE,
    idle_timeout: Annotated[int, typer.Option("--idle-timeout", min=0, help="Seconds before idle nodes go.")] = 60,
    rayjob: Annotated[bool, typer.Option("--rayjob", help="Print a RayJob bringing the cluster up.")] = False,
    entrypoint: Annotated[str | None, typer.Option("--entrypoint", help="The RayJob's command.")] = None,
    crd: Annotated[list[Path], typer.Option(
        "--crd", help="A KubeRay CRD file (or a folder of them) to validate against; repeat for more.")] = [],  # noqa: B006
    kubeconfig: Annotated[str | None, typer.Option(
        "--kubeconfig", help="Validate against this kubeconfig's cluster's CRDs (default: ~/.kube/config).")] = None,
    context: Annotated[str | None, typer.Option("--context", help="The kubeconfig context to use.")] = None,
    check: Annotated[bool | None, typer.Option(
        "--validate/--no-validate",
        help="--validate: fail when no CRD can be found; --no-validate: skip. Default: validate when a "
             "--crd file or a cluster is at hand, else print it unvalidated and say so.")] = None,
    checkpoint_root: Annotated[str | None, typer.Option(
        "--checkpoint-root", help="RAYSLICE_CHECKPOINT_ROOT on every pod, e.g. gs://bucket/checkpoints.")] = None,
    auth: Annotated[bool, typer.Option(
        "--auth/--no-auth", help="Ray token auth (default on); the token is in the Secret --token-secret.")] = True,
    token_secret: Annotated[str | None, typer.Option(
        "--token-secret", help="The Secret (key auth_token) with the Ray token (default: <name>-ray-token).")
    ] = None,
    head_service_type: Annotated[str, typer.Option(
        "--head-service-type", help="ClusterIP (default), NodePort or LoadBalancer; the last two need --auth.")
    ] = "ClusterIP",
    head_cpu: Annotated[str, typer.Option("--head-cpu", help="The head pod's CPUs (requests = limits).")] = "8",
    head_memory: Annotated[str, typer.Option("--head-memory", help="The head pod's memory, e.g. 40G.")] = "40G",
    label: Annotated[list[str], typer.Option(
        "--label", help="KEY=VALUE on the RayCluster and every pod (cost allocation); repeat for more.")] = [],  # noqa: B006
    service_account: Annotated[str | None, typer.Option(
        "--service-account", help="The pods' Kubernetes service account (Workload Identity for gs:// "
        "checkpoints).")] = None,
    node_selector: Annotated[list[str], typer.Option(
        "--node-selector", help="KEY=VALUE every worker pod's node must have; repeat for more.")] = [],  # noqa: B006
    toleration: Annotated[list[str], typer.Option(
        "--toleration", help="KEY[=VALUE]:EFFECT tolerated by the worker pods; repeat for more.")] = [],  # noqa: B006
    spot: Annotated[bool, typer.Option(
        "--spot", help="Workers on GKE Spot VMs: cloud.google.com/gke-spot=true, selected and tolerated.")] = False,
    reservation: Annotated[str | None, typer.Option(
        "--reservation", help="Workers on this GKE reservation (cloud.google.com/reservation-name).")] = None,
    priority_class: Annotated[str | None, typer.Option(
        "--priority-class", help="The pods' PriorityClass.")] = None,
    image_pull_secret: Annotated[list[str], typer.Option(
        "--image-pull-secret", help="A Secret to pull the images with; repeat for more.")] = [],  # noqa: B006
    internal_load_balancer: Annotated[bool, typer.Option(
        "--internal-load-balancer", help="A LoadBalancer head Service inside the VPC only (GKE's internal "
        "load balancer).")] = False,
    load_balancer_source_range: Annotated[list[str], typer.Option(
        "--load-balancer-source-range", help="A CIDR allowed to reach a LoadBalancer head Service; repeat for "
        "more.")] = [],  # noqa: B006
) -> None:
    """Print the RayCluster (or RayJob) YAML; stderr says whether, and against which CRD, it was validated.

    The CRD comes from --crd files, else from the cluster of the kubeconfig (--kubeconfig/--context, or
    the default one), read through the Kubernetes API. A source named with --crd, --kubeconfig or
    --context that fails is an error; without them, a manifest that could not be validated is still
    printed, with the reason on stderr.
    """
    try:
        if rayjob and not entrypoint:
            raise InvalidRequestError("--rayjob needs --entrypoint, e.g. --entrypoint 'python train.py'")
        selector = _pairs(node_selector, "--node-selector")
        tolerations = [_toleration(t) for t in toleration]
        if spot:
            selector |= SPOT_SELECTOR
            tolerations.append(dict(SPOT_TOLERATION))
        if reservation:
            if not _LABEL_VALUE.match(reservation):
                raise InvalidRequestError(f"--reservation {reservation!r} is not a GKE reservation name "
                                          "(letters, digits, '-', '_', '.'; at most 63 characters)")
            selector |= {"cloud.google.com/reservation-name": reservation,
                         "cloud.google.com/reservation-affinity": "specific"}
        pods = PodSettings(head_cpu=head_cpu, head_memory=head_memory, labels=_pairs(label, "--label"),
                           service_account=service_account, node_selector=selector, tolerations=tolerations,
                           priority_class=priority_class, image_pull_secrets=image_pull_secret,
                           internal_load_balancer=internal_load_balancer,
                           load_balancer_source_ranges=load_balancer_source_range)
        result = render_raycluster(name, tpus=tpu, max_slices=max_slices, gpu_nodes=gpu_nodes,
                                   gpu_type=gpu_type, image=image, gpu_image=gpu_image,
                                   idle_timeout_seconds=idle_timeout,
                                   namespace=namespace, checkpoint_root=checkpoint_root, auth=auth,
                                   token_secret=token_secret, head_service_type=head_service_type, pods=pods)
        if rayjob:
            result = render_rayjob(name, entrypoint=entrypoint or "", cluster=result)
        check_rules(result)
        note = ("not validated against a KubeRay CRD (--no-validate)" if check is False
                else _validate_as_told(result, crd, kubeconfig, context, require=bool(check)))
    except (InvalidRequestError, CrdUnavailableError) as exc:
        typer.echo(f"error: {in_flag_words(str(exc))}", err=True)
        raise typer.Exit(1) from None
    typer.echo(yaml.safe_dump(result, sort_keys=False), nl=False)
    typer.echo(note, err=True)
    if auth:
        secret = token_secret or token_secret_name(name)
        typer.echo(f"Ray token auth is on: create the Secret before applying, e.g. `kubectl create secret generic "
                   f"{secret} {f'-n {namespace} ' if namespace else ''}--from-literal={TOKEN_SECRET_KEY}=\"$(openssl "
                   f"rand -hex 32)\"`, and give the `ray` connection the same token (its password, or the kuberay "
                   f"extra's \"token_secret\": \"{secret}\")", err=True)
    if warning := exposure_warning(head_service_type, auth):
        typer.echo(warning, err=True)
    if note := default_image_note(image, gpu_image if gpu_nodes else None):
        typer.echo(note, err=True)


def _rbac_command() -> None:
    from rayslice.cloud.kuberay_rbac import rbac

    app.command("rbac")(rbac)


_rbac_command()
