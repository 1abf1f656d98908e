"""The image recipes under docker/ copy only what `docker build` really sends them (issue 50, B5).

The context is built the way `docker build -f docker/<file> .` builds it from a checkout, honouring
`.dockerignore` with Docker's own matching rules (tests/docker_context.py), after the walkthroughs'
`uv build --wheel --out-dir dist .`; then every COPY/ADD source of every Dockerfile must be in it.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from tests.docker_context import context_files, copy_sources, excluded, parse, source_found

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILES = sorted(p for p in (ROOT / "docker").glob("Dockerfile.*") if not p.name.endswith(".dockerignore"))


@pytest.fixture(scope="module")
def checkout(tmp_path_factory) -> Path:
    """The files of a checkout that has run the walkthroughs' wheel build (dist/), stand-in files for what
    gets built or cached there (a venv, __pycache__), and the ignore files."""
    root = tmp_path_factory.mktemp("checkout")
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    import subprocess

    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    for name in tracked.splitlines():
        if (ROOT / name).is_file():
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            # The ignore files as they are; every other file's content does not matter here.
            (root / name).write_bytes((ROOT / name).read_bytes() if name.endswith(".dockerignore") else b"")
    for extra in (f"dist/rayslice-{version}-py3-none-any.whl", f"dist/rayslice-{version}.tar.gz",
                  ".venv/bin/python", "rayslice/__pycache__/cli.cpython-312.pyc"):
        (root / extra).parent.mkdir(parents=True, exist_ok=True)
        (root / extra).write_bytes(b"")
    return root


def test_there_are_recipes_for_the_cluster_and_airflow():
    assert {p.name for p in DOCKERFILES} >= {"Dockerfile.tpu", "Dockerfile.gpu", "Dockerfile.airflow"}


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_every_copy_source_is_in_the_build_context(checkout, dockerfile):
    files = context_files(checkout, checkout / "docker" / dockerfile.name)
    sources = copy_sources(dockerfile)
    assert sources, f"{dockerfile.name} copies nothing from the context"
    for source in sources:
        assert source_found(source, files), f"{dockerfile.name}: COPY {source} is not in the build context"
    assert not any(f.startswith((".venv/", "dist/rayslice-0.1.0.tar")) or "__pycache__" in f for f in files)


def test_the_cluster_images_get_the_package_not_the_docs_or_tests(checkout):
    files = context_files(checkout, checkout / "docker" / "Dockerfile.tpu")
    assert {"pyproject.toml", "requirements.lock", "rayslice/cli.py", "operators/cloud_tpu.py"} <= files
    assert not any(f.startswith(("docs/", "tests/")) for f in files)


# Docker's matching rules (moby's patternmatcher), each against a case its documentation or source gives.
@pytest.mark.parametrize(("patterns", "path", "left_out"), [
    ("*", "dist/a.whl", True),                              # the parent `dist` matches `*`
    ("*\n!dist/*.whl", "dist/a.whl", False),                # an exception re-includes a file in an excluded dir
    ("*\n!dist/*.whl", "dist/a.tar.gz", True),
    ("*\n!dist", "dist/sub/a.whl", False),                  # ... or a whole directory
    ("*.md\n!README*.md", "README-secret.md", False),       # Docker's documented example
    ("*.md\n!README*.md\nREADME-secret.md", "README-secret.md", True),  # the last match wins
    ("temp?", "tempa", True),
    ("temp?", "temp/x", False),
    ("*/temp*", "somedir/temporary.txt", True),
    ("*/temp*", "temporary.txt", False),                    # no implicit `**/`: unlike .gitignore
    ("*/*/temp*", "somedir/subdir/temporary.txt", True),
    ("**/__pycache__", "a/b/__pycache__/x.pyc", True),
    ("**/__pycache__", "__pycache__/x.pyc", True),
    ("/dist", "dist/a.whl", True),                          # a leading slash is dropped
    ("dist/../docs", "docs/a.md", True),                    # patterns are cleaned like filepath.Clean
    ("[a-c]at", "bat", True),
    ("[^a-c]at", "bat", False),
    ("# a comment\n\n  dist  ", "dist/a", True),
    ("docs/**", "docs/a/b.md", True),
    ("foo", "a/foo", False),                                # at the root only
])
def test_dockerignore_matching_follows_docker(patterns, path, left_out):
    assert excluded(path, parse(patterns)) is left_out
