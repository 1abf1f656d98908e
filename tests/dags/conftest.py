"""Configure Airflow (private AIRFLOW_HOME, SQLite) before any test here imports it."""

from tests.airflow_env import airflow_db, ray_default  # noqa: F401  (fixtures)
