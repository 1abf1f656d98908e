"""rayslice.cloud.preflight (`rayslice doctor --kuberay-namespace` / `--project --zone`) against the HTTP fakes.

Each test breaks one thing the doctor checks on a control plane (an old KubeRay CRD, no TPU webhook,
an RBAC denial, the Cloud TPU API off, a zone without the type, a missing service account) and sees
the doctor name it and the fix, through the CLI as a user runs it.
"""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from rayslice.cli import app
from rayslice.cloud import cloud_tpu
from rayslice.cloud.preflight import cloud_tpu_checks, kuberay_checks
from tests.conftest import kuberay_release_crds
from tests.fake_cloud_tpu import FakeCloudTpu
from tests.fake_kubernetes import FakeKubernetes

runner = CliRunner()
PROJECT, ZONE = "my-project", "us-east5-b"
SA = "ray-tpu@my-project.iam.gserviceaccount.com"


def doctor(*args: str) -> tuple[int, str]:
    result = runner.invoke(app, ["doctor", "--no-cluster", *args])
    return result.exit_code, " ".join(result.output.split())


@pytest.fixture
def kube(tmp_path):
    with FakeKubernetes(crds=kuberay_release_crds("v1.7.0")) as server:
        server.kubeconfig = str(server.write_kubeconfig(tmp_path / "kc"))
        yield server


def by_name(checks) -> dict:
    return {c.name: c for c in checks}


def test_kuberay_passes_on_a_current_operator_with_webhook_and_rbac(kube):
    code, out = doctor("--kuberay-namespace", "ml", "--kubeconfig", kube.kubeconfig, "--kuberay-manage")
    assert code == 0, out
    assert "PASS kuberay crd: rayclusters.ray.io is KubeRay >= 1.6.0 (authOptions: enableK8sTokenAuth, mode, " \
           "secretName)" in out
    assert "PASS tpu webhook: mutating webhook kuberay-tpu-webhook" in out
    assert "PASS kuberay rbac: allowed: every lookup and manage call rayslice makes in ml (8 " in out
    reviews = [body for method, path, body in kube.requests if path.endswith("/selfsubjectaccessreviews")]
    assert {(r["spec"]["resourceAttributes"]["verb"], r["spec"]["resourceAttributes"]["resource"]) for r in reviews} \
        >= {("get", "rayclusters"), ("create", "rayclusters"), ("get", "customresourcedefinitions")}


def test_an_old_kuberay_crd_is_named_with_the_upgrade(tmp_path):
    with FakeKubernetes(crds=kuberay_release_crds("v1.5.1")) as old:
        code, out = doctor("--kuberay-namespace", "ml", "--kubeconfig",
                           str(old.write_kubeconfig(tmp_path / "kc")))
    assert code == 1
    assert "FAIL kuberay crd: rayclusters.ray.io is from a KubeRay older than 1.6.0 (authOptions: mode)" in out
    assert "fix: upgrade the operator: `helm upgrade --install kuberay-operator kuberay/kuberay-operator " \
           "--version 1.7.0`" in out


def test_kuberay_not_installed(kube):
    kube.installed_crds.pop("rayclusters.ray.io")
    checks = by_name(kuberay_checks(namespace="ml", kubeconfig=kube.kubeconfig))
    assert checks["kuberay crd"].status == "FAIL" and "not installed" in checks["kuberay crd"].detail
    assert "helm install kuberay-operator" in checks["kuberay crd"].fix


def test_no_tpu_webhook(kube):
    kube.mutating_webhooks = ["cert-manager-webhook"]
    code, out = doctor("--kuberay-namespace", "ml", "--kubeconfig", kube.kubeconfig)
    assert code == 1
    assert "FAIL tpu webhook: no TPU webhook among 1 mutating webhook configuration(s)" in out
    assert "ai-on-gke/kuberay-tpu-webhook" in out and "cert-manager" in out


def test_a_denied_ssar_names_the_verb_and_the_rbac_command(kube):
    kube.denied = {("get", "secrets")}
    code, out = doctor("--kuberay-namespace", "ml", "--kubeconfig", kube.kubeconfig)
    assert code == 1
    assert "FAIL kuberay rbac: denied: get secrets in ml (RBAC: no rule allows get secrets)" in out
    assert "fix: apply `rayslice kuberay rbac --namespace ml --lookup-only" in out
    kube.denied = {("create", "rayclusters")}  # lookups pass; the manage check finds it
    assert by_name(kuberay_checks(namespace="ml", kubeconfig=kube.kubeconfig))["kuberay rbac"].status == "PASS"
    manage = by_name(kuberay_checks(namespace="ml", kubeconfig=kube.kubeconfig, manage=True))["kuberay rbac"]
    assert manage.status == "FAIL" and "create rayclusters.ray.io in ml" in manage.detail


def test_wrong_kubernetes_credentials(kube, tmp_path):
    bad = str(kube.write_kubeconfig(tmp_path / "bad", token="wrong"))
    checks = by_name(kuberay_checks(namespace="ml", kubeconfig=bad))
    assert checks["kuberay crd"].status == "FAIL" and "credentials were refused" in checks["kuberay crd"].detail


@pytest.fixture
def tpu():
    cloud_tpu._zone_cache.clear()
    with FakeCloudTpu() as server:
        server.service_accounts = {SA: False}
        yield server


def tpu_doctor(tpu: FakeCloudTpu, *args: str) -> tuple[int, str]:
    return doctor("--project", PROJECT, "--zone", ZONE, "--tpu-api-endpoint", tpu.url, "--iam-endpoint", tpu.url,
                  *args)


def test_cloud_tpu_passes(tpu):
    code, out = tpu_doctor(tpu, "--tpu-type", "v6e-16", "--service-account", SA)
    assert code == 0, out
    assert "PASS cloud tpu api: tpu.googleapis.com answers for my-project (8 TPU type(s) in us-east5-b)" in out
    assert "PASS tpu type: us-east5-b offers v6e-16" in out
    assert f"PASS service account: {SA} exists and is enabled" in out


def test_cloud_tpu_api_disabled(tpu):
    tpu.api_disabled = True
    code, out = tpu_doctor(tpu, "--tpu-type", "v6e-16")
    assert code == 1
    assert "FAIL cloud tpu api: listing us-east5-b's TPU types in my-project: HTTP 403" in out
    assert "fix: `gcloud services enable tpu.googleapis.com --project my-project`" in out


def test_a_zone_without_the_type(tpu):
    code, out = tpu_doctor(tpu, "--tpu-type", "v6e-64")
    assert code == 1
    assert "FAIL tpu type: us-east5-b does not offer v6e-64 (it offers v6e-1, v6e-16, v6e-32, v6e-4, v6e-8)" in out
    assert "accelerator-types list" in out


def test_a_missing_or_disabled_service_account(tpu):
    checks = by_name(cloud_tpu_checks(project=PROJECT, zone=ZONE, service_account="nobody@my-project.iam."
                                      "gserviceaccount.com", api_endpoint=tpu.url, iam_endpoint=tpu.url))
    assert checks["service account"].status == "FAIL" and "does not exist" in checks["service account"].detail
    assert "gcloud iam service-accounts create nobody" in checks["service account"].fix
    tpu.service_accounts[SA] = True
    checks = by_name(cloud_tpu_checks(project=PROJECT, zone=ZONE, service_account=SA, api_endpoint=tpu.url,
                                      iam_endpoint=tpu.url))
    assert checks["service account"].status == "FAIL" and "is disabled" in checks["service account"].detail


def test_the_live_raycluster_ready_with_its_token_secret(kube):
    from rayslice.cloud import kuberay
    from rayslice.cloud.kuberay_client import ClusterRef, KubeRayClient

    manifest = kuberay.render_raycluster("rs", tpus=["v6e-16"], namespace="ml")
    checks = by_name(kuberay_checks(namespace="ml", kubeconfig=kube.kubeconfig, cluster="rs"))
    assert checks["raycluster ml/rs"].status == "FAIL" and "no such RayCluster" in checks["raycluster ml/rs"].detail
    kube.add_cluster(manifest, ready=False)
    with KubeRayClient(ClusterRef(name="rs", namespace="ml", kubeconfig=kube.kubeconfig)) as client:
        client.ensure_token_secret("rs-ray-token", owner="me")
    code, out = doctor("--kuberay-namespace", "ml", "--kubeconfig", kube.kubeconfig, "--kuberay-cluster", "rs")
    assert code == 1 and "FAIL raycluster ml/rs: not ready" in out and "kubectl describe raycluster -n ml rs" in out
    kube.ready_after_gets = 1  # the operator readies it at the next read
    code, out = doctor("--kuberay-namespace", "ml", "--kubeconfig", kube.kubeconfig, "--kuberay-cluster", "rs")
    assert code == 0, out
    assert "PASS raycluster ml/rs: ready, token auth from Secret rs-ray-token" in out


def test_a_raycluster_whose_secret_name_was_dropped_is_named(kube):
    """What KubeRay 1.5 with a non-strict client leaves: token mode, no secretName, a token nobody has."""
    from rayslice.cloud import kuberay

    manifest = kuberay.render_raycluster("rs", tpus=["v6e-16"], namespace="ml")
    del manifest["spec"]["authOptions"]["secretName"]
    kube.add_cluster(manifest)
    check = by_name(kuberay_checks(namespace="ml", kubeconfig=kube.kubeconfig, cluster="rs"))["raycluster ml/rs"]
    assert check.status == "FAIL" and "KubeRay made its own random token" in check.detail
    assert "upgrade KubeRay to >= 1.6.0" in check.fix


def _rendered_rules(*args: str) -> list[dict]:
    """The rules `rayslice kuberay rbac ARGS` renders, each with its Role's namespace (None: a ClusterRole's)."""
    import yaml

    from rayslice.cloud.kuberay_cli import app as kuberay_app

    result = runner.invoke(kuberay_app, ["rbac", "--service-account", "airflow-worker", *args])
    assert result.exit_code == 0, result.output
    return [{**rule, "namespace": obj["metadata"].get("namespace") if obj["kind"] == "Role" else None}
            for obj in yaml.safe_load_all(result.stdout) if obj["kind"] in ("Role", "ClusterRole")
            for rule in obj["rules"]]


def test_the_doctor_passes_as_the_identity_the_rendered_rbac_binds(kube):
    """deploying-gke.md step 8 runs the doctor in an Airflow worker pod under step 5's lookup-only RBAC (the token
    Secret by name), and step 10's manage RBAC reads the CRD by name: the doctor's reviews must ask what those
    rules grant (with the names), and the cluster-scoped reads lookup-only never grants (the CRD, the webhooks)
    are a warning to check them as an admin, not a failure."""
    import re

    from rayslice.cloud import kuberay
    from rayslice.cloud.kuberay_client import ClusterRef, KubeRayClient

    kube.add_cluster(kuberay.render_raycluster("rayslice", tpus=["v6e-16"], namespace="ml"))
    with KubeRayClient(ClusterRef(name="rayslice", namespace="ml", kubeconfig=kube.kubeconfig)) as client:
        client.ensure_token_secret("rayslice-ray-token", owner="me")
    kube.rbac_rules = _rendered_rules("--namespace", "ml", "--lookup-only", "--token-secret", "rayslice-ray-token")
    for path in ("customresourcedefinitions/", "mutatingwebhookconfigurations"):  # not the worker's to read
        kube.failures += [("GET", re.compile(path), 403)] * 3
    code, out = doctor("--kuberay-namespace", "ml", "--kubeconfig", kube.kubeconfig, "--kuberay-cluster", "rayslice")
    assert code == 0, out
    assert "PASS kuberay rbac" in out and "PASS raycluster ml/rayslice" in out
    assert "WARN kuberay crd" in out and "WARN tpu webhook" in out
    kube.failures.clear()
    kube.rbac_rules = _rendered_rules("--namespace", "ml", "--manage")
    checks = by_name(kuberay_checks(namespace="ml", kubeconfig=kube.kubeconfig, manage=True))
    assert checks["kuberay rbac"].status == "PASS", checks["kuberay rbac"]


def test_a_crd_this_identity_may_not_read_is_named_as_rbac_not_as_a_missing_kuberay(kube):
    """Seen failing first: a 403 on the CRD read gave "install KubeRay" (already installed) as the fix."""
    kube.fail_next("GET", r"/customresourcedefinitions/", 403)
    check = by_name(kuberay_checks(namespace="ml", kubeconfig=kube.kubeconfig, manage=True))["kuberay crd"]
    assert check.status == "FAIL" and "not allowed" in check.detail, check
    assert "get on customresourcedefinitions" in check.fix and "helm install" not in check.fix, check
    kube.fail_next("GET", r"/customresourcedefinitions/", 403)  # lookup-only: never granted, so checked as an admin
    check = by_name(kuberay_checks(namespace="ml", kubeconfig=kube.kubeconfig))["kuberay crd"]
    assert check.status == "WARN" and "helm install" not in check.fix, check
