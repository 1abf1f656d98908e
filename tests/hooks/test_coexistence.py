"""rayslice next to astro-provider-ray in one Airflow: both load, and rayslice's steps keep their connections.

astro-provider-ray (deprecated, still installable) registers the connection type `ray` too, and Airflow
gives a type to the first provider by package name: astro's. rayslice therefore also registers its own
type, `rayslice`, and its hook reads any connection by id, astro's `ray` connections included (their
dashboard URL is the extra `address`).

astro-provider-ray is not in requirements.lock: in this environment it would replace the locked
`kubernetes` and load the cncf-kubernetes provider in every test. It is installed (without
dependencies: everything else it needs is here) into a folder of its own, put on the PYTHONPATH of an
Airflow process that is then asked what it loaded.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.airflow_env import REPO

#: What astro-provider-ray 0.4.0 needs beyond this environment (installed with --no-deps).
ASTRO = ["astro-provider-ray==0.4.0", "apache-airflow-providers-cncf-kubernetes==10.25.0", "kubernetes-asyncio==36.1.0"]

PROBE = """
import json
import tests.airflow_env  # noqa: F401
from airflow.providers_manager import ProvidersManager
from airflow.sdk.providers_manager_runtime import ProvidersManagerTaskRuntime
from ray_provider.hooks import RayHook as AstroHook  # theirs imports, next to ours
from rayslice.hooks.ray import RayHook

manager, hooks = ProvidersManager(), ProvidersManagerTaskRuntime().hooks
print(json.dumps({
    "providers": sorted(p for p in manager.providers if p in ("astro-provider-ray", "rayslice")),
    "ray": hooks["ray"].hook_class_name, "rayslice": hooks["rayslice"].hook_class_name,
    "decorators": sorted(d for d in manager.taskflow_decorators if d in ("tpu_slice", "ray_accelerator")),
    "astro_made": RayHook("astro_made").settings().dashboard_url,
    "own": RayHook("own").settings().dashboard_url,
    "astro_hook": AstroHook.conn_type,
}))
"""


@pytest.fixture(scope="module")
def astro(tmp_path_factory) -> Path:
    target = tmp_path_factory.mktemp("astro-provider-ray")
    uv = shutil.which("uv") or str(Path.home() / ".local" / "bin" / "uv")
    done = subprocess.run([uv, "pip", "install", "--quiet", "--no-deps", "--target", str(target),
                           "--python", sys.executable, *ASTRO], capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        pytest.fail(f"installing {ASTRO} needs the package registry or uv's cache: {done.stderr[-2000:]}")
    return target


def test_rayslice_and_astro_provider_ray_in_one_airflow(astro, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW_CONN")}
    env |= {
        "PYTHONPATH": f"{astro}{os.pathsep}{REPO}",
        # what astro-provider-ray's form saves: the host hidden, the dashboard URL in `address`
        "AIRFLOW_CONN_ASTRO_MADE": json.dumps({"conn_type": "ray", "extra": {
            "address": "http://ray-head.ml:8265", "verify": False, "cookies": "", "namespace": "ml"}}),
        "AIRFLOW_CONN_OWN": json.dumps({"conn_type": "rayslice", "host": "https://ray.example.com:8265"}),
    }
    done = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["providers"] == ["astro-provider-ray", "rayslice"]
    assert found["ray"] == "ray_provider.hooks.RayHook"  # astro's, first by package name
    assert found["rayslice"] == "rayslice.hooks.ray.RaysliceHook"  # rayslice's own type stays ours
    assert found["decorators"] == ["ray_accelerator", "tpu_slice"]
    assert found["astro_made"] == "http://ray-head.ml:8265" and found["own"] == "https://ray.example.com:8265"
    assert found["astro_hook"] == "ray"
