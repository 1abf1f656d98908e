"""KubeRay through Airflow: the `ray` connection naming a RayCluster, and the setup/teardown operators.

Real Airflow (`dag.test()`) and the real `kubernetes` client; the Kubernetes API server is the HTTP
fake of tests/fake_kubernetes.py (no API server can run here), which validates every RayCluster
against the real KubeRay CRD. In the lifecycle test the fake's head Service load balancer points
at the real local Ray cluster's dashboard, so the step in the middle is a real Ray job reached
through the KubeRay lookup.
"""

from __future__ import annotations

import asyncio
import json
import os
import textwrap

import httpx
import pytest

from rayslice.cloud import kuberay
from rayslice.cloud.kuberay_client import OWNER_ANNOTATION, KubeRayError
from rayslice.core.exceptions import InvalidRequestError
from tests.airflow_env import load_dag_file, task_states, write_dag_file, xcom_values
from tests.fake_kubernetes import FakeKubernetes
from tests.operators.moved_trigger import kill_while_still_deferred

CONN = "kuberay_fake"

COMMON = textwrap.dedent(
    """
    from datetime import datetime

    from airflow.sdk import DAG, task

    from rayslice.cloud.kuberay import render_raycluster
    from rayslice.operators.accelerator import AcceleratorOperator
    from rayslice.operators.kuberay import CreateRayClusterOperator, DeleteRayClusterOperator

    START = datetime(2026, 1, 1)
    """
)

LIFECYCLE = COMMON + textwrap.dedent(
    """
    # KubeRay's head Service mirrors the head container's named ports: here the local Ray dashboard's.
    MANIFEST = render_raycluster("ignored", tpus=[], gpu_nodes=1)
    MANIFEST["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["ports"] = [
        {"containerPort": DASHBOARD_PORT, "name": "dashboard"}]


    def fail():
        raise RuntimeError("the step failed on purpose")


    with DAG("kr_lifecycle", schedule=None, start_date=START):
        create = CreateRayClusterOperator(task_id="create", ray_conn_id="kuberay_fake", manifest=MANIFEST,
                                          head_service_type="LoadBalancer", poll_interval=0.05, ready_timeout=60)
        step = AcceleratorOperator(task_id="step", ray_conn_id="kuberay_fake", accelerator="GPU", count=0.25,
                                   python_callable=fail, poll_interval=0.5)
        delete = DeleteRayClusterOperator(task_id="delete", ray_conn_id="kuberay_fake", poll_interval=0.05)
        create.as_setup() >> step >> delete.as_teardown(setups=create)
    """
)

NO_RAY = COMMON + textwrap.dedent(
    """
    @task
    def use_cluster():
        return "ran"


    with DAG("kr_setup_teardown", schedule=None, start_date=START):
        create = CreateRayClusterOperator(task_id="create", ray_conn_id="kuberay_fake", tpus=["v6e-16"],
                                          head_service_type="LoadBalancer", poll_interval=0.05, ready_timeout=0.5)
        delete = DeleteRayClusterOperator(task_id="delete", ray_conn_id="kuberay_fake", poll_interval=0.05)
        create.as_setup() >> use_cluster() >> delete.as_teardown(setups=create)

    with DAG("kr_setup_teardown_on_a_worker", schedule=None, start_date=START):
        create = CreateRayClusterOperator(task_id="create", ray_conn_id="kuberay_fake", tpus=["v6e-16"],
                                          head_service_type="LoadBalancer", poll_interval=0.05, ready_timeout=0.5,
                                          deferrable=False)
        delete = DeleteRayClusterOperator(task_id="delete", ray_conn_id="kuberay_fake", poll_interval=0.05)
        create.as_setup() >> use_cluster() >> delete.as_teardown(setups=create)

    with DAG("kr_teardown_only", schedule=None, start_date=START):
        use_cluster() >> DeleteRayClusterOperator(task_id="delete", ray_conn_id="kuberay_fake", poll_interval=0.05)
    """
)


@pytest.fixture
def fake(monkeypatch, tmp_path, reference_crds):
    with FakeKubernetes(crds=reference_crds) as server:
        kubeconfig = server.write_kubeconfig(tmp_path / "kubeconfig")
        server.kubeconfig = str(kubeconfig)
        extra = {"kuberay": {"namespace": "ml", "name": "rs", "kubeconfig": str(kubeconfig)}}
        monkeypatch.setenv(f"AIRFLOW_CONN_{CONN.upper()}", json.dumps({"conn_type": "ray", "extra": extra}))
        yield server


@pytest.fixture(scope="module")
def no_ray_dags(airflow_db):
    dags, errors = load_dag_file(write_dag_file("kr_no_ray", NO_RAY))
    assert not errors
    return dags


def ready_cluster(fake: FakeKubernetes, *, exposed: bool = True) -> dict:
    manifest = kuberay.render_raycluster("rs", tpus=["v6e-4"], namespace="ml")
    if exposed:
        manifest["spec"]["headGroupSpec"]["serviceType"] = "LoadBalancer"
    return fake.add_cluster(manifest)


# --- the hook


def test_the_hook_finds_the_dashboard_of_the_named_raycluster(fake):
    from rayslice.hooks.ray import RayHook

    fake.load_balancer_ip = "198.51.100.4"
    ready_cluster(fake)
    assert RayHook(CONN).settings().dashboard_url == "http://198.51.100.4:8265"
    settings = asyncio.run(RayHook(CONN).asettings())
    assert settings.dashboard_url == "http://198.51.100.4:8265"
    assert RayHook(CONN).cluster_ref().namespace == "ml"


def test_the_hook_reads_the_token_from_the_clusters_secret(fake, monkeypatch, tmp_path):
    import base64

    from rayslice.hooks.ray import RayHook

    fake.secrets[("ml", "rs-ray-token")] = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "rs-ray-token"},
                                            "data": {"auth_token": base64.b64encode(b"t0ken").decode()}}
    ready_cluster(fake)
    kubeconfig = fake.write_kubeconfig(tmp_path / "kc")
    extra = {"kuberay": {"namespace": "ml", "name": "rs", "kubeconfig": str(kubeconfig),
                         "token_secret": "rs-ray-token"}}
    monkeypatch.setenv(f"AIRFLOW_CONN_{CONN.upper()}", json.dumps({"conn_type": "ray", "extra": extra}))
    assert RayHook(CONN).settings().token == "t0ken"
    assert asyncio.run(RayHook(CONN).asettings()).token == "t0ken"
    # A password on the connection wins, and the Secret is then not read at all.
    fake.requests.clear()
    monkeypatch.setenv(f"AIRFLOW_CONN_{CONN.upper()}",
                       json.dumps({"conn_type": "ray", "password": "own", "extra": extra}))
    assert RayHook(CONN).settings().token == "own"
    assert not [p for _, p, _ in fake.requests if "/secrets/" in p]
    # A Secret that is not there is named, with the extra to fix.
    monkeypatch.setenv(f"AIRFLOW_CONN_{CONN.upper()}", json.dumps(
        {"conn_type": "ray", "extra": {"kuberay": {**extra["kuberay"], "token_secret": "nope"}}}))
    with pytest.raises(KubeRayError, match="no Secret ml/nope with the Ray token of ml/rs.*'token_secret'"):
        RayHook(CONN).settings()


def _token_secret(fake: FakeKubernetes, name: str, token: str, owner: str | None = None,
                  made_for: str | None = None) -> None:
    """A token Secret; with `owner` and `made_for`, as a setup makes it for the RayCluster `made_for`."""
    import base64

    from rayslice.cloud.kuberay_client import CLUSTER_ANNOTATION

    marks = {**({OWNER_ANNOTATION: owner} if owner else {}), **({CLUSTER_ANNOTATION: made_for} if made_for else {})}
    meta = {"name": name, **({"annotations": marks} if marks else {})}
    fake.secrets[("ml", name)] = {"apiVersion": "v1", "kind": "Secret", "metadata": meta,
                                  "data": {"auth_token": base64.b64encode(token.encode()).decode()}}


def _cluster(fake: FakeKubernetes, name: str, *, owner: str | None = None, token_secret: str | None = None) -> None:
    manifest = kuberay.render_raycluster(name, tpus=["v6e-4"], namespace="ml", token_secret=token_secret)
    manifest["spec"]["headGroupSpec"]["serviceType"] = "LoadBalancer"
    if owner:
        manifest["metadata"].setdefault("annotations", {})[OWNER_ANNOTATION] = owner
    fake.add_cluster(manifest)


def test_a_steps_named_cluster_is_authenticated_as_the_connections_never_by_a_secret_the_cluster_names(
        fake, monkeypatch):
    """kuberay_cluster="<name>": the same API server and namespace, another RayCluster, the connection's token.

    The cluster's spec does not choose which Secret Airflow reads: whoever may create a RayCluster in the
    namespace could otherwise point its authOptions at another team's token Secret and be sent that token.
    """
    from rayslice.hooks.ray import RayHook

    fake.load_balancer_ip = "198.51.100.4"
    _cluster(fake, "rs-other", token_secret="victim-token")
    _token_secret(fake, "victim-token", "victim")
    _token_secret(fake, "rs-ray-token", "shared")
    extra = {"kuberay": {"namespace": "ml", "name": "rs", "kubeconfig": fake.kubeconfig,
                         "token_secret": "rs-ray-token"}}
    monkeypatch.setenv(f"AIRFLOW_CONN_{CONN.upper()}", json.dumps({"conn_type": "ray", "extra": extra}))
    for settings in (RayHook(CONN, cluster="rs-other").settings(),
                     asyncio.run(RayHook(CONN, cluster="rs-other").asettings())):
        assert (settings.dashboard_url, settings.token) == ("http://198.51.100.4:8265", "shared")
    assert not [p for _, p, _ in fake.requests if p.endswith("/rayclusters/rs") or "victim-token" in p]
    with pytest.raises(KubeRayError, match="no RayCluster ml/rs-run-3"):
        RayHook(CONN, cluster="rs-run-3").settings()


def test_a_runs_own_cluster_gets_its_runs_token_never_the_connections(fake, monkeypatch):
    """kuberay_cluster="per-run": the cluster and its Secret carry the run's owner mark; the shared password stays."""
    from rayslice.hooks.ray import RayHook

    owner = "prod/dag/run-2"
    fake.load_balancer_ip = "198.51.100.4"
    _cluster(fake, "rs-run-2", owner=owner)
    _token_secret(fake, "rs-run-2-ray-token", "run-2", owner=owner, made_for="rs-run-2")
    extra = {"kuberay": {"namespace": "ml", "name": "rs", "kubeconfig": fake.kubeconfig}}
    monkeypatch.setenv(f"AIRFLOW_CONN_{CONN.upper()}",
                       json.dumps({"conn_type": "ray", "password": "shared-cluster-token", "extra": extra}))
    for settings in (RayHook(CONN, cluster="rs-run-2", cluster_owner=owner).settings(),
                     asyncio.run(RayHook(CONN, cluster="rs-run-2", cluster_owner=owner).asettings())):
        assert (settings.dashboard_url, settings.token) == ("http://198.51.100.4:8265", "run-2")


@pytest.mark.parametrize("made_by", [None, "staging/dag/run-2"])
def test_a_runs_own_cluster_made_by_someone_else_is_refused_before_any_token(fake, monkeypatch, made_by):
    """A RayCluster under the run's (predictable) name that the run did not make gets no token, and no step."""
    from rayslice.hooks.ray import RayHook

    _cluster(fake, "rs-run-2", owner=made_by, token_secret="victim-token")
    _token_secret(fake, "victim-token", "victim")
    _token_secret(fake, "rs-run-2-ray-token", "squatted", owner=made_by)
    extra = {"kuberay": {"namespace": "ml", "name": "rs", "kubeconfig": fake.kubeconfig}}
    monkeypatch.setenv(f"AIRFLOW_CONN_{CONN.upper()}",
                       json.dumps({"conn_type": "ray", "password": "shared-cluster-token", "extra": extra}))
    fake.requests.clear()
    with pytest.raises(KubeRayError, match=r"RayCluster ml/rs-run-2 was made by .*not by this DAG run "
                                           r"\(prod/dag/run-2\).*is sent no token"):
        RayHook(CONN, cluster="rs-run-2", cluster_owner="prod/dag/run-2").settings()
    assert not [p for _, p, _ in fake.requests if "/secrets/" in p]


def test_a_cluster_a_setup_made_gets_its_own_token_even_when_the_step_names_it_or_an_old_trigger_lost_the_owner(
        fake, monkeypatch):
    """Reviewer of issue 41: a trigger serialized before the owner was carried, or a templated name, reached a run's
    cluster as a named one, and was sent the connection's password. A cluster a rayslice setup made (it carries an
    owner mark) is sent only the token of the Secret it names, and only if that Secret carries the same mark."""
    from rayslice.hooks.ray import RayHook

    fake.load_balancer_ip = "198.51.100.4"
    _cluster(fake, "rs-run-2", owner="prod/dag/run-2", token_secret="run-2-token")
    _token_secret(fake, "run-2-token", "run-2", owner="prod/dag/run-2", made_for="rs-run-2")
    _cluster(fake, "rs-bad", owner="prod/dag/run-3", token_secret="victim-token")
    _token_secret(fake, "victim-token", "victim", owner="prod/other/run-9", made_for="victim")
    extra = {"kuberay": {"namespace": "ml", "name": "rs", "kubeconfig": fake.kubeconfig}}
    monkeypatch.setenv(f"AIRFLOW_CONN_{CONN.upper()}",
                       json.dumps({"conn_type": "ray", "password": "shared-cluster-token", "extra": extra}))
    assert RayHook(CONN, cluster="rs-run-2").settings().token == "run-2"
    with pytest.raises(KubeRayError, match="Secret ml/victim-token, which RayCluster ml/rs-bad names, was not made "
                                           "by a setup for that cluster"):
        RayHook(CONN, cluster="rs-bad").settings()


def test_a_cluster_that_copies_a_teams_owner_mark_is_not_sent_that_teams_token(fake, monkeypatch):
    """Second reviewer of issue 41: who may create RayClusters (not Secrets) copied team A's owner mark onto a cluster
    of theirs and pointed its authOptions at team A's Secret; a step naming it was sent team A's token."""
    from rayslice.hooks.ray import RayHook

    _cluster(fake, "scratch", owner="prod/team-a/run-1", token_secret="teama-ray-token")
    _token_secret(fake, "teama-ray-token", "team-a", owner="prod/team-a/run-1", made_for="teama")
    extra = {"kuberay": {"namespace": "ml", "name": "rs", "kubeconfig": fake.kubeconfig}}
    monkeypatch.setenv(f"AIRFLOW_CONN_{CONN.upper()}", json.dumps({"conn_type": "ray", "extra": extra}))
    with pytest.raises(KubeRayError, match="was not made by a setup for that cluster"):
        RayHook(CONN, cluster="scratch").settings()


def test_a_named_setups_reused_or_admin_secret_still_authenticates_its_steps(fake, monkeypatch):
    """Second reviewer of issue 41 (upgrade): a named setup that reused a Secret (a stale one of an earlier run of
    that cluster, or the admin's, named in the extra's token_secret) left steps that failed. Both still work."""
    from rayslice.hooks.ray import RayHook

    fake.load_balancer_ip = "198.51.100.4"
    _cluster(fake, "train", owner="prod/dag/run-2", token_secret="train-ray-token")
    _token_secret(fake, "train-ray-token", "stale", owner="prod/dag/run-1", made_for="train")  # run 1's, kept
    _cluster(fake, "eval", owner="prod/dag/run-2", token_secret="admin-token")
    _token_secret(fake, "admin-token", "admins")  # external-secrets' Secret: no rayslice marks
    extra = {"kuberay": {"namespace": "ml", "name": "rs", "kubeconfig": fake.kubeconfig,
                         "token_secret": "admin-token"}}
    monkeypatch.setenv(f"AIRFLOW_CONN_{CONN.upper()}", json.dumps({"conn_type": "ray", "extra": extra}))
    assert RayHook(CONN, cluster="train").settings().token == "stale"
    assert RayHook(CONN, cluster="eval").settings().token == "admins"


def test_a_runs_own_cluster_with_a_token_secret_it_did_not_make_is_refused(fake, monkeypatch):
    from rayslice.hooks.ray import RayHook

    owner = "prod/dag/run-2"
    _cluster(fake, "rs-run-2", owner=owner)
    _token_secret(fake, "rs-run-2-ray-token", "planted")  # no owner mark: someone else's
    extra = {"kuberay": {"namespace": "ml", "name": "rs", "kubeconfig": fake.kubeconfig}}
    monkeypatch.setenv(f"AIRFLOW_CONN_{CONN.upper()}", json.dumps({"conn_type": "ray", "extra": extra}))
    with pytest.raises(KubeRayError, match="Secret ml/rs-run-2-ray-token was not made by the DAG run that made"):
        RayHook(CONN, cluster="rs-run-2", cluster_owner=owner).settings()


def test_a_steps_cluster_needs_a_kuberay_connection(monkeypatch):
    from rayslice.hooks.ray import RayHook

    monkeypatch.setenv("AIRFLOW_CONN_KR_HOST", json.dumps({"conn_type": "ray", "host": "http://h:8265"}))
    with pytest.raises(InvalidRequestError, match="kuberay_cluster='rs-1' needs a `ray` connection with a 'kuberay' "
                                                  "extra"):
        RayHook("kr_host", cluster="rs-1").settings()


@pytest.mark.parametrize("operator", ["TpuSliceOperator", "AcceleratorOperator"])
def test_a_steps_kuberay_cluster_is_checked_at_parse_time_unless_templated(operator):
    from rayslice.operators.accelerator import AcceleratorOperator
    from rayslice.operators.tpu_slice import TpuSliceOperator

    cls = {"TpuSliceOperator": TpuSliceOperator, "AcceleratorOperator": AcceleratorOperator}[operator]
    args = {"tpu": "v6e-4"} if operator == "TpuSliceOperator" else {"accelerator": "GPU", "count": 0.5}
    with pytest.raises(InvalidRequestError, match="kuberay_cluster of 's' 'Run_1' is invalid"):
        cls(task_id="s", callable="m:f", kuberay_cluster="Run_1", **args)
    for ok in ("per-run", "rayslice", "rs-{{ params.cluster }}"):
        assert cls(task_id="s", callable="m:f", kuberay_cluster=ok, **args).kuberay_cluster == ok
    assert "kuberay_cluster" in cls.template_fields


def test_the_hook_says_when_the_cluster_is_missing_or_not_ready(fake):
    from rayslice.hooks.ray import RayHook

    ok, message = RayHook(CONN).test_connection()
    assert not ok and "no RayCluster ml/rs" in message
    fake.add_cluster(kuberay.render_raycluster("rs", tpus=["v6e-4"], namespace="ml"), ready=False)
    with pytest.raises(KubeRayError, match="RayCluster ml/rs is not ready"):
        RayHook(CONN).settings()


def test_host_and_kuberay_together_are_refused(monkeypatch):
    from rayslice.hooks.ray import RayHook

    both = {"conn_type": "ray", "host": "http://127.0.0.1:8265", "extra": {"kuberay": {"name": "rs"}}}
    monkeypatch.setenv("AIRFLOW_CONN_KR_BOTH", json.dumps(both))
    with pytest.raises(InvalidRequestError, match="both a host and a 'kuberay' extra"):
        RayHook("kr_both").settings()
    monkeypatch.setenv("AIRFLOW_CONN_KR_HOST", json.dumps({"conn_type": "ray", "host": "http://h:8265"}))
    with pytest.raises(InvalidRequestError, match="names no RayCluster"):
        RayHook("kr_host").cluster_ref()


def test_the_connection_form_has_the_kuberay_field():
    from rayslice.provider import get_provider_info

    for conn_type in get_provider_info()["connection-types"]:  # `ray`, and rayslice's own `rayslice`
        assert "kuberay" in conn_type["conn-fields"]
    assert "rayslice.operators.kuberay" in get_provider_info()["operators"][0]["python-modules"]


# --- operator arguments, checked when the DAG file is parsed


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ('tpus=["v6e-15"]', "'v6e-15' is not a v6e slice"),
        ('tpus=["v3-32"]', "no GKE node pools"),
        ("tpus=[]", "can run nothing"),
        ('tpus=["v6e-16"], name="Bad_Name"', "name of 'create' 'Bad_Name' is invalid: a RayCluster name is a DNS-1035"),
        ('tpus=["v6e-16"], head_service_type="Ingress"', "use ClusterIP, NodePort or LoadBalancer"),
        ('tpus=["v6e-16"], head_service_type="LoadBalancer", auth=False', "without Ray token auth"),
        ('tpus=["v6e-16"], head_service_type="NodePort", auth=False', "without Ray token auth"),
        ('manifest=render_raycluster("x", tpus=["v6e-4"], auth=False) | {"spec": {"headGroupSpec": '
         '{"serviceType": "LoadBalancer"}}}', "without Ray token auth"),
        ('tpus=["v6e-16"], auth=False, token_secret="mine"', "needs auth on"),
        ('tpus=["v6e-16"], name="per-run", token_secret="mine"', "cannot be used with name='per-run'"),
        ('tpus=["v6e-16"], manifest={"kind": "RayCluster"}', "either manifest or tpus"),
        ('manifest={"kind": "Pod"}', "must be a RayCluster"),
        ('tpus=["v6e-16"], ready_timeout=0', "ready_timeout=0"),
    ],
)
def test_bad_arguments_fail_the_dag_import(tmp_path, airflow_db, args, message):
    path = tmp_path / "kr_bad.py"
    path.write_text(COMMON + f'\nwith DAG("kr_bad", schedule=None, start_date=START):\n'
                             f'    CreateRayClusterOperator(task_id="create", {args})\n')
    dags, errors = load_dag_file(path)
    assert not dags
    [error] = errors.values()
    assert "InvalidRequestError" in error and message in error


def test_each_operators_cluster_has_token_auth_and_no_open_head(reference_crds):
    """What CreateRayClusterOperator sends, rendered or given, for every way of calling it that is accepted."""
    from rayslice.operators.kuberay import CreateRayClusterOperator

    from rayslice.cloud.kuberay_crds import KubeRayCrds

    crds = KubeRayCrds.from_files(reference_crds)
    given = kuberay.render_raycluster("given", tpus=["v6e-4"], head_service_type="LoadBalancer")
    cases = [  # (arguments, the token Secret, the head Service type)
        ({"tpus": ["v6e-16"]}, "rs-ray-token", "ClusterIP"),
        ({"tpus": ["v6e-16"], "gpu_nodes": 1, "head_service_type": "LoadBalancer"}, "rs-ray-token", "LoadBalancer"),
        ({"gpu_nodes": 2, "token_secret": "shared-token"}, "shared-token", "ClusterIP"),
        ({"manifest": given}, "given-ray-token", "LoadBalancer"),
    ]
    for kwargs, secret, service_type in cases:
        manifest = CreateRayClusterOperator(task_id="c", **kwargs)._manifest("rs")
        kuberay.validate(manifest, crds)
        assert manifest["spec"]["authOptions"] == {"mode": "token", "secretName": secret}, kwargs
        assert manifest["spec"]["headGroupSpec"]["serviceType"] == service_type, kwargs
    # The one unauthenticated cluster it renders when told to stays inside the Kubernetes cluster.
    open_ = CreateRayClusterOperator(task_id="c", tpus=["v6e-16"], auth=False)._manifest("rs")
    assert "authOptions" not in open_["spec"] and open_["spec"]["headGroupSpec"]["serviceType"] == "ClusterIP"


def test_a_given_manifests_per_run_cluster_keeps_its_token_in_a_secret_of_its_own():
    """Two runs sharing a manifest's one Secret: the first run's teardown would delete the second run's token."""
    from rayslice.operators.kuberay import CreateRayClusterOperator

    manifest = kuberay.render_raycluster("x", tpus=["v6e-4"], token_secret="shared")
    op = CreateRayClusterOperator(task_id="c", manifest=manifest, name="per-run")
    assert op._manifest("rs-d-0123456789")["spec"]["authOptions"] == {"mode": "token",
                                                                     "secretName": "rs-d-0123456789-ray-token"}
    assert manifest["spec"]["authOptions"]["secretName"] == "shared"  # the DAG's own dict is left as it was
    assert CreateRayClusterOperator(task_id="c", manifest=manifest, name="rs")._manifest("rs")["spec"][
        "authOptions"]["secretName"] == "shared"


def test_a_templated_name_is_checked_at_run_time():
    from rayslice.operators.kuberay import CreateRayClusterOperator

    op = CreateRayClusterOperator(task_id="c", tpus=["v6e-16"], name="rs-{{ ds_nodash }}")
    assert "name" in op.template_fields and op.name == "rs-{{ ds_nodash }}"


# --- setup/teardown in real DAG runs


@pytest.mark.parametrize("dag_id", ["kr_setup_teardown", "kr_setup_teardown_on_a_worker"],
                         ids=["waits-in-the-triggerer", "waits-on-the-worker"])
def test_a_setup_that_never_gets_ready_deletes_its_own_cluster(fake, no_ray_dags, capfd, dag_id):
    fake.ready_after_gets = None
    fake.gone_after_gets = 0
    dr = no_ray_dags[dag_id].test()
    out = capfd.readouterr().out
    assert task_states(dr)["create"] == "failed"
    assert "not ready after 0.5 s" in out
    assert ("waiting for its head in the triggerer" in out) is (dag_id == "kr_setup_teardown")
    assert fake.cluster("ml", "rs") is None  # the failed setup removed what it created
    assert not fake.secrets  # and the token Secret it made for it
    posts = [r for r in fake.requests if r[0] == "POST" and "rayclusters" in r[1]]
    deletes = [r for r in fake.requests if r[0] == "DELETE" and "rayclusters" in r[1]]
    assert len(posts) == 1 and len(deletes) == 1
    # Checked against the cluster's own RayCluster CRD before it was sent.
    paths = [p for _, p, _ in fake.requests]
    crd = paths.index("/apis/apiextensions.k8s.io/v1/customresourcedefinitions/rayclusters.ray.io")
    assert crd < paths.index(posts[0][1])


def test_a_setup_on_a_cluster_without_kuberay_creates_nothing_and_says_so(fake, no_ray_dags, capfd):
    fake.installed_crds.clear()
    dr = no_ray_dags["kr_setup_teardown"].test()
    out = capfd.readouterr().out
    assert task_states(dr)["create"] == "failed"
    assert "rayclusters.ray.io" in out and "install the KubeRay operator" in out
    assert not [r for r in fake.requests if r[0] == "POST"]


def test_a_pre_existing_cluster_is_never_deleted(fake, no_ray_dags, capfd):
    theirs = ready_cluster(fake)
    dr = no_ray_dags["kr_setup_teardown"].test()
    out = capfd.readouterr().out
    assert task_states(dr)["create"] == "failed"
    assert "already exists and was made by someone else" in out
    dr = no_ray_dags["kr_teardown_only"].test()
    assert task_states(dr) == {"use_cluster": "success", "delete": "success"}
    assert xcom_values(dr, "delete") == ["not-owned"]
    assert fake.cluster("ml", "rs") is theirs
    assert not [r for r in fake.requests if r[0] == "DELETE" and "rayclusters" in r[1]]
    assert not fake.secrets  # the token Secret the failed setup made is gone again


def test_a_token_secret_made_elsewhere_is_used_and_kept(fake, no_ray_dags, capfd):
    import base64

    token = base64.b64encode(b"operators-own-token").decode()
    fake.secrets[("ml", "rs-ray-token")] = {"apiVersion": "v1", "kind": "Secret", "data": {"auth_token": token},
                                            "metadata": {"name": "rs-ray-token", "namespace": "ml"}}
    fake.ready_after_gets = None
    fake.gone_after_gets = 0
    dr = no_ray_dags["kr_setup_teardown"].test()  # never ready: the setup fails and cleans up what it made
    assert task_states(dr)["create"] == "failed"
    assert "already there, used as is" in capfd.readouterr().out
    assert fake.secrets[("ml", "rs-ray-token")]["data"] == {"auth_token": token}


def test_teardown_of_a_missing_cluster_succeeds(fake, no_ray_dags):
    dr = no_ray_dags["kr_teardown_only"].test()
    assert task_states(dr) == {"use_cluster": "success", "delete": "success"}
    assert xcom_values(dr, "delete") == ["absent"]


def test_the_cluster_is_deleted_when_the_step_between_fails(fake, airflow_db, ray_default, monkeypatch, capfd):
    """create (setup) -> a real Ray step that fails, through the KubeRay lookup -> delete (teardown)."""
    url = httpx.URL(ray_default.dashboard_url)
    fake.load_balancer_ip = url.host
    if ray_default.token:  # a token-auth test cluster: the connection carries it as for a host
        var = f"AIRFLOW_CONN_{CONN.upper()}"
        monkeypatch.setenv(var, json.dumps({**json.loads(os.environ[var]), "password": ray_default.token}))
    dags, errors = load_dag_file(write_dag_file("kr_lifecycle", LIFECYCLE.replace("DASHBOARD_PORT", str(url.port))))
    assert not errors
    dr = dags["kr_lifecycle"].test()
    out = capfd.readouterr().out
    assert task_states(dr) == {"create": "success", "step": "failed", "delete": "success"}
    assert "the step failed on purpose" in out  # the step really ran on the Ray cluster behind the lookup
    [created] = xcom_values(dr, "create")
    assert created == {"namespace": "ml", "name": "rs", "dashboard_url": f"http://{url.host}:{url.port}"}
    assert xcom_values(dr, "delete") == ["deleted"]
    assert fake.cluster("ml", "rs") is None
    [(_, _, body)] = [r for r in fake.requests if r[0] == "POST" and "rayclusters" in r[1]]
    from airflow.models import Variable

    deployment = Variable.get("rayslice_deployment")  # the owner mark names this Airflow too (issue 38 (9))
    assert body["metadata"]["annotations"][OWNER_ANNOTATION] == f"{deployment}/kr_lifecycle/{dr.run_id}"
    assert body["spec"]["headGroupSpec"]["serviceType"] == "LoadBalancer"
    # Token auth on: the setup made the token's Secret before the cluster, the teardown removed it after.
    assert body["spec"]["authOptions"] == {"mode": "token", "secretName": "ignored-ray-token"}
    posts = [r[1] for r in fake.requests if r[0] == "POST"]
    assert posts == ["/api/v1/namespaces/ml/secrets", "/apis/ray.io/v1/namespaces/ml/rayclusters"], posts
    assert ("DELETE", "/api/v1/namespaces/ml/secrets/ignored-ray-token", None) in fake.requests
    assert not fake.secrets


# --- the deferred setup's trigger


OWNER = "kr_setup_teardown/manual__1"


def _trigger(fake, **kwargs):
    from rayslice.operators.setup_triggers import RayClusterReadyTrigger

    ref = {"namespace": "ml", "name": "rs", "kubeconfig": fake.kubeconfig, "address": "load-balancer"}
    return RayClusterReadyTrigger(ref=ref, owner=OWNER, deadline=kwargs.pop("deadline", 4e9), timeout=60,
                                  poll_interval=0.05, **kwargs)


def _created(fake) -> None:
    from rayslice.cloud.kuberay_client import ClusterRef, KubeRayClient

    manifest = kuberay.render_raycluster("rs", tpus=["v6e-4"], namespace="ml")
    manifest["spec"]["headGroupSpec"]["serviceType"] = "LoadBalancer"
    with KubeRayClient(ClusterRef(name="rs", namespace="ml", kubeconfig=fake.kubeconfig)) as kube:
        kube.create(manifest, owner=OWNER)


async def _events(trigger) -> list[dict]:
    events = [event.payload async for event in trigger.run()]
    await trigger.cleanup()
    return events


def test_the_trigger_reports_the_dashboard_once_the_cluster_is_ready(fake):
    fake.ready_after_gets = 3
    _created(fake)
    trigger = _trigger(fake)
    assert trigger.serialize()[0] == "rayslice.operators.setup_triggers.RayClusterReadyTrigger"
    [event] = asyncio.run(_events(trigger))
    assert event["status"] == "ready" and event["name"] == "rs" and event["namespace"] == "ml"
    assert event["dashboard_url"].startswith("http://") and event["dashboard_url"].endswith(":8265")


def test_the_trigger_reports_its_deadline_with_the_clusters_state(fake):
    fake.ready_after_gets = None
    _created(fake)
    [event] = asyncio.run(_events(_trigger(fake, deadline=__import__("time").time() + 0.3)))
    assert event["status"] == "timeout" and "not ready after 60 s" in event["message"], event
    assert fake.cluster("ml", "rs") is not None  # the operator deletes it when it resumes, not the trigger


def test_a_killed_deferred_setup_deletes_its_cluster_and_a_moved_one_does_not(fake, monkeypatch):
    fake.ready_after_gets = None
    fake.gone_after_gets = 0
    _created(fake)
    kill_while_still_deferred(_trigger(fake), monkeypatch)
    assert fake.cluster("ml", "rs") is not None
    asyncio.run(_trigger(fake).on_kill())  # no Airflow to ask (as when the user's kill reaches it): delete
    assert fake.cluster("ml", "rs") is None


def test_a_killed_setup_whose_state_airflow_does_not_give_keeps_its_cluster(fake, monkeypatch):
    """Issue 36, item 7: an unreadable state is not a kill (a moved trigger's cluster is still wanted)."""
    from types import SimpleNamespace

    from airflow.sdk.execution_time import task_runner

    from tests.operators.test_trigger_kill import Unanswered

    fake.ready_after_gets = None
    fake.gone_after_gets = 0
    _created(fake)
    monkeypatch.setattr(task_runner, "SUPERVISOR_COMMS", Unanswered(), raising=False)
    trigger = _trigger(fake, call_timeout=3)
    trigger._task_instance = SimpleNamespace(dag_id="d", run_id="r", task_id="t", map_index=-1)
    asyncio.run(trigger.on_kill())
    assert fake.cluster("ml", "rs") is not None


def test_a_passing_api_failure_while_waiting_is_looked_at_again_not_a_delete(fake):
    """Issue 36, item 9: a 5xx (a control-plane upgrade) or a reset connection ends no setup."""
    fake.ready_after_gets = 3
    _created(fake)
    fake.fail_next("GET", r"/rayclusters/rs$", 503)
    fake.fail_next("GET", r"/rayclusters/rs$", 500)
    [event] = asyncio.run(_events(_trigger(fake)))
    assert event["status"] == "ready", event
    fake.fail_next("GET", r"/rayclusters/rs$", 403)  # not passing: the operator deletes and fails
    [event] = asyncio.run(_events(_trigger(fake)))
    assert event["status"] == "error" and "403" in event["message"], event


def test_a_failed_setups_delete_goes_through_passing_api_failures(fake):
    """Issue 36, item 9: the delete after a failed setup meets a 5xx: asked again, the cluster does not leak."""
    from rayslice.operators.setup_triggers import retry_passing

    from rayslice.cloud.kuberay_client import ClusterRef, KubeRayClient, KubeRayError

    fake.gone_after_gets = 0
    _created(fake)
    fake.fail_next("DELETE", r"/rayclusters/rs$", 503)
    fake.fail_next("DELETE", r"/rayclusters/rs$", 502)
    with KubeRayClient(ClusterRef(name="rs", namespace="ml", kubeconfig=fake.kubeconfig)) as kube:
        assert retry_passing(lambda: kube.delete(owner=OWNER), pause=0.01) == "deleted"
        assert fake.cluster("ml", "rs") is None
        _created(fake)
        fake.fail_next("DELETE", r"/rayclusters/rs$", 403)  # a lasting failure is not asked again
        with pytest.raises(KubeRayError, match="403"):
            retry_passing(lambda: kube.delete(owner=OWNER), pause=0.01)


def test_a_step_aimed_elsewhere_than_its_upstream_setups_cluster_is_warned_about():
    """Reviewer of issue 41: a setup with name="per-run" and a step without kuberay_cluster="per-run" ran the step on
    the connection's shared cluster, without a word, while the run paid for its own."""
    from airflow.sdk import DAG
    from rayslice.operators.accelerator import AcceleratorOperator
    from rayslice.operators.kuberay import CreateRayClusterOperator

    def step(task_id, **kwargs):
        return AcceleratorOperator(task_id=task_id, ray_conn_id=CONN, accelerator="GPU", count=0.5,
                                   callable="m:f", **kwargs)

    with DAG("kr_mismatch", schedule=None):
        create = CreateRayClusterOperator(task_id="create", ray_conn_id=CONN, name="per-run", tpus=["v6e-4"])
        shared, own, other_conn = step("shared"), step("own", kuberay_cluster="per-run"), step("x")
        other_conn.ray_conn_id = "another"
        templated = step("templated", kuberay_cluster="{{ params.c }}")
        create >> [shared, own, other_conn, templated]
    assert shared.setup_mismatch() == ("'create' upstream creates the RayCluster name='per-run', but this step runs "
                                       "on the connection's cluster: give it kuberay_cluster='per-run' to run on the "
                                       "cluster the run made")
    assert own.setup_mismatch() is None and other_conn.setup_mismatch() is None
    assert templated.setup_mismatch() is None


def test_a_runs_own_setup_refuses_a_token_secret_someone_else_planted_under_its_name(fake, monkeypatch):
    """Reviewer of issue 41: an existing `<name>-ray-token` was "used as is", so whoever planted it knew the token
    of the run's cluster. For a run's own cluster only a Secret an earlier try of the same run made is used."""
    from types import SimpleNamespace

    from rayslice.operators.kuberay import CreateRayClusterOperator

    from rayslice.cloud.cluster_names import owner_for_run, per_run_name

    extra = {"kuberay": {"namespace": "ml", "name": "rs", "kubeconfig": fake.kubeconfig}, "deployment": "prod"}
    monkeypatch.setenv(f"AIRFLOW_CONN_{CONN.upper()}", json.dumps({"conn_type": "ray", "extra": extra}))
    context = {"dag_run": SimpleNamespace(dag_id="d", run_id="r1")}
    name = per_run_name("d", "r1", "prod")
    op = CreateRayClusterOperator(task_id="create", ray_conn_id=CONN, name="per-run", tpus=["v6e-4"],
                                  deferrable=False, ready_timeout=0.2, poll_interval=0.05)
    _token_secret(fake, f"{name}-ray-token", "planted")
    with pytest.raises(KubeRayError, match=f"Secret ml/{name}-ray-token was not made by the DAG run"):
        op.execute(context)
    assert ("ml", name) not in fake.clusters
    _token_secret(fake, f"{name}-ray-token", "earlier-try", owner=owner_for_run("d", "r1", "prod"))
    with pytest.raises(Exception, match="head Service .* is ClusterIP"):  # an earlier try's Secret: it goes on
        op.execute(context)
