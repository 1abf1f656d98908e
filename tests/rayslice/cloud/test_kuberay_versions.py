"""Every KubeRay release in shared/reference: what rayslice renders is accepted and token auth works on it,
or rayslice refuses before anything is created, naming the version it needs.

`authOptions.secretName` first shipped in KubeRay 1.6.0 (ray-project/kuberay PR #4554); the 1.5.1 CRD
has `authOptions.mode` only. The Kubernetes fake serves and enforces each release's own CRDs.
"""

from __future__ import annotations

import base64

import pytest

from rayslice.cloud import kuberay, pins
from rayslice.cloud.kuberay_client import ClusterRef, KubeRayClient, KubeRayError
from rayslice.cloud.kuberay_crds import KubeRayCrds
from rayslice.core.exceptions import InvalidRequestError
from tests.conftest import KUBERAY_RELEASES, kuberay_release_crds
from tests.fake_kubernetes import FakeKubernetes

OWNER = "prod/nightly/manual__2026-12-06"
SUPPORTED = tuple(r for r in KUBERAY_RELEASES if tuple(map(int, r[1:].split("."))) >= (1, 6, 0))
TOO_OLD = tuple(r for r in KUBERAY_RELEASES if r not in SUPPORTED)


def rendered() -> list[dict]:
    return [kuberay.render_raycluster("rs", tpus=["v6e-16"], gpu_nodes=1, namespace="ml"),
            kuberay.render_rayjob("rs-job", entrypoint="python -m train", namespace="ml",
                                  cluster=kuberay.render_raycluster("rs", tpus=["v6e-16"], namespace="ml"))]


def test_the_floor_is_a_release_we_check():
    assert pins.KUBERAY_FLOOR == "1.6.0" and SUPPORTED and TOO_OLD
    assert f"v{pins.KUBERAY_HELM_VERSION}" in KUBERAY_RELEASES  # the Helm pin the docs give is checked too


@pytest.mark.parametrize("release", SUPPORTED)
def test_rendered_manifests_validate_on_supported_releases(release):
    crds = KubeRayCrds.from_files(kuberay_release_crds(release))
    for manifest in rendered():
        assert release in kuberay.validate(manifest, crds)
    assert "secretName" in crds.auth_fields("RayCluster") and "secretName" in crds.auth_fields("RayJob")


@pytest.mark.parametrize("release", TOO_OLD)
def test_older_releases_are_refused_by_version_not_by_a_schema_path(release):
    crds = KubeRayCrds.from_files(kuberay_release_crds(release))
    for manifest in rendered():
        with pytest.raises(InvalidRequestError, match=r"older than 1\.6\.0 \(authOptions with mode only\).*"
                                                      r"authOptions\.secretName.*--version 1\.7\.0"):
            kuberay.validate(manifest, crds)
    # Without token auth nothing needs the newer field.
    plain = kuberay.render_raycluster("rs", tpus=["v6e-16"], auth=False)
    assert release in kuberay.validate(plain, crds)


@pytest.mark.parametrize("release", KUBERAY_RELEASES)
def test_on_the_kubernetes_fake_token_auth_works_or_nothing_is_created(release, tmp_path):
    """The operator's order (check, Secret, RayCluster) against an API server with that release installed."""
    with FakeKubernetes(crds=kuberay_release_crds(release)) as fake:
        ref = ClusterRef(name="rs", namespace="ml", kubeconfig=str(fake.write_kubeconfig(tmp_path / "kc")))
        manifest = kuberay.render_raycluster("rs", tpus=["v6e-16"], namespace="ml")
        secret = manifest["spec"]["authOptions"]["secretName"]
        with KubeRayClient(ref) as kube:
            if release in TOO_OLD:
                with pytest.raises(InvalidRequestError, match=r"KubeRay older than 1\.6\.0.*nothing was created"):
                    kube.check(manifest)
                assert not fake.clusters and not fake.secrets
                assert not [r for r in fake.requests if r[0] == "POST"]
                return
            kube.check(manifest)
            assert kube.ensure_token_secret(secret, owner=OWNER)
            kube.create(manifest, owner=OWNER)
            token = kube.read_token(secret)
        stored = fake.cluster("ml", "rs")
        # What KubeRay >= 1.6 reads: the Secret authOptions names, key auth_token, the token the client sends.
        assert stored["spec"]["authOptions"] == {"mode": "token", "secretName": secret}
        data = fake.secrets[("ml", secret)]["data"][kuberay.TOKEN_SECRET_KEY]
        assert base64.b64decode(data).decode() == token


def test_an_unreadable_crd_does_not_let_an_old_kuberay_drop_the_token_secret(tmp_path):
    """Without read access to CRDs the client cannot check first; the API server's default (fieldValidation=Warn)
    would drop authOptions.secretName on KubeRay 1.5 and the operator would make its own random token (a 401 on
    every step). The client asks for strict field validation, so the create is refused instead."""
    with FakeKubernetes(crds=kuberay_release_crds("v1.5.1")) as fake:
        ref = ClusterRef(name="rs", namespace="ml", kubeconfig=str(fake.write_kubeconfig(tmp_path / "kc")))
        fake.fail_next("GET", r"/customresourcedefinitions/", 403)
        manifest = kuberay.render_raycluster("rs", tpus=["v6e-16"], namespace="ml")
        with KubeRayClient(ref) as kube, pytest.raises(KubeRayError, match=r"HTTP 422"):
            kube.create(manifest, owner=OWNER)
        assert fake.cluster("ml", "rs") is None
