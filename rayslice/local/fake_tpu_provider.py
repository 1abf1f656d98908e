"""Ray's `FakeMultiNodeProvider`, plus per-node-type environment variables for the nodes it starts.

Ray's multi-host slice reservation (`reserve_tpu_slice`) learns the slice name by running a
task on worker 0 that reads the `TPU_NAME` environment variable, not the node's labels. The
fake provider starts every node with the autoscaler's own environment, so a node type's
`node_config: {env: {...}}` is applied around the start of each of its nodes (the raylet and
its workers inherit it). Types without `env` start exactly as with the unmodified provider.

Runs inside Ray's autoscaler process (named by the cluster config's `provider.module`).
"""

from __future__ import annotations

from ray.autoscaler._private.fake_multi_node.node_provider import FakeMultiNodeProvider  # noqa: TID253 (runs in the autoscaler)

from rayslice.local.processes import environ_overlaid


class FakeTpuHostProvider(FakeMultiNodeProvider):
    def _create_node_with_resources_and_labels(self, node_config, tags, count, resources, labels):
        env = {str(k): str(v) for k, v in (node_config or {}).get("env", {}).items()}
        with self.lock, environ_overlaid(env):  # nodes start one at a time under this lock
            return super()._create_node_with_resources_and_labels(node_config, tags, count, resources, labels)
