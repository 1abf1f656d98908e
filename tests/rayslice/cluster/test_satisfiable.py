"""Which requests fail at once as impossible (no cluster: `ray.nodes()` snapshots are given)."""

from __future__ import annotations

import pytest

from rayslice.cluster import autoscaler, reservation
from rayslice.core.accelerators import TpuSliceRequest
from rayslice.core.exceptions import UnsatisfiableRequestError


def node(id, slice_name, worker, alive=True, pod="v6e-16"):
    return {"NodeID": id, "Alive": alive, "Resources": {"TPU": 4},
            "Labels": {"ray.io/tpu-pod-type": pod, "ray.io/tpu-slice-name": slice_name,
                       "ray.io/tpu-worker-id": str(worker)}}


@pytest.fixture(autouse=True)
def no_autoscaler(monkeypatch):
    monkeypatch.setattr(autoscaler, "may_add", lambda resource: False)


def test_a_slice_that_lost_a_host_is_waited_for_not_impossible():
    """Issue 38 (11): on a cluster of exactly two v6e-16, a preempted host made a 2-slice retry fail for good."""
    nodes = [node(f"a{w}", "a", w) for w in range(4)] + [node(f"b{w}", "b", w) for w in range(4)]
    two = TpuSliceRequest(tpu="v6e-16", num_slices=2)
    assert reservation.check_satisfiable(two, nodes, lost=frozenset({"b2"})) == {"b"}  # the GCS still shows it alive
    nodes[6]["Alive"] = False  # and once it shows it dead
    assert reservation.check_satisfiable(two, nodes) == {"b"}


def test_a_slice_type_the_cluster_never_had_is_impossible_at_once():
    nodes = [node(f"a{w}", "a", w) for w in range(4)]
    with pytest.raises(UnsatisfiableRequestError, match="has 1 intact v6e-16 slice"):
        reservation.check_satisfiable(TpuSliceRequest(tpu="v6e-16", num_slices=2), nodes)
    with pytest.raises(UnsatisfiableRequestError, match="has 0 intact v6e-4"):
        reservation.check_satisfiable(TpuSliceRequest(tpu="v6e-4"), nodes)
