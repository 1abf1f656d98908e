"""A step's local code goes to the cluster once per content, whatever number of tasks ship it."""

from __future__ import annotations

import asyncio
import os

import pytest

from rayslice.client import uploads
from rayslice.client.jobs_client import AsyncRayJobsClient
from rayslice.core.exceptions import InvalidRequestError


@pytest.fixture
def program(tmp_path):
    folder = tmp_path / "program"
    (folder / "lib").mkdir(parents=True)
    (folder / "train.py").write_text("print('hi')\n")
    (folder / "lib" / "__init__.py").write_text(f"SEED = {os.urandom(8).hex()!r}\n")
    (folder / "big.ckpt").write_bytes(os.urandom(1024))  # left out by `excludes`
    (folder / "seed").write_bytes(os.urandom(32))  # this test's own content: new to the cluster
    return folder


def test_sixteen_mapped_tasks_shipping_one_folder_upload_it_once(cluster, program):
    env = {"working_dir": str(program), "py_modules": [str(program / "lib")], "excludes": ["*.ckpt"],
           "env_vars": {"A": "1"}}

    async def sixteen_submissions():
        async with AsyncRayJobsClient(cluster.dashboard_url, token=cluster.token) as client:
            puts: list[str] = []

            async def count(request):
                if request.method == "PUT" and "/api/packages/" in request.url.path:
                    puts.append(request.url.path)

            client._client.event_hooks["request"].append(count)  # every request this client sends
            resolved = await asyncio.gather(*(uploads.upload_runtime_env(client, env) for _ in range(16)))
            later = await uploads.upload_runtime_env(client, env)  # a later task, once all have uploaded
            return puts, resolved, later

    puts, resolved, later = asyncio.run(sixteen_submissions())
    assert len(puts) == 2, puts  # the working_dir and the py_module, once each
    assert all(r == later for r in resolved)
    assert later["working_dir"].startswith("gcs://_ray_pkg_") and later["py_modules"][0].startswith("gcs://_ray_pkg_")
    assert later["env_vars"] == {"A": "1"} and "excludes" not in later


def test_excludes_leave_files_out_of_the_package(program):
    import io
    import zipfile

    names = zipfile.ZipFile(io.BytesIO(uploads.package_of(str(program), ["*.ckpt"], parent=False))).namelist()
    assert "train.py" in names and "lib/__init__.py" in names and "big.ckpt" not in names


def test_a_missing_folder_is_named_with_where_it_was_looked_for(tmp_path):
    with pytest.raises(InvalidRequestError, match="runtime_env working_dir './nowhere' is neither a folder"):
        uploads.package_of("./nowhere", [], parent=False)


def test_a_requirements_file_is_read_on_the_airflow_side(tmp_path):
    req = tmp_path / "requirements.txt"
    req.write_text("# pinned\ntqdm==4.66.0\n\nrich\n")
    assert uploads._requirements(str(req), "pip") == ["tqdm==4.66.0", "rich"]
