"""A Cloud TPU v2 REST API fake: real HTTP, request and response bodies checked against the real protos.

The Cloud TPU API cannot run here, so this stands in at the HTTP transport: the real
``google-cloud-tpu`` client (REST transport, ``api_endpoint`` pointed here) talks to it. Every
QueuedResource it receives or serves, and every accelerator type it lists, is parsed strictly
(unknown fields fail) into the client library's own protobuf messages; errors are Google's JSON
error shape; long-running operations come back done. Queued resources go ACCEPTED -> PROVISIONING
-> ACTIVE over a few GETs (or FAILED), and deleting an active one needs ``force``, as on GCP.
"""

from __future__ import annotations

import json
import re
import uuid
from datetime import UTC, datetime
from typing import Any

from google.cloud import tpu_v2
from google.protobuf import json_format

from tests.http_fake import JsonHttpFake, Request

_TYPES = re.compile(r"^/v2/projects/([^/]+)/locations/([^/]+)/acceleratorTypes$")
_QUEUED = re.compile(r"^/v2/(projects/([^/]+)/locations/([^/]+))/queuedResources(?:/([^/:]+))?$")
_SERVICE_ACCOUNT = re.compile(r"^/v1/projects/[^/]+/serviceAccounts/([^/]+)$")  # IAM, on the same fake
_OPERATION = re.compile(r"^/v2/(projects/[^/]+/locations/[^/]+/operations/[^/]+)$")
DEFAULT_TYPES = ("v6e-1", "v6e-4", "v6e-8", "v6e-16", "v6e-32", "v5litepod-8", "v5litepod-16", "v4-8")


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _error(code: int, status: str, message: str) -> dict[str, Any]:
    return {"error": {"code": code, "message": message, "status": status}}


def checked(message_type: Any, payload: dict[str, Any]) -> dict[str, Any]:
    """``payload`` parsed strictly into the client's proto (unknown fields, bad enums fail)."""
    json_format.ParseDict(payload, message_type.pb(message_type()), ignore_unknown_fields=False)
    return payload


class FakeCloudTpu(JsonHttpFake):
    """``with FakeCloudTpu() as tpu:`` -> ``tpu.url`` (the ``api_endpoint``), ``tpu.queued``, ``tpu.requests``."""

    def __init__(self, *, zones: dict[str, tuple[str, ...]] | None = None, active_after_gets: int | None = 2,
                 page_size: int = 3) -> None:
        self.zones = zones or {"us-east5-b": DEFAULT_TYPES}
        self.active_after_gets = active_after_gets  # None: stays PROVISIONING
        self.fail_with: str | None = None  # a message: the resource goes FAILED instead of ACTIVE
        self.page_size = page_size
        self.api_disabled = False  # every TPU call answers 403 SERVICE_DISABLED, as for a project without the API
        self.service_accounts: dict[str, bool] = {}  # IAM: email -> disabled
        self.queued: dict[str, dict[str, Any]] = {}
        self.requests: list[tuple[str, str, dict[str, list[str]], Any]] = []  # method, path, query, body
        self._gets: dict[str, int] = {}
        self._operations: dict[str, dict[str, Any]] = {}
        super().__init__()

    def add_queued(self, parent: str, queued_id: str, body: dict[str, Any], state: str = "ACTIVE",
                   create_time: str | None = None) -> dict:
        """A queued resource someone else made (e.g. with gcloud), or made at ``create_time`` (RFC 3339)."""
        with self._lock:
            obj = self._store(parent, queued_id, body)
            obj["state"] = {"state": state, "stateInitiator": "USER"}
            if create_time:
                obj["createTime"] = create_time
            return obj

    def _store(self, parent: str, queued_id: str, body: dict[str, Any]) -> dict[str, Any]:
        obj = checked(tpu_v2.QueuedResource, json.loads(json.dumps(body)))
        obj.update(name=f"{parent}/queuedResources/{queued_id}", createTime=_now(),
                   state={"state": "ACCEPTED", "stateInitiator": "USER"})
        self.queued[obj["name"]] = obj
        self._gets[obj["name"]] = 0
        return obj

    def _operation(self, parent: str, verb: str, target: str, response: dict[str, Any], type_url: str) -> dict:
        name = f"{parent}/operations/operation-{uuid.uuid4().hex[:12]}"
        op = {"name": name, "done": True,
              "metadata": {"@type": "type.googleapis.com/google.cloud.tpu.v2.OperationMetadata",
                           "createTime": _now(), "endTime": _now(), "target": target, "verb": verb,
                           "apiVersion": "v2"},
              "response": {"@type": type_url, **response}}
        self._operations[name] = op
        return op

    def _advance(self, obj: dict[str, Any]) -> None:
        """Time passes in GETs: ACCEPTED -> PROVISIONING -> ACTIVE (or FAILED)."""
        name = obj["name"]
        self._gets[name] += 1
        state = obj["state"]["state"]
        if state in ("ACCEPTED", "PROVISIONING") and self.fail_with:
            obj["state"] = {"state": "FAILED", "stateInitiator": "SERVICE",
                            "failedData": {"error": {"code": 8, "message": self.fail_with}}}
        elif state == "ACCEPTED":
            obj["state"] = {"state": "PROVISIONING", "stateInitiator": "USER", "provisioningData": {}}
        elif state == "PROVISIONING" and self.active_after_gets is not None \
                and self._gets[name] >= self.active_after_gets:
            obj["state"] = {"state": "ACTIVE", "stateInitiator": "USER", "activeData": {}}

    def _handle(self, method: str, path: str, query: dict[str, list[str]], body: Any) -> tuple[int, Any]:
        self.requests.append((method, path, query, body))
        if m := _SERVICE_ACCOUNT.match(path):
            if m[1] not in self.service_accounts:
                return 404, _error(404, "NOT_FOUND", f"Unknown service account {m[1]}")
            return 200, {"email": m[1], "name": f"projects/-/serviceAccounts/{m[1]}",
                         "disabled": self.service_accounts[m[1]]}
        if self.api_disabled:
            return 403, {"error": {"code": 403, "status": "PERMISSION_DENIED", "message":
                                   "Cloud TPU API has not been used in project 123456789 before or it is disabled. "
                                   "Enable it by visiting https://console.developers.google.com/apis/api/"
                                   "tpu.googleapis.com/overview?project=123456789 then retry.",
                                   "details": [{"@type": "type.googleapis.com/google.rpc.ErrorInfo",
                                                "reason": "SERVICE_DISABLED", "domain": "googleapis.com",
                                                "metadata": {"service": "tpu.googleapis.com"}}]}}
        if m := _TYPES.match(path):
            if method != "GET":
                return 405, _error(405, "UNIMPLEMENTED", "method not served")
            zone = m[2]
            if zone not in self.zones:
                return 404, _error(404, "NOT_FOUND", f"Location projects/{m[1]}/locations/{zone} not found")
            types = self.zones[zone]
            start = int((query.get("pageToken") or ["0"])[0])
            page = types[start:start + self.page_size]
            out: dict[str, Any] = {"acceleratorTypes": [
                checked(tpu_v2.AcceleratorType, {"name": f"projects/{m[1]}/locations/{zone}/acceleratorTypes/{t}",
                                                 "type": t}) for t in page]}
            if start + self.page_size < len(types):
                out["nextPageToken"] = str(start + self.page_size)
            return 200, out
        if m := _OPERATION.match(path):
            op = self._operations.get(m[1])
            return (200, op) if op else (404, _error(404, "NOT_FOUND", f"operation {m[1]} not found"))
        m = _QUEUED.match(path)
        if not m:
            return 404, _error(404, "NOT_FOUND", f"the fake does not serve {path}")
        parent, zone, queued_id = m[1], m[3], m[4]
        if zone not in self.zones:
            return 404, _error(404, "NOT_FOUND", f"Location {parent} not found")
        if method == "GET" and queued_id is None:  # list, a page at a time
            names = sorted(n for n in self.queued if n.startswith(f"{parent}/"))
            start = int((query.get("pageToken") or ["0"])[0])
            out = {"queuedResources": [checked(tpu_v2.QueuedResource, self.queued[n])
                                       for n in names[start:start + self.page_size]]}
            if start + self.page_size < len(names):
                out["nextPageToken"] = str(start + self.page_size)
            return 200, out
        if method == "POST" and queued_id is None:
            queued_id = (query.get("queuedResourceId") or [""])[0]
            name = f"{parent}/queuedResources/{queued_id}"
            if name in self.queued:
                return 409, _error(409, "ALREADY_EXISTS", f"Resource '{name}' already exists")
            try:
                checked(tpu_v2.QueuedResource, body or {})
            except json_format.ParseError as exc:
                return 400, _error(400, "INVALID_ARGUMENT", f"Invalid JSON payload received. {exc}")
            for spec in body.get("tpu", {}).get("nodeSpec", []):
                kind = spec.get("node", {}).get("acceleratorType")
                if kind not in self.zones[zone]:
                    return 400, _error(400, "INVALID_ARGUMENT", f"Accelerator type {kind} not available in {zone}")
            obj = self._store(parent, queued_id, body)
            return 200, self._operation(parent, "create", name, checked(tpu_v2.QueuedResource, obj),
                                        "type.googleapis.com/google.cloud.tpu.v2.QueuedResource")
        name = f"{parent}/queuedResources/{queued_id}"
        obj = self.queued.get(name)
        if obj is None:
            return 404, _error(404, "NOT_FOUND", f"Resource '{name}' was not found")
        if method == "GET":
            self._advance(obj)
            return 200, checked(tpu_v2.QueuedResource, obj)
        if method == "DELETE":
            force = (query.get("force") or ["false"])[0] == "true"
            if obj["state"]["state"] == "ACTIVE" and not force:
                return 400, _error(400, "FAILED_PRECONDITION", "Cannot delete an ACTIVE queued resource with "
                                   "nodes: delete the nodes first or pass force")
            del self.queued[name]
            return 200, self._operation(parent, "delete", name, {}, "type.googleapis.com/google.protobuf.Empty")
        return 405, _error(405, "UNIMPLEMENTED", f"the fake does not serve {method} {path}")

    def answer(self, request: Request) -> tuple[int, Any]:
        return self._handle(request.method, request.path, request.query, request.body)
