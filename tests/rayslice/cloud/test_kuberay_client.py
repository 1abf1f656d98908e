"""rayslice.cloud.kuberay_client: the real `kubernetes` client against an HTTP fake of the API server.

No Kubernetes API server can run here; tests/fake_kubernetes.py serves API-shaped JSON over real
HTTP, validating every RayCluster it accepts and serves against the real KubeRay CRD. The client
is built from a real kubeconfig file that names the fake.
"""

from __future__ import annotations

import copy
import json
import socket

import pytest

from rayslice.cloud import kuberay
from rayslice.cloud.kuberay_client import (
    MANAGED_BY_LABEL,
    OWNER_ANNOTATION,
    ClusterRef,
    KubeRayClient,
    KubeRayError,
    KubeRayNotReadyError,
    resolve_dashboard_url,
)
from rayslice.core.exceptions import InvalidRequestError
from tests.fake_kubernetes import FakeKubernetes

OWNER = "nightly/manual__2026-01-01T00:00:00+00:00"


@pytest.fixture
def fake(reference_crds):
    with FakeKubernetes(crds=reference_crds) as server:
        yield server


@pytest.fixture
def kubeconfig(fake, tmp_path):
    return str(fake.write_kubeconfig(tmp_path / "kubeconfig"))


@pytest.fixture
def manifest():
    return kuberay.render_raycluster("ignored", tpus=["v6e-16"], gpu_nodes=1)


def exposed(manifest: dict) -> dict:
    out = copy.deepcopy(manifest)
    out["spec"]["headGroupSpec"]["serviceType"] = "LoadBalancer"
    return out


def client(kubeconfig: str, **ref) -> KubeRayClient:
    return KubeRayClient(ClusterRef(**{"name": "rs", "namespace": "ml", "kubeconfig": kubeconfig, **ref}))


# --- the connection extra


def test_ref_from_extra_accepts_a_dict_or_its_json():
    ref = ClusterRef.from_extra({"namespace": "ml", "name": "rs", "in_cluster": True})
    assert (ref.namespace, ref.name, ref.in_cluster, str(ref)) == ("ml", "rs", True, "ml/rs")
    assert ClusterRef.from_extra(json.dumps({"name": "rs", "kubeconfig": "/k"})) == \
        ClusterRef(name="rs", namespace="default", kubeconfig="/k")
    assert ClusterRef.from_extra({"name": "rs"}, name="other", namespace=None).name == "other"


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ("not json", "must be a JSON object"),
        (["rs"], "must be a JSON object"),
        ({"namespace": "ml"}, "has no 'name'"),
        ({"name": "rs", "nmespace": "ml"}, "unknown key(s) ['nmespace']"),
        ({"name": "Bad_Name"}, "DNS-1035"),
        ({"name": "rs", "namespace": "ML"}, "DNS-1123"),
        ({"name": "rs", "in_cluster": True, "kubeconfig": "/k"}, "drop kubeconfig"),
        ({"name": "rs", "in_cluster": "yes"}, "true or false"),
        ({"name": "rs", "address": "nodeport"}, "use one of auto, load-balancer"),
        ({"name": "rs", "scheme": "ftp"}, "use http or https"),
    ],
)
def test_bad_extras_fail_with_the_fix(extra, message):
    with pytest.raises(InvalidRequestError) as info:
        ClusterRef.from_extra(extra)
    assert message in str(info.value)


# --- create, ready, dashboard address


def test_create_marks_the_owner_and_sends_a_manifest_the_crd_accepts(fake, kubeconfig, manifest):
    with client(kubeconfig) as kube:
        assert kube.get() is None
        created = kube.create(manifest, owner=OWNER)
    [(method, path, body)] = [r for r in fake.requests if r[0] == "POST"]
    assert path == "/apis/ray.io/v1/namespaces/ml/rayclusters"
    kuberay.validate(body, fake.schemas)  # what went over the wire is a valid RayCluster
    assert body["metadata"]["name"] == "rs" and body["metadata"]["namespace"] == "ml"
    assert body["metadata"]["labels"][MANAGED_BY_LABEL] == "rayslice"
    assert body["metadata"]["annotations"][OWNER_ANNOTATION] == OWNER
    assert body["spec"] == manifest["spec"]
    assert created["metadata"]["uid"] == fake.cluster("ml", "rs")["metadata"]["uid"]


def test_an_invalid_manifest_fails_before_it_is_sent(fake, kubeconfig, manifest):
    """Checked against the CRD the cluster has installed (read through apiextensions), not sent."""
    manifest["spec"]["workerGroupSpecs"][0]["replicas"] = "many"
    with client(kubeconfig) as kube, pytest.raises(InvalidRequestError, match="replicas") as info:
        kube.create(manifest, owner=OWNER)
    assert f"rayclusters.ray.io in the cluster at {fake.url}" in str(info.value)
    assert [(m, p) for m, p, _ in fake.requests] == [
        ("GET", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/rayclusters.ray.io")]


def test_the_clusters_own_crd_decides(fake, kubeconfig, manifest):
    """A cluster whose KubeRay caps maxReplicas at 1: two slices fail there before the POST, with the path."""
    crd = copy.deepcopy(fake.installed_crds["rayclusters.ray.io"])
    crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"][
        "workerGroupSpecs"]["items"]["properties"]["maxReplicas"]["maximum"] = 1
    fake.installed_crds["rayclusters.ray.io"] = crd
    with client(kubeconfig) as kube:
        kube.create(manifest, owner=OWNER)  # max_slices=1 fits
        two = kuberay.render_raycluster("ignored", tpus=["v6e-16"], max_slices=2)
        with pytest.raises(InvalidRequestError, match=r"workerGroupSpecs\[0\]\.maxReplicas"):
            client(kubeconfig, name="rs2").create(two, owner=OWNER)
    assert [p for m, p, _ in fake.requests if m == "POST"] == ["/apis/ray.io/v1/namespaces/ml/rayclusters"]


def test_a_cluster_without_kuberay_is_named(fake, kubeconfig, manifest):
    fake.installed_crds.clear()
    with client(kubeconfig) as kube, pytest.raises(KubeRayError, match="install the KubeRay operator") as info:
        kube.create(manifest, owner=OWNER)
    assert info.value.status_code == 404 and not [r for r in fake.requests if r[0] == "POST"]


def test_no_right_to_read_crds_leaves_the_check_to_the_api_server(fake, kubeconfig, manifest, caplog):
    fake.fail_next("GET", "customresourcedefinitions/rayclusters.ray.io$", 403)
    with client(kubeconfig) as kube:
        kube.create(manifest, owner=OWNER)
    assert "not validated before sending" in caplog.text and "customresourcedefinitions" in caplog.text
    assert fake.cluster("ml", "rs") is not None  # the fake API server validated it on POST


def test_wait_ready_returns_the_load_balancer_dashboard(fake, kubeconfig, manifest):
    fake.load_balancer_ip = "203.0.113.9"
    with client(kubeconfig) as kube:
        kube.create(exposed(manifest), owner=OWNER)
        with pytest.raises(KubeRayNotReadyError, match="not ready .*HeadPodReady=False"):
            kube.dashboard_url()  # the fake's operator has not readied it yet
        assert kube.wait_ready(timeout=30, poll_interval=0.01) == "http://203.0.113.9:8265"
    served = fake.cluster("ml", "rs")
    kuberay.validate(served, fake.schemas)  # status included
    assert served["status"]["state"] == "ready" and served["status"]["endpoints"]["dashboard"] == "8265"


@pytest.mark.parametrize(
    ("ref", "url"),
    [
        ({"address": "service-dns"}, "http://rs-head-svc.ml.svc:8265"),
        ({"address": "cluster-ip", "scheme": "https"}, "https://10.12.0.7:8265"),
    ],
)
def test_address_modes(fake, kubeconfig, manifest, ref, url):
    fake.add_cluster(kuberay.render_raycluster("rs", tpus=["v6e-4"], namespace="ml"))
    with client(kubeconfig, **ref) as kube:
        assert kube.dashboard_url() == url


def test_in_cluster_uses_the_service_dns_name(fake, kubeconfig):
    fake.add_cluster(kuberay.render_raycluster("rs", tpus=["v6e-4"], namespace="ml"))
    with client(kubeconfig) as outside:  # the client the in-cluster config would build, on the fake
        ref = ClusterRef(name="rs", namespace="ml", in_cluster=True)
        assert resolve_dashboard_url(ref, api_client=outside._api) == "http://rs-head-svc.ml.svc:8265"


def test_a_cluster_ip_service_from_outside_says_how_to_reach_it(fake, kubeconfig):
    fake.add_cluster(kuberay.render_raycluster("rs", tpus=["v6e-4"], namespace="ml"))
    with client(kubeconfig) as kube, pytest.raises(KubeRayError) as info:
        kube.dashboard_url()
    assert "is ClusterIP" in str(info.value) and "LoadBalancer" in str(info.value)
    with client(kubeconfig, address="load-balancer") as kube, pytest.raises(KubeRayNotReadyError,
                                                                            match="no load balancer"):
        kube.dashboard_url()


def test_a_missing_cluster_is_named(kubeconfig):
    with client(kubeconfig) as kube, pytest.raises(KubeRayError, match="no RayCluster ml/rs") as info:
        kube.dashboard_url()
    assert info.value.status_code == 404


def test_wait_ready_times_out_with_the_clusters_state(fake, kubeconfig, manifest):
    fake.ready_after_gets = None
    with client(kubeconfig) as kube:
        kube.create(manifest, owner=OWNER)
        with pytest.raises(KubeRayNotReadyError, match=r"not ready after 0.2 s.*HeadPodNotFound"):
            kube.wait_ready(timeout=0.2, poll_interval=0.05)


# --- ownership


def test_a_foreign_cluster_is_never_taken_over_nor_deleted(fake, kubeconfig, manifest):
    theirs = fake.add_cluster(kuberay.render_raycluster("rs", tpus=["v6e-4"], namespace="ml"))
    with client(kubeconfig) as kube:
        with pytest.raises(KubeRayError, match="already exists and was made by someone else") as info:
            kube.create(manifest, owner=OWNER)
        assert info.value.status_code == 409
        assert kube.delete(owner=OWNER) == "not-owned"
        assert kube.delete(owner="") == "not-owned"
    assert fake.cluster("ml", "rs") is theirs
    assert not [r for r in fake.requests if r[0] == "DELETE"]


def test_a_cluster_of_another_run_is_left_alone(fake, kubeconfig, manifest):
    with client(kubeconfig) as kube:
        kube.create(manifest, owner="nightly/run-1")
        with pytest.raises(KubeRayError, match="made by nightly/run-1, not nightly/run-2"):
            kube.create(manifest, owner="nightly/run-2")
        assert kube.delete(owner="nightly/run-2") == "not-owned"
    assert fake.cluster("ml", "rs") is not None


def test_another_airflow_with_the_same_dag_and_run_never_adopts_nor_deletes_it(fake, kubeconfig, manifest):
    """Issue 38 (9): the mark was `dag/run`, so a staging Airflow took over prod's cluster on a 409 and deleted it."""
    from rayslice.cloud.kuberay_client import owner_for_run

    prod, staging = owner_for_run("nightly", "run-1", "prod"), owner_for_run("nightly", "run-1", "staging")
    with client(kubeconfig) as kube:
        kube.create(manifest, owner=prod)
        kube.ensure_token_secret("rs-token", owner=prod)
        with pytest.raises(KubeRayError, match="made by prod/nightly/run-1, not staging/nightly/run-1"):
            kube.create(manifest, owner=staging)
        assert kube.delete(owner=staging) == "not-owned"
        assert kube.delete_token_secret("rs-token", owner=staging) == "not-owned"
    assert fake.cluster("ml", "rs") is not None


def test_a_retried_create_adopts_its_own_cluster(fake, kubeconfig, manifest):
    with client(kubeconfig) as kube:
        first = kube.create(manifest, owner=OWNER)
        again = kube.create(manifest, owner=OWNER)
    assert again["metadata"]["uid"] == first["metadata"]["uid"]
    assert len(fake.clusters) == 1


def test_delete_own_cluster_with_uid_precondition_and_wait_until_gone(fake, kubeconfig, manifest):
    with client(kubeconfig) as kube:
        uid = kube.create(manifest, owner=OWNER)["metadata"]["uid"]
        assert kube.delete(owner=OWNER) == "deleted"
        [(_, path, body)] = [r for r in fake.requests if r[0] == "DELETE"]
        assert path.endswith("/namespaces/ml/rayclusters/rs")
        assert body["preconditions"] == {"uid": uid} and body["propagationPolicy"] == "Foreground"
        assert fake.cluster("ml", "rs")["metadata"]["deletionTimestamp"]  # Foreground: pods first
        kube.wait_gone(timeout=30, poll_interval=0.01)
        assert fake.cluster("ml", "rs") is None
        assert kube.delete(owner=OWNER) == "absent"


def test_a_replaced_cluster_fails_the_uid_precondition(fake, kubeconfig, manifest):
    """Between our GET and DELETE someone recreated the name: the API server refuses, nothing is deleted."""
    with client(kubeconfig) as kube:
        kube.create(manifest, owner=OWNER)
        stale = kube.get()
        kube.get = lambda: stale  # the GET saw our cluster ...
        fake.clusters.clear()      # ... which is then replaced by someone else's
        fake.add_cluster(kuberay.render_raycluster("rs", tpus=["v6e-4"], namespace="ml"))
        assert kube.delete(owner=OWNER) == "not-owned"
    assert fake.cluster("ml", "rs") is not None


# --- API errors


def test_the_token_secret_is_made_once_read_back_and_deleted_only_by_its_owner(fake, kubeconfig):
    with client(kubeconfig) as kube:
        assert kube.ensure_token_secret("rs-ray-token", owner=OWNER) is True
        token = kube.read_token("rs-ray-token")
        assert len(token) == 64 and int(token, 16) >= 0  # 32 random bytes, hex
        assert kube.ensure_token_secret("rs-ray-token", owner="someone/else") is False  # kept, not replaced
        assert kube.read_token("rs-ray-token") == token
        stored = fake.secrets[("ml", "rs-ray-token")]["metadata"]
        assert stored["annotations"][OWNER_ANNOTATION] == OWNER and stored["labels"][MANAGED_BY_LABEL] == "rayslice"
        assert kube.delete_token_secret("rs-ray-token", owner="someone/else") == "not-owned"
        assert kube.delete_token_secret("rs-ray-token", owner=OWNER) == "deleted"
        assert kube.delete_token_secret("rs-ray-token", owner=OWNER) == "absent"
        with pytest.raises(KubeRayError, match="no Secret ml/rs-ray-token"):
            kube.read_token("rs-ray-token")


def test_a_wrong_token_is_a_clear_401(fake, tmp_path):
    path = str(fake.write_kubeconfig(tmp_path / "kc", token="wrong"))
    with client(path) as kube, pytest.raises(KubeRayError, match="HTTP 401 .*credentials") as info:
        kube.get()
    assert info.value.status_code == 401


def test_forbidden_names_the_rbac_it_needs(fake, kubeconfig):
    fake.fail_next("GET", "rayclusters/rs$", 403)
    with client(kubeconfig) as kube, pytest.raises(KubeRayError, match="what `rayslice kuberay rbac` prints"):
        kube.get()


def test_an_unreachable_api_server(tmp_path, reference_crds):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = FakeKubernetes(crds=reference_crds)
    kc = tmp_path / "kc"
    server.write_kubeconfig(kc)
    kc.write_text(kc.read_text().replace(server.url, f"http://127.0.0.1:{port}"))
    server._server.server_close()
    with client(str(kc)) as kube, pytest.raises(KubeRayError, match=f"cannot reach the Kubernetes API at "
                                                                   f"http://127.0.0.1:{port}"):
        kube.get()


def test_a_missing_kubeconfig(tmp_path):
    with pytest.raises(KubeRayError, match="cannot load Kubernetes credentials from kubeconfig .*nowhere"):
        client(str(tmp_path / "nowhere"))


@pytest.mark.parametrize("text", ["garbage: [\n", "- a\n- b\n", "just a string\n"])
def test_a_kubeconfig_that_is_not_one_is_named_not_a_traceback(tmp_path, text):
    """Seen failing first: malformed YAML gave yaml's ParserError, a YAML list or string a bare TypeError
    (`rayslice doctor --kuberay-namespace` printed a traceback; the operators a TypeError)."""
    from rayslice.cloud.kuberay_client import load_api_client

    path = tmp_path / "kubeconfig"
    path.write_text(text)
    with pytest.raises(KubeRayError, match=rf"(?s)cannot load Kubernetes credentials from kubeconfig {path}: .*"
                                           r"pass --kubeconfig"):
        load_api_client(kubeconfig=str(path))
