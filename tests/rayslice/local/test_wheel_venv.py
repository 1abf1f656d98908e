"""The cluster side from the wheel alone: a fresh venv with only `rayslice[cluster]`, and a cluster that runs it.

The wheel is built from this checkout and installed (no dependencies) into a new venv. This machine
is offline and uv's cache does not hold every locked wheel, so the dependencies are not downloaded:
the venv gets exactly the installed distributions `rayslice[cluster]` requires (its closure, read
from this `.venv`'s metadata) linked in, and nothing else: no Airflow. `rayslice local up --python`
then starts a small cluster on that Python, and a function step and a command step run on it with the
installed launcher (the wheel's rayslice, not a shipped copy). The venv has pip, as `python -m venv`
makes it, so a step's `pip` runtime env can install a package the cluster lacks (a wheel built here,
installed offline); Ray installs it once per node and list, and a second step reuses it.
"""

from __future__ import annotations

import asyncio
import importlib.metadata as md
import os
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from rayslice.client.submission import run_step_job
from rayslice.core.accelerators import TpuSliceRequest
from rayslice.core.step import Owner, StepSpec
from rayslice.local import local_cluster
from tests.conftest import private_cluster

REPO = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.cluster  # builds a wheel and a venv, and starts a cluster


def cluster_closure() -> list[md.Distribution]:
    """The installed distributions `rayslice[cluster]` needs, transitively (markers evaluated here)."""
    wanted, seen, out = [("rayslice", {"cluster"})], set(), []
    while wanted:
        name, extras = wanted.pop()
        dist = md.distribution(name)
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker and not any(req.marker.evaluate({"extra": e}) for e in (extras or {""})):
                continue
            key = (canonicalize_name(req.name), frozenset(req.extras))
            if key not in seen:
                seen.add(key)
                wanted.append((req.name, set(req.extras)))
        if canonicalize_name(name) != "rayslice" and dist not in out:
            out.append(dist)
    return out


def _uv() -> str:
    found = shutil.which("uv") or shutil.which("uv", path=str(Path.home() / ".local" / "bin"))
    assert found, "uv is needed to build the wheel (scripts/bootstrap installs it)"
    return found


@pytest.fixture(scope="module")
def wheel_python(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("wheel-venv")
    source = root / "source"  # a copy: setuptools writes build/ and *.egg-info next to the sources it builds
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    for name in {"pyproject.toml", "README.md", *project["tool"]["setuptools"]["package-dir"].values()}:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            source.mkdir(exist_ok=True)
            shutil.copy(REPO / name, source / name)
    subprocess.run([_uv(), "build", "--wheel", "--offline", "--quiet", "--out-dir", str(root / "dist"), str(source)],
                   check=True)
    (wheel,) = (root / "dist").glob("rayslice-*.whl")
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)  # with pip: Ray's `pip` env uses it
    python = venv / "bin" / "python"
    subprocess.run([_uv(), "pip", "install", "--offline", "--quiet", "--no-deps", "--python", str(python), str(wheel)],
                   check=True)
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    names = set()
    for dist in cluster_closure():
        assert dist.files, f"{dist.metadata['Name']} has no RECORD"
        names |= {f.parts[0] for f in dist.files if f.parts[0] not in ("..", "__pycache__")}
    source = Path(md.distribution("ray").locate_file(""))
    for name in sorted(names):
        if (source / name).exists() and not (site / name).exists():
            (site / name).symlink_to(source / name)
    return python


def test_the_wheels_cluster_side_imports_without_airflow(wheel_python):
    probe = subprocess.run(
        [str(wheel_python), "-c", "import importlib.util, rayslice, rayslice.cluster, ray, jax; "
         "print(rayslice.__file__); print(importlib.util.find_spec('airflow'))"],
        capture_output=True, text=True, cwd="/", env={"PATH": os.environ["PATH"]})
    assert probe.returncode == 0, probe.stderr
    where, airflow = probe.stdout.split()
    assert str(wheel_python.parents[1]) in where and str(REPO) not in where  # the wheel's copy
    assert airflow == "None"


def what_runs_here() -> dict:
    import importlib.util
    import sys

    import jax

    import rayslice

    return {"python": sys.executable, "rayslice": rayslice.__file__, "devices": jax.device_count(),
            "airflow": importlib.util.find_spec("airflow") is not None}


@pytest.fixture(scope="module")
def wheel_cluster(wheel_python, tmp_path_factory):
    home = tmp_path_factory.mktemp("wheel-home")
    name = f"wheel-{os.getpid()}"

    def start() -> local_cluster.ClusterRecord:
        env = {**os.environ, "RAYSLICE_HOME": str(home)}
        up = subprocess.run([str(Path(sys.executable).with_name("rayslice")), "local", "up", "--tpu", "v6e-4",
                             "--name", name, "--python", str(wheel_python)], env=env, capture_output=True, text=True)
        assert up.returncode == 0, up.stdout + up.stderr
        return local_cluster.ClusterRecord.load(name)

    with private_cluster(home, name, start) as record:
        yield record


def test_a_cluster_on_the_wheel_venv_runs_a_function_step_and_a_command_step(wheel_python, wheel_cluster):
    assert wheel_cluster.python == str(wheel_python)

    def run(spec: StepSpec) -> list:
        return asyncio.run(run_step_job(wheel_cluster.dashboard_url, spec, token=wheel_cluster.token,
                                        emit=lambda line: None))

    request = TpuSliceRequest(tpu="v6e-4")
    [function] = run(StepSpec.for_function(what_runs_here, request=request, launcher="installed",
                                           owner=Owner(submission_id=f"test-wheel-fn-{time.time_ns()}")))
    assert function == {"python": str(wheel_python), "rayslice": function["rayslice"], "devices": 4,
                        "airflow": False}
    assert str(wheel_python.parents[1]) in function["rayslice"]
    program = ("import json, os, sys, jax; jax.distributed.initialize(); "
               "json.dump({'python': sys.executable, 'devices': jax.device_count(), 'argv': sys.argv[1:]}, "
               "open(os.environ['RAYSLICE_RESULT_FILE'], 'w'))")
    [command] = run(StepSpec(request=request, command=["python", "-c", program, "--steps", "3"], launcher="installed",
                             owner=Owner(submission_id=f"test-wheel-cmd-{time.time_ns()}")))
    assert command == {"python": str(wheel_python), "devices": 4, "argv": ["--steps", "3"]}


def probe_wheel(folder: Path) -> Path:
    """A one-module wheel (`rayslice_pip_probe`) that no index and no cluster venv holds."""
    import base64
    import hashlib
    import zipfile

    files = {
        "rayslice_pip_probe/__init__.py": 'VALUE = "installed by the step\'s pip runtime env"\n',
        "rayslice_pip_probe-1.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: rayslice-pip-probe\nVersion: 1.0\n",
        "rayslice_pip_probe-1.0.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                                "Tag: py3-none-any\n",
    }
    record = [f"{name},sha256={base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b'=').decode()},"
              f"{len(text.encode())}" for name, text in files.items()]
    files["rayslice_pip_probe-1.0.dist-info/RECORD"] = "\n".join([*record, "rayslice_pip_probe-1.0.dist-info/RECORD,,"])
    wheel = folder / "rayslice_pip_probe-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for name, text in files.items():
            archive.writestr(name, text)
    return wheel


def uses_the_probe() -> dict:
    import os
    import sys

    import rayslice_pip_probe

    return {"value": rayslice_pip_probe.VALUE, "python": sys.executable, "env": os.environ.get("VIRTUAL_ENV", "")}


def test_a_steps_pip_runtime_env_installs_a_package_the_cluster_lacks(wheel_python, wheel_cluster, tmp_path):
    probe = subprocess.run([str(wheel_python), "-c", "import rayslice_pip_probe"], capture_output=True, text=True)
    assert probe.returncode != 0  # not in the cluster's venv
    runtime_env = {"pip": {"packages": [str(probe_wheel(tmp_path))],
                           "pip_install_options": ["--no-index", "--disable-pip-version-check"]}}

    def run() -> dict:
        [result] = asyncio.run(run_step_job(
            wheel_cluster.dashboard_url, token=wheel_cluster.token, emit=lambda line: None,
            spec=StepSpec.for_function(uses_the_probe, request=TpuSliceRequest(tpu="v6e-4"), launcher="installed",
                                       runtime_env=runtime_env,
                                       owner=Owner(submission_id=f"test-wheel-pip-{time.time_ns()}"))))
        return result

    first, second = run(), run()
    assert first["value"] == second["value"] == "installed by the step's pip runtime env"
    # Ray's own environment for that list (a clone of the cluster's venv under its runtime resources),
    # made once on the node and used by both steps.
    assert first["python"] == second["python"] != str(wheel_python)
    assert "runtime_resources/pip/" in first["python"], first
