"""The pods a RayCluster manifest asks for: the CLI's flags for them, and Kubernetes' own schemas.

Every manifest here validates against KubeRay's CRD (the reference files) and, pod template by pod
template, against Kubernetes' Pod schema (tests/kubernetes_schemas.py, offline and strict).
"""

from __future__ import annotations

import pytest
import yaml
from typer.testing import CliRunner

from rayslice.cloud import kuberay, kuberay_cli
from rayslice.cloud.kuberay_crds import KubeRayCrds
from rayslice.core.exceptions import InvalidRequestError
from tests.kubernetes_schemas import validate_manifest, validate_object

runner = CliRunner()
EVERY_FLAG = ["--tpu", "v6e-16", "--tpu", "v5litepod-8", "--gpu-nodes", "1", "--spot", "--label", "team=research",
              "--label", "cost-center=ml-42", "--service-account", "ray-ksa", "--node-selector",
              "example.com/pool=tpu", "--toleration", "example.com/dedicated=ml:NoSchedule",
              "--toleration", "example.com/gpu:NoExecute", "--priority-class", "training-high",
              "--image-pull-secret", "regcred", "--head-cpu", "4", "--head-memory", "16Gi",
              "--head-service-type", "LoadBalancer", "--internal-load-balancer",
              "--load-balancer-source-range", "10.8.0.0/16", "--checkpoint-root", "gs://bucket/ckpt",
              "--namespace", "ml", "--no-validate"]


@pytest.fixture(scope="module")
def crds(reference_crds) -> KubeRayCrds:
    return KubeRayCrds.from_files(reference_crds)


def manifest_from_cli(*args: str) -> dict:
    result = runner.invoke(kuberay_cli.app, ["manifest", *args])
    assert result.exit_code == 0, result.output
    return yaml.safe_load(result.stdout)


@pytest.mark.parametrize("args", [
    ["--tpu", "v6e-16", "--no-validate"],
    ["--tpu", "v6e-16", "--tpu", "v4-32", "--gpu-nodes", "2", "--no-validate"],
    ["--gpu-nodes", "1", "--no-auth", "--no-validate"],
    EVERY_FLAG,
    [*EVERY_FLAG, "--rayjob", "--entrypoint", "python -m train"],
], ids=["one-tpu", "mixed", "gpu-no-auth", "every-flag", "rayjob"])
def test_rendered_manifests_pass_kuberays_crd_and_kubernetes_pod_schema(args, crds):
    manifest = manifest_from_cli(*args)
    kuberay.validate(manifest, crds)
    assert validate_manifest(manifest) >= 2


def test_the_flags_reach_the_pods(crds):
    manifest = manifest_from_cli(*EVERY_FLAG)
    spec = manifest["spec"]
    head, workers = spec["headGroupSpec"], spec["workerGroupSpecs"]
    assert manifest["metadata"]["labels"] == {"team": "research", "cost-center": "ml-42"}
    for group in [head, *workers]:
        pod = group["template"]["spec"]
        assert pod["serviceAccountName"] == "ray-ksa" and pod["priorityClassName"] == "training-high"
        assert pod["imagePullSecrets"] == [{"name": "regcred"}]
        assert group["template"]["metadata"]["labels"]["team"] == "research"
    assert "nodeSelector" not in head["template"]["spec"] and "tolerations" not in head["template"]["spec"]
    for group in workers:
        pod = group["template"]["spec"]
        assert pod["nodeSelector"]["cloud.google.com/gke-spot"] == "true"
        assert pod["nodeSelector"]["example.com/pool"] == "tpu"
        assert {"key": "cloud.google.com/gke-spot", "operator": "Equal", "value": "true",
                "effect": "NoSchedule"} in pod["tolerations"]
        assert {"key": "example.com/gpu", "operator": "Exists", "effect": "NoExecute"} in pod["tolerations"]
    tpu = workers[0]["template"]["spec"]["nodeSelector"]
    assert tpu["cloud.google.com/gke-tpu-accelerator"] == "tpu-v6e-slice"  # the flags add, never replace
    assert head["template"]["spec"]["containers"][0]["resources"]["limits"] == {"cpu": "4", "memory": "16Gi"}
    assert head["serviceType"] == "LoadBalancer"
    assert head["headService"] == {"spec": {"loadBalancerSourceRanges": ["10.8.0.0/16"]}}
    assert spec["headServiceAnnotations"] == {"networking.gke.io/load-balancer-type": "Internal"}


def test_a_reservation_selects_its_nodes():
    manifest = manifest_from_cli("--tpu", "v6e-16", "--reservation", "my-v6e", "--no-validate")
    selector = manifest["spec"]["workerGroupSpecs"][0]["template"]["spec"]["nodeSelector"]
    assert selector["cloud.google.com/reservation-name"] == "my-v6e"
    assert selector["cloud.google.com/reservation-affinity"] == "specific"
    validate_manifest(manifest)


@pytest.mark.parametrize(("args", "message"), [
    (["--label", "team"], "--label 'team' is invalid: give KEY=VALUE"),
    (["--label", "team=a b"], "--label team=a b is not a Kubernetes label"),
    (["--toleration", "dedicated=ml"], "--toleration 'dedicated=ml' is invalid: give KEY[=VALUE]:EFFECT"),
    (["--toleration", "dedicated=ml:Sometimes"], "EFFECT one of NoSchedule, PreferNoSchedule, NoExecute"),
    (["--head-memory", "lots"], "--head-memory 'lots' is not a Kubernetes quantity"),
    (["--service-account", "Ray_KSA"], "--service-account 'Ray_KSA' is not a Kubernetes object name"),
    (["--internal-load-balancer"], "add --head-service-type LoadBalancer"),
    (["--head-service-type", "LoadBalancer", "--load-balancer-source-range", "10.0.0.0/33"],
     "--load-balancer-source-range '10.0.0.0/33' is not a CIDR"),
    ([], "give --tpu v6e-16 and/or --gpu-nodes 1"),
])
def test_bad_flags_fail_in_the_commands_words(args, message):
    tpu = [] if not args else ["--tpu", "v6e-16"]
    result = runner.invoke(kuberay_cli.app, ["manifest", *tpu, *args, "--no-validate"])
    assert result.exit_code == 1 and message in result.stderr, result.output
    assert "tpus=" not in result.stderr and "gpu_nodes=" not in result.stderr and result.stdout == ""


def test_pod_settings_apply_to_the_operators_clusters_too(crds):
    pods = kuberay.PodSettings(service_account="ray-ksa", labels={"team": "ml"})
    manifest = kuberay.render_raycluster("rs", tpus=["v6e-4"], pods=pods)
    kuberay.validate(manifest, crds)
    validate_manifest(manifest)
    with pytest.raises(InvalidRequestError, match="set head_service_type to LoadBalancer"):
        kuberay.render_raycluster("rs", tpus=["v6e-4"], pods=kuberay.PodSettings(internal_load_balancer=True))


def test_the_schema_check_catches_a_broken_pod():
    """The check is real: a misspelled field or a wrong type in a pod template fails."""
    manifest = kuberay.render_raycluster("rs", tpus=["v6e-4"])
    manifest["spec"]["headGroupSpec"]["template"]["spec"]["serviceAccount_name"] = "x"
    with pytest.raises(AssertionError, match="serviceAccount_name"):
        validate_manifest(manifest)
    with pytest.raises(AssertionError, match="containerPort"):
        validate_object({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"},
                         "spec": {"containers": [{"name": "c", "ports": [{"containerPort": "http"}]}]}})


# Review of issue 41: bad values give an error naming the flag the user typed, never an invalid object.
@pytest.mark.parametrize(("flags", "message"), [
    (["--namespace", "a.b"], "--namespace 'a.b'"),
    (["--namespace", "Bad_NS"], "--namespace 'Bad_NS'"),
    (["--gpu-nodes", "1", "--gpu-type", "bad value"], "--gpu-type 'bad value'"),
    (["--image", ""], "--image ''"),
    (["--image", "ray image"], "--image 'ray image'"),
    (["--head-service-type", "Foo"], "--head-service-type 'Foo'"),
    (["--reservation", "my res"], "--reservation 'my res'"),
    (["--name", "Bad"], "--name 'Bad'"),
])
def test_bad_values_name_their_flag(flags, message):
    result = runner.invoke(kuberay_cli.app, ["manifest", "--tpu", "v6e-16", "--no-validate", *flags])
    assert result.exit_code == 1, result.stdout
    assert message in result.stderr, result.stderr


@pytest.mark.parametrize("tpu", ["garbage", "v6e"])
def test_a_bad_tpu_speaks_of_the_tpu_flag_not_of_operator_arguments(tpu):
    """The manifest command has --tpu and no topology: its errors must not suggest tpu='v6e', topology='4x4'."""
    result = runner.invoke(kuberay_cli.app, ["manifest", "--tpu", tpu, "--no-validate"])
    assert result.exit_code == 1
    assert "--tpu" in result.stderr and "tpu=" not in result.stderr and "topology=" not in result.stderr, \
        result.stderr
