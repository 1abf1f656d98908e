"""The claims chain (rayslice/core/cluster_claim.py) against a writer frozen mid-claim (issue 53, found by review),
in a local folder, as the local clusters share it."""

from __future__ import annotations

from rayslice.core.cluster_claim import Claims


def test_a_claim_completed_late_never_makes_two_holders(tmp_path, monkeypatch):
    """A writer frozen between its write and the claim's creation (a paused VM, a stalled NFS write) while
    another cluster claims: the claim decides, not timing; one holds the step, never both."""
    import builtins

    a = Claims(f"file://{tmp_path}", member="a", submission_id="sid")
    b = Claims(f"file://{tmp_path}", member="b", submission_id="sid")
    real_open, seen = builtins.open, {}

    def open_then_freeze(path, mode="r", *args, **kwargs):
        f = real_open(path, mode, *args, **kwargs)
        if "claim-0" in str(path) and ".a." in str(path) and "w" in mode and "b" not in seen:
            seen["b"] = b.take()  # a froze as it wrote its claim; meanwhile b is admitted and claims
        return f

    monkeypatch.setattr(builtins, "open", open_then_freeze)
    a_state = a.take()  # a thaws, creates its claim (or finds b's), and reads the chain again
    monkeypatch.setattr(builtins, "open", real_open)
    b_holds = seen["b"].held_by("b", "sid")
    assert b_holds and not a_state.held_by("a", "sid"), (a_state, seen["b"])