"""`rayslice kuberay rbac`: the rules are complete for every Kubernetes API call rayslice makes, and no wider.

Every public method of the KubeRay client (which the hook, the operators and their triggers go through)
runs against the HTTP fake of the API server; each request it sent is then authorized against the
rendered Role and ClusterRole the way the API server's RBAC authorizer does (verb, API group,
resource, resource name, namespace). A new client method fails `test_every_client_call_is_exercised`
until it is added here, so a new API call cannot ship without its rule.
"""

from __future__ import annotations

import inspect
import re

import pytest
import yaml
from typer.testing import CliRunner

from rayslice.cloud import kuberay, kuberay_cli
from rayslice.cloud.kuberay_client import ClusterRef, KubeRayClient, resolve
from rayslice.cloud.kuberay_rbac import render_rbac
from rayslice.core.exceptions import InvalidRequestError
from tests.fake_kubernetes import FakeKubernetes
from tests.kubernetes_schemas import validate_object

OWNER = "nightly/manual__2026-01-01T00:00:00+00:00"
_PATH = re.compile(r"^/(?:api/v1|apis/(?P<group>[^/]+)/[^/]+)(?:/namespaces/(?P<ns>[^/]+))?/(?P<resource>[^/]+)"
                   r"(?:/(?P<name>[^/]+))?$")
_VERBS = {"POST": "create", "DELETE": "delete", "PUT": "update", "PATCH": "patch"}


def request_attributes(method: str, path: str) -> tuple[str, str, str, str | None, str | None]:
    """(verb, API group, resource, namespace, name) of a request, as the API server's authorizer sees it."""
    m = _PATH.match(path)
    assert m, f"not a resource path: {path}"
    verb = _VERBS.get(method) or ("get" if m["name"] else "list")
    return verb, m["group"] or "", m["resource"], m["ns"], m["name"]


def allowed(objects: list[dict], verb: str, group: str, resource: str, namespace: str | None,
            name: str | None) -> bool:
    """Whether a Role in ``namespace`` or a ClusterRole grants the request (the bindings are checked separately)."""
    for obj in objects:
        scoped = obj["kind"] == "Role" and obj["metadata"]["namespace"] == namespace
        if not (scoped or obj["kind"] == "ClusterRole"):
            continue
        for rule in obj["rules"]:
            if (group in rule["apiGroups"] and resource in rule["resources"] and verb in rule["verbs"]
                    and (not rule.get("resourceNames") or name in rule["resourceNames"])):
                return True
    return False


@pytest.fixture
def fake(reference_crds):
    with FakeKubernetes(crds=reference_crds) as server:
        yield server


def every_call(kube: KubeRayClient) -> set[str]:
    """Run every public method of the client, as the create/delete operators and the hook do; the names run."""
    manifest = kuberay.render_raycluster("ignored", tpus=["v6e-16"])
    ran = {"check", "create", "ensure_token_secret", "wait_ready", "ready_url", "get", "dashboard_url",
           "read_token", "delete", "wait_gone", "delete_token_secret", "close"}
    kube.check(manifest)
    assert kube.ensure_token_secret("rs-ray-token", owner=OWNER)
    kube.create(manifest, owner=OWNER)
    kube.wait_ready(timeout=30, poll_interval=0.01)
    kube.ready_url()
    kube.get()
    kube.dashboard_url()
    kube.read_token("rs-ray-token")
    assert kube.delete(owner=OWNER) == "deleted"
    kube.wait_gone(timeout=30, poll_interval=0.01)
    assert kube.delete_token_secret("rs-ray-token", owner=OWNER) == "deleted"
    kube.close()
    return ran


def test_every_client_call_is_exercised(fake, tmp_path):
    kubeconfig = str(fake.write_kubeconfig(tmp_path / "kubeconfig"))
    ran = every_call(KubeRayClient(ClusterRef(name="rs", namespace="ml", kubeconfig=kubeconfig, address="cluster-ip")))
    public = {name for name, _ in inspect.getmembers(KubeRayClient, inspect.isfunction) if not name.startswith("_")}
    assert public == ran, f"KubeRayClient methods not exercised here (add them to every_call): {public - ran}"


def test_the_rendered_rules_allow_every_call_the_client_makes(fake, tmp_path):
    kubeconfig = str(fake.write_kubeconfig(tmp_path / "kubeconfig"))
    every_call(KubeRayClient(ClusterRef(name="rs", namespace="ml", kubeconfig=kubeconfig, address="cluster-ip")))
    objects = render_rbac(namespace="ml", service_accounts=["airflow-worker"], service_account_namespace="airflow")
    seen = {request_attributes(method, path) for method, path, _ in fake.requests}
    assert {(v, g, r) for v, g, r, _, _ in seen} >= {
        ("get", "ray.io", "rayclusters"), ("create", "ray.io", "rayclusters"), ("delete", "ray.io", "rayclusters"),
        ("get", "", "services"), ("get", "", "secrets"), ("create", "", "secrets"), ("delete", "", "secrets"),
        ("get", "apiextensions.k8s.io", "customresourcedefinitions")}
    refused = [call for call in seen if not allowed(objects, *call)]
    assert not refused, f"calls the rendered RBAC does not allow: {refused}"


def test_lookup_only_allows_resolving_a_connection_and_nothing_else(fake, tmp_path):
    kubeconfig = str(fake.write_kubeconfig(tmp_path / "kubeconfig"))
    fake.add_cluster(kuberay.render_raycluster("rs", tpus=["v6e-16"], namespace="ml"))
    with KubeRayClient(ClusterRef(name="bootstrap", namespace="ml", kubeconfig=kubeconfig)) as kube:
        kube.ensure_token_secret("rs-ray-token", owner=OWNER)
    fake.requests.clear()
    url, token = resolve(ClusterRef(name="rs", namespace="ml", kubeconfig=kubeconfig, token_secret="rs-ray-token",
                                    address="cluster-ip"))
    assert url and token
    lookup = render_rbac(namespace="ml", service_accounts=["airflow-worker"], manage=False)
    calls = {request_attributes(method, path) for method, path, _ in fake.requests}
    assert calls and all(allowed(lookup, *call) for call in calls), calls
    assert not allowed(lookup, "create", "ray.io", "rayclusters", "ml", None)
    assert not allowed(lookup, "get", "apiextensions.k8s.io", "customresourcedefinitions", None,
                       "rayclusters.ray.io")
    assert [o["kind"] for o in lookup] == ["Role", "RoleBinding"]


def test_crd_reads_are_limited_to_kuberays_raycluster_crd():
    objects = render_rbac(namespace="ml", service_accounts=["airflow-worker"])
    assert not allowed(objects, "get", "apiextensions.k8s.io", "customresourcedefinitions", None,
                       "certificates.cert-manager.io")
    assert not allowed(objects, "list", "", "secrets", "ml", None)  # one Secret by name, never the list
    assert not allowed(objects, "get", "", "secrets", "kube-system", "x")  # only the RayClusters' namespace


def test_the_bindings_name_every_service_account_and_every_object_passes_kubernetes_schemas():
    objects = render_rbac(namespace="ml", service_accounts=["airflow-worker", "airflow-triggerer"],
                          service_account_namespace="airflow", create_service_accounts=True)
    assert [o["kind"] for o in objects] == ["ServiceAccount", "ServiceAccount", "Role", "RoleBinding",
                                            "ClusterRole", "ClusterRoleBinding"]
    for binding in (o for o in objects if o["kind"].endswith("Binding")):
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa, "namespace": "airflow"}
                                       for sa in ("airflow-worker", "airflow-triggerer")]
    for obj in objects:
        validate_object(obj)


def test_the_module_imports_on_its_own():
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", "from rayslice.cloud.kuberay_rbac import render_rbac"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def test_cli_prints_the_objects_and_refuses_bad_names():
    runner = CliRunner()
    result = runner.invoke(kuberay_cli.app, ["rbac", "--namespace", "ml", "--service-account", "airflow-worker",
                                         "--service-account-namespace", "airflow"])
    assert result.exit_code == 0, result.output
    printed = list(yaml.safe_load_all(result.stdout))
    assert printed == render_rbac(namespace="ml", service_accounts=["airflow-worker"],
                                  service_account_namespace="airflow")
    bad = runner.invoke(kuberay_cli.app, ["rbac", "--namespace", "ML", "--service-account", "airflow-worker"])
    assert bad.exit_code == 1 and "namespace 'ML' is not a Kubernetes name" in bad.stderr
    with pytest.raises(InvalidRequestError, match="give the Airflow service account"):
        render_rbac(namespace="ml", service_accounts=[])


# Review of issue 41.
@pytest.mark.parametrize("namespace", ["a.b", "a" * 64])
def test_a_namespace_is_a_dns_label(namespace):
    with pytest.raises(InvalidRequestError, match="namespace"):
        render_rbac(namespace=namespace, service_accounts=["airflow-worker"])
    with pytest.raises(InvalidRequestError, match="service_account_namespace"):
        render_rbac(namespace="ml", service_accounts=["airflow-worker"], service_account_namespace=namespace)


def test_cli_errors_name_the_flags():
    runner = CliRunner()
    bad = runner.invoke(kuberay_cli.app, ["rbac", "--namespace", "ML", "--service-account", "airflow-worker"])
    assert bad.exit_code == 1 and "--namespace 'ML'" in bad.stderr, bad.stderr
    bad = runner.invoke(kuberay_cli.app, ["rbac", "--namespace", "ml", "--service-account", "Airflow"])
    assert bad.exit_code == 1 and "--service-account 'Airflow'" in bad.stderr, bad.stderr
    bad = runner.invoke(kuberay_cli.app, ["rbac", "--namespace", "ml", "--service-account", "a",
                                      "--service-account-namespace", "X"])
    assert bad.exit_code == 1 and "--service-account-namespace 'X'" in bad.stderr, bad.stderr


def test_a_long_name_never_renders_an_invalid_cluster_role():
    with pytest.raises(InvalidRequestError, match="name"):
        render_rbac(namespace="ml", service_accounts=["a"], name="a" * 250)


def test_only_the_raycluster_crd_is_readable():
    """Least privilege: the operators create RayClusters only, so nothing reads the RayJob CRD."""
    objects = render_rbac(namespace="ml", service_accounts=["airflow-worker"])
    assert allowed(objects, "get", "apiextensions.k8s.io", "customresourcedefinitions", None, "rayclusters.ray.io")
    assert not allowed(objects, "get", "apiextensions.k8s.io", "customresourcedefinitions", None, "rayjobs.ray.io")


def test_token_secrets_narrow_the_secret_rules_to_those_names(fake, tmp_path):
    """Least privilege: with --token-secret, Airflow reads and deletes those Secrets only, not every one in
    the namespace (image pull secrets, other workloads' credentials); create cannot be narrowed by name."""
    kubeconfig = str(fake.write_kubeconfig(tmp_path / "kubeconfig"))
    every_call(KubeRayClient(ClusterRef(name="rs", namespace="ml", kubeconfig=kubeconfig, address="cluster-ip")))
    objects = render_rbac(namespace="ml", service_accounts=["airflow-worker"], token_secrets=["rs-ray-token"])
    calls = {request_attributes(method, path) for method, path, _ in fake.requests}
    assert not [call for call in calls if not allowed(objects, *call)]
    assert not allowed(objects, "get", "", "secrets", "ml", "someone-elses-credentials")
    assert not allowed(objects, "delete", "", "secrets", "ml", "someone-elses-credentials")
    lookup = render_rbac(namespace="ml", service_accounts=["a"], token_secrets=["rs-ray-token"], manage=False)
    assert allowed(lookup, "get", "", "secrets", "ml", "rs-ray-token")
    assert not allowed(lookup, "get", "", "secrets", "ml", "x") and not allowed(lookup, "create", "", "secrets",
                                                                               "ml", None)
    for obj in objects:
        validate_object(obj)
    result = CliRunner().invoke(kuberay_cli.app, ["rbac", "--namespace", "ml", "--service-account", "a",
                                              "--token-secret", "rs-ray-token"])
    assert result.exit_code == 0, result.output
    assert list(yaml.safe_load_all(result.stdout)) == render_rbac(namespace="ml", service_accounts=["a"],
                                                                 token_secrets=["rs-ray-token"])
