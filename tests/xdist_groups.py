"""The full suite's split over pytest-xdist workers: each file on one worker, the session Airflow's users together.

Each xdist worker is its own pytest session with its own local Ray cluster, so a file's module
cluster or stack must not start on two workers, and the tests that share the session's Airflow
(about 90 s of two cores to start) must run on one worker. pytest-xdist's own `--dist loadgroup`
cannot do this with pytest 9: it renames `Item._nodeid`, which pytest 9 no longer reads, so every
test lands in a group of its own. Here the workers write the group of each test to a file while
they collect, and the controller's scheduler reads it; `pytest_xdist_make_scheduler` is xdist's
public hook for that.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pytest

#: Where the controller tells its workers to write the groups (workers inherit its environment).
GROUPS_FILE_ENV = "RAYSLICE_TEST_GROUPS_FILE"
SESSION_AIRFLOW = "session-airflow"


def group_of(nodeid: str, session_airflow_users: set[str]) -> str:
    return SESSION_AIRFLOW if nodeid in session_airflow_users else nodeid.split("::")[0]


class GroupsPlugin:
    """Registered by tests/conftest.py when the run uses xdist."""

    @pytest.hookimpl
    def pytest_configure(self, config: pytest.Config) -> None:
        if not hasattr(config, "workerinput"):  # the controller
            path = Path(tempfile.mkdtemp(prefix="rayslice-test-groups-")) / "groups.json"
            os.environ[GROUPS_FILE_ENV] = str(path)

    @pytest.hookimpl(optionalhook=True)
    def pytest_xdist_make_scheduler(self, config: pytest.Config, log):
        if config.getvalue("dist") != "loadgroup":
            return None
        from xdist.scheduler import LoadScopeScheduling

        class GroupScheduling(LoadScopeScheduling):
            """Scope = the group a worker wrote for the test (its file if none)."""

            groups: dict[str, str] | None = None

            def _split_scope(self, nodeid: str) -> str:
                if self.groups is None:  # read once: schedule() runs after every worker collected
                    path = Path(os.environ[GROUPS_FILE_ENV])
                    self.groups = json.loads(path.read_text()) if path.is_file() else {}
                return self.groups.get(nodeid) or nodeid.split("::")[0]

        config.option.loadscopereorder = False  # hand groups out in collection order: the Airflow users first
        return GroupScheduling(config, log)


def write_groups(config: pytest.Config, groups: dict[str, str]) -> None:
    """In the first worker (they all collect the same tests): the group of every test, for the controller."""
    if getattr(config, "workerinput", {}).get("workerid") == "gw0" and os.environ.get(GROUPS_FILE_ENV):
        path = Path(os.environ[GROUPS_FILE_ENV])
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(groups))
        tmp.replace(path)
