"""RayHook against the real test cluster, through real Airflow connections (no mocks)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from airflow.sdk import Connection
from rayslice.hooks.ray import RayHook, dashboard_url, settings_from_connection

from rayslice.core.exceptions import InvalidRequestError
from rayslice.local.local_cluster import free_port
from tests.airflow_env import REPO, ray_connection_json

TOKEN = "tok-5ecret-do-not-print"


@pytest.mark.parametrize(
    ("conn", "expected"),
    [
        ({"host": "http://127.0.0.1:8265"}, "http://127.0.0.1:8265"),
        ({"host": "http://127.0.0.1:8265/"}, "http://127.0.0.1:8265"),
        ({"host": "127.0.0.1", "port": 8265}, "http://127.0.0.1:8265"),
        ({"host": "ray.example.com", "schema": "https", "port": 443}, "https://ray.example.com"),
        ({"host": "https://ray.example.com:8443/proxy", "port": 9}, "https://ray.example.com:8443/proxy"),
    ],
)
def test_dashboard_url_from_connection_fields(conn, expected):
    c = Connection(conn_id="r", conn_type="ray", **conn)
    assert settings_from_connection(c).dashboard_url == expected


@pytest.mark.parametrize(
    ("uri", "expected"),
    [
        ("ray://127.0.0.1:8265", "http://127.0.0.1:8265"),
        ("ray://http://127.0.0.1:8265", "http://127.0.0.1:8265"),  # Airflow splits the port off
        ("ray://:tok@ray.example.com:443/https?verify=false", "https://ray.example.com"),
    ],
)
def test_dashboard_url_from_uri_connections(uri, expected):
    settings = settings_from_connection(Connection(conn_id="r", uri=uri))
    assert settings.dashboard_url == expected


@pytest.mark.parametrize("fields", [{"host": "http://127.0.0.1:8265"}, {"host": "127.0.0.1", "port": 8265}])
def test_connections_survive_the_uri_round_trip_the_api_server_does(fields):
    """The UI's "Test" button hands the hook the connection as an AIRFLOW_CONN_* URI."""
    from airflow.models.connection import Connection as StoredConnection

    uri = StoredConnection(conn_id="r", conn_type="ray", **fields).get_uri()
    assert settings_from_connection(Connection(conn_id="r", uri=uri)).dashboard_url == "http://127.0.0.1:8265"


def test_extras_and_token_stay_out_of_reprs():
    conn = Connection(conn_id="r", conn_type="ray", host="http://h:1", password=TOKEN,
                      extra=json.dumps({"verify": "false", "headers": {"X-Key": "v"}}))
    settings = settings_from_connection(conn)
    assert settings.verify is False and settings.headers == {"X-Key": "v"} and settings.token == TOKEN
    assert TOKEN not in repr(settings) and TOKEN not in repr(settings.client())
    assert TOKEN not in repr(RayHook())


def test_the_checkpoint_root_extra_is_a_url_or_nothing():
    def settings(extra):
        return settings_from_connection(Connection(conn_id="r", conn_type="ray", host="http://h:1",
                                                   extra=json.dumps(extra)))

    assert settings({"checkpoint_root": "gs://bucket/ckpt"}).checkpoint_root == "gs://bucket/ckpt"
    assert settings({}).checkpoint_root is None and settings({"checkpoint_root": ""}).checkpoint_root is None
    with pytest.raises(InvalidRequestError, match="'checkpoint_root' must be a URL like 'gs://bucket/checkpoints'"):
        settings({"checkpoint_root": "/local/ckpt"})


def test_the_launcher_extra_is_shipped_by_default_or_installed():
    def settings(extra):
        return settings_from_connection(Connection(conn_id="r", conn_type="ray", host="http://h:1",
                                                   extra=json.dumps(extra)))

    assert settings({}).launcher == "shipped" and settings({"launcher": "installed"}).launcher == "installed"
    with pytest.raises(InvalidRequestError, match="'launcher' must be 'shipped' .* or 'installed' .*got 'local'"):
        settings({"launcher": "local"})


def test_the_deployment_extra_names_a_folder_or_nothing():
    def settings(extra):
        return settings_from_connection(Connection(conn_id="r", conn_type="ray", host="http://h:1",
                                                   extra=json.dumps(extra)))

    assert settings({"deployment": "prod-eu.2"}).deployment == "prod-eu.2"
    assert settings({}).deployment is None and settings({"deployment": ""}).deployment is None
    for bad in ("../prod", "prod/eu", " prod", "x" * 65, 7):
        with pytest.raises(InvalidRequestError, match="'deployment' must be 1-64 letters, digits"):
            settings({"deployment": bad})


def test_the_team_extra_is_the_platforms_and_a_queue_extra_is_refused():
    """Issue 38 (3): a connection's `queue` extra used to set the whole cluster's policy and quotas."""
    def settings(extra):
        return settings_from_connection(Connection(conn_id="r", conn_type="ray", host="http://h:1",
                                                   extra=json.dumps(extra)))

    assert settings({"team": "research/vision"}).team == "research/vision" and settings({}).team is None
    with pytest.raises(InvalidRequestError, match="extra 'team' must be a team name"):
        settings({"team": "a b"})
    with pytest.raises(InvalidRequestError, match="extra 'queue' is no longer read: .* cluster operator's, set on "
                                                  "the head \\(RAYSLICE_QUEUE\\) or with `rayslice queue --set"):
        settings({"queue": {"quotas": {}, "policy": "strict"}})


def test_missing_host_names_the_fix():
    with pytest.raises(InvalidRequestError, match="host to the Ray dashboard URL"):
        dashboard_url("")


def test_json_env_connection_reaches_the_cluster(ray_default, monkeypatch):
    monkeypatch.setenv("AIRFLOW_CONN_RAY_DEFAULT",
                       json.dumps({"conn_type": "ray", "host": ray_default.dashboard_url}))
    ok, message = RayHook().test_connection()
    assert ok, message
    assert "Ray 2." in message and ray_default.dashboard_url in message
    with RayHook().client() as client:
        assert isinstance(client.list_jobs(), list)


def test_connection_failure_is_false_and_never_shows_the_token(monkeypatch):
    closed = f"http://127.0.0.1:{free_port()}"
    monkeypatch.setenv("AIRFLOW_CONN_RAY_BAD", ray_connection_json(closed, TOKEN))
    ok, message = RayHook("ray_bad", timeout=2, retries=1).test_connection()
    assert not ok
    assert closed in message and "check the `ray` connection's host" in message
    assert TOKEN not in message


async def test_async_settings_and_client(ray_default):
    settings = await RayHook().asettings()
    async with settings.async_client() as client:
        info = await client.version()
    assert info["ray_version"].startswith("2.")


def test_airflow_side_imports_and_works_without_ray(ray_default):
    """Workers, triggerers and the API server need no `ray` (nor `jax`) installed."""
    script = textwrap.dedent(
        """
        import sys

        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("ray", "jax", "jaxlib", "optax"):
                    raise ImportError(f"{name} is blocked in this test")

        sys.meta_path.insert(0, Block())
        import rayslice.hooks.ray, rayslice.provider
        import rayslice.operators.step, rayslice.operators.tpu_slice, rayslice.operators.accelerator
        import rayslice.operators.triggers, rayslice.operators.links, rayslice.operators.decorators
        from rayslice.hooks.ray import RayHook

        rayslice.provider.get_provider_info()
        ok, message = RayHook().test_connection()
        assert ok, message
        with RayHook().client() as client:
            client.list_jobs()
        assert not any(m.split(".")[0] in ("ray", "jax") for m in sys.modules), "ray or jax got imported"
        print("OK")
        """
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0 and done.stdout.strip().endswith("OK"), done.stderr[-3000:]


def test_provider_info_validates_and_registers_the_connection_form():
    import importlib.resources

    import jsonschema
    from airflow.providers_manager import ProvidersManager
    from airflow.sdk.providers_manager_runtime import ProvidersManagerTaskRuntime

    from rayslice.provider import get_provider_info

    schema = json.loads(importlib.resources.files("airflow").joinpath("provider_info.schema.json").read_text())
    jsonschema.validate(get_provider_info(), schema)
    manager = ProvidersManager()
    assert ProvidersManagerTaskRuntime().hooks["ray"].hook_class_name == "rayslice.hooks.ray.RayHook"
    behaviour = manager.field_behaviours["ray"]
    assert behaviour["relabeling"] == {"host": "Ray dashboard URL", "password": "Ray auth token"}
    assert {"extra__ray__verify", "extra__ray__headers"} <= set(manager.connection_form_widgets)
    assert ProvidersManagerTaskRuntime().hooks["rayslice"].hook_class_name == "rayslice.hooks.ray.RaysliceHook"
    assert {"extra__rayslice__verify", "extra__rayslice__kuberay"} <= set(manager.connection_form_widgets)


def test_a_ray_connection_saved_by_another_providers_form_is_read():
    """astro-provider-ray's and Apache's `ray` forms hide the host and keep the dashboard URL in `address`."""
    conn = Connection(conn_id="r", conn_type="ray", password=TOKEN, extra=json.dumps(
        {"address": "https://ray.example.com:8443", "headers": '{"X-Key": "v"}', "verify": False,
         "cookies": "", "kube_config_path": "", "namespace": "ml", "disable_tcp_keepalive": False}))
    settings = settings_from_connection(conn)
    assert settings.dashboard_url == "https://ray.example.com:8443" and settings.token == TOKEN
    assert settings.headers == {"X-Key": "v"} and settings.verify is False
    with pytest.raises(InvalidRequestError, match="unknown extra 'cookies'"):  # theirs only with their address
        settings_from_connection(Connection(conn_id="r", conn_type="ray", host="http://h:1",
                                            extra=json.dumps({"cookies": "x"})))


def test_an_unknown_extra_fails_naming_the_valid_ones():
    """A misspelled extra would otherwise be ignored: the checkpoint folders would silently go elsewhere."""
    from rayslice.hooks.ray import EXTRAS

    conn = Connection(conn_id="r", conn_type="ray", host="http://h:1",
                      extra=json.dumps({"checkpoint-root": "gs://b/c", "verfy": False}))
    with pytest.raises(InvalidRequestError) as info:
        settings_from_connection(conn)
    message = str(info.value)
    assert "'checkpoint-root' (did you mean 'checkpoint_root'?)" in message and "'verfy'" in message
    assert all(name in message for name in EXTRAS)


def test_the_connection_form_offers_every_extra():
    from rayslice.hooks.ray import EXTRAS

    from rayslice.provider import get_provider_info

    ray, rayslice = get_provider_info()["connection-types"]
    assert set(ray["conn-fields"]) == set(EXTRAS)
    assert (ray["connection-type"], rayslice["connection-type"]) == ("ray", "rayslice")
    assert {k: v for k, v in rayslice.items() if k not in ("connection-type", "hook-class-name", "hook-name")} == \
        {k: v for k, v in ray.items() if k not in ("connection-type", "hook-class-name", "hook-name")}


def test_another_providers_connection_with_an_empty_address_says_the_address_is_missing():
    """Review of issue 41: astro's form saved with its URL left empty: the error is about `address`, not
    about its own fields (cookies, namespace) being unknown extras."""
    conn = Connection(conn_id="r", conn_type="ray", extra=json.dumps(
        {"address": "", "cookies": "", "namespace": "ml", "verify": True}))
    with pytest.raises(InvalidRequestError) as caught:
        settings_from_connection(conn)
    assert "address" in str(caught.value) and "unknown extra" not in str(caught.value), str(caught.value)


@pytest.mark.parametrize("root", ["file://ckpt", "FILE:///shared/ckpt", "memory://ckpt"])
def test_a_checkpoint_root_extra_that_would_lose_its_checkpoints_is_refused_as_the_connections(root):
    """Review of issue 49 finding 11: the connection's extra took any root with '://', so a relative file:// root
    failed only as each step was shipped ("cannot ship the step: checkpoint_root ..."), naming the task's
    parameter, which the author never set."""
    conn = Connection(conn_id="r", conn_type="ray", host="http://h:1", extra=json.dumps({"checkpoint_root": root}))
    with pytest.raises(InvalidRequestError, match="the `ray` connection's extra 'checkpoint_root' must be a URL like"):
        settings_from_connection(conn)
