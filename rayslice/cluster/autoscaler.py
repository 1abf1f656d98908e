"""Whether an autoscaler may add a node with a given resource: then "not in the cluster now" is not "never".

The admission queue counts such a kind as the most it can hold, a reservation waits for the node
instead of failing as unsatisfiable, and a host ships the launcher to a node that may not exist yet.
Its own module because the queue (`queue`) and the reservation (`reservation`, which holds a queue
place) both ask it: neither imports the other for it.
"""

from __future__ import annotations

import ray


def may_add(resource: str) -> bool:
    """Whether an autoscaler node group declares `resource`, or an autoscaler whose groups we cannot see runs."""
    config = ray._private.state.state.get_cluster_config()
    groups = list(config.node_group_configs) if config else []
    if any(resource in group.resources and group.max_count != 0 for group in groups):
        return True
    return config is None and _running()  # Ray 2.60's autoscaler does not report its node groups


def _running() -> bool:
    """Whether an autoscaler v2 has reported its state to the GCS (KubeRay's, or `ray start` with v2 on).

    Not v1: every head without an autoscaling config runs a read-only v1 monitor that reports
    the same way, so v1's report cannot tell "may add a slice" from "never will".
    """
    from ray.core.generated.autoscaler_pb2 import GetClusterStatusReply

    reply = GetClusterStatusReply.FromString(ray._private.worker.global_worker.gcs_client.get_cluster_status())
    return reply.autoscaling_state.autoscaler_state_version > 0
