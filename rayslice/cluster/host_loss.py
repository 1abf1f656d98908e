"""Which host a gang's failure is blamed on, and whether its node was lost or only its process.

A host's death makes its peers' collectives fail, and Ray may report those failures first; a
coordinator's death ends its whole group. Naming the wrong host sends the user to the wrong
log, and reading a dead node as a dead process turns a preemption (a whole-gang retry on fresh
capacity) into a failed try. So each failure the driver gets is read here: the error that names
the host, the short windows in which Ray may still name the real cause, and the node's fate.
"""

from __future__ import annotations

import time
import traceback
from typing import Any

import ray
from ray.exceptions import RayActorError, RayTaskError

from rayslice.cluster import commands, node_probe
from rayslice.cluster.environments import HostPlan
from rayslice.core.exceptions import HostLostError, PreemptedError, StepFailedError

#: How long a lost host's node may take to be declared dead (Ray's default health checks: 3 s x 5).
NODE_DEATH_WINDOW_S = 30.0
#: How long a failed collective waits for Ray to report the peer whose death caused it.
PEER_DEATH_WINDOW_S = 2.0
#: How long a lost host waits for its group's coordinator to be reported lost too (then the coordinator is named).
COORDINATOR_DEATH_WINDOW_S = 1.0
#: After a command step's program failed like a lost peer: how long the program that caused it may take to be reported.
PROGRAM_END_WINDOW_S = 2.0
#: Failures that may be a peer's death: JAX/XLA runtime errors, and what a broken link says.
RUNTIME_ERRORS = ("JaxRuntimeError", "XlaRuntimeError")
PEER_LOSS_SIGNS = ("Connection reset", "Connection closed", "Connection refused", "Broken pipe", "UNAVAILABLE",
                   "DEADLINE_EXCEEDED", "heartbeat")


def get_result(ref: Any, plan: HostPlan) -> Any:
    """A host's return value, or the error that names the host and why it failed."""
    where = where_is(plan)
    try:
        return ray.get(ref)
    except RayTaskError as exc:
        raised = exc.cause if isinstance(exc.cause, BaseException) else exc
        cause = f"{type(raised).__name__}: {raised}"
        exit_code = ended_at = None
        if isinstance(raised, commands.CommandExitError):  # the program's own failure: its lines, not our stack
            error, message, exit_code = StepFailedError, f"step failed on {where}: {raised}", raised.exit_code
            ended_at = raised.ended_at
        else:
            error, message = StepFailedError, f"step failed on {where}: {cause}\n{_remote_traceback(exc)}"
    except RayActorError as exc:
        exit_code = ended_at = None
        node_lost = node_was_lost(exc)
        cause = "its node was preempted or removed" if node_lost else "its process died"
        error = PreemptedError if node_lost else HostLostError
        message = f"host {where} was lost: {cause} ({_first_line(exc)})"
    failure = error(message, slice_index=plan.slice_index, worker_id=plan.worker_id, host=plan.ip, cause=cause,
                    exit_code=exit_code)
    if ended_at is not None:
        failure.program_ended_at = ended_at  # the driver names the program that ended first (driver-side only)
    raise failure from None


def where_is(plan: HostPlan) -> str:
    return f"{plan.label} (slice {plan.slice_index}, worker {plan.worker_id}, {plan.ip})"


def node_was_lost(exc: BaseException) -> bool:
    """Preemption (the node died or was drained) as opposed to the step's own process dying."""
    text = str(exc).lower()
    return (
        bool(getattr(exc, "preempted", False))
        or "node has died" in text
        or "node died" in text
        or "draining" in text
        or "node was terminated" in text
    )


def node_died(node_id: str, actor: Any, within: float = NODE_DEATH_WINDOW_S) -> bool:
    """Whether a lost host's node is gone, as far as the GCS or its raylet can tell within `within` seconds.

    A killed node first surfaces as an unreachable actor ("Socket closed"); the GCS marks the
    node dead only after its health checks fail (~10 s), so a raylet that accepts no connection
    twice in a row is taken as the node's loss at once. A process that died on a live node is
    reported dead by its raylet at once, so that case returns quickly.
    """
    if not node_id:
        return False
    actor_id = actor._actor_id.hex()
    deadline = time.monotonic() + within
    unreachable = 0
    while True:
        actor_info = ray._private.state.state.actor_table(actor_id)
        node = next((n for n in ray.nodes() if n["NodeID"] == node_id), None)
        if node is None or not node["Alive"] or "node has died" in str(actor_info.get("DeathCause", "")):
            return True
        if actor_info.get("State") == "DEAD" or time.monotonic() > deadline:
            return False  # the process died on a node that is still alive
        unreachable = unreachable + 1 if node_probe.raylet_unreachable(node_id) else 0
        if unreachable >= 2:
            return True
        time.sleep(0.2)


def with_node(error: PreemptedError, plan: HostPlan) -> PreemptedError:
    """The lost host's node and slice ride on the error: the retry avoids them while the GCS still shows them."""
    error.node_id = plan.node_id
    error.slice_name = plan.slice_name
    return error


def dead_nodes(node_ids: set[str]) -> set[str]:
    """Which of these nodes the GCS has declared dead (or no longer knows)."""
    alive = {node["NodeID"] for node in ray.nodes() if node["Alive"]}
    return {node_id for node_id in node_ids if node_id and node_id not in alive}


def may_be_a_peers_death(exc: StepFailedError) -> bool:
    """A failure inside JAX's runtime (a collective, the coordination service) may be a peer's death.

    Only those are worth waiting up to PEER_DEATH_WINDOW_S for Ray to name a dead host; the
    step's own exceptions (a ValueError in user code) fail the gang at once.
    """
    cause = exc.cause or ""
    return cause.startswith(RUNTIME_ERRORS) or any(sign in cause for sign in PEER_LOSS_SIGNS)


def lost_peer(
    pending: list[Any], refs: dict[Any, int], plans: list[HostPlan], within: float = PEER_DEATH_WINDOW_S
) -> tuple[int, HostLostError] | None:
    """The host whose process or node died, if Ray reports one within `within` seconds."""
    deadline = time.monotonic() + within
    pending = list(pending)
    while pending:
        ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            return None
        index = refs[ready[0]]
        try:
            get_result(ready[0], plans[index])
        except HostLostError as exc:
            return index, exc
        except StepFailedError:
            continue
    return None


def first_program_to_end(index: int, error: StepFailedError, pending: list[Any], refs: dict[Any, int],
                          plans: list[HostPlan], within: float = PROGRAM_END_WINDOW_S) -> tuple[int, StepFailedError]:
    """The host whose program failed first: the cause, not a peer whose collective it broke.

    A program that ends breaks its peers' collectives, and their programs then fail too (exit 1,
    "Connection reset by peer" in their last lines); on a loaded machine such a failure can reach
    the driver first. A failure whose last lines read like a lost peer waits up to `within` for
    the others: one that does not read so wins, then the program that ended first (each failure
    carries when its program ended). A host lost in that window (its process or node died) is the
    cause instead. A failure that reads like the program's own is named at once.
    """
    first = (index, error)
    deadline = time.monotonic() + within
    pending = list(pending)
    while pending and _reads_like_a_lost_peer(first[1]):
        ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            break
        other = refs[ready[0]]
        try:
            get_result(ready[0], plans[other])
        except HostLostError as lost:
            return coordinator_first(other, lost, pending, refs, plans)
        except StepFailedError as failed:
            if getattr(failed, "program_ended_at", None) is not None and _rank(failed) < _rank(first[1]):
                first = (other, failed)
    return first


def _reads_like_a_lost_peer(error: StepFailedError) -> bool:
    return any(sign in (error.cause or "") for sign in PEER_LOSS_SIGNS)


def _rank(error: StepFailedError) -> tuple[bool, float]:
    return _reads_like_a_lost_peer(error), error.program_ended_at


def coordinator_first(index: int, error: HostLostError, pending: list[Any], refs: dict[Any, int],
                       plans: list[HostPlan], within: float = COORDINATOR_DEATH_WINDOW_S) -> tuple[int, HostLostError]:
    """The lost host to name: its group's coordinator, if that died too, else `index`.

    JAX ends every process of a group whose coordinator process died, and Ray may report one of
    those deaths before the coordinator's own. So a lost host that is not its group's coordinator
    waits up to `within` for the coordinator's outcome; a coordinator lost too is the cause.
    """
    plan = plans[index]
    if plan.process_id == 0 or plan.num_processes <= 1:
        return index, error
    coordinator = [ref for ref in pending
                   if plans[refs[ref]].process_id == 0 and plans[refs[ref]].coordinator == plan.coordinator]
    ready, _ = ray.wait(coordinator, timeout=within) if coordinator else ([], [])
    if not ready:
        return index, error
    try:
        get_result(ready[0], plans[refs[ready[0]]])
    except HostLostError as lost:
        message = f"{lost}; {plan.label} ended with it (JAX ends every process of a group whose coordinator died)"
        return refs[ready[0]], type(lost)(message, slice_index=lost.slice_index, worker_id=lost.worker_id,
                                          host=lost.host, cause=lost.cause)
    except StepFailedError:
        pass
    return index, error


def _remote_traceback(exc: RayTaskError) -> str:
    text = str(exc)
    return text if "Traceback" in text else "".join(traceback.format_exception(exc))


def _first_line(exc: BaseException) -> str:
    lines = [line for line in str(exc).splitlines() if line.strip()]
    return lines[0][:300] if lines else type(exc).__name__
