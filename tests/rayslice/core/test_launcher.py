"""The launcher's digest: equal copies give equal digests, and any byte of the shipped files changes it."""

from __future__ import annotations

import io
import shutil
import zipfile
from pathlib import Path

import cloudpickle

import rayslice
from rayslice.client.submission import launcher_packages
from rayslice.core import launcher

PACKAGE = Path(rayslice.__file__).parent
CLOUDPICKLE = Path(cloudpickle.__file__).parent


def copy(tmp_path: Path) -> tuple[Path, Path]:
    ours = shutil.copytree(PACKAGE, tmp_path / "rayslice", ignore=shutil.ignore_patterns("__pycache__"))
    return ours, shutil.copytree(CLOUDPICKLE, tmp_path / "cloudpickle")


def test_a_copy_has_the_same_digest_and_one_changed_byte_another(tmp_path):
    ours, theirs = copy(tmp_path)
    digest = launcher.digest(PACKAGE, CLOUDPICKLE)
    assert launcher.digest(ours, theirs) == digest and len(digest) == launcher.DIGEST_HEX
    (ours / "cluster" / "__pycache__").mkdir(exist_ok=True)
    (ours / "cluster" / "__pycache__" / "gang.cpython-312.pyc").write_bytes(b"compiled")  # never shipped
    (ours / "operators_copy.py").write_text("# not the cluster side\n")
    assert launcher.digest(ours, theirs) == digest
    gang = ours / "cluster" / "gang.py"
    gang.write_bytes(gang.read_bytes() + b" ")
    assert launcher.digest(ours, theirs) != digest
    gang.write_bytes(gang.read_bytes()[:-1])
    (theirs / "cloudpickle.py").write_text((theirs / "cloudpickle.py").read_text() + "\n")
    assert launcher.digest(ours, theirs) != digest  # cloudpickle is shipped too


def test_the_digest_covers_exactly_the_files_a_job_ships():
    shipped = zipfile.ZipFile(io.BytesIO(launcher_packages()[0]))
    files = sorted(n.removeprefix("rayslice/") for n in shipped.namelist() if not n.endswith("/"))
    digested = sorted(p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*")
                      if p.is_file() and launcher.is_cluster_side(p.relative_to(PACKAGE).as_posix()))
    assert files == digested and "cluster/gang.py" in files and "core/launcher.py" in files
