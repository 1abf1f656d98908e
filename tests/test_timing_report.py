"""The suite's timing report and budget (tests/timing_report.py), run in a pytest of its own.

The budget must bite: a run whose tests all pass fails once its wall time passes the budget, and its
message names the test that took the time, so CI's failure says where to cut.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

SUITE = '''
import time

def test_quick():
    pass

def test_deliberately_slow():
    time.sleep(0.4)
'''


def run_suite(tmp_path: Path, *options: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """A pytest over a two-test file (one quick, one slow) with only the timing plugin, as CI would see it."""
    folder = tmp_path / "suite"
    folder.mkdir(exist_ok=True)
    (folder / "test_two.py").write_text(SUITE)
    ini = tmp_path / "pytest.ini"
    ini.write_text("[pytest]\n")
    environ = {key: value for key, value in os.environ.items()
               if key not in ("RAYSLICE_SUITE_BUDGET_MINUTES", "PYTEST_ADDOPTS", "RAYSLICE_TEST_TIMES",
                              "PYTEST_XDIST_WORKER")}
    environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), environ.get("PYTHONPATH")]))
    environ.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "tests.timing_report", "-p", "no:cacheprovider", "-c", str(ini),
         "--rootdir", str(tmp_path), str(folder), *options],
        cwd=tmp_path, env=environ, capture_output=True, text=True, timeout=120)


def over_budget_message(output: str) -> str:
    lines = [line for line in output.splitlines() if "over its budget" in line]
    assert len(lines) == 1, output
    return lines[0]


def test_a_slow_test_past_a_tiny_budget_fails_the_run_and_is_named(tmp_path: Path) -> None:
    run = run_suite(tmp_path, "--suite-budget-minutes=0.002")  # 0.12 s; the slow test alone sleeps 0.4 s
    assert "2 passed" in run.stdout, run.stdout + run.stderr
    assert run.returncode == 1, run.stdout + run.stderr
    message = over_budget_message(run.stdout)
    assert "budget of 0.002 min" in message
    slowest = message.split("slowest: ", 1)[1]
    assert slowest.startswith("suite/test_two.py::test_deliberately_slow ("), message


def test_the_environment_sets_the_budget_and_the_option_overrides_it(tmp_path: Path) -> None:
    tiny = {"RAYSLICE_SUITE_BUDGET_MINUTES": "0.002"}
    run = run_suite(tmp_path, env=tiny)
    assert run.returncode == 1, run.stdout + run.stderr
    assert "test_deliberately_slow" in over_budget_message(run.stdout)

    run = run_suite(tmp_path, "--suite-budget-minutes=30", env=tiny)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "over its budget" not in run.stdout


def test_within_budget_the_run_passes_and_reports_the_slowest_and_each_directory(tmp_path: Path) -> None:
    run = run_suite(tmp_path, "--slowest=1")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "over its budget" not in run.stdout
    report = run.stdout.split("1 slowest tests", 1)[1]
    listed, per_directory = report.split("time per test directory", 1)
    assert "test_deliberately_slow" in listed and "test_quick" not in listed
    assert any(line.split()[-1] == "suite" and "2 tests" in line for line in per_directory.splitlines()), report
    assert "budget 50 min" in run.stdout  # the default


@pytest.mark.parametrize("value", ["soon", "-5"])
def test_a_bad_budget_is_a_usage_error_naming_it(tmp_path: Path, value: str) -> None:
    run = run_suite(tmp_path, env={"RAYSLICE_SUITE_BUDGET_MINUTES": value})
    assert run.returncode == pytest.ExitCode.USAGE_ERROR, run.stdout + run.stderr
    assert "RAYSLICE_SUITE_BUDGET_MINUTES" in run.stderr and value in run.stderr
    assert "minutes" in run.stderr


def test_under_two_workers_each_workers_total_is_shown_and_every_tests_time_can_be_kept(tmp_path: Path) -> None:
    times = tmp_path / "times.json"
    run = run_suite(tmp_path, "-n", "2", env={"RAYSLICE_TEST_TIMES": str(times)})
    assert run.returncode == 0, run.stdout + run.stderr
    kept = json.loads(times.read_text())["tests"]
    slow = kept["suite/test_two.py::test_deliberately_slow"]
    assert slow["s"] >= 0.4 and slow["worker"] in ("gw0", "gw1")
    per_worker = [line.split() for line in run.stdout.split("time per xdist worker", 1)[1].splitlines()
                  if "last test ended at" in line]
    rows = {row[4].rstrip(","): (float(row[0]), int(row[2])) for row in per_worker}
    assert sum(count for _, count in rows.values()) == 2, run.stdout
    assert rows[slow["worker"]][0] >= 0.4, run.stdout  # the slow test is charged to the worker that ran it


def test_ci_fails_when_the_suite_passes_its_budget_and_names_the_slow_test(tmp_path: Path) -> None:
    """The whole chain CI runs (.ci/run, scripts/test, its default workers, the timing report), over a suite of
    a quick and a deliberately slow test: within the default budget it passes; past a budget it fails."""
    (tmp_path / "test_two.py").write_text(SUITE)
    environ = {key: value for key, value in os.environ.items()
               if not key.startswith(("RAYSLICE_TEST_", "RAYSLICE_SUITE_", "PYTEST_"))}
    environ["PYTEST_ADDOPTS"] = f"-p tests.timing_report -p no:cacheprovider {tmp_path / 'test_two.py'}"

    def ci(**env: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(ROOT / ".ci" / "run")], cwd=tmp_path, env=environ | env, capture_output=True,
                              text=True, timeout=300)

    run = ci()
    assert run.returncode == 0, run.stdout + run.stderr
    assert "2 passed" in run.stdout and "budget 50 min" in run.stdout, run.stdout
    run = ci(RAYSLICE_SUITE_BUDGET_MINUTES="0.002")
    assert "2 passed" in run.stdout, run.stdout + run.stderr
    assert run.returncode == 1, run.stdout + run.stderr
    assert "test_two.py::test_deliberately_slow (" in over_budget_message(run.stdout)
