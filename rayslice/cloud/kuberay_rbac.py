"""The Kubernetes RBAC that Airflow's components need for `ray` connections naming a RayCluster.

Why: with a ``kuberay`` extra, every Airflow component that resolves the connection (workers,
triggerer, api-server) reads the RayCluster, its head Service and, with ``token_secret``, the token's
Secret through the Kubernetes API; ``CreateRayClusterOperator`` / ``DeleteRayClusterOperator`` also
create and delete RayClusters and token Secrets, and read KubeRay's RayCluster CRD (cluster-scoped) to check a
manifest before sending it. ``rayslice kuberay rbac`` prints exactly that, so an operator grants what
rayslice uses and no more; tests/rayslice/cloud/test_kuberay_rbac.py replays every call the client
makes against these rules.
"""

from __future__ import annotations

import re
from typing import Annotated, Any

import typer
import yaml

from rayslice.cloud.kuberay_crds import CRD_NAMES
from rayslice.core.exceptions import InvalidRequestError

_DNS1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
_DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
#: The command's flag for each argument, so that its errors speak of what the user typed.
_FLAGS = {"service_account_namespace": "--service-account-namespace", "namespace": "--namespace",
          "service_account": "--service-account", "name": "--name", "token_secret": "--token-secret"}
#: (API group, resource) -> verbs, for resolving a connection: every component that reads it.
LOOKUP = {("ray.io", "rayclusters"): ("get",), ("", "services"): ("get",), ("", "secrets"): ("get",)}
#: What the create and delete operators add, in the RayClusters' namespace.
MANAGE = {("ray.io", "rayclusters"): ("create", "delete"), ("", "secrets"): ("create", "delete")}
#: Cluster-scoped: reading KubeRay's RayCluster CRD (by name) to check a manifest before creating it; the
#: operators create RayClusters only, so the RayJob CRD is never read.
CRDS = {("apiextensions.k8s.io", "customresourcedefinitions"): ("get",)}


#: Verbs a rule with resourceNames can grant (the API server knows no name when it authorizes a create).
_NAMED_VERBS = ("get", "delete")


def _rules(grants: dict[tuple[str, str], tuple[str, ...]], names: list[str] | None = None,
           named: dict[tuple[str, str], list[str]] | None = None) -> list[dict[str, Any]]:
    """One rule per resource; ``names`` narrow every rule, ``named`` the get/delete of some resources."""
    rules = []
    for (group, resource), verbs in grants.items():
        only = names or (named or {}).get((group, resource))
        unnamed = [v for v in verbs if v not in _NAMED_VERBS] if only and not names else []
        if unnamed:
            rules.append({"apiGroups": [group], "resources": [resource], "verbs": unnamed})
            verbs = tuple(v for v in verbs if v in _NAMED_VERBS)
        rule: dict[str, Any] = {"apiGroups": [group], "resources": [resource], "verbs": list(verbs)}
        if only:
            rule["resourceNames"] = list(only)
        rules.append(rule)
    return rules


def _merge(*grants: dict[tuple[str, str], tuple[str, ...]]) -> dict[tuple[str, str], tuple[str, ...]]:
    merged: dict[tuple[str, str], tuple[str, ...]] = {}
    for grant in grants:
        for key, verbs in grant.items():
            merged[key] = tuple(dict.fromkeys((*merged.get(key, ()), *verbs)))
    return merged


def _check_name(value: str, what: str, *, limit: int = 253) -> None:
    if not isinstance(value, str) or not _DNS1123_SUBDOMAIN.match(value) or len(value) > limit:
        raise InvalidRequestError(f"{what} {value!r} is not a Kubernetes name (lowercase letters, digits, '-' "
                                  f"and '.', at most {limit} characters), e.g. 'airflow-worker'")


def _check_namespace(value: str, what: str) -> None:
    if not isinstance(value, str) or not _DNS1123_LABEL.match(value) or len(value) > 63:
        raise InvalidRequestError(f"{what} {value!r} is not a Kubernetes namespace (a DNS-1123 label: lowercase "
                                  "letters, digits and '-', at most 63 characters), e.g. 'ml'")


def render_rbac(*, namespace: str, service_accounts: list[str], service_account_namespace: str | None = None,
                manage: bool = True, create_service_accounts: bool = False,
                name: str = "rayslice-airflow", token_secrets: list[str] | None = None) -> list[dict[str, Any]]:
    """ServiceAccounts (optional), a Role and RoleBinding in ``namespace`` (where the RayClusters live) and,
    with ``manage``, a ClusterRole and ClusterRoleBinding to read KubeRay's RayCluster CRD.

    ``service_accounts`` are Airflow's (in ``service_account_namespace``, default ``namespace``): the Helm
    chart gives its workers, triggerer and api-server their own, so list each. ``manage=False`` grants only
    the lookup (no cluster per DAG run). ``token_secrets`` (the connections' ``token_secret`` names) narrow
    reading and deleting Secrets to those; without them every Secret of ``namespace`` can be read.
    """
    if not service_accounts:
        raise InvalidRequestError("give the Airflow service account(s) to grant, e.g. service_accounts="
                                  "['airflow-worker', 'airflow-triggerer', 'airflow-api-server']")
    sa_namespace = service_account_namespace or namespace
    _check_namespace(namespace, "namespace")
    _check_namespace(sa_namespace, "service_account_namespace")
    # The ClusterRole is named <name>-<namespace>-crds, a name of at most 253 characters.
    _check_name(name, "name", limit=253 - len(f"-{namespace}-crds"))
    for sa in service_accounts:
        _check_name(sa, "service_account")
    for secret in token_secrets or []:
        _check_name(secret, "token_secret")
    named = {("", "secrets"): list(dict.fromkeys(token_secrets))} if token_secrets else None
    subjects = [{"kind": "ServiceAccount", "name": sa, "namespace": sa_namespace} for sa in service_accounts]
    labels = {"app.kubernetes.io/managed-by": "rayslice"}
    objects: list[dict[str, Any]] = []
    if create_service_accounts:
        objects += [{"apiVersion": "v1", "kind": "ServiceAccount",
                     "metadata": {"name": sa, "namespace": sa_namespace, "labels": labels}}
                    for sa in service_accounts]
    role_meta = {"name": name, "namespace": namespace, "labels": labels}
    objects += [
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": role_meta,
         "rules": _rules(_merge(LOOKUP, MANAGE) if manage else LOOKUP, named=named)},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": role_meta,
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
         "subjects": subjects},
    ]
    if manage:
        cluster_meta = {"name": f"{name}-{namespace}-crds", "labels": labels}
        objects += [
            {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole", "metadata": cluster_meta,
             "rules": _rules(CRDS, [CRD_NAMES["RayCluster"]])},
            {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding", "metadata": cluster_meta,
             "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                         "name": cluster_meta["name"]},
             "subjects": subjects},
        ]
    return objects


def rbac(
    namespace: Annotated[str, typer.Option("--namespace", help="Where the RayClusters (and their token "
                                           "Secrets) live.")],
    service_account: Annotated[list[str], typer.Option(
        "--service-account", help="An Airflow component's service account (workers, triggerer, api-server); "
        "repeat for each.")],
    service_account_namespace: Annotated[str | None, typer.Option(
        "--service-account-namespace", help="Airflow's namespace (default: --namespace).")] = None,
    manage: Annotated[bool, typer.Option(
        "--manage/--lookup-only", help="--manage (default): also create and delete RayClusters and token Secrets "
        "(CreateRayClusterOperator) and read KubeRay's RayCluster CRD; --lookup-only: only resolve "
        "connections.")] = True,
    create_service_accounts: Annotated[bool, typer.Option(
        "--create-service-accounts", help="Also print the ServiceAccounts (when Airflow's chart does not make "
        "them).")] = False,
    name: Annotated[str, typer.Option("--name", help="The Role's (and binding's) name.")] = "rayslice-airflow",
    token_secret: Annotated[list[str], typer.Option(
        "--token-secret", help="Read (and delete) only this Secret: the connections' token_secret; repeat for "
        "more. Default: every Secret of --namespace.")] = [],  # noqa: B006
) -> None:
    """Print the RBAC (Role, RoleBinding, ClusterRole for the RayCluster CRD) for `kuberay` connections."""
    try:
        objects = render_rbac(namespace=namespace, service_accounts=service_account,
                              service_account_namespace=service_account_namespace, manage=manage,
                              create_service_accounts=create_service_accounts, name=name,
                              token_secrets=token_secret)
    except InvalidRequestError as exc:
        message = str(exc).replace("service_accounts=", "--service-account ")
        message = re.sub(r"^(" + "|".join(_FLAGS) + r") ", lambda m: _FLAGS[m[1]] + " ", message)
        typer.echo(f"error: {message}", err=True)
        raise typer.Exit(1) from None
    typer.echo(yaml.safe_dump_all(objects, sort_keys=False), nl=False)
