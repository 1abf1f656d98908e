"""Airflow provider metadata, read through the `apache_airflow_provider` entry point.

Airflow calls this in every process that discovers providers, so it imports nothing:
the connection form is declared here (``conn-fields`` / ``ui-field-behaviour``), not by
the hook, and the plugin is only looked up, not imported.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, distribution
from importlib.util import find_spec

_INTEGRATION = "Ray"
_PLUGIN_MODULE = "rayslice.plugins.slices"


def _plugins() -> list[dict[str, str]]:
    """The Slices UI plugin, unless our package already registers it as an `airflow.plugins` entry point.

    Airflow loads both lists; a plugin named in both is reported as an import error
    ("already registered"), so it must be declared in exactly one place.
    """
    try:
        present = find_spec("rayslice.plugins.slices") is not None
    except ImportError:
        present = False
    if not present:  # the plugin ships separately (plugins/slices.py): nothing to list yet
        return []
    try:
        own = distribution("rayslice").entry_points
    except PackageNotFoundError:
        own = ()
    if any(ep.group == "airflow.plugins" and ep.value.startswith(_PLUGIN_MODULE) for ep in own):
        return []
    return [{"name": "rayslice_slices", "plugin-class": f"{_PLUGIN_MODULE}.SlicesPlugin"}]


def _connection_type(connection_type: str, hook_class: str, hook_name: str) -> dict:
    """The connection form: the same fields under `ray` and under rayslice's own `rayslice`."""
    return {
        "connection-type": connection_type,
        "hook-class-name": f"rayslice.hooks.ray.{hook_class}",
        "hook-name": hook_name,
        "conn-fields": {
            "verify": {
                "label": "Verify TLS",
                "description": "true (default), false, or the path of a CA bundle on the workers",
                "schema": {"type": ["string", "boolean", "null"]},
            },
            "headers": {
                "label": "Extra HTTP headers",
                "description": 'JSON object sent with every request, e.g. {"X-Proxy-Key": "..."}',
                "schema": {"type": ["object", "null"], "additionalProperties": {"type": "string"}},
            },
            "kuberay": {
                "label": "KubeRay cluster (instead of a URL)",
                "description": 'JSON naming a RayCluster whose dashboard is looked up, e.g. {"namespace": '
                               '"ml", "name": "rayslice", "in_cluster": true} or "kubeconfig": "/path"; '
                               '"token_secret": "rayslice-ray-token" reads the Ray token from that Secret',
                "schema": {"type": ["object", "null"]},
            },
            "checkpoint_root": {
                "label": "Checkpoint root (optional)",
                "description": "URL under which every step gets its checkpoint folder, e.g. "
                               "gs://bucket/checkpoints (else the cluster's RAYSLICE_CHECKPOINT_ROOT)",
                "schema": {"type": ["string", "null"]},
            },
            "launcher": {
                "label": "Launcher (optional)",
                "description": "shipped (default): each job uploads rayslice's cluster side; installed: the "
                               "cluster's image has this rayslice version, so jobs carry only the step and "
                               "start faster",
                "schema": {"type": ["string", "null"]},
            },
            "runtime_env": {
                "label": "Default runtime_env (optional)",
                "description": 'JSON in Ray\'s runtime_env format, the default of every step on this '
                               'connection, under each task\'s own (env_vars merged), e.g. '
                               '{"env_vars": {"XLA_FLAGS": "..."}}',
                "schema": {"type": ["object", "null"]},
            },
            "team": {
                "label": "Team (optional)",
                "description": "The team this connection's steps count against in the admission queue's quotas "
                               "(set by the platform); a step may narrow it (research/vision), never name "
                               "another (docs/security.md)",
                "schema": {"type": ["string", "null"]},
            },
            "deployment": {
                "label": "Deployment name (optional)",
                "description": "This Airflow's name on the cluster, e.g. prod: stamped on every job and first "
                               "in every checkpoint folder, so Airflows sharing a cluster keep to their own "
                               "(else the Airflow Variable rayslice_deployment, created with a random id)",
                "schema": {"type": ["string", "null"]},
            },
            "cloud_tpu": {
                "label": "Cloud TPU zone check (optional)",
                "description": 'JSON {"project": "...", "zone": "us-east5-b"}: TPU slice types are checked '
                               "against the types the zone offers",
                "schema": {"type": ["object", "null"]},
            },
            "clusters": {
                "label": "Cluster set: member connections (optional)",
                "description": 'Makes this connection a cluster set: other ray connection ids in order of '
                               'preference, e.g. ["ray_us_east5", "ray_europe_west4"] (leave the URL empty); a '
                               "step runs on whichever admits it first (docs/cluster-sets.md)",
                "schema": {"type": ["array", "string", "null"]},
            },
            "shared_root": {
                "label": "Cluster set: checkpoint root on a shared mount (optional)",
                "description": "true: the set's checkpoint_root is a local path every member cluster mounts "
                               "(NFS, the local clusters of one machine)",
                "schema": {"type": ["boolean", "null"]},
            },
        },
        "ui-field-behaviour": {
            "hidden-fields": ["schema", "login", "port"],
            "relabeling": {"host": "Ray dashboard URL", "password": "Ray auth token"},
            "placeholders": {
                "host": "http://127.0.0.1:8265",
                "password": "token of a cluster started with RAY_AUTH_MODE=token (optional)",
            },
        },
    }


def get_provider_info() -> dict:
    return {
        "package-name": "rayslice",
        "name": "rayslice",
        "description": "Run accelerator steps (TPU slices, GPU fractions) on Ray.",
        "versions": ["0.1.0"],
        "integrations": [
            {"integration-name": _INTEGRATION, "external-doc-url": "https://docs.ray.io/en/latest/cluster/"
             "running-applications/job-submission/rest.html", "tags": ["compute"]},
        ],
        "hooks": [{"integration-name": _INTEGRATION, "python-modules": ["rayslice.hooks.ray"]}],
        "operators": [
            {
                "integration-name": _INTEGRATION,
                "python-modules": [
                    "rayslice.operators.step",
                    "rayslice.operators.tpu_slice",
                    "rayslice.operators.accelerator",
                    "rayslice.operators.kuberay",
                    "rayslice.operators.cloud_tpu",
                ],
            }
        ],
        "triggers": [{"integration-name": _INTEGRATION, "python-modules": [
            "rayslice.operators.triggers", "rayslice.operators.start_trigger", "rayslice.operators.setup_triggers"]}],
        # `ray`, and `rayslice` for an Airflow where another provider (astro-provider-ray) owns `ray`.
        "connection-types": [_connection_type("ray", "RayHook", "Ray"),
                             _connection_type("rayslice", "RaysliceHook", "Ray (rayslice)")],
        "task-decorators": [
            {"name": "tpu_slice", "class-name": "rayslice.operators.decorators.tpu_slice_task"},
            {"name": "ray_accelerator", "class-name": "rayslice.operators.decorators.ray_accelerator_task"},
        ],
        "extra-links": ["rayslice.operators.links.RayJobLink"],
        "plugins": _plugins(),
    }
