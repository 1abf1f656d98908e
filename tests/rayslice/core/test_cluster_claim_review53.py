"""Review of issue 53 (cluster sets): the claims chain (rayslice/core/cluster_claim.py) in a local folder, as the
local clusters share it. Marked `xfail(strict=True)`: fails on the code reviewed, passes once the defect is fixed."""

from __future__ import annotations

import os
import time

import pytest

from rayslice.core.cluster_claim import VOID_AFTER_S, Claims


@pytest.mark.xfail(strict=True, reason="defect: a claim is void by its age alone (unreadable and older than "
                   "VOID_AFTER_S), but its writer may still be alive: a launcher frozen between the exclusive create "
                   "and the write (a paused VM, a stalled NFS write) completes its claim after another cluster took "
                   "the next generation, and both hold the step: timing, not the claim, decides")
def test_a_claim_completed_late_never_makes_two_holders(tmp_path):
    a = Claims(f"file://{tmp_path}", member="a", submission_id="sid")
    b = Claims(f"file://{tmp_path}", member="b", submission_id="sid")
    real_open = a.fs.open
    frozen = {"done": False}
    seen = {}

    def open_then_freeze(path, mode="rb", **kwargs):
        f = real_open(path, mode, **kwargs)
        if mode == "xb" and path.endswith("claim-0.json") and not frozen["done"]:
            # a created claim-0 and froze before writing it, for longer than VOID_AFTER_S.
            frozen["done"] = True
            old = time.time() - VOID_AFTER_S - 1
            os.utime(path, (old, old))
            seen["b"] = b.take()  # meanwhile b is admitted: claim-0 looks void, so b claims generation 1 and runs
        return f

    a.fs.open = open_then_freeze  # a's own filesystem object (fsspec may share it: only claim-0's create freezes)
    try:
        a_state = a.take()  # a thaws, writes its claim-0, and reads the chain again
    finally:
        del a.fs.open
    # b runs its body from its claim on: it reads the chain again only once its attempt ends.
    b_holds = seen["b"].held_by("b", "sid")
    assert not (a_state.held_by("a", "sid") and b_holds), \
        f"both hold the step: a by claim {a_state.generation}, b by claim {seen['b'].generation}"
