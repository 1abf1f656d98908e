"""Fixtures the cluster-side tests share."""

from __future__ import annotations

import pytest

from rayslice.cluster import notices


@pytest.fixture
def kv(monkeypatch):
    """Ray's internal KV, as the notices use it, in a dict (no cluster): puts and deletes."""
    store: dict[str, bytes] = {}
    monkeypatch.setattr(notices.internal_kv, "_internal_kv_put",
                        lambda k, v, namespace=None, **kw: store.__setitem__(k, v))
    monkeypatch.setattr(notices.internal_kv, "_internal_kv_del", lambda k, namespace=None, **kw: store.pop(k, None))
    return store
