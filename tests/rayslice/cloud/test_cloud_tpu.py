"""rayslice.cloud.cloud_tpu: the real google-cloud-tpu client (REST transport) against an HTTP fake of the TPU v2 API.

The Cloud TPU API cannot run here: tests/fake_cloud_tpu.py serves it over real HTTP and parses
every request and response body strictly into the client library's own protobuf messages.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

import rayslice
from rayslice.cloud import cloud_tpu
from rayslice.cloud.cloud_tpu import CloudTpuError, QueuedSlice, QueuedSliceClient
from rayslice.core.exceptions import InvalidRequestError
from tests.fake_cloud_tpu import FakeCloudTpu

PROJECT, ZONE = "my-project", "us-east5-b"
OWNER = "nightly/manual__2026-01-01T00:00:00+00:00"
SCRIPT = cloud_tpu.startup_script("10.0.0.2:6379")


@pytest.fixture(autouse=True)
def empty_zone_cache():
    cloud_tpu._zone_cache.clear()
    yield
    cloud_tpu._zone_cache.clear()


@pytest.fixture
def fake():
    with FakeCloudTpu() as server:
        yield server


def client(fake: FakeCloudTpu, **queued) -> QueuedSliceClient:
    spec = QueuedSlice(**{"project": PROJECT, "zone": ZONE, "queued_resource_id": "rs-1", "tpu": "v6e-16", **queued})
    return QueuedSliceClient(spec, api_endpoint=fake.url)


def type_requests(fake: FakeCloudTpu) -> list:
    return [r for r in fake.requests if r[1].endswith("/acceleratorTypes")]


# --- accelerator types of a zone


def test_zone_types_are_listed_across_pages_and_cached(fake):
    types = cloud_tpu.zone_accelerator_types(PROJECT, ZONE, api_endpoint=fake.url)
    assert set(types) == set(fake.zones[ZONE])
    assert len(type_requests(fake)) == 3  # 8 types, 3 a page
    assert cloud_tpu.zone_accelerator_types(PROJECT, ZONE, api_endpoint=fake.url) == types
    assert cloud_tpu.check_accelerator_type("v6e-16", PROJECT, ZONE, api_endpoint=fake.url) == "v6e-16"
    assert len(type_requests(fake)) == 3  # served from the cache
    fake.zones[ZONE] = ("v6e-4",)
    assert cloud_tpu.zone_accelerator_types(PROJECT, ZONE, api_endpoint=fake.url, max_age=0) == ("v6e-4",)


@pytest.mark.parametrize(
    ("tpu", "message"),
    [
        ("v6e-64", "v6e-64 is not offered in zone us-east5-b: v6e there comes as v6e-1, v6e-16, v6e-32, v6e-4"),
        ("v5p-8", "it has no v5p TPUs (it offers v4-8, "),
        ("v5e-16", None),  # an alias of v5litepod-16, which the zone offers
    ],
)
def test_check_accelerator_type(fake, tpu, message):
    if message is None:
        assert cloud_tpu.check_accelerator_type(tpu, PROJECT, ZONE, api_endpoint=fake.url) == "v5litepod-16"
        return
    with pytest.raises(InvalidRequestError) as info:
        cloud_tpu.check_accelerator_type(tpu, PROJECT, ZONE, api_endpoint=fake.url)
    assert message in str(info.value)


def test_an_unknown_zone_is_an_api_error(fake):
    with pytest.raises(CloudTpuError, match="answered 404 .*europe-west9-z not found"):
        cloud_tpu.zone_accelerator_types(PROJECT, "europe-west9-z", api_endpoint=fake.url)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"project": "P"}, "GCP project 'P' is invalid"),
        ({"zone": "us-east5"}, "zone 'us-east5' is invalid"),
        ({"queued_resource_id": "Rs_1"}, "queued_resource_id 'Rs_1' is invalid"),
        ({"tpu": "v6e-15"}, "not a v6e slice"),
        ({"num_slices": 0}, "num_slices"),
        # The Cloud TPU API does not serve TPU7x and later (https://cloud.google.com/tpu/docs/v6e-training, caution).
        ({"tpu": "v7x-16"}, r"TPU v7x \(Ironwood\) cannot be created through the Cloud TPU API .* run it on GKE"),
        ({"tpu": "v7x-16", "runtime_version": "v2-alpha-tpu7x"}, "cannot be created through the Cloud TPU API"),
    ],
)
def test_bad_queued_slices_fail_at_construction(kwargs, message):
    with pytest.raises(InvalidRequestError, match=message):
        QueuedSlice(**{"project": PROJECT, "zone": ZONE, "queued_resource_id": "rs-1", "tpu": "v6e-16", **kwargs})


# --- the startup script


def _lock(package: str) -> str:
    lock = (Path(__file__).resolve().parents[3] / "requirements.lock").read_text()
    (version,) = re.findall(rf"^{package}==(\S+)$", lock, re.M)
    return version


def test_the_startup_script_installs_the_locked_versions_into_a_python_312_venv_and_starts_ray_from_it():
    script = cloud_tpu.startup_script("10.0.0.2:6379", ray_start_args="--num-cpus 4; rm -rf /")
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0
    lines = script.splitlines()
    assert lines[0] == "#!/bin/bash" and "set -euo pipefail" in lines
    assert 'uv venv --clear --python 3.12.16 "$venv"' in script and "venv=/opt/rayslice/venv" in lines
    [install] = [line for line in lines if line.startswith("uv pip install")]
    assert shlex.split(install)[3:] == ["--python", "$venv/bin/python", "pydantic>=2.10", "fsspec>=2024.1",
                                        "gcsfs>=2024.1", f"jax[tpu]=={_lock('jax')}", f"ray[default]=={_lock('ray')}"]
    assert "rayslice" not in install  # in no registry: only from a wheel
    assert shlex.split(lines[-1]) == ["$venv/bin/ray", "start", "--address=10.0.0.2:6379", "--num-cpus", "4;", "rm",
                                      "-rf", "/"]
    bare = cloud_tpu.startup_script("10.0.0.2:6379", install=False)
    assert "uv" not in bare and bare.splitlines()[-1] == "ray start --address=10.0.0.2:6379"


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"head_address": "10.0.0.2"}, "host:port"),
    ({"ray_version": "latest; reboot"}, "ray_version 'latest; reboot' is invalid"),
    ({"jax_version": "0.12 && reboot"}, "jax_version"),
    ({"python_version": "3.11"}, "rayslice needs Python 3.12 or newer"),
    ({"python_version": "3"}, "python_version '3' is invalid"),
    ({"python_version": "3.12.x; reboot"}, "python_version '3.12.x; reboot' is invalid"),
    ({"venv": "relative/venv"}, "give an absolute path"),
    ({"wheel": "rayslice.whl"}, "wheel 'rayslice.whl' is invalid"),
    ({"wheel": "gs://b/rayslice-0.0.9-py3-none-any.whl"}, "is not rayslice " + rayslice.__version__),
    ({"token_secret": "ray token; reboot"}, "token_secret 'ray token; reboot' is invalid"),
])
def test_the_startup_script_refuses_bad_arguments(kwargs, message):
    with pytest.raises(InvalidRequestError, match=re.escape(message)):
        cloud_tpu.startup_script(**{"head_address": "h:6379", **kwargs})


def test_the_startup_script_runs_the_way_a_booting_vm_would(tmp_path):
    """Run it, twice (a reboot), with stand-ins for curl, uv and ray on PATH that record what they were asked."""
    stubs, log, venv = tmp_path / "bin", tmp_path / "calls", tmp_path / "venv"
    stubs.mkdir()
    record = f'echo "$(basename "$0") $*" >> {shlex.quote(str(log))}'

    def stub(path: Path, body: str) -> None:
        path.write_text(f"#!/bin/bash\n{record}\n{body}\n")
        path.chmod(0o755)

    # `uv venv --clear --python 3.12.16 DIR` makes DIR/bin/{python,ray}, which record their calls as venv-<name>;
    # that python answers the version uv was asked for (what `platform.python_version()` prints).
    stub(tmp_path / "uv", 'if [ "$1" = venv ]; then mkdir -p "$5/bin"; for b in python ray; do\n'
         f'  printf \'#!/bin/bash\\necho "venv-$(basename "$0") $*" >> %s\\n\' {shlex.quote(str(log))} > "$5/bin/$b"\n'
         '  chmod +x "$5/bin/$b"; done; echo "echo $4" >> "$5/bin/python"; fi')
    # The uv installer that `curl ... | sh` runs puts that uv where UV_INSTALL_DIR says.
    stub(stubs / "curl", f'echo \'cp {tmp_path / "uv"} "$UV_INSTALL_DIR/uv"\'')
    uv_dir = tmp_path / "uv-bin"
    uv_dir.mkdir()
    script = cloud_tpu.startup_script("10.0.0.2:6379", venv=str(venv)).replace("/usr/local/bin", str(uv_dir))
    for tool in ("basename", "chmod", "cp", "env", "mkdir", "sh"):  # only these: no uv of this machine's
        (stubs / tool).symlink_to(shutil.which(tool))
    env = {"PATH": f"{stubs}:{uv_dir}", "HOME": str(tmp_path)}
    for _ in range(2):
        done = subprocess.run([shutil.which("bash"), "-c", script], env=env, text=True, capture_output=True)
        assert done.returncode == 0, done.stderr
    calls = log.read_text().splitlines()
    packages = f"pydantic>=2.10 fsspec>=2024.1 gcsfs>=2024.1 jax[tpu]=={_lock('jax')} ray[default]=={_lock('ray')}"
    probe = "venv-python -c import platform; print(platform.python_version())"
    assert calls == [
        "curl -LsSf https://astral.sh/uv/0.13.9/install.sh",  # first boot: no uv yet; a pinned uv release
        f"uv venv --clear --python 3.12.16 {venv}",
        f"uv pip install --python {venv}/bin/python {packages}",
        "venv-ray start --address=10.0.0.2:6379",
        # the reboot: uv is there, and so is the venv of that Python; the install is uv's no-op
        probe,
        f"uv pip install --python {venv}/bin/python {packages}",
        "venv-ray start --address=10.0.0.2:6379",
    ]


def test_the_shipped_launchers_needs_are_the_cluster_extras():
    from importlib.metadata import requires

    def extra(name):
        return [r.split(";")[0].strip() for r in requires("rayslice") if f'extra == "{name}"' in r]

    assert sorted(cloud_tpu.SHIPPED_LAUNCHER_NEEDS) == sorted(
        r for r in extra("cluster") if not r.startswith(("ray", "jax", "cloudpickle")))  # cloudpickle: with each job
    assert list(cloud_tpu.GCS_NEEDS) == extra("gcs")


def test_a_token_auth_head_and_a_wheel(tmp_path):
    """The token comes from Secret Manager at boot (never in the VM's metadata); rayslice from the wheel."""
    wheel = f"gs://my-bucket/wheels/rayslice-{rayslice.__version__}-py3-none-any.whl"
    script = cloud_tpu.startup_script("10.0.0.2:6379", wheel=wheel, token_secret="ray-token")
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0
    lines = script.splitlines()
    assert lines[3:6] == ["export RAY_AUTH_MODE=token",
                          'RAY_AUTH_TOKEN="$(gcloud secrets versions access latest --secret=ray-token '
                          '| tr -d \'\\n\')"',
                          "export RAY_AUTH_TOKEN"]
    local = f"/opt/rayslice/venv-wheels/rayslice-{rayslice.__version__}-py3-none-any.whl"
    assert f"gcloud storage cp {wheel} {local}" in lines
    [install] = [line for line in lines if line.startswith("uv pip install")]
    assert f"rayslice[cluster,gcs] @ file://{local}" in shlex.split(install)
    bare = cloud_tpu.startup_script("10.0.0.2:6379", install=False, token_secret="ray-token")
    assert bare.splitlines()[3] == "export RAY_AUTH_MODE=token" and "uv" not in bare


# --- queued resources


def test_create_sends_a_valid_queued_resource_and_waits_for_active(fake):
    kube = client(fake)
    kube.create(owner=OWNER, script=SCRIPT)
    [(_, path, query, body)] = [r for r in fake.requests if r[0] == "POST"]
    assert path == f"/v2/projects/{PROJECT}/locations/{ZONE}/queuedResources" and query["queuedResourceId"] == ["rs-1"]
    [spec] = body["tpu"]["nodeSpec"]  # the fake parsed it strictly into tpu_v2.QueuedResource
    assert spec["parent"] == f"projects/{PROJECT}/locations/{ZONE}" and spec["nodeId"] == "rs-1"
    node = spec["node"]
    assert node["acceleratorType"] == "v6e-16" and node["runtimeVersion"] == "v2-alpha-tpuv6e"
    assert node["metadata"]["startup-script"] == SCRIPT
    assert node["labels"] == {"managed-by": "rayslice", "rayslice-owner": cloud_tpu.owner_label(OWNER)}
    active = kube.wait_active(timeout=30, poll_interval=0.01)
    assert active.state.state.name == "ACTIVE"


def test_multislice_asks_for_node_count_slices(fake):
    client(fake, num_slices=2, spot=True).create(owner=OWNER, script=SCRIPT)
    [(_, _, _, body)] = [r for r in fake.requests if r[0] == "POST"]
    [spec] = body["tpu"]["nodeSpec"]
    assert spec["multisliceParams"] == {"nodeCount": 2, "nodeIdPrefix": "rs-1"} and "nodeId" not in spec
    assert body["spot"] == {}


def test_a_type_the_zone_lacks_is_refused_by_the_api(fake):
    fake.zones[ZONE] = ("v6e-4",)
    with pytest.raises(CloudTpuError, match="answered 400 .*v6e-16 not available"):
        client(fake).create(owner=OWNER, script=SCRIPT)


def test_a_failed_queued_resource_says_why(fake):
    fake.fail_with = "There is no more capacity in the zone"
    kube = client(fake)
    kube.create(owner=OWNER, script=SCRIPT)
    with pytest.raises(CloudTpuError, match="is FAILED: There is no more capacity"):
        kube.wait_active(timeout=30, poll_interval=0.01)


def test_waiting_for_capacity_times_out(fake):
    fake.active_after_gets = None
    kube = client(fake)
    kube.create(owner=OWNER, script=SCRIPT)
    with pytest.raises(CloudTpuError, match=r"not ACTIVE after 0.2 s \(state PROVISIONING\)"):
        kube.wait_active(timeout=0.2, poll_interval=0.05)


def test_delete_only_what_this_owner_made(fake):
    kube = client(fake)
    assert kube.delete(owner=OWNER) == "absent"
    kube.create(owner=OWNER, script=SCRIPT)
    kube.wait_active(timeout=30, poll_interval=0.01)
    assert kube.delete(owner="nightly/another-run") == "not-owned"
    assert kube.get() is not None
    assert kube.delete(owner=OWNER) == "deleted"
    [(_, _, query, _)] = [r for r in fake.requests if r[0] == "DELETE"]
    assert query["force"] == ["true"]  # an ACTIVE queued resource goes with its nodes
    assert kube.get() is None


def test_a_foreign_queued_resource_is_never_taken_over(fake):
    theirs = fake.add_queued(f"projects/{PROJECT}/locations/{ZONE}", "rs-1",
                             {"tpu": {"nodeSpec": [{"parent": f"projects/{PROJECT}/locations/{ZONE}", "nodeId": "rs-1",
                                                    "node": {"acceleratorType": "v6e-16",
                                                             "runtimeVersion": "v2-alpha-tpuv6e"}}]}})
    kube = client(fake)
    with pytest.raises(CloudTpuError, match="already exists and was not made by"):
        kube.create(owner=OWNER, script=SCRIPT)
    assert kube.delete(owner=OWNER) == "not-owned"
    assert fake.queued[theirs["name"]] is theirs
    assert not [r for r in fake.requests if r[0] == "DELETE"]


def test_a_retried_create_adopts_its_own(fake):
    kube = client(fake)
    first = kube.create(owner=OWNER, script=SCRIPT)
    again = kube.create(owner=OWNER, script=SCRIPT)
    assert again.name == first.name and len(fake.queued) == 1


# Review of issue 41: what a careless or hostile caller types.
@pytest.mark.parametrize(("kwargs", "message"), [
    ({"ray_start_args": 'a "b'}, "ray_start_args 'a \"b' is invalid"),  # an unclosed quote: no traceback
    ({"head_address": "[[[:6379"}, "host:port"),
    ({"head_address": "10.0.0.2:99999"}, "host:port"),
    ({"head_address": "10.0.0.2:0"}, "host:port"),
])
def test_the_startup_script_refuses_malformed_arguments_with_their_name(kwargs, message):
    with pytest.raises(InvalidRequestError, match=re.escape(message)):
        cloud_tpu.startup_script(**{"head_address": "h:6379", **kwargs})


def test_the_startup_script_command_names_the_flag_of_an_unclosed_quote():
    from typer.testing import CliRunner

    from rayslice.cli import app

    result = CliRunner().invoke(app, ["cloud-tpu", "startup-script", "--head-address", "10.0.0.2:6379",
                                      "--ray-start-args", 'a "b'])
    assert result.exit_code == 1 and result.exception is None or isinstance(result.exception, SystemExit), \
        result.exception
    assert "--ray-start-args" in result.output and "Traceback" not in result.output


# --- issue 50: network, service account, one Python patch for head and hosts, the sweeper


def test_the_hosts_get_the_network_external_ips_and_service_account_asked_for(fake):
    """Through the raw v2 API a TPU VM gets no external IP, the `default` VPC and the default compute account
    unless the request says otherwise: the body says all of it (parsed strictly into tpu_v2.QueuedResource)."""
    client(fake, network="ml-vpc", subnetwork="projects/my-project/regions/us-east5/subnetworks/ml-us-east5",
           enable_external_ips=False, service_account="ray-tpu@my-project.iam.gserviceaccount.com",
           scopes=["https://www.googleapis.com/auth/cloud-platform"]).create(owner=OWNER, script=SCRIPT)
    [(_, _, _, body)] = [r for r in fake.requests if r[0] == "POST"]
    node = body["tpu"]["nodeSpec"][0]["node"]
    assert node["networkConfig"] == {"network": "ml-vpc",
                                     "subnetwork": "projects/my-project/regions/us-east5/subnetworks/ml-us-east5"}
    assert node["serviceAccount"] == {"email": "ray-tpu@my-project.iam.gserviceaccount.com",
                                      "scope": ["https://www.googleapis.com/auth/cloud-platform"]}


def test_by_default_the_hosts_get_an_external_ip_as_gcloud_gives(fake):
    client(fake).create(owner=OWNER, script=SCRIPT)
    [(_, _, _, body)] = [r for r in fake.requests if r[0] == "POST"]
    node = body["tpu"]["nodeSpec"][0]["node"]
    assert node["networkConfig"] == {"enableExternalIps": True} and "serviceAccount" not in node


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"network": "My_VPC"}, "network 'My_VPC' is invalid"),
    ({"subnetwork": "projects/p/regions/x/subnetworks/s; rm"}, "subnetwork"),
    ({"enable_external_ips": "no"}, "enable_external_ips 'no' is invalid"),
    ({"service_account": "ray-tpu"}, "service_account 'ray-tpu' is invalid: give the service account's e-mail"),
    ({"scopes": ["cloud-platform"]}, "scopes ('cloud-platform',) is invalid"),
    ({"scopes": []}, "scopes () is invalid"),
])
def test_bad_network_and_service_account_settings_are_refused(kwargs, message):
    with pytest.raises(InvalidRequestError, match=re.escape(message)):
        QueuedSlice(project=PROJECT, zone=ZONE, queued_resource_id="rs-1", tpu="v6e-16", **kwargs)


def test_the_head_and_the_hosts_get_one_python_patch_and_one_uv_release():
    """Ray refuses a node whose Python differs from the head's at patch level: both scripts make the same
    exact Python with the same uv release, and an exact patch can be given (a minor alone cannot pin one)."""
    def python_of(script: str) -> str:
        [made] = re.findall(r"uv venv --clear --python (\S+)", script)
        return made

    host, head = cloud_tpu.startup_script("10.0.0.2:6379"), cloud_tpu.head_startup_script()
    assert python_of(host) == python_of(head) == cloud_tpu.HOST_PYTHON
    assert re.fullmatch(r"3\.12\.\d+", cloud_tpu.HOST_PYTHON)
    assert re.findall(r"astral\.sh/uv/\S+", host) == re.findall(r"astral\.sh/uv/\S+", head) == \
        [f"astral.sh/uv/{cloud_tpu.UV_VERSION}/install.sh"]
    assert python_of(cloud_tpu.startup_script("10.0.0.2:6379", python_version="3.13.9")) == "3.13.9"


def test_the_head_script_installs_rayslice_from_the_wheel_and_starts_a_head_with_metrics(tmp_path):
    """A `launcher: installed` connection runs `python -m rayslice.cluster` on the head: the head gets the wheel."""
    wheel = f"gs://my-bucket/wheels/rayslice-{rayslice.__version__}-py3-none-any.whl"
    script = cloud_tpu.head_startup_script(wheel=wheel, token_secret="ray-token")
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0
    lines = script.splitlines()
    [install] = [line for line in lines if line.startswith("uv pip install")]
    local = f"/opt/rayslice/venv-wheels/rayslice-{rayslice.__version__}-py3-none-any.whl"
    assert f"rayslice[cluster,gcs] @ file://{local}" in shlex.split(install)
    assert not [w for w in shlex.split(install) if w.startswith("jax")]  # nothing computes on the head
    assert shlex.split(lines[-1]) == ["$venv/bin/ray", "start", "--head", "--port=6379", "--num-cpus=0",
                                      "--dashboard-host=0.0.0.0", "--metrics-export-port=8080"]
    with pytest.raises(InvalidRequestError, match="metrics_port 0 is invalid"):
        cloud_tpu.head_startup_script(metrics_port=0)


def _labelled(deployment: str | None, *, managed: bool = True) -> dict:
    labels = {"managed-by": "rayslice"} if managed else {}
    if deployment:
        labels["rayslice-deployment"] = cloud_tpu.owner_label(deployment)
    return {"tpu": {"nodeSpec": [{"parent": f"projects/{PROJECT}/locations/{ZONE}", "nodeId": "n",
                                  "node": {"acceleratorType": "v6e-16", "runtimeVersion": "v2-alpha-tpuv6e",
                                           "labels": labels}}]}}


def test_sweep_deletes_only_this_deployments_old_queued_resources(fake):
    """Orphans whose teardown never ran: this deployment's older than the limit go; its young ones, another
    deployment's, a hand-made one and an unlabelled rayslice one stay. Listing crosses pages (3 a page)."""
    import time as clock
    from datetime import UTC, datetime, timedelta

    parent = f"projects/{PROJECT}/locations/{ZONE}"
    old = (datetime.now(UTC) - timedelta(days=2)).strftime("%Y-%m-%dT%H:%M:%SZ")
    fake.add_queued(parent, "ours-old-1", _labelled("prod"), create_time=old)
    fake.add_queued(parent, "ours-old-2", _labelled("prod"), create_time=old)
    fake.add_queued(parent, "ours-young", _labelled("prod"))
    fake.add_queued(parent, "staging-old", _labelled("staging"), create_time=old)
    fake.add_queued(parent, "by-hand-old", _labelled(None, managed=False), create_time=old)
    fake.add_queued(parent, "unmarked-old", _labelled(None), create_time=old)
    listed = cloud_tpu.sweep(PROJECT, ZONE, deployment="prod", older_than_s=12 * 3600, api_endpoint=fake.url)
    assert {s.queued_resource_id: s.outcome for s in listed} == {
        "ours-old-1": "would delete", "ours-old-2": "would delete", "ours-young": "kept: too young"}
    assert not [r for r in fake.requests if r[0] == "DELETE"]  # listing deletes nothing
    swept = cloud_tpu.sweep(PROJECT, ZONE, deployment="prod", older_than_s=12 * 3600, delete=True,
                            api_endpoint=fake.url, now=clock.time())
    assert sorted(s.queued_resource_id for s in swept if s.outcome == "deleted") == ["ours-old-1", "ours-old-2"]
    assert sorted(n.rsplit("/", 1)[-1] for n in fake.queued) == ["by-hand-old", "ours-young", "staging-old",
                                                                   "unmarked-old"]
    deletes = [r for r in fake.requests if r[0] == "DELETE"]
    assert len(deletes) == 2 and all(r[2]["force"] == ["true"] for r in deletes)


def test_the_queued_resources_rayslice_creates_carry_the_deployment_label_sweep_looks_for(fake):
    client(fake).create(owner="prod/dag/run", script=SCRIPT, deployment="prod")
    [(_, _, _, body)] = [r for r in fake.requests if r[0] == "POST"]
    assert body["tpu"]["nodeSpec"][0]["node"]["labels"]["rayslice-deployment"] == cloud_tpu.owner_label("prod")
    [found] = cloud_tpu.sweep(PROJECT, ZONE, deployment="prod", older_than_s=0, api_endpoint=fake.url)
    assert found.queued_resource_id == "rs-1" and found.outcome == "would delete"


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"deployment": ""}, "deployment is required"),
    ({"older_than_s": -1}, "older_than -1 is invalid"),
    ({"zone": "east"}, "zone 'east' is invalid"),
])
def test_sweep_refuses_bad_arguments(kwargs, message):
    args = {"project": PROJECT, "zone": ZONE, "deployment": "prod", "older_than_s": 3600, **kwargs}
    with pytest.raises(InvalidRequestError, match=re.escape(message)):
        cloud_tpu.sweep(args.pop("project"), args.pop("zone"), **args)


def test_the_sweep_and_head_script_commands(fake):
    from datetime import UTC, datetime, timedelta

    from typer.testing import CliRunner

    from rayslice.cli import app

    old = (datetime.now(UTC) - timedelta(days=1)).strftime("%Y-%m-%dT%H:%M:%SZ")
    fake.add_queued(f"projects/{PROJECT}/locations/{ZONE}", "ours", _labelled("prod"), create_time=old)
    base = ["cloud-tpu", "sweep", "--project", PROJECT, "--zone", ZONE, "--deployment", "prod", "--api-endpoint",
            fake.url]
    listed = CliRunner().invoke(app, [*base, "--older-than", "12h"])
    assert listed.exit_code == 0, listed.output
    assert "ours" in listed.output and "would delete (add --delete): 1 of 1" in listed.output
    assert fake.queued
    swept = CliRunner().invoke(app, [*base, "--older-than", "12h", "--delete"])
    assert swept.exit_code == 0 and "deleted: 1 of 1" in swept.output and not fake.queued
    bad = CliRunner().invoke(app, [*base, "--older-than", "soon"])
    assert bad.exit_code == 1 and "--older-than 'soon' is invalid" in bad.output
    head = CliRunner().invoke(app, ["cloud-tpu", "head-script", "--token-secret", "ray-token",
                                    "--python-version", "3.12.16"])
    assert head.exit_code == 0 and head.output == cloud_tpu.head_startup_script(token_secret="ray-token")
    wrong = CliRunner().invoke(app, ["cloud-tpu", "startup-script", "--head-address", "h:6379", "--python-version",
                                     "3.11.9"])
    assert wrong.exit_code == 1 and "--python-version '3.11.9' is invalid" in wrong.output
def test_hosts_join_a_head_whose_python_differs_at_patch_level():
    """Ray 2.60 refuses a node whose Python differs from the head's at patch level unless
    RAY_DEFAULT_PYTHON_VERSION_MATCH_LEVEL=minor (ray._private.utils.check_version_info); uv picks a 3.12.x."""
    from rayslice.cloud.cloud_tpu import startup_script

    for install in (True, False):
        script = startup_script("10.0.0.2:6379", install=install)
        assert script.index("export RAY_DEFAULT_PYTHON_VERSION_MATCH_LEVEL=minor") < script.index(" start --address")
    pinned = startup_script("10.0.0.2:6379", python_version="3.12.12")  # or pin the head's exact patch
    assert "uv venv --clear --python 3.12.12" in pinned
    with pytest.raises(InvalidRequestError, match="python_version '3.11.9'"):
        startup_script("10.0.0.2:6379", python_version="3.11.9")


@pytest.mark.parametrize("make", [
    lambda venv: cloud_tpu.head_startup_script(venv=venv),
    lambda venv: cloud_tpu.startup_script("10.0.0.2:6379", venv=venv),
], ids=["head", "host"])
def test_rays_jobs_find_the_venvs_python_on_path(tmp_path, make):
    """Ray runs a job's entrypoint (`python -m rayslice.cluster ...`) through the shell with the PATH `ray start`
    had; a VM's startup script has the system PATH, where Debian 12 has no `python` at all. The venv's bin must
    come first, or every step on a TPU-VM head fails with `python: not found`."""
    stubs, log, venv = tmp_path / "bin", tmp_path / "calls", tmp_path / "venv"
    stubs.mkdir()
    (stubs / "uv").write_text(
        '#!/bin/bash\nif [ "$1" = venv ]; then mkdir -p "$5/bin"; touch "$5/bin/python"; chmod +x "$5/bin/python"\n'
        f'  printf \'#!/bin/bash\\necho "python=$(command -v python)" >> %s\\n\' {shlex.quote(str(log))} '
        '> "$5/bin/ray"; chmod +x "$5/bin/ray"; fi\n')
    (stubs / "uv").chmod(0o755)
    for tool in ("chmod", "mkdir", "touch", "printf"):
        if found := shutil.which(tool):
            (stubs / tool).symlink_to(found)
    system = tmp_path / "usr-bin"  # the image's own python (Debian 12: python3 only; here a decoy `python`)
    system.mkdir()
    (system / "python").write_text("#!/bin/bash\n")
    (system / "python").chmod(0o755)
    done = subprocess.run([shutil.which("bash"), "-c", make(str(venv))], text=True, capture_output=True,
                          env={"PATH": f"{stubs}:{system}", "HOME": str(tmp_path)})
    assert done.returncode == 0, done.stderr
    assert log.read_text().splitlines() == [f"python={venv}/bin/python"]


def test_a_multislice_ids_node_names_fit_the_api():
    """With num_slices > 1 the API names the nodes `<id>-0` .. `<id>-<n-1>` (MultisliceParams.node_id_prefix
    defaults to the queued resource's id); each is a resource id of at most 63 characters, so an id that fits
    alone but not with its suffix is refused up front, naming the longest node id."""
    QueuedSlice(project="my-project", zone="us-east5-b", queued_resource_id="a" * 63, tpu="v6e-16")
    QueuedSlice(project="my-project", zone="us-east5-b", queued_resource_id="a" * 61, tpu="v6e-16", num_slices=10)
    with pytest.raises(InvalidRequestError, match=re.escape(f"'{'a' * 62}-1' is 64 characters")):
        QueuedSlice(project="my-project", zone="us-east5-b", queued_resource_id="a" * 62, tpu="v6e-16", num_slices=2)
