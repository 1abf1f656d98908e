"""Configure Airflow (private AIRFLOW_HOME, SQLite) before any test here imports it: the trigger runs in-process."""

import tests.airflow_env  # noqa: F401  (configures Airflow at import)
