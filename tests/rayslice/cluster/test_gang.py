"""A host process's folder: the step's own, whatever the step leaves running or the host's end leaves behind."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import pytest

from rayslice.cluster import step_folders
from rayslice.core.accelerators import TpuSliceRequest
from rayslice.core.step import StepSpec


def spec(**runtime_env):
    return StepSpec(request=TpuSliceRequest(tpu="v6e-4"), command=["python"], runtime_env=runtime_env or None)


class Writer:
    """What a step leaves running in its folder: a data loader, a summary writer, a child nobody waited for."""

    def __init__(self, folder):
        self.folder, self.stop = folder, threading.Event()
        self.thread = threading.Thread(target=self._write, daemon=True)
        self.thread.start()
        time.sleep(0.02)

    def _write(self):
        i = 0
        while not self.stop.is_set():
            try:
                os.makedirs(os.path.join(self.folder, f"d{i % 50}"), exist_ok=True)
                open(os.path.join(self.folder, f"d{i % 50}", f"f{i}"), "w").close()
            except OSError:
                pass
            i += 1

    def end(self):
        self.stop.set()
        self.thread.join()
        shutil.rmtree(self.folder, ignore_errors=True)


def test_a_step_runs_in_a_folder_of_its_own_removed_after_it_unless_it_has_a_working_dir():
    before = os.getcwd()
    with step_folders.step_folder(spec()):
        folder = os.getcwd()
        assert os.path.basename(folder).startswith(f"{step_folders.STEP_FOLDER_PREFIX}{os.getpid()}-")
    assert os.getcwd() == before and not os.path.exists(folder)
    with step_folders.step_folder(spec(working_dir="gcs://_ray_pkg_x.zip")):
        assert os.getcwd() == before  # Ray started the process in the working_dir


@pytest.mark.parametrize("raises", [False, True], ids=["returned", "raised"])
def test_what_a_step_leaves_writing_in_its_folder_neither_fails_it_nor_hides_its_error(raises):
    """rmtree races the writer (`Directory not empty`): 18 of 20 finished steps failed, and a step's own error
    was replaced by the OSError, before the folder's removal ignored its errors."""
    for _ in range(20):
        writer = None
        try:
            with step_folders.step_folder(spec()):
                writer = Writer(os.getcwd())
                if raises:
                    raise ValueError("the step's own error")
        except ValueError:
            assert raises
        finally:
            if writer:
                writer.end()


def test_the_folders_of_hosts_that_ended_without_cleaning_up_are_removed_by_the_next_step():
    """A host killed mid-step (`ray.kill`: no `finally` runs) leaves its folder; a fresh one per step would fill
    the host's /tmp."""
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = tempfile.mkdtemp(prefix=f"{step_folders.STEP_FOLDER_PREFIX}{int(ended.stdout)}-")
    alive = tempfile.mkdtemp(prefix=f"{step_folders.STEP_FOLDER_PREFIX}{os.getppid()}-")
    try:
        with step_folders.step_folder(spec()):
            pass
        assert not os.path.exists(dead)
        assert os.path.exists(alive)  # a live host's step is running in it
    finally:
        shutil.rmtree(dead, ignore_errors=True)
        shutil.rmtree(alive, ignore_errors=True)
