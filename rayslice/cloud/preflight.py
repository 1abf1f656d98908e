"""`rayslice doctor`'s control-plane checks: KubeRay (CRD version, TPU webhook, RBAC) and Cloud TPU (API, zone,
service account).

Why: what breaks a first deployment on GKE or Cloud TPU is usually not the Ray cluster but what
stands around it: a KubeRay too old for ``authOptions.secretName``, no TPU webhook (multi-host slices
never form), RBAC that lets Airflow read but not create, the Cloud TPU API off, a zone without the
type, a service account that does not exist. Each function asks the control plane the one question
and returns ``rayslice.client.doctor.Check`` rows with the fix.
"""

from __future__ import annotations

import json
from typing import Any

from rayslice.client.doctor import Check
from rayslice.cloud.kuberay_crds import CrdUnavailableError, KubeRayCrds
from rayslice.cloud.kuberay_rbac import CRDS, LOOKUP, MANAGE
from rayslice.cloud.pins import KUBERAY_FLOOR, KUBERAY_HELM_VERSION

__all__ = ["cloud_tpu_checks", "kuberay_checks"]

#: How a TPU webhook is recognised: its configuration's or its service's name.
TPU_WEBHOOK_HINT = "tpu"
WEBHOOK_FIX = ("install it after cert-manager: `helm install kuberay-tpu-webhook "
               "oci://us-docker.pkg.dev/ai-on-gke/kuberay-tpu-webhook-helm/kuberay-tpu-webhook` "
               "(github.com/ai-on-gke/kuberay-tpu-webhook), or enable GKE's Ray operator add-on; without it "
               "multi-host TPU worker groups never form a slice")


#: Why a 403 on a cluster-scoped read is a warning without --kuberay-manage: the lookup-only rules of an Airflow
#: component grant none (it needs none), so the doctor run as that component cannot see them.
_ADMIN_CHECK = ("this identity may not read it, and lookup-only RBAC needs no such right; check it once with an "
                "admin's kubeconfig: `rayslice doctor --no-cluster --kuberay-namespace {namespace} --context <admin>`")


def _crd_check(api: Any, namespace: str, manage: bool) -> Check:
    try:
        fields = KubeRayCrds.from_cluster(api).auth_fields("RayCluster")
    except CrdUnavailableError as exc:
        if exc.status_code == 403 and not manage:  # lookup-only RBAC never grants this read
            return Check("kuberay crd", "WARN", str(exc), _ADMIN_CHECK.format(namespace=namespace))
        if exc.status_code in (401, 403):  # KubeRay may well be there: this identity may not look
            return Check("kuberay crd", "FAIL", str(exc),
                         "grant get on customresourcedefinitions.apiextensions.k8s.io (the `rayslice kuberay rbac` "
                         "manage role has it) to whoever runs the doctor, or check by hand: `kubectl get crd "
                         "rayclusters.ray.io -o jsonpath='{.spec.versions[*].schema.openAPIV3Schema.properties.spec"
                         ".properties.authOptions.properties}'` (secretName there: KubeRay >= "
                         f"{KUBERAY_FLOOR})")
        return Check("kuberay crd", "FAIL", str(exc),
                     f"install KubeRay >= {KUBERAY_FLOOR}: `helm install kuberay-operator kuberay/kuberay-operator "
                     f"--version {KUBERAY_HELM_VERSION}`, or enable GKE's Ray operator add-on")
    if fields is not None and "secretName" in fields:
        return Check("kuberay crd", "PASS", f"rayclusters.ray.io is KubeRay >= {KUBERAY_FLOOR} "
                     f"(authOptions: {', '.join(sorted(fields))})")
    seen = "no authOptions" if fields is None else f"authOptions: {', '.join(sorted(fields))}"
    return Check("kuberay crd", "FAIL", f"rayclusters.ray.io is from a KubeRay older than {KUBERAY_FLOOR} ({seen}): "
                 "rayslice's token-auth clusters need authOptions.secretName",
                 f"upgrade the operator: `helm upgrade --install kuberay-operator kuberay/kuberay-operator --version "
                 f"{KUBERAY_HELM_VERSION}` (CRDs too: `kubectl apply --server-side -k "
                 f"\"github.com/ray-project/kuberay/ray-operator/config/crd?ref=v{KUBERAY_HELM_VERSION}\"`), or a GKE "
                 f"version whose Ray add-on has KubeRay >= {KUBERAY_FLOOR}")


def _webhook_check(api: Any, namespace: str, manage: bool) -> Check:
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException

    try:
        resp = client.AdmissionregistrationV1Api(api).list_mutating_webhook_configuration(
            _preload_content=False, _request_timeout=10)
        items = json.loads(resp.data).get("items") or []
    except ApiException as exc:
        if exc.status == 403 and not manage:
            return Check("tpu webhook", "WARN", "could not list mutatingwebhookconfigurations: HTTP 403",
                         _ADMIN_CHECK.format(namespace=namespace))
        return Check("tpu webhook", "FAIL", f"could not list mutatingwebhookconfigurations: HTTP {exc.status} "
                     f"({exc.reason})", "grant list on mutatingwebhookconfigurations.admissionregistration.k8s.io "
                     "to whoever runs the doctor, or check by hand: `kubectl get mutatingwebhookconfigurations "
                     "| grep -i tpu`")

    def is_tpu(item: dict[str, Any]) -> bool:
        names = [item.get("metadata", {}).get("name", "")]
        names += [(w.get("clientConfig", {}).get("service") or {}).get("name", "") for w in item.get("webhooks") or []]
        return any(TPU_WEBHOOK_HINT in n.lower() for n in names)

    found = [i["metadata"]["name"] for i in items if is_tpu(i)]
    if found:
        return Check("tpu webhook", "PASS", f"mutating webhook {', '.join(found)}")
    return Check("tpu webhook", "FAIL", f"no TPU webhook among {len(items)} mutating webhook configuration(s)",
                 WEBHOOK_FIX)


def _rbac_check(api: Any, namespace: str, manage: bool, names: dict[tuple[str, str], str]) -> Check:
    """Ask, for each call rayslice makes, whether this identity may; a lookup by name asks with that name.

    Why the names: rendered rules narrow reads to names (the token Secret with ``--token-secret``, the CRD
    ``rayclusters.ray.io``), and a review without a name is not allowed by a rule with resourceNames.
    """
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException

    wanted = [(group, resource, verb, namespace) for (group, resource), verbs in LOOKUP.items() for verb in verbs]
    if manage:
        wanted += [(g, r, v, namespace) for (g, r), verbs in MANAGE.items() for v in verbs]
        wanted += [(g, r, v, None) for (g, r), verbs in CRDS.items() for v in verbs]
    denied, auth = [], client.AuthorizationV1Api(api)
    for group, resource, verb, ns in wanted:
        attrs = {"group": group, "resource": resource, "verb": verb}
        if ns:
            attrs["namespace"] = ns
        if verb == "get" and (group, resource) in names:
            attrs["name"] = names[(group, resource)]
        body = {"apiVersion": "authorization.k8s.io/v1", "kind": "SelfSubjectAccessReview",
                "spec": {"resourceAttributes": attrs}}
        try:
            resp = auth.create_self_subject_access_review(body, _preload_content=False, _request_timeout=10)
            status = json.loads(resp.data).get("status") or {}
        except ApiException as exc:
            return Check("kuberay rbac", "FAIL", f"SelfSubjectAccessReview failed: HTTP {exc.status} ({exc.reason})",
                         "the credentials may not ask the API server; check the kubeconfig")
        if not status.get("allowed"):
            named = f" {attrs['name']}" if "name" in attrs else ""
            where = f" in {ns}" if ns else " (cluster-wide)"
            what = f"{verb} {resource}{'.' + group if group else ''}{named}{where}"
            denied.append(what + (f" ({status['reason']})" if status.get("reason") else ""))
    scope = "lookup and manage" if manage else "lookup"
    if not denied:
        return Check("kuberay rbac", "PASS", f"allowed: every {scope} call rayslice makes in {namespace} "
                     f"({len(wanted)} SelfSubjectAccessReviews)")
    flag = "" if manage else " --lookup-only"
    return Check("kuberay rbac", "FAIL", "denied: " + "; ".join(denied),
                 f"apply `rayslice kuberay rbac --namespace {namespace}{flag} --service-account <this identity's "
                 "service account>` (run the doctor as that identity: in its pod, or with its kubeconfig)")


def _raycluster_check(api: Any, namespace: str, name: str, seen: dict[str, str]) -> Check:
    """The live RayCluster: ready, and its token auth as rendered (a pruned ``secretName`` means a token nobody has)."""
    from rayslice.cloud.kuberay_client import ClusterRef, KubeRayClient, KubeRayError, is_ready

    what = f"raycluster {namespace}/{name}"
    try:
        with KubeRayClient(ClusterRef(name=name, namespace=namespace), api_client=api) as kube:
            obj = kube.get()
            if obj is None:
                return Check(what, "FAIL", "no such RayCluster", "create it (`rayslice kuberay manifest ... | kubectl "
                             "apply -f -`, or CreateRayClusterOperator), or fix the name")
            auth = obj.get("spec", {}).get("authOptions") or {}
            secret = auth.get("secretName")
            if secret:
                seen["secret"] = secret  # the RBAC check asks for it by name
            if auth.get("mode") == "token" and not secret:
                return Check(what, "FAIL", "token auth without authOptions.secretName: KubeRay made its own random "
                             "token (the field was dropped or never set), so the token rayslice holds is refused",
                             f"upgrade KubeRay to >= {KUBERAY_FLOOR}, then recreate the cluster from rayslice's "
                             "manifest")
            if secret:
                kube.read_token(secret)
            state = (obj.get("status") or {}).get("state") or "no state yet"
            if not is_ready(obj):
                return Check(what, "FAIL", f"not ready ({state})", f"`kubectl describe raycluster -n {namespace} "
                             f"{name}` and `kubectl get pods -n {namespace} -l ray.io/cluster={name}`: image pulls, "
                             "a missing token Secret (CreateContainerConfigError), head resources")
    except KubeRayError as exc:
        return Check(what, "FAIL", str(exc), "see the kuberay rbac check; the token Secret must exist before the "
                     "pods start")
    token = f"token auth from Secret {secret}" if secret else "no token auth"
    return Check(what, "PASS", f"ready, {token}")


def kuberay_checks(*, namespace: str, kubeconfig: str | None = None, context: str | None = None,
                   in_cluster: bool = False, manage: bool = False, cluster: str | None = None) -> list[Check]:
    """The KubeRay CRD's version (authOptions fields), the TPU webhook, RBAC for ``namespace``, and the RayCluster
    ``cluster`` (ready, its token Secret readable)."""
    from rayslice.cloud.kuberay_client import KubeRayError, load_api_client

    try:
        api = load_api_client(kubeconfig=kubeconfig, context=context, in_cluster=in_cluster, retries=1,
                              hint="pass --kubeconfig/--context")
    except KubeRayError as exc:
        return [Check("kubernetes", "FAIL", str(exc), "pass --kubeconfig/--context, or run in a pod")]
    names = {("apiextensions.k8s.io", "customresourcedefinitions"): "rayclusters.ray.io"}
    try:
        checks = [_crd_check(api, namespace, manage), _webhook_check(api, namespace, manage)]
        if not cluster:
            return [*checks, _rbac_check(api, namespace, manage, names)]
        seen: dict[str, str] = {}
        live = _raycluster_check(api, namespace, cluster, seen)  # first: it reads the token Secret's name
        names[("ray.io", "rayclusters")] = cluster
        names[("", "secrets")] = seen.get("secret", f"{cluster}-ray-token")
        return [*checks, _rbac_check(api, namespace, manage, names), live]
    finally:
        api.close()


def _http_status(exc: Exception) -> tuple[int | None, str]:
    code = getattr(exc, "code", None)
    return (int(code) if isinstance(code, int) else None), str(getattr(exc, "message", "") or exc)


def cloud_tpu_checks(*, project: str, zone: str, tpu_type: str | None = None, service_account: str | None = None,
                     api_endpoint: str | None = None, iam_endpoint: str | None = None,
                     credentials: Any = None) -> list[Check]:
    """Cloud TPU API enabled (listing the zone's types), the zone offers ``tpu_type``, ``service_account`` exists."""
    from google.api_core import exceptions as gexc

    from rayslice.cloud import cloud_tpu

    checks: list[Check] = []
    try:
        cloud_tpu.check_project_zone(project, zone)
        client = cloud_tpu.tpu_client(api_endpoint, credentials=credentials)
        types = {t.type_ for t in client.list_accelerator_types(parent=f"projects/{project}/locations/{zone}")}
    except gexc.GoogleAPICallError as exc:
        code, message = _http_status(exc)
        disabled = code == 403 and (getattr(exc, "reason", None) == "SERVICE_DISABLED"
                                    or "has not been used" in message or "is disabled" in message)
        fix = (f"`gcloud services enable tpu.googleapis.com --project {project}`" if disabled else
               f"check --project/--zone, and that this identity has roles/tpu.viewer on {project}")
        return [Check("cloud tpu api", "FAIL", f"listing {zone}'s TPU types in {project}: HTTP {code}: {message}",
                      fix)]
    except Exception as exc:  # noqa: BLE001 - credentials, validation: all one failed check
        return [Check("cloud tpu api", "FAIL", f"{type(exc).__name__}: {exc}",
                      "run `gcloud auth application-default login`, or give the VM/pod a service account")]
    checks.append(Check("cloud tpu api", "PASS", f"tpu.googleapis.com answers for {project} ({len(types)} TPU "
                        f"type(s) in {zone})"))
    if tpu_type:
        if tpu_type in types:
            checks.append(Check("tpu type", "PASS", f"{zone} offers {tpu_type}"))
        else:
            near = sorted(t for t in types if t.split("-")[0] == tpu_type.split("-")[0]) or sorted(types)
            checks.append(Check("tpu type", "FAIL", f"{zone} does not offer {tpu_type} (it offers "
                                f"{', '.join(near[:12]) or 'none'})",
                                f"pick a zone that does: `gcloud compute tpus accelerator-types list --zone ZONE "
                                f"--filter=type:{tpu_type}`, or a type {zone} offers"))
    if service_account:
        checks.append(_service_account_check(project, service_account, iam_endpoint, credentials))
    return checks


def _service_account_check(project: str, email: str, iam_endpoint: str | None, credentials: Any) -> Check:
    """``GET iam.googleapis.com/v1/projects/-/serviceAccounts/<email>``: it exists and is enabled."""
    import google.auth
    from google.auth.transport.requests import AuthorizedSession

    fix = (f"create it: `gcloud iam service-accounts create {email.split('@')[0]} --project {project}`, give the "
           "TPU VMs that account (service_account=), and grant it what the startup script uses "
           "(roles/secretmanager.secretAccessor on the token secret, roles/storage.objectViewer on the wheel, "
           "roles/storage.objectUser on the checkpoint bucket)")
    if "@" not in email:
        return Check("service account", "FAIL", f"{email!r} is not a service account email", fix)
    try:
        if credentials is None and iam_endpoint and iam_endpoint.startswith("http://"):
            from google.auth.credentials import AnonymousCredentials

            credentials = AnonymousCredentials()
        if credentials is None:
            credentials, _ = google.auth.default(scopes=["https://www.googleapis.com/auth/cloud-platform"])
        session = AuthorizedSession(credentials)
        base = (iam_endpoint or "https://iam.googleapis.com").rstrip("/")
        resp = session.get(f"{base}/v1/projects/-/serviceAccounts/{email}", timeout=10)
    except Exception as exc:  # noqa: BLE001
        return Check("service account", "FAIL", f"could not ask IAM about {email}: {type(exc).__name__}: {exc}", fix)
    if resp.status_code == 404:
        return Check("service account", "FAIL", f"{email} does not exist", fix)
    if resp.status_code != 200:
        return Check("service account", "FAIL", f"IAM answered HTTP {resp.status_code} for {email}: "
                     f"{resp.text[:200]}",
                     f"grant this identity roles/iam.serviceAccountViewer on {project}, or: {fix}")
    if resp.json().get("disabled"):
        return Check("service account", "FAIL", f"{email} is disabled",
                     f"`gcloud iam service-accounts enable {email}`")
    return Check("service account", "PASS", f"{email} exists and is enabled")
