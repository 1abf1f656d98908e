"""Two small real local Ray clusters, `set-a` and `set-b` (a v6e-4 each), for the tests of one step over
several clusters (tests/rayslice/client/test_cluster_set.py, tests/operators/test_cluster_set_step.py).

Started once per session by the `cluster_pair` fixture (tests/conftest.py), when a test first needs them;
their tests share one xdist worker (`tests/conftest.py:_group_for_workers`).
"""

from __future__ import annotations

from pathlib import Path

from rayslice.client import capacity
from rayslice.client.cluster_set import Member
from rayslice.client.jobs_client import AsyncRayJobsClient, RayJobsClient
from rayslice.local import local_cluster

SHAPE = local_cluster.ClusterSpec(tpus=("v6e-4",), gpus=0)
NAMES = ("set-a", "set-b")


class Pair:
    def __init__(self, a: local_cluster.ClusterRecord, b: local_cluster.ClusterRecord, shared: Path,
                 home: Path) -> None:
        self.records = {a.name: a, b.name: b}
        self.shared = shared
        self.home = home  # their RAYSLICE_HOME (where their records are)

    def replace_tpu_node(self, name: str) -> None:
        """A drained host's VM replaced: its node killed and started again with the same TPU identity."""
        from tests.conftest import rayslice_home

        record = self.records[name]
        index = next(i for i, node in enumerate(record.nodes) if node.slice_name)
        with rayslice_home(self.home):
            local_cluster.kill_node(record, index)
            local_cluster.restart_node(record, index)

    def members(self, *names: str) -> list[Member]:
        """Members for `run_on_set`, each with a client of its own (close them: `aclose`)."""
        return [Member(name, AsyncRayJobsClient(self.records[name].dashboard_url, token=self.records[name].token),
                       launcher="installed") for name in names]

    def free_chips(self, name: str) -> float:
        """The cluster's free TPU chips, from its own state API (not the launcher's word)."""
        record = self.records[name]
        taken = capacity.snapshot(record.dashboard_url, record.token)
        return sum(h.chips - h.chips_used for s in taken.slices for h in s.hosts if h.state == "free")

    def held_by(self, name: str, sid: str) -> list[str]:
        """What the step still holds on one cluster, from its state API: placement groups not yet removed and
        host processes alive, named `rayslice:<sid>/...` (not the launcher's word)."""
        import httpx

        record = self.records[name]
        headers = {"Authorization": f"Bearer {record.token}"} if record.token else {}
        held = []
        for kind, done in (("placement_groups", "REMOVED"), ("actors", "DEAD")):
            body = httpx.get(f"{record.dashboard_url}/api/v0/{kind}", params={"detail": "1", "limit": "10000"},
                             headers=headers, timeout=30).json()
            for row in body["data"]["result"]["result"]:
                if (row.get("name") or "").startswith(f"rayslice:{sid}") and row.get("state") != done:
                    held.append(f"{kind} {row.get('name')} {row.get('state')}")
        return held

    def jobs(self, name: str, sid: str) -> tuple[str, str]:
        """(status, log) of the step's Ray job on one cluster, from that cluster's Jobs API."""
        with RayJobsClient(self.records[name].dashboard_url, token=self.records[name].token) as client:
            job = client.get(sid)
            return job.status.value, client.logs(sid)
