"""Each step's own working folder on a host, and the removal of those that ended hosts left behind.

A host process without a `working_dir` would otherwise start where the raylet runs, a folder
every step on the node shares: what one step writes there, the next one sees.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

from rayslice.core.step import StepSpec


@contextmanager
def step_folder(spec: StepSpec) -> Iterator[None]:
    """The step runs in its `working_dir`, else in a folder of its own, removed after it (not the raylet's).

    A host process started without a runtime env starts where the raylet runs, shared by every step on
    the node; one with a runtime env but no `working_dir` also does. A host killed mid-step (a peer
    failed, a timeout, a suspension) leaves its folder: the next step on the node removes those of
    processes no longer alive. What is still writing into it when the step ends never fails the step.
    """
    if (spec.runtime_env or {}).get("working_dir"):  # Ray started the process in it
        yield
        return
    _remove_folders_of_ended_hosts()
    before = os.getcwd()
    with tempfile.TemporaryDirectory(prefix=f"{STEP_FOLDER_PREFIX}{os.getpid()}-", ignore_cleanup_errors=True) \
            as folder:
        os.chdir(folder)
        try:
            yield
        finally:
            os.chdir(before)


#: A step's own folder, under the host's temporary folder: the prefix, then the host process's pid.
STEP_FOLDER_PREFIX = "rayslice-step-"


def _remove_folders_of_ended_hosts() -> None:
    import shutil

    root = tempfile.gettempdir()
    for name in os.listdir(root):
        pid = name.removeprefix(STEP_FOLDER_PREFIX).split("-", 1)[0]
        if name.startswith(STEP_FOLDER_PREFIX) and pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True
