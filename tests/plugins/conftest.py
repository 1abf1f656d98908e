"""Configure Airflow (private AIRFLOW_HOME, SQLite) before any test here imports it; the plugin's app."""

import contextlib
import json
import uuid

import pytest

from tests.airflow_env import airflow_db, ray_default  # noqa: F401  (fixtures)


@contextlib.contextmanager
def plugin_app(folder, users: str, connections: dict[str, dict]):
    """Airflow's API app with the Slices plugin (installed the plugins-folder way), the simple auth manager with
    `users` ("name:role,..."), and `connections` (id -> the JSON form) as environment connections."""
    from airflow import plugins_manager, settings
    from airflow.api_fastapi import app as api_app

    (folder / "rayslice_slices.py").write_text("from rayslice.plugins.slices import SlicesPlugin  # noqa: F401\n")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(settings, "PLUGINS_FOLDER", str(folder))
        mp.setenv("AIRFLOW__CORE__AUTH_MANAGER",
                  "airflow.api_fastapi.auth.managers.simple.simple_auth_manager.SimpleAuthManager")
        mp.setenv("AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS", "False")
        mp.setenv("AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS", users)
        mp.setenv("AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE", str(folder / "passwords.json"))
        mp.setenv("AIRFLOW__API_AUTH__JWT_SECRET", uuid.uuid4().hex * 2)
        for conn_id, conn in connections.items():
            mp.setenv(f"AIRFLOW_CONN_{conn_id.upper()}", json.dumps(conn))
        _reset_plugins(plugins_manager, api_app)
        try:
            yield api_app.create_app("core")
        finally:
            _reset_plugins(plugins_manager, api_app)


def _reset_plugins(plugins_manager, api_app) -> None:
    for cached in (plugins_manager._get_plugins, plugins_manager._get_ui_plugins, plugins_manager.get_fastapi_plugins):
        cached.cache_clear()
    api_app.purge_cached_app()
