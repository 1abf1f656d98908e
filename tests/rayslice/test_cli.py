"""The `rayslice` command's own error paths: flags named, no traceback, nothing-to-do is not an error.

No cluster: these are the paths a user meets before one answers (an unreachable address, a missing
connection, nothing running). The commands that reach a cluster are tested against the session
cluster in tests/rayslice/local/test_local_cluster.py and tests/e2e.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import typer

from rayslice.cli import app

RAYSLICE = str(Path(sys.executable).with_name("rayslice"))


def run(*args: str, home: Path, **env: str) -> subprocess.CompletedProcess:
    """The installed `rayslice` command, as a user runs it (wide terminal, so messages are not wrapped)."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW_CONN")}
    environ |= {"RAYSLICE_HOME": str(home), "COLUMNS": "250", **env}
    return subprocess.run([RAYSLICE, *args], env=environ, capture_output=True, text=True, timeout=120)


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]  # nothing listens there once the socket is closed


def commands(group, path: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], object]]:
    found = []
    for name, command in group.commands.items():
        if hasattr(command, "commands"):  # a group (typer's own click types need not be click's classes)
            found += commands(command, (*path, name))
        else:
            found.append(((*path, name), command))
    return found


def test_every_command_and_option_says_what_it_is_for():
    root = typer.main.get_command(app)
    listed = commands(root)
    assert len(listed) >= 10
    for path, command in listed:
        assert (command.help or "").strip(), f"`rayslice {' '.join(path)}` has no help text"
        for param in command.params:
            if getattr(param, "param_type_name", "") == "option" and not param.hidden:
                assert (param.help or "").strip(), f"`rayslice {' '.join(path)}` {param.opts[0]} has no help text"


@pytest.mark.parametrize("command", [["capacity"], ["reap", "--dry-run"], ["usage"]])
def test_an_unreachable_address_names_the_flag_without_a_traceback(command, tmp_path):
    out = run(*command, "--address", f"http://127.0.0.1:{closed_port()}", home=tmp_path)
    assert out.returncode == 1, out.stdout + out.stderr
    text = out.stdout + out.stderr
    assert "could not reach the Ray dashboard" in text and "check --address" in text, text
    assert "Traceback" not in text


def test_a_bad_address_names_the_flag(tmp_path):
    out = run("capacity", "--address", "ftp://head:8265", home=tmp_path)
    assert out.returncode == 1 and "--address must be http(s)://host:port" in out.stdout, out.stdout + out.stderr


def test_address_and_conn_id_are_exclusive(tmp_path):
    out = run("capacity", "--address", "http://h:8265", "--conn-id", "ray_default", home=tmp_path)
    assert out.returncode == 1 and "give --address or --conn-id, not both" in out.stdout


def test_conn_id_reads_the_airflow_connection_and_names_the_flag(tmp_path):
    port = closed_port()
    conn = json.dumps({"conn_type": "ray", "host": f"http://127.0.0.1:{port}"})
    out = run("capacity", "--conn-id", "ray_prod", home=tmp_path, AIRFLOW_CONN_RAY_PROD=conn)
    text = out.stdout + out.stderr
    assert out.returncode == 1 and f"127.0.0.1:{port}" in text and "named by --conn-id ray_prod" in text, text
    assert "Traceback" not in text
    missing = run("capacity", "--conn-id", "no_such_conn", home=tmp_path)
    text = missing.stdout + missing.stderr
    assert missing.returncode == 1 and "--conn-id 'no_such_conn'" in text and "Traceback" not in text, text


def test_no_local_cluster_says_which_flags_point_elsewhere(tmp_path):
    out = run("capacity", home=tmp_path)
    text = out.stdout + out.stderr
    assert out.returncode == 1 and "no local cluster named 'default'" in text, text
    assert "--address or --conn-id" in text and "Traceback" not in text


@pytest.mark.parametrize("command", [["local", "down"], ["airflow", "down"]])
def test_down_with_nothing_running_says_so_and_succeeds(command, tmp_path):
    out = run(*command, home=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "nothing to stop" in out.stdout


@pytest.mark.parametrize(
    ("args", "flag"),
    [(["--idle-timeout", "-1"], "'--idle-timeout'"), (["--max-slices", "0"], "'--max-slices'"),
     (["--gpu-nodes", "-2"], "'--gpu-nodes'"), (["--head-service-type", "Ingress"], "--head-service-type 'Ingress'")],
)
def test_manifest_errors_name_the_flag(args, flag, tmp_path):
    out = run("kuberay", "manifest", "--tpu", "v6e-4", "--no-validate", *args, home=tmp_path)
    assert out.returncode != 0 and flag in out.stdout + out.stderr, out.stdout + out.stderr
    assert "idle_timeout_seconds" not in out.stdout + out.stderr and "Traceback" not in out.stdout + out.stderr


def test_version_prints_the_installed_version(tmp_path):
    from importlib.metadata import version

    out = run("--version", home=tmp_path)
    assert out.returncode == 0 and out.stdout.strip() == f"rayslice {version('rayslice')}", out.stdout + out.stderr


def test_on_off_flags_show_no_value_placeholder():
    """`--token <bool>` reads as if the flag took a value; a flag's help shows no type."""
    from typer.testing import CliRunner

    root = typer.main.get_command(app)
    for path, _ in [((), None), *commands(root)]:
        result = CliRunner().invoke(app, [*path, "--help"], env={"COLUMNS": "250"}, prog_name="rayslice")
        assert result.exit_code == 0, result.output
        assert "<bool>" not in result.output and "--help" in result.output, (path, result.output)


def test_address_alone_needs_no_airflow(tmp_path):
    """`capacity --address` checks the URL by the connection's rules without importing Airflow (which would
    create ~/airflow and cost seconds), and says which flag to fix."""
    script = (
        "import sys\n"
        "from typer.testing import CliRunner\n"
        "from rayslice.cli import app\n"
        f"result = CliRunner().invoke(app, ['capacity', '--address', 'http://127.0.0.1:{closed_port()}'])\n"
        "print(result.exit_code, sorted(m for m in sys.modules if m == 'airflow' or m.startswith('airflow.')))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW")} | {"HOME": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip().endswith("1 []"), out.stdout + out.stderr
    assert not (tmp_path / "airflow").exists()


def test_a_refused_token_names_the_token_flag(tmp_path):
    """A 401 seen through --address speaks of --token, not of a connection's password the user never set."""
    from tests.http_fake import JsonHttpFake

    class Refusing(JsonHttpFake):
        def answer(self, request):
            return 401, {"error": "Unauthorized: missing or invalid token"}

    with Refusing() as fake:
        out = run("capacity", "--address", fake.url, "--token", "wrong", home=tmp_path)
    text = out.stdout + out.stderr
    assert out.returncode == 1 and "--token" in text and "connection" not in text, text


def test_launcher_label_names_this_pythons_launcher_digest(tmp_path):
    from pathlib import Path

    import cloudpickle

    import rayslice
    from rayslice.core import launcher

    out = run("launcher-label", home=tmp_path)
    digest = launcher.digest(Path(rayslice.__file__).parent, Path(cloudpickle.__file__).parent)
    assert out.returncode == 0 and out.stdout.strip() == f"rayslice.io/launcher={digest}", out.stdout + out.stderr
