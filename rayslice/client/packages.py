"""Ray's runtime_env packages as the dashboard stores them: content-addressed names, deterministic zips.

A step's local `working_dir` / `py_modules` travel as `gcs://_ray_pkg_<sha1>.zip` packages. Equal
trees must give equal bytes, so that an upload happens once per content (`uploads`), and the name
must follow Ray's own convention, so that Ray's client and ours share a package. The upload itself
is a Jobs API call (`jobs_client.ensure_package`).
"""

from __future__ import annotations

import hashlib
import io
import os
import stat
import zipfile
from collections.abc import Callable
from pathlib import Path

from rayslice.core.exceptions import InvalidRequestError

__all__ = ["PACKAGE_EXTENSIONS", "RAY_PKG_PREFIX", "package_name_for", "split_package_uri", "zip_directory"]

# Package formats the Ray dashboard accepts for upload (ray._common.runtime_env_package).
PACKAGE_EXTENSIONS = (".zip", ".whl", ".tar.gz", ".tgz", ".tar.xz")
# Ray's own prefix for content-addressed packages (ray._private.runtime_env.packaging).
RAY_PKG_PREFIX = "_ray_pkg_"
# Zip entries get this timestamp, so equal trees give equal bytes (zip's epoch).
_ZIP_EPOCH = (1980, 1, 1, 0, 0, 0)


def package_name_for(data: bytes, extension: str = ".zip") -> str:
    """Ray's content-addressed package name for ``data``: ``_ray_pkg_<sha1 hex><extension>``.

    The same convention ``ray.job_submission`` uses for file packages, so a
    package we upload and one Ray's own client uploads for the same bytes share a URI.
    """
    return f"{RAY_PKG_PREFIX}{hashlib.sha1(data).hexdigest()}{extension}"


def _default_include(relpath: str) -> bool:
    name = relpath.rsplit("/", 1)[-1]
    return name != "__pycache__" and not name.endswith((".pyc", ".pyo"))


def zip_directory(
    path: str | os.PathLike[str],
    *,
    include: Callable[[str], bool] | None = None,
    include_parent_dir: bool = False,
) -> bytes:
    """Zip the tree under ``path`` deterministically: equal trees give equal bytes (and hash).

    Entries are sorted, timestamped 1980-01-01 and given mode 0644 (0755 when the
    file is executable), so neither mtimes nor the walk order change the result.

    ``include`` is called with each entry's POSIX path relative to ``path`` (e.g.
    ``"pkg/mod.py"``), directories included: returning False for a directory
    prunes it. The default keeps everything but ``__pycache__`` and ``*.pyc``.

    ``include_parent_dir=True`` puts the entries under ``<basename of path>/``:
    the layout ``py_modules`` wants (the unpacked package directory goes on
    ``sys.path``, so ``import <basename>`` works). Leave it False for ``working_dir``.
    """
    root = Path(path)
    if not root.is_dir():
        raise InvalidRequestError(f"zip_directory: {str(root)!r} is not a directory")
    keep = include or _default_include
    prefix = f"{root.resolve().name}/" if include_parent_dir else ""

    entries: list[tuple[str, Path | None]] = []  # (arcname, file or None for a directory)
    if prefix:
        entries.append((prefix, None))

    def walk(directory: Path, rel: str) -> None:
        for child in sorted(directory.iterdir(), key=lambda p: p.name):
            child_rel = f"{rel}{child.name}"
            if not keep(child_rel):
                continue
            if child.is_dir():
                entries.append((f"{prefix}{child_rel}/", None))
                walk(child, f"{child_rel}/")
            elif child.is_file():
                entries.append((f"{prefix}{child_rel}", child))

    walk(root, "")
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for arcname, file in entries:
            info = zipfile.ZipInfo(arcname, date_time=_ZIP_EPOCH)
            info.create_system = 3  # Unix, so external_attr means mode bits everywhere
            if file is None:
                info.external_attr = (stat.S_IFDIR | 0o755) << 16 | 0x10
                zf.writestr(info, b"")
            else:
                executable = os.access(file, os.X_OK)
                info.external_attr = (stat.S_IFREG | (0o755 if executable else 0o644)) << 16
                info.compress_type = zipfile.ZIP_DEFLATED
                zf.writestr(info, file.read_bytes(), compresslevel=6)
    return buf.getvalue()


def split_package_uri(uri: str) -> tuple[str, str]:
    """A package URI's protocol and name (`gcs://_ray_pkg_<hash>.zip`), refused unless Ray could store it."""
    protocol, sep, name = uri.partition("://")
    if not sep or not protocol or not name or "/" in name:
        raise InvalidRequestError(
            f"package URI must look like 'gcs://_ray_pkg_<hash>.zip', got {uri!r}"
        )
    if not name.endswith(PACKAGE_EXTENSIONS):
        raise InvalidRequestError(
            f"package {uri!r} must end in one of {', '.join(PACKAGE_EXTENSIONS)}"
        )
    return protocol, name
