"""A launcher on one cluster of a set: it stands by while another cluster holds the step, claims it once
admitted here, releases it after a suspension, and ends the standbys when the step ends.

The claims themselves are `rayslice.core.cluster_claim` (files in the step's shared checkpoint folder).
Here is when the launcher reads and writes them:

- before it joins its cluster's queue, and while it waits there (every `POLL_S`): a generation held by
  another cluster sends it out of the queue to stand by; the step's end (`done`) ends this job with
  `RanElsewhereError`;
- once admitted, before anything is reserved: it claims the generation in play; a lost race gives the
  admission back (`place.leave`) and it stands by. A cluster later in the set's preference order waits
  `PREFERENCE_STEP_S` per place first when an earlier one was admitted too (`admitted`), so a tie goes to
  the earlier one;
- after an attempt that resumes (a notice, a lost slice), once every host ended: it releases the
  generation, so that whichever cluster admits the step next runs it, from the same checkpoint;
- when the step ends here (succeeded, failed, stopped): `done`.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from rayslice.core.cluster_claim import Claims, ClaimState
from rayslice.core.exceptions import InvalidRequestError, RanElsewhereError
from rayslice.core.step import StepSpec

#: How often a standby (or a launcher waiting in its queue) looks at the claims.
POLL_S = 1.0
#: A tie goes to the cluster first in the set's order: each later place waits this much before it claims.
PREFERENCE_STEP_S = 0.25
#: Reads and the end's write are tried this many times (0.5, 1, 2 s apart) through a storage outage.
READ_TRIES = 4

T = TypeVar("T")


def retried(call: Callable[[], T]) -> T:
    """`call()`, asked again through a storage outage (a 503, a timeout): `READ_TRIES` tries, 0.5, 1, 2 s apart;
    the last try's error is raised."""
    for attempt in range(READ_TRIES - 1):
        try:
            return call()
        except Exception:
            time.sleep(min(4.0, 0.5 * 2 ** attempt))
    return call()


class SetMember:
    """This job's part in a step that names several clusters (`StepSpec.cluster_set`)."""

    def __init__(self, spec: StepSpec, checkpoint_dir: str | None, log: Callable[[str], None]) -> None:
        clusters = spec.cluster_set
        assert clusters is not None
        if not checkpoint_dir:
            raise InvalidRequestError(
                f"this step names the clusters {', '.join(clusters.members)} (set {clusters.name!r}), which keep "
                "apart through claims in its checkpoint folder, but it has none: give it a checkpoint_root every "
                "cluster can read (e.g. gs://bucket/ckpt)")
        self.clusters = clusters
        self.claims = Claims(checkpoint_dir, member=clusters.member, submission_id=spec.owner.submission_id or "adhoc")
        self.log = log
        self.generation: int | None = None  # the generation this job holds, while it does
        # The step's preemption retries used on every cluster of the set before this job's claim: one budget
        # (`preemption_retries`) for the whole set, not one per cluster.
        self.retries_used = 0
        self.preemption_retries = spec.preemption_retries
        self._said: tuple | None = None
        self._looked = 0.0
        self._elsewhere = False
        self._last: ClaimState | None = None  # the last state read, for a read that fails

    def _state(self) -> ClaimState:
        """The claims now. Storage that fails a read (a 503, a timeout) is asked again, up to `READ_TRIES` times;
        then the last state read stands (nothing changed, as far as this job can tell), or, before any, it raises."""
        try:
            self._last = retried(self.claims.state)
        except Exception as exc:
            if self._last is None:
                raise
            self.log(f"cluster set {self.clusters.name}: could not read the claims ({type(exc).__name__}: {exc}); "
                     "going on as they last read")
        return self._last

    def _mine(self, state: ClaimState) -> bool:
        return state.held_by(self.claims.member, self.claims.submission_id)

    def _elsewhere_now(self, state: ClaimState) -> bool:
        return state.done is not None or (state.holder is not None and not self._mine(state))

    def must_stand_by(self) -> bool:
        """Whether another cluster holds the step now (or it ended): then this job waits out of its queue."""
        return self._elsewhere_now(self._state())

    def stand_by(self) -> None:
        """Until the generation in play is free (or this job's): out of the queue, holding nothing."""
        while True:
            state = self._state()
            if state.done is not None and state.done.get("killed"):
                raise RanElsewhereError(
                    f"its Airflow task was stopped ({state.done.get('outcome', 'killed')}); cluster "
                    f"{self.clusters.member} ends without running it")
            if state.done is not None and state.done.get("superseded_by"):
                raise RanElsewhereError(
                    f"a later Airflow try of this task (Ray job {state.done['superseded_by']}) superseded this one; "
                    f"cluster {self.clusters.member} ends without running it")
            if state.done is not None:
                raise RanElsewhereError(
                    f"cluster {state.done.get('cluster', '?')} of set {self.clusters.name!r} ran this step "
                    f"({state.done.get('outcome', 'ended')}); cluster {self.clusters.member} stood by and ends "
                    "without running it")
            if state.holder is None or self._mine(state):
                return
            said = (state.generation, state.holder.get("cluster"))
            if said != self._said:
                self._said = said
                self.log(f"cluster set {self.clusters.name}: cluster {said[1]} runs the step (claim {said[0]}); "
                         f"{self.clusters.member} stands by, out of its queue, until it ends or is suspended")
            time.sleep(POLL_S)

    def taken_elsewhere(self) -> bool:
        """While waiting in the queue: whether another cluster claimed the step (looked at once per POLL_S)."""
        now = time.monotonic()
        if now - self._looked >= POLL_S:
            self._looked = now
            self._elsewhere = self._elsewhere_now(self._state())
        return self._elsewhere

    def admitted(self) -> None:
        """This cluster's queue admitted the step: say so, off the step's path (a thread), so that a cluster later
        in the set's order that is admitted at about the same time gives this one its preference."""
        generation = self._last.generation if self._last is not None else 0

        def note() -> None:
            with contextlib.suppress(Exception):  # only a hint: without it, a tie goes to whoever claims first
                self.claims.note_admitted(generation)

        threading.Thread(target=note, name="rayslice-set-admitted", daemon=True).start()

    def _ahead_of_me(self) -> bool:
        """Whether a cluster earlier in the set's order was admitted for the generation in play."""
        earlier = set(self.clusters.members[: self.clusters.rank])
        generation = self._last.generation if self._last is not None else 0
        try:
            return bool(self.claims.admitted(generation) & earlier)
        except Exception:  # storage that cannot list: wait, as if one were
            return True

    def claim(self) -> bool:
        """Admitted here and capacity held: claim the step before any host starts. False: another cluster has it.

        A cluster later in the set's order waits `PREFERENCE_STEP_S` per place first, but only when an earlier
        one was admitted too (its `admitted` note): a tie goes to the earlier one, and a step whose earlier
        clusters are full pays nothing for being on a set."""
        if self.clusters.rank and self._ahead_of_me():
            time.sleep(PREFERENCE_STEP_S * self.clusters.rank)
        try:
            state = self.claims.take()
        except BaseException:  # stopped (or storage failed) after the claim was made: the end still writes `done`
            with contextlib.suppress(Exception):
                if self._mine(now := self.claims.state()):
                    self.generation = now.generation
            raise
        if not self._mine(state):
            return False
        self.generation = state.generation
        if (after := self._state()).done is not None:  # ended from Airflow as it claimed (a kill, a later try)
            self.log(f"cluster set {self.clusters.name}: the step was ended ({after.done.get('outcome', 'ended')}) "
                     f"as cluster {self.clusters.member} claimed it: it does not run here")
            return False
        self.retries_used = self._retries_before(state.generation)
        used = f"; {self.retries_used} preemption retries used so far on the set" if self.retries_used else ""
        self.log(f"cluster set {self.clusters.name}: the step runs on cluster {self.clusters.member} "
                 f"(claim {state.generation}{used})")
        return True

    @property
    def resumptions_left(self) -> int:
        """The set's preemption retries left, as of this job's claim."""
        return max(0, self.preemption_retries - self.retries_used)

    def _retries_before(self, generation: int) -> int:
        """What the previous holder said it had used (read again through a storage outage; 0 if never read)."""
        try:
            return retried(lambda: self.claims.retries_before(generation))
        except Exception:
            self.log(f"cluster set {self.clusters.name}: could not read the retries used before claim {generation}; "
                     "counting this cluster's own")
            return 0

    def count_retries(self) -> int:
        """Before joining this cluster's queue: the set's preemption retries left, as the chain says now (a step
        with none left must not wait as a priority victim here, whatever this cluster's own count)."""
        generation = self._last.generation if self._last is not None else self._state().generation
        self.retries_used = max(self.retries_used, self._retries_before(generation))
        return self.resumptions_left

    def release(self, why: str, retries_used: int = 0) -> None:
        """Every host of the attempt ended and the step resumes: whichever cluster admits it next runs it.

        `retries_used`: the set's preemption retries used, this suspension's included (the next holder's start).
        The write is tried again through a storage outage (4 tries); this job holds the generation until it is
        written, and a release that never could be written fails the step here (its end then writes `done`)."""
        if self.generation is None:
            return
        generation = self.generation
        try:
            retried(lambda: self.claims.release(generation, why, retries_used))
        except Exception as exc:
            raise RuntimeError(f"cluster set {self.clusters.name}: could not release claim {generation} "
                               f"({type(exc).__name__}: {exc}): the step cannot move to another cluster and ends "
                               "here") from exc
        self.generation = None
        self.log(f"cluster set {self.clusters.name}: released claim {generation}; the step waits in every "
                 f"cluster's queue of {', '.join(self.clusters.members)} again, at its original arrival")

    def finish(self, outcome: str) -> None:
        """The step ended on this cluster: the other clusters' jobs end without running it. Never raises: the
        step's outcome stands (a standby left waiting is stopped by the submitter, who has the outcome)."""
        if self.generation is None:
            return
        try:
            retried(lambda: self.claims.finish(outcome))
        except Exception as exc:
            self.log(f"cluster set {self.clusters.name}: could not write the step's end to the claims "
                     f"({type(exc).__name__}: {exc}); the other clusters' jobs are stopped by the submitter")
