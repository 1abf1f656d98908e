"""What the wheel holds: every file of the package folders is in a listed package or its package data.

setuptools' explicit `packages` list misses folders without `__init__.py`; `rayslice/cluster/jax_autodetect/`
(the command steps' sitecustomize) was missing from the wheel that way. The wheel itself is built and run
in tests/rayslice/local/test_wheel_venv.py (cluster-marked).
"""

from __future__ import annotations

import fnmatch
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_file_goes_into_the_wheel():
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = setuptools["package-dir"]

    def folder(package: str) -> Path:
        top = max((name for name in folders if package == name or package.startswith(name + ".")), key=len)
        return ROOT / folders[top] / Path(*package.split(".")[len(top.split(".")):])

    packages = {folder(p): p for p in setuptools["packages"]}
    missing = []
    for base in {ROOT / f for f in folders.values()}:
        for path in base.rglob("*"):
            if path.is_dir() or "__pycache__" in path.parts or path.name == "ruff.toml":  # lint rules stay here
                continue
            owner = max((d for d in packages if path.is_relative_to(d)), key=lambda d: len(d.parts))
            relative = path.relative_to(owner)
            if len(relative.parts) == 1 and path.suffix == ".py":
                continue
            patterns = setuptools.get("package-data", {}).get(packages[owner], [])
            if not any(fnmatch.fnmatch(str(relative), pattern) for pattern in patterns):
                missing.append(str(path.relative_to(ROOT)))
    assert not missing, f"not in the wheel: {missing}"
