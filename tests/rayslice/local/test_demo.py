"""The demo shows what a user needs of Airflow's log, and every error."""

from __future__ import annotations

import os

from rayslice.local import demo

RAYSLICE_LINE = ("2026-12-03T22:13:49.472418Z [info     ] [rayslice] reserved v6e-16-a in 659 ms "
                 "[rayslice.operators.triggers.RayStepTrigger] loc=submission.py:355")
BOOKKEEPING = ("2026-12-03T22:13:26.087739Z [info     ] setting next dagrun info       [airflow.models.dag] "
               "loc=dag.py:848 next_dagrun=None")
HOST_LINE = ("2026-12-03T22:13:58.499471Z [info     ] (v6e-16-a/host0 pid=21385) [Gloo] Rank 0 is connected to 3 "
             "peer ranks. [rayslice.operators.triggers.RayStepTrigger] loc=submission.py:355")
TASK_START = ("2026-12-03T22:13:40.392082Z [info     ] [DAG TEST] starting task_id=train map_index=-1 "
              "[airflow.sdk.definitions.dag] loc=dag.py:1501")
ERROR = ("2026-12-03T22:13:42.000000Z [error    ] Task failed with exception [task] "
         "loc=task_runner.py:1 ti=RuntimeTaskInstance(id=1)")
WARNING = ("2026-12-03T22:13:40.532150Z [warning  ] empty cryptography key - values will not be stored encrypted. "
           "[airflow.models.crypto] loc=crypto.py:169")


def test_rayslice_lines_task_starts_errors_and_raw_output_are_shown_bookkeeping_is_not():
    assert demo.shown(RAYSLICE_LINE) == "  [rayslice] reserved v6e-16-a in 659 ms"
    assert demo.shown(TASK_START) == "  task train"
    assert demo.shown(ERROR) == ERROR
    assert demo.shown('  File "dags/training_pipeline.py", line 3, in train') is not None  # a traceback's line
    assert demo.shown(BOOKKEEPING) is None and demo.shown(HOST_LINE) is None and demo.shown(WARNING) is None


def test_inside_the_block_output_goes_to_the_file_and_the_screen_gets_the_shown_lines(tmp_path, capfd):
    log = tmp_path / "airflow.log"
    with demo.airflow_output(log):  # file descriptors, as Airflow's logging and child processes write them
        os.write(1, (BOOKKEEPING + "\n").encode())
        os.write(2, (ERROR + "\n").encode())
        os.write(1, (RAYSLICE_LINE + "\n").encode())
    os.write(1, b"after\n")
    screen = capfd.readouterr()
    assert screen.out.splitlines() == [ERROR, "  [rayslice] reserved v6e-16-a in 659 ms", "after"]
    assert log.read_text().splitlines() == [BOOKKEEPING, ERROR, RAYSLICE_LINE]


def test_a_per_host_list_is_shown_once_when_every_host_returned_the_same():
    assert demo.same_on_every_host([{"loss": 1.5}] * 4) == "{'loss': 1.5} (the same from all 4 hosts)"
    assert demo.same_on_every_host([1, 2]) == [1, 2]
