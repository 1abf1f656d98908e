"""The versions a cluster set up by rayslice runs are requirements.lock's: the Dockerfiles under docker/,
`rayslice.cloud.pins` (the KubeRay manifests' rayVersion and default images, the Cloud TPU startup
script) and pyproject.toml's version cannot drift from the lock, or from each other."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from rayslice.cloud import pins

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILES = {"tpu": ROOT / "docker" / "Dockerfile.tpu", "gpu": ROOT / "docker" / "Dockerfile.gpu"}


def locked(package: str) -> str:
    (version,) = re.findall(rf"^{re.escape(package)}==(\S+)$", (ROOT / "requirements.lock").read_text(), re.M)
    return version


def build_args(dockerfile: Path) -> dict[str, str]:
    """Every ARG's default (an ARG redeclared without one, inside the stage, inherits the global default)."""
    args: dict[str, str] = {}
    for name, value in re.findall(r"^ARG (\w+)(?:=(\S+))?$", dockerfile.read_text(), re.M):
        if value:
            assert args.setdefault(name, value) == value, f"{dockerfile.name}: ARG {name} has two defaults"
    return args


def test_pins_are_the_locks():
    assert pins.RAY_VERSION == locked("ray")
    assert pins.JAX_VERSION == locked("jax") == locked("jaxlib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert pins.RAYSLICE_VERSION == project["version"]
    assert project["requires-python"] == f">={pins.PYTHON_VERSION}"


@pytest.mark.parametrize("kind", DOCKERFILES)
def test_dockerfiles_build_from_ray_at_the_locked_versions(kind):
    path = DOCKERFILES[kind]
    text = path.read_text()
    args = build_args(path)
    assert args == {"RAY_VERSION": locked("ray"), "JAX_VERSION": locked("jax")}
    (base,) = re.findall(r"^FROM (\S+)", text, re.M)
    python_tag = "py" + pins.PYTHON_VERSION.replace(".", "")
    assert base == f"rayproject/ray:${{RAY_VERSION}}-{python_tag}" + ("-gpu" if kind == "gpu" else "")
    jax_extra = {"tpu": "tpu", "gpu": "cuda12"}[kind]
    assert '"/tmp/rayslice[cluster,examples,gcs]"' in text and '"ray[default]==${RAY_VERSION}"' in text
    assert f'"jax[{jax_extra}]==${{JAX_VERSION}}"' in text
    assert "-c /tmp/rayslice/requirements.lock" in text  # every other dependency at its locked version
    # The tag the file's own build line gives is the name the KubeRay manifests default to.
    image = pins.DEFAULT_IMAGE if kind == "tpu" else pins.DEFAULT_GPU_IMAGE
    assert f"docker build -f docker/{path.name} -t {image} ." in text


def test_the_build_context_keeps_what_the_package_build_needs():
    kept = {line[1:] for line in (ROOT / ".dockerignore").read_text().splitlines() if line.startswith("!")}
    kept.discard("dist/rayslice-*-py3-none-any.whl")  # the Airflow image's wheel (tests/test_docker_context.py)
    package_dirs = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
                       .values())
    assert package_dirs | {"pyproject.toml", "README.md", "requirements.lock"} == kept
