"""rayslice.cluster.doctor_probe without a cluster: what it does with the nodes' answers."""

from __future__ import annotations

import threading

from rayslice.cluster import doctor_probe


def test_every_nodes_metrics_port_is_asked_at_once(monkeypatch):
    """Seen failing first: the ports were asked one after another, 5 s each where a firewall drops (not refuses)
    the port: on 64 hosts that outlasts the doctor's 300 s wait for the probe, and every other fact is lost with
    it. Here each ask waits until all have started, which only asking them at once lets happen."""
    targets = [(f"10.0.0.{i}", 8080) for i in range(6)]
    everyone = threading.Barrier(len(targets), timeout=10)

    def dropped(address, port):
        everyone.wait()
        return f"TimeoutError: {address}:{port} timed out"

    monkeypatch.setattr(doctor_probe, "_metrics", dropped)
    assert doctor_probe.metrics_errors(targets) == [f"TimeoutError: {a}:{p} timed out" for a, p in targets]
