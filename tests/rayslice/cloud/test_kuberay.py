"""KubeRay manifests: their shape (against KubeRay's own TPU sample) and validation against the real CRDs.

The CRDs and the sample are the reference files (`reference_crds`, tests/conftest.py): missing, these
tests fail under CI and skip elsewhere. The CLI reads CRDs from `--crd` files or, through the
Kubernetes API, from a cluster (the HTTP fake of tests/fake_kubernetes.py, serving the same files).
"""

from __future__ import annotations

import copy

import pytest
import yaml
from typer.testing import CliRunner

from rayslice.cloud import kuberay, kuberay_cli, kuberay_crds
from rayslice.cloud.kuberay_crds import CrdUnavailableError, KubeRayCrds
from rayslice.core.exceptions import InvalidRequestError
from tests.conftest import reference_file
from tests.fake_kubernetes import FakeKubernetes


@pytest.fixture(scope="module")
def crds(reference_crds) -> KubeRayCrds:
    return KubeRayCrds.from_files(reference_crds)


@pytest.fixture(scope="module")
def sample() -> dict:
    return yaml.safe_load(reference_file("kuberay-sample-tpu-v6e-16-multihost.yaml").read_text())


@pytest.fixture(autouse=True)
def no_default_kubeconfig(monkeypatch, tmp_path):
    """No test reads the machine's own ~/.kube/config: the CLI's cluster comes from --kubeconfig."""
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "no-kubeconfig"))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)


@pytest.fixture(scope="module")
def cluster() -> dict:
    return kuberay.render_raycluster("rayslice", tpus=["v6e-16"], max_slices=4, gpu_nodes=1)


def _group(manifest: dict, name: str) -> dict:
    groups = manifest["spec"]["workerGroupSpecs"]
    return next(g for g in groups if g["groupName"] == name)


def _rejected(manifest: dict, crds: KubeRayCrds) -> str:
    with pytest.raises(ValueError) as err:
        kuberay.validate(manifest, crds)
    assert isinstance(err.value, InvalidRequestError)
    return str(err.value)


def test_cluster_validates_against_the_raycluster_crd(cluster, crds):
    kuberay.validate(cluster, crds)
    assert cluster["apiVersion"] == "ray.io/v1" and cluster["kind"] == "RayCluster"
    assert [g["groupName"] for g in cluster["spec"]["workerGroupSpecs"]] == ["tpu-v6e-16", "gpu-nvidia-l4"]


def test_tpu_group_has_the_samples_shape(cluster, sample):
    ours, theirs = _group(cluster, "tpu-v6e-16"), sample["spec"]["workerGroupSpecs"][0]
    assert ours["numOfHosts"] == theirs["numOfHosts"] == 4
    assert (ours["minReplicas"], ours["maxReplicas"], ours["replicas"]) == (0, 4, 0)
    assert ours["template"]["spec"]["nodeSelector"] == theirs["template"]["spec"]["nodeSelector"] == {
        "cloud.google.com/gke-tpu-accelerator": "tpu-v6e-slice",
        "cloud.google.com/gke-tpu-topology": "4x4",
    }
    container = ours["template"]["spec"]["containers"][0]
    sample_container = theirs["template"]["spec"]["containers"][0]
    assert container["resources"] == sample_container["resources"]  # google.com/tpu "4", 24 CPU, 200G
    assert container["resources"]["limits"]["google.com/tpu"] == "4"
    assert container["env"] == sample_container["env"]
    assert container["ports"] == sample_container["ports"]
    assert ours["rayStartParams"] == {"resources": "'{\"TPU\": 4}'"}


def test_head_runs_nothing_and_autoscaler_v2_is_on(cluster):
    spec = cluster["spec"]
    head = spec["headGroupSpec"]
    assert head["rayStartParams"] == {"num-cpus": "0", "dashboard-host": "0.0.0.0"}
    container = head["template"]["spec"]["containers"][0]
    assert "google.com/tpu" not in container["resources"]["limits"]
    assert {"containerPort": 8265, "name": "dashboard"} in container["ports"]
    assert spec["enableInTreeAutoscaling"] is True
    assert spec["autoscalerOptions"] == {
        "version": "v2", "upscalingMode": "Default", "idleTimeoutSeconds": 60
    }
    # KubeRay rejects the env switch next to autoscalerOptions.version.
    assert "env" not in container
    assert spec["rayVersion"] == "2.60.0"


def test_gpu_group(cluster):
    group = _group(cluster, "gpu-nvidia-l4")
    assert (group["minReplicas"], group["maxReplicas"]) == (0, 1)
    assert "numOfHosts" not in group
    container = group["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert group["template"]["spec"]["nodeSelector"] == {"cloud.google.com/gke-accelerator": "nvidia-l4"}


def test_no_gpu_group_without_gpu_nodes():
    manifest = kuberay.render_raycluster("rs", tpus=["v6e-16"])
    assert [g["groupName"] for g in manifest["spec"]["workerGroupSpecs"]] == ["tpu-v6e-16"]
    assert _group(manifest, "tpu-v6e-16")["maxReplicas"] == 1
    assert kuberay.render_raycluster("rs", tpus="v6e-16") == manifest  # one type as a bare string


def test_one_group_per_tpu_type(crds):
    manifest = kuberay.render_raycluster("rs", tpus=["v6e-16", "v6e-4", "v5e-16", "v4-8"], max_slices=2)
    kuberay.validate(manifest, crds)
    groups = manifest["spec"]["workerGroupSpecs"]
    assert [g["groupName"] for g in groups] == ["tpu-v6e-16", "tpu-v6e-4", "tpu-v5litepod-16", "tpu-v4-8"]
    assert [g["numOfHosts"] for g in groups] == [4, 1, 4, 1]
    assert all(g["maxReplicas"] == 2 for g in groups)


@pytest.mark.parametrize(
    ("tpu", "accelerator", "topology", "chips", "hosts"),
    [
        ("v5litepod-8", "tpu-v5-lite-podslice", "2x4", "8", 1),
        ("v4-32", "tpu-v4-podslice", "2x2x4", "4", 4),
        ("v5p-16", "tpu-v5p-slice", "2x2x2", "4", 2),
        ("v6e-8", "tpu-v6e-slice", "2x4", "8", 1),
        ("v7x-16", "tpu7x", "2x2x2", "4", 2),
    ],
)
def test_gke_selectors_and_chip_counts(tpu, accelerator, topology, chips, hosts, crds):
    manifest = kuberay.render_raycluster("rs", tpus=[tpu])
    kuberay.validate(manifest, crds)
    group = manifest["spec"]["workerGroupSpecs"][0]
    assert group["template"]["spec"]["nodeSelector"] == {
        "cloud.google.com/gke-tpu-accelerator": accelerator,
        "cloud.google.com/gke-tpu-topology": topology,
    }
    resources = group["template"]["spec"]["containers"][0]["resources"]
    assert resources["limits"]["google.com/tpu"] == resources["requests"]["google.com/tpu"] == chips
    assert group["numOfHosts"] == hosts
    assert group["rayStartParams"]["resources"] == f"'{{\"TPU\": {chips}}}'"


def test_v5e_hosts_ask_for_less_memory_than_they_have():
    group = kuberay.render_raycluster("rs", tpus=["v5litepod-4"])["spec"]["workerGroupSpecs"][0]
    limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert limits["memory"] == "160G"  # the host has 192 GB


def test_rayjob_validates_against_the_rayjob_crd(cluster, crds):
    job = kuberay.render_rayjob("train", entrypoint="python train.py", cluster=cluster)
    kuberay.validate(job, crds)
    assert job["kind"] == "RayJob" and job["apiVersion"] == "ray.io/v1"
    assert job["spec"]["entrypoint"] == "python train.py"
    assert job["spec"]["shutdownAfterJobFinishes"] is True
    assert job["spec"]["ttlSecondsAfterFinished"] == 60
    assert job["spec"]["rayClusterSpec"] == cluster["spec"]
    assert job["spec"]["rayClusterSpec"] is not cluster["spec"]


def test_rayjob_takes_a_bare_spec_and_drops_the_ttl_when_the_cluster_stays(cluster, crds):
    job = kuberay.render_rayjob(
        "train", entrypoint="python t.py", cluster=cluster["spec"], shutdown_after_job_finishes=False
    )
    kuberay.validate(job, crds)
    assert "ttlSecondsAfterFinished" not in job["spec"]  # KubeRay rejects a TTL without shutdown


def test_rayjob_keeps_the_clusters_namespace():
    cluster = kuberay.render_raycluster("rs", tpus=["v6e-4"], namespace="ml")
    assert cluster["metadata"] == {"name": "rs", "namespace": "ml"}
    assert kuberay.render_rayjob("j", entrypoint="x", cluster=cluster)["metadata"]["namespace"] == "ml"


def test_the_kuberay_sample_passes(sample, crds):
    kuberay.validate(sample, crds)


@pytest.mark.parametrize(
    ("path", "value", "where"),
    [
        (("workerGroupSpecs", 0, "numOfHosts"), "four", "$.spec.workerGroupSpecs[0].numOfHosts"),
        (("workerGroupSpecs", 0, "maxReplicas"), 2.5, "$.spec.workerGroupSpecs[0].maxReplicas"),
        (("headGroupSpec", "rayStartParams", "block"), True, "$.spec.headGroupSpec.rayStartParams.block"),
        (("autoscalerOptions", "version"), "v3", "$.spec.autoscalerOptions.version"),
        (("workerGroupSpecs", 0, "numOfHost"), 4, "$.spec.workerGroupSpecs[0]"),  # a typo: unknown field
    ],
)
def test_broken_manifests_are_rejected_with_their_path(cluster, path, value, where, crds):
    broken = copy.deepcopy(cluster)
    node = broken["spec"]
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    message = _rejected(broken, crds)
    assert where in message


def test_missing_required_fields_are_rejected(cluster, crds):
    broken = copy.deepcopy(cluster)
    del broken["spec"]["workerGroupSpecs"][0]["template"]
    assert "'template' is a required property" in _rejected(broken, crds)
    broken = copy.deepcopy(cluster)
    del broken["spec"]["headGroupSpec"]
    assert "'headGroupSpec' is a required property" in _rejected(broken, crds)


def test_quantities_are_int_or_string(cluster, crds):
    """x-kubernetes-int-or-string: both forms pass, anything else and bad strings fail."""
    manifest = copy.deepcopy(cluster)
    limits = manifest["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
    limits["cpu"] = 8
    kuberay.validate(manifest, crds)
    limits["cpu"] = "lots"
    assert "resources.limits.cpu" in _rejected(manifest, crds)
    limits["cpu"] = [8]
    assert "resources.limits.cpu" in _rejected(manifest, crds)


def test_int_or_string_without_a_type_and_nullable_are_understood():
    import jsonschema

    schema = kuberay_crds._to_json_schema({
        "type": "object",
        "properties": {
            "port": {"x-kubernetes-int-or-string": True},
            "when": {"type": "string", "nullable": True},
        },
    })
    validator = jsonschema.Draft4Validator(schema)
    for ok in ({"port": 80}, {"port": "http"}, {"when": None}, {"when": "now"}):
        assert not list(validator.iter_errors(ok)), ok
    for bad in ({"port": [80]}, {"port": None}, {"when": 3}, {"other": 1}):
        assert list(validator.iter_errors(bad)), bad


def test_kubray_operator_rules_are_checked(cluster, crds):
    both = copy.deepcopy(cluster)
    head = both["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    head["env"] = [{"name": "RAY_enable_autoscaler_v2", "value": "1"}]
    assert "RAY_enable_autoscaler_v2" in _rejected(both, crds)
    long_name = copy.deepcopy(cluster)
    long_name["metadata"]["name"] = "x" * 54
    assert "at most 53" in _rejected(long_name, crds)
    upside_down = copy.deepcopy(cluster)
    upside_down["spec"]["workerGroupSpecs"][0]["minReplicas"] = 5
    assert "minReplicas > maxReplicas" in _rejected(upside_down, crds)


def test_not_a_kuberay_manifest(cluster, crds):
    assert "not a KubeRay manifest" in _rejected({**cluster, "apiVersion": "apps/v1"}, crds)
    assert "not a served RayCluster version" in _rejected({**cluster, "apiVersion": "ray.io/v2"}, crds)


def test_crds_from_files_and_folders(tmp_path, cluster, reference_crds):
    folder = tmp_path / "crds"
    folder.mkdir()
    (folder / "ray.io_rayclusters.yaml").symlink_to(reference_crds[0])
    (folder / "README.md").write_text("not a CRD")
    only_clusters = KubeRayCrds.from_files([folder])
    assert kuberay.validate(cluster, only_clusters) == \
        f"the RayCluster CRD (ray.io/v1) from {folder / 'ray.io_rayclusters.yaml'}"
    job = kuberay.render_rayjob("j", entrypoint="x", cluster=cluster)
    with pytest.raises(CrdUnavailableError, match="no RayJob CRD in .* add KubeRay's rayjobs.ray.io file"):
        kuberay.validate(job, only_clusters)
    assert "rayjobs.yaml" in kuberay.validate(job, KubeRayCrds.from_files(reference_crds))
    with pytest.raises(CrdUnavailableError, match="no CRD file or folder at .*nowhere"):
        KubeRayCrds.from_files([tmp_path / "nowhere"])
    with pytest.raises(CrdUnavailableError, match="no ray.io CustomResourceDefinition in .*README.md"):
        KubeRayCrds.from_files([folder / "README.md"])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"tpus": ["v9-8"]}, "unknown TPU version"),
        ({"tpus": ["v6e-12"]}, "not a v6e slice"),
        ({"tpus": ["v3-32"]}, "no GKE node pools"),
        ({"tpus": ["v6e-16"], "max_slices": 0}, "max_slices=0"),
        ({"tpus": ["v6e-16"], "gpu_nodes": -1}, "gpu_nodes=-1"),
        ({"tpus": ["v6e-16"], "idle_timeout_seconds": -5}, "idle_timeout_seconds=-5"),
        ({"tpus": ["v6e-16", "v6e-16"]}, "listed twice"),
        ({"tpus": ["v5e-8", "v5litepod-8"]}, "listed twice"),
        ({"tpus": []}, "can run nothing"),
    ],
)
def test_invalid_requests(kwargs, message):
    with pytest.raises(InvalidRequestError, match=message):
        kuberay.render_raycluster("rs", **kwargs)


@pytest.mark.parametrize("name", ["", "Ray", "9lives", "a_b", "end-", "x" * 54])
def test_invalid_names(name):
    with pytest.raises(InvalidRequestError, match="DNS-1035"):
        kuberay.render_raycluster(name, tpus=["v6e-16"])


def test_invalid_rayjob_inputs(cluster):
    with pytest.raises(InvalidRequestError, match="at most 47"):
        kuberay.render_rayjob("j" * 48, entrypoint="x", cluster=cluster)
    with pytest.raises(InvalidRequestError, match="entrypoint"):
        kuberay.render_rayjob("j", entrypoint=" ", cluster=cluster)
    with pytest.raises(InvalidRequestError, match="ttl"):
        kuberay.render_rayjob("j", entrypoint="x", cluster=cluster, ttl_seconds_after_finished=-1)


def test_gpu_only_cluster(crds):
    manifest = kuberay.render_raycluster("rs", tpus=[], gpu_nodes=2, gpu_type="nvidia-tesla-t4")
    kuberay.validate(manifest, crds)
    (group,) = manifest["spec"]["workerGroupSpecs"]
    assert group["groupName"] == "gpu-nvidia-tesla-t4" and group["maxReplicas"] == 2


# --- the `rayslice kuberay` CLI ---

runner = CliRunner()


def test_cli_prints_yaml_that_round_trips_and_validates(crds):
    args = ["manifest", "--tpu", "v6e-16", "--max-slices", "4", "--gpu-nodes", "1"]
    result = runner.invoke(kuberay_cli.app, args)
    assert result.exit_code == 0, result.output
    manifest = yaml.safe_load(result.stdout)
    kuberay.validate(manifest, crds)
    assert manifest == kuberay.render_raycluster("rayslice", tpus=["v6e-16"], max_slices=4, gpu_nodes=1)


def test_cli_several_tpus_and_a_rayjob(crds):
    args = ["manifest", "--tpu", "v6e-16", "--tpu", "v4-32", "--name", "nightly", "--rayjob",
            "--entrypoint", "python -m train", "--namespace", "ml", "--idle-timeout", "120"]
    result = runner.invoke(kuberay_cli.app, args)
    assert result.exit_code == 0, result.output
    job = yaml.safe_load(result.stdout)
    kuberay.validate(job, crds)
    assert job["kind"] == "RayJob" and job["metadata"] == {"name": "nightly", "namespace": "ml"}
    assert job["spec"]["entrypoint"] == "python -m train"
    spec = job["spec"]["rayClusterSpec"]
    assert [g["groupName"] for g in spec["workerGroupSpecs"]] == ["tpu-v6e-16", "tpu-v4-32"]
    assert spec["autoscalerOptions"]["idleTimeoutSeconds"] == 120


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--tpu", "v6e-16", "--rayjob"], "--rayjob needs --entrypoint"),
        (["--tpu", "v6e-17"], "not a v6e slice"),
    ],
)
def test_cli_errors_go_to_stderr(args, message):
    result = runner.invoke(kuberay_cli.app, ["manifest", *args])
    assert result.exit_code == 1
    assert message in result.stderr
    assert result.stdout == ""


def test_cli_without_a_crd_or_a_cluster_prints_it_and_says_it_is_not_validated():
    result = runner.invoke(kuberay_cli.app, ["manifest", "--tpu", "v6e-16", "--max-slices", "2"])
    assert result.exit_code == 0, result.output
    assert yaml.safe_load(result.stdout) == kuberay.render_raycluster("rayslice", tpus=["v6e-16"], max_slices=2)
    assert "NOT validated against a KubeRay CRD: no Kubernetes cluster to read the CRDs from" in result.stderr
    assert "pass --crd" in result.stderr and "--kubeconfig" in result.stderr  # how to validate
    strict = runner.invoke(kuberay_cli.app, ["manifest", "--tpu", "v6e-16", "--validate"])
    assert strict.exit_code == 1 and strict.stdout == ""
    assert "error: no Kubernetes cluster" in strict.stderr
    skipped = runner.invoke(kuberay_cli.app, ["manifest", "--tpu", "v6e-16", "--no-validate"])
    assert skipped.exit_code == 0 and yaml.safe_load(skipped.stdout)["kind"] == "RayCluster"
    assert "not validated against a KubeRay CRD (--no-validate)" in skipped.stderr


def test_cli_validates_against_a_crd_file(reference_crds):
    result = runner.invoke(kuberay_cli.app, ["manifest", "--tpu", "v6e-16", "--crd", str(reference_crds[0])])
    assert result.exit_code == 0, result.output
    assert yaml.safe_load(result.stdout)["kind"] == "RayCluster"
    assert f"validated against the RayCluster CRD (ray.io/v1) from {reference_crds[0]}" in result.stderr
    folder = str(reference_crds[1].parent)
    job = runner.invoke(kuberay_cli.app, ["manifest", "--tpu", "v6e-4", "--rayjob", "--entrypoint", "x",
                                          "--crd", folder])
    assert job.exit_code == 0, job.output
    assert f"validated against the RayJob CRD (ray.io/v1) from {reference_crds[1]}" in job.stderr


def test_cli_rejects_what_the_named_crd_rejects(tmp_path, reference_crds):
    """A CRD file that caps maxReplicas at 1 (an older or stricter KubeRay): the manifest fails against it."""
    # libyaml's loader and dumper, as the product's (kuberay_crds._load_file): pure-Python YAML takes seconds on ~1 MB.
    crd = yaml.load(reference_crds[0].read_text(), Loader=yaml.CSafeLoader)
    group = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"][
        "workerGroupSpecs"]["items"]["properties"]["maxReplicas"]
    group["maximum"] = 1
    strict = tmp_path / "strict.yaml"
    strict.write_text(yaml.dump(crd, Dumper=yaml.CSafeDumper))
    result = runner.invoke(kuberay_cli.app, ["manifest", "--tpu", "v6e-16", "--max-slices", "2", "--crd", str(strict)])
    assert result.exit_code == 1 and result.stdout == ""
    assert "workerGroupSpecs[0].maxReplicas" in result.stderr and str(strict) in result.stderr
    missing = runner.invoke(kuberay_cli.app, ["manifest", "--tpu", "v6e-4", "--rayjob", "--entrypoint", "x",
                                          "--crd", str(reference_crds[0])])
    assert missing.exit_code == 1 and "error: no RayJob CRD in" in missing.stderr


def test_cli_validates_against_the_clusters_crd(tmp_path, reference_crds):
    """With a kubeconfig, the CRD is the one installed in that cluster, read through the Kubernetes API."""
    with FakeKubernetes(crds=reference_crds) as server:
        kubeconfig = str(server.write_kubeconfig(tmp_path / "kubeconfig"))
        result = runner.invoke(kuberay_cli.app, ["manifest", "--tpu", "v6e-16", "--kubeconfig", kubeconfig])
        assert result.exit_code == 0, result.output
        assert ("validated against the RayCluster CRD (ray.io/v1) from rayclusters.ray.io in the cluster at "
                f"{server.url}") in result.stderr
        assert ("GET", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/rayclusters.ray.io", None) \
            in server.requests
        # The default kubeconfig ($KUBECONFIG) is used the same way.
        with pytest.MonkeyPatch.context() as env:
            env.setenv("KUBECONFIG", kubeconfig)
            assert "in the cluster at" in runner.invoke(kuberay_cli.app, ["manifest", "--tpu", "v6e-4"]).stderr
        # The cluster's schema decides: one that caps maxReplicas rejects two slices.
        crd = copy.deepcopy(server.installed_crds["rayclusters.ray.io"])
        crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"][
            "workerGroupSpecs"]["items"]["properties"]["maxReplicas"]["maximum"] = 1
        server.installed_crds["rayclusters.ray.io"] = crd
        capped = runner.invoke(kuberay_cli.app, ["manifest", "--tpu", "v6e-16", "--max-slices", "2",
                                             "--kubeconfig", kubeconfig])
        assert capped.exit_code == 1 and "maxReplicas" in capped.stderr and server.url in capped.stderr


def test_cli_cluster_without_kuberay_or_unreachable(tmp_path, reference_crds):
    with FakeKubernetes(crds=reference_crds) as server:
        kubeconfig = str(server.write_kubeconfig(tmp_path / "kubeconfig"))
        server.installed_crds.clear()
        named = runner.invoke(kuberay_cli.app, ["manifest", "--tpu", "v6e-16", "--kubeconfig", kubeconfig])
        assert named.exit_code == 1  # a cluster the user named and that cannot validate is an error
        assert "rayclusters.ray.io" in named.stderr and "install the KubeRay operator" in named.stderr
        with pytest.MonkeyPatch.context() as env:  # the default kubeconfig: printed, and said why not validated
            env.setenv("KUBECONFIG", kubeconfig)
            default = runner.invoke(kuberay_cli.app, ["manifest", "--tpu", "v6e-16"])
        assert default.exit_code == 0 and yaml.safe_load(default.stdout)["kind"] == "RayCluster"
        assert "NOT validated against a KubeRay CRD" in default.stderr
        assert "install the KubeRay operator" in default.stderr
        url = server.url
    gone = runner.invoke(kuberay_cli.app, ["manifest", "--tpu", "v6e-16", "--kubeconfig", kubeconfig])
    assert gone.exit_code == 1 and f"could not read the CRD rayclusters.ray.io from the Kubernetes API at {url}" \
        in gone.stderr


def test_token_auth_is_on_by_default_and_validates(cluster, crds):
    assert cluster["spec"]["authOptions"] == {"mode": "token", "secretName": "rayslice-ray-token"}
    assert cluster["spec"]["headGroupSpec"]["serviceType"] == "ClusterIP"
    kuberay.validate(cluster, crds)
    job = kuberay.render_rayjob("train", entrypoint="python t.py", cluster=cluster)
    assert job["spec"]["rayClusterSpec"]["authOptions"]["mode"] == "token"
    kuberay.validate(job, crds)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"head_service_type": "LoadBalancer", "auth": False}, "without Ray token auth would let anyone"),
        ({"head_service_type": "NodePort", "auth": False}, "without Ray token auth would let anyone"),
        ({"head_service_type": "Ingress"}, "use ClusterIP, NodePort or LoadBalancer"),
        ({"token_secret": "Not_A_Name"}, "is not a Kubernetes Secret name"),
        ({"token_secret": "x", "auth": False}, "needs auth on"),
        ({"image": "rayproject/ray:2.50.1-py311"}, "token auth needs Ray 2.52 or newer"),
    ],
)
def test_insecure_or_impossible_exposure_is_refused(kwargs, message):
    with pytest.raises(InvalidRequestError, match=message):
        kuberay.render_raycluster("rs", tpus=["v6e-4"], **kwargs)


def test_cli_never_prints_an_open_external_head(crds):
    runner = CliRunner()
    from rayslice.cli import app

    refused = runner.invoke(app, ["kuberay", "manifest", "--tpu", "v6e-16", "--no-auth",
                                  "--head-service-type", "LoadBalancer", "--no-validate"])
    assert refused.exit_code == 1 and refused.stdout == ""
    assert "without Ray token auth" in refused.stderr and "Traceback" not in refused.output
    exposed = runner.invoke(app, ["kuberay", "manifest", "--tpu", "v6e-16", "--head-service-type", "LoadBalancer",
                                  "--no-validate"])
    assert exposed.exit_code == 0
    spec = yaml.safe_load(exposed.stdout)["spec"]
    assert spec["authOptions"]["mode"] == "token" and spec["headGroupSpec"]["serviceType"] == "LoadBalancer"
    assert "warning: the head Service is LoadBalancer" in exposed.stderr
    assert "kubectl create secret generic rayslice-ray-token" in exposed.stderr
    unauthenticated = runner.invoke(app, ["kuberay", "manifest", "--tpu", "v6e-16", "--no-auth", "--no-validate"])
    assert unauthenticated.exit_code == 0 and "authOptions" not in yaml.safe_load(unauthenticated.stdout)["spec"]
    assert "warning: Ray token auth is off" in unauthenticated.stderr


def test_cli_help_lists_manifest():
    result = runner.invoke(kuberay_cli.app, ["--help"])
    assert result.exit_code == 0 and "manifest" in result.stdout


def test_a_checkpoint_root_reaches_every_pod_and_still_validates(crds):
    manifest = kuberay.render_raycluster("rs", tpus=["v6e-16"], gpu_nodes=1, checkpoint_root="gs://bucket/ckpt")
    kuberay.validate(manifest, crds)
    templates = [manifest["spec"]["headGroupSpec"]["template"],
                 *(g["template"] for g in manifest["spec"]["workerGroupSpecs"])]
    for template in templates:
        [container] = template["spec"]["containers"]
        assert {"name": "RAYSLICE_CHECKPOINT_ROOT", "value": "gs://bucket/ckpt"} in container["env"]
    with pytest.raises(InvalidRequestError, match="must be a URL every pod reaches"):
        kuberay.render_raycluster("rs", tpus=["v6e-16"], checkpoint_root="/local/only")


def test_missing_reference_files_fail_under_ci_and_skip_elsewhere(monkeypatch):
    """So a green CI run means the CRD tests ran: `CI=true` turns the skip into a failure."""
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="reference file .*not-there.yaml is missing"):
        reference_file("not-there.yaml")
    monkeypatch.delenv("CI")
    with pytest.raises(pytest.skip.Exception, match="not-there.yaml is missing"):
        reference_file("not-there.yaml")


# --- the pods' images: docker/'s recipes by default

def _images(manifest: dict) -> dict[str, str]:
    spec = manifest["spec"]
    groups = {"head": spec["headGroupSpec"]} | {g["groupName"]: g for g in spec["workerGroupSpecs"]}
    return {name: g["template"]["spec"]["containers"][0]["image"] for name, g in groups.items()}


def test_pods_run_the_recipes_images_by_default(cluster):
    assert _images(cluster) == {"head": "rayslice-cluster:0.1.0-tpu", "tpu-v6e-16": "rayslice-cluster:0.1.0-tpu",
                                "gpu-nvidia-l4": "rayslice-cluster:0.1.0-gpu"}
    assert cluster["spec"]["rayVersion"] == "2.60.0"  # what the recipes install


def test_pushed_images_are_used_and_their_ray_version_read_from_ray_tags_only(crds):
    pushed = kuberay.render_raycluster("rs", tpus=["v6e-4"], gpu_nodes=1, image="gcr.io/p/rayslice-cluster:0.1.0-tpu",
                                       gpu_image="gcr.io/p/rayslice-cluster:0.1.0-gpu")
    kuberay.validate(pushed, crds)
    assert _images(pushed) == {"head": "gcr.io/p/rayslice-cluster:0.1.0-tpu",
                               "tpu-v6e-4": "gcr.io/p/rayslice-cluster:0.1.0-tpu",
                               "gpu-nvidia-l4": "gcr.io/p/rayslice-cluster:0.1.0-gpu"}
    # Its tag's 0.1.0 is rayslice's version, not Ray's: no "token auth needs Ray 2.52" refusal.
    assert pushed["spec"]["rayVersion"] == "2.60.0"
    mirror = kuberay.render_raycluster("rs", tpus=["v6e-4"], image="mirror.example/rayproject/ray:2.58.1-py312")
    assert mirror["spec"]["rayVersion"] == "2.58.1"


def test_cli_says_the_default_images_must_be_built_and_pushed():
    default = runner.invoke(kuberay_cli.app, ["manifest", "--tpu", "v6e-16", "--gpu-nodes", "1", "--no-validate"])
    assert default.exit_code == 0, default.output
    assert ("the pods run rayslice-cluster:0.1.0-tpu and rayslice-cluster:0.1.0-gpu, the image(s) "
            "docker/Dockerfile.tpu and docker/Dockerfile.gpu build") in default.stderr
    assert "pass that name with --image / --gpu-image" in default.stderr
    pushed = runner.invoke(kuberay_cli.app, ["manifest", "--tpu", "v6e-16", "--no-validate",
                                         "--image", "gcr.io/p/rayslice-cluster:0.1.0-tpu"])
    assert pushed.exit_code == 0, pushed.output
    assert "docker/Dockerfile" not in pushed.stderr  # no GPU group: its default image is not named
    assert yaml.safe_load(pushed.stdout)["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["image"] == (
        "gcr.io/p/rayslice-cluster:0.1.0-tpu")
