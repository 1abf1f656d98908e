"""A RayCluster name of a DAG run's own, so that two runs of one DAG never share (or delete) a cluster.

Why: a DAG that creates its cluster as a setup task and deletes it as a teardown runs each of its runs
on a cluster of its own. With the connection's one fixed name, a second run started while the first
one's cluster exists finds that cluster (not its own) and fails. ``PER_RUN`` (the string
``"per-run"``), given as the setup/teardown operators' ``name`` and the steps' ``kuberay_cluster``,
stands for ``per_run_name(dag_id, run_id, deployment)``: the same name wherever it is computed (the
setup, each step, the teardown; on a worker or in the triggerer), with no XCom between them.

Dependency-free (no kubernetes, no yaml): DAG files that import the operators stay fast to parse.
"""

from __future__ import annotations

import hashlib
import re

from rayslice.core.exceptions import InvalidRequestError

__all__ = ["MAX_NAME", "PER_RUN", "check_name", "owner_for_run", "per_run_name", "resolve_name"]

#: Stands for the DAG run's own RayCluster name (``per_run_name``). Not a name itself: "per-run" is reserved.
PER_RUN = "per-run"
#: KubeRay's limit on a RayCluster's name (it derives Service names from it, and those are <= 63 characters).
MAX_NAME = 53
_DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
#: A per-run name: ``rs-`` + up to 26 characters of the DAG id + ``-`` + 10 hex digits, 40 characters at most,
#: so ``<name>-ray-token`` and KubeRay's ``<name>-head-svc`` and pod names stay well within their limits.
_PREFIX, _SLUG, _DIGEST = "rs", 26, 10


def check_name(name: object, what: str) -> None:
    """Refuse ``name`` unless it is a RayCluster name or ``PER_RUN``, in the words of ``what`` (the argument)."""
    if name == PER_RUN:
        return
    if not isinstance(name, str) or not _DNS1035.match(name) or len(name) > MAX_NAME:
        raise InvalidRequestError(
            f"{what} {name!r} is invalid: a RayCluster name is a DNS-1035 label of at most {MAX_NAME} characters "
            f"(lowercase letters, digits and '-', starting with a letter), e.g. 'rayslice'; or {PER_RUN!r} for a "
            "name of the DAG run's own")


def per_run_name(dag_id: str, run_id: str, deployment: str = "") -> str:
    """``rs-<dag id, shortened>-<hash of deployment, DAG and run>``: one name per run of one Airflow.

    The deployment is in the hash as in the owner mark: a staging Airflow running prod's DAG with
    prod's run ids in the same namespace gets clusters of its own, never prod's.
    """
    slug = re.sub(r"[^a-z0-9]+", "-", dag_id.lower()).strip("-")[:_SLUG].strip("-")
    digest = hashlib.sha256(f"{deployment}/{dag_id}/{run_id}".encode()).hexdigest()[:_DIGEST]
    return "-".join(part for part in (_PREFIX, slug, digest) if part)


def resolve_name(value: str | None, dag_id: str, run_id: str, deployment: str = "", *,
                 what: str = "name") -> str | None:
    """The RayCluster name ``value`` (as rendered) stands for: None (the connection's), the run's own, or itself."""
    if value in (None, ""):
        return None
    check_name(value, what)
    return per_run_name(dag_id, run_id, deployment) if value == PER_RUN else value


def owner_for_run(dag_id: str, run_id: str, deployment: str) -> str:
    """The owner mark of clusters (and their token Secrets) made by one DAG run of one Airflow.

    An annotation, so any length and characters. The deployment comes first: a staging Airflow with
    prod's DAGs and run ids must not adopt, delete or send a token to prod's cluster. A step with
    ``kuberay_cluster="per-run"`` checks it too: it runs only on the cluster its own run made.
    """
    return f"{deployment}/{dag_id}/{run_id}"
