"""Every Python example in the README and the docs/ pages runs as written against the local cluster.

Each one runs as its own `python example.py`, in the environment a user gets from the README's
`eval "$(rayslice local env)"` (and, for the DAG file, the tests' Airflow home, with the file in
its DAG folder), and must print what the README says it prints.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.airflow_env import REPO, TEST_DAGS, init_db

BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
#: The pages whose Python blocks run, in this order (every page of docs/ is listed; a test checks that).
PAGES = ["README.md", "docs/examples.md", "docs/concepts.md", "docs/connection.md", "docs/deploying.md",
         "docs/ui.md", "docs/cli.md", "docs/errors.md", "docs/limits.md", "docs/sharing.md", "docs/operators.md",
         "docs/deploying-gke.md", "docs/deploying-tpu-vms.md", "docs/troubleshooting.md", "docs/upgrading.md",
         "docs/simulation.md", "docs/security.md", "docs/metrics.md", "docs/goodput.md",
         "docs/preemption.md", "docs/elastic.md", "docs/doctor.md", "docs/cluster-sets.md"]
EXAMPLES = [block for page in PAGES for block in BLOCK.findall((REPO / page).read_text())]
HOST_LINE = re.compile(r"^(\x1b\[\d+m)?\([\w.-]+/(host\d+|GPU) pid=\d+\)")
RAYSLICE = str(Path(sys.executable).with_name("rayslice"))

#: What each example prints, in PAGES order (a pattern per printed line).
PRINTS = [
    [r"success"],
    [r"\[16, 16, 16, 16\]", r"\[32, 32, 32, 32, 32, 32, 32, 32\]"],
    [r"\[12\.0\]"],
    [r"[0-2]"],
    [rf"\{{'process': {i}, 'devices': 16, 'total': 16\.0, 'lr': '0\.1'\}}" for i in range(4)],
    [r"nightly urgent True"],
    [r"\[(\[2, 32\](, \[2, 32\]){7}|\[1, 16\](, \[1, 16\]){3})\]"],  # on both slices, or on the one free
]


def test_the_table_covers_every_example():
    assert len(EXAMPLES) == len(PRINTS), "an example was added or removed: say what it prints in PRINTS"
    assert {f"docs/{p.name}" for p in (REPO / "docs").glob("*.md")} <= set(PAGES), "a docs/ page is not in PAGES"


def local_env(cluster) -> dict[str, str]:
    """What `eval "$(rayslice local env --name ...)"` sets, parsed from the command's own output."""
    out = subprocess.run([RAYSLICE, "local", "env", "--name", cluster.name], capture_output=True, text=True,
                         check=True, timeout=60).stdout
    pairs = [shlex.split(line.removeprefix("export "))[0].split("=", 1) for line in out.splitlines()]
    return dict(pairs)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("index", range(len(PRINTS)), ids=["dag", "run_step", "checkpoints", "run_step_job",
                                                                  "command_step", "sharing",
                                                                  "elastic"])
def test_a_readme_example_runs_as_written(cluster, index, tmp_path):
    source = EXAMPLES[index]
    folder = tmp_path
    if "@dag" in source:  # a DAG file lives in a DAG folder; dag.test() needs the metadata DB
        init_db()
        folder = TEST_DAGS
    example = folder / f"readme_example_{index}.py"
    example.write_text(source)
    env = {**os.environ, **local_env(cluster)}
    try:
        done = subprocess.run([sys.executable, str(example)], cwd=tmp_path, env=env, capture_output=True,
                              text=True, timeout=540)
    finally:
        if folder == TEST_DAGS:
            example.unlink()
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    # What the example printed, without the launcher's progress lines ("[rayslice] ...") and the hosts'
    # own output relayed by Ray ("(v6e-16-a/host0 pid=...) ...") between them.
    printed = [line for line in done.stdout.splitlines()
               if line.strip() and not line.startswith("[rayslice]") and not HOST_LINE.match(line)]
    tail = printed[-len(PRINTS[index]):]
    assert all(re.fullmatch(pattern, line) for pattern, line in zip(PRINTS[index], tail, strict=True)), \
        "\n".join(printed[-40:])
