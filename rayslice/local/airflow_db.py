"""The SQLite connection settings of the local Airflow (`rayslice airflow up`, `AirflowStack`).

SQLite lets one writer in at a time; another waits `timeout` seconds (Python's default: 5) and then
fails with "database is locked". On a loaded laptop or a two-core CI machine a scheduler loop's commit
waited longer than that behind the API server and triggerers, and the scheduler exited
(`SchedulerJob._run_scheduler_loop`: sqlite3.OperationalError), leaving every later run queued. Airflow
reads this dict by import path (`[database] sql_alchemy_connect_args`), so it is a module of its own:
the scheduler, triggerer, API server and dag-processor import only this.
"""

#: Wait up to a minute for the write lock rather than crash a component.
CONNECT_ARGS = {"timeout": 60}
