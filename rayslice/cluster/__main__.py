"""The Ray job's driver: `python -m rayslice.cluster spec.json`.

Prints phase lines, every host's output (prefixed `(slice/hostN pid=...)` by Ray), and
finally one marked result or error line that the Airflow side reads back.
"""

from __future__ import annotations

import os
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from rayslice.core.exceptions import RanElsewhereError, RaysliceError, StepFailedError, error_fields
from rayslice.core.step import ResultTooLargeError, StepSpec, format_error, format_result


class StopRequested(KeyboardInterrupt):
    """The job was stopped (SIGTERM from `ray job stop`): unwind through every release path.

    A KeyboardInterrupt, because that is the one exception Ray's blocking calls (`ray.wait`,
    `ray.get`) let out of a signal handler: they turn it into a plain KeyboardInterrupt and drop
    any other. So the handler also sets `_stop_requested`, which tells the two apart.
    """


_stop_requested = False
#: How often the driver's blocking Ray calls let a signal handler run (ms).
SIGNAL_CHECK_MS = 50


def _stop(signum: int, frame: object) -> None:
    global _stop_requested
    _stop_requested = True
    raise StopRequested


def main(argv: list[str]) -> int:
    main_entered = time.time()
    spec = StepSpec.model_validate_json(Path(argv[1] if len(argv) > 1 else "spec.json").read_text())
    tag = spec.marker_tag
    here = f"{sys.version_info[0]}.{sys.version_info[1]}"
    if spec.pickled and spec.python != here:
        print(
            format_error(
                "InvalidRequestError",
                (
                    f"the step function was serialized by Python {spec.python} on the Airflow side, but the cluster "
                    f"runs Python {here}; a function shipped by value needs the same minor version. "
                    "Match the versions, or give an import path (callable='package.module:function') "
                    "installed on the cluster."
                ),
                tag,
            )
        )
        return 2
    if spec.launcher == "installed":
        from rayslice import __version__

        if spec.rayslice_version != __version__:
            print(format_error("InvalidRequestError", (
                f"the step was submitted by rayslice {spec.rayslice_version} to run on the rayslice installed on the "
                f"cluster, which is {__version__}: install rayslice=={spec.rayslice_version} in the cluster's image, "
                "or set the `ray` connection's extra 'launcher' to 'shipped' so each job carries its own launcher"),
                tag))
            return 2
    # Ray's "Unhandled error" report would print a host's exception (text the step chose) unprefixed
    # into the driver's output, where only the driver's own lines may start with a marker.
    os.environ["RAY_IGNORE_UNHANDLED_ERRORS"] = "1"
    # Ray's blocking calls (`ray.wait`, `ray.get`) look for a pending signal this often (1 s by
    # default): `ray job stop`'s SIGTERM unwinds the step, and frees its capacity, that much sooner.
    os.environ.setdefault("RAY_get_check_signal_interval_milliseconds", str(SIGNAL_CHECK_MS))
    from rayslice.cluster import host_env

    # Before ray.init: the hosts start without the job's env where their node has this launcher installed.
    host_env.leave_job_env()
    import ray

    from rayslice.cluster import phases, run_step
    from rayslice.cluster.metrics import sender as metrics

    imported = time.time()
    ray.init(address="auto", logging_level="WARNING")
    metrics.start()
    signal.signal(signal.SIGTERM, _stop)  # after ray.init, which installs its own handler
    driver_phases = {"driver_started": phases.process_start_time(), "main": main_entered, "imported": imported,
                     "connected": time.time()}
    accepted = phases.job_accepted_time(spec.owner.submission_id)
    if accepted is not None:
        driver_phases["accepted"] = accepted
    try:
        result = run_step(spec, driver_phases=driver_phases)
    except KeyboardInterrupt:
        if not _stop_requested:
            raise
        # run_step released everything on the way out; exit now instead of in Ray's stop grace period.
        print("[rayslice] stopped on request; capacity released", flush=True)
        metrics.step(spec, "stopped")
        metrics.flush()
        sys.stderr.flush()
        os._exit(143)
    except RaysliceError as exc:
        print(format_error(type(exc).__name__, str(exc), tag, error_fields(exc)), flush=True)
        _counted(spec, metrics, type(exc).__name__)
        return 1
    except Exception as exc:  # not the step's failure (that is a StepFailedError): the launcher's or Ray's
        for line in traceback.format_exc().splitlines():  # prefixed: the text may hold the step's own words
            print(f"[rayslice] {line}", file=sys.stderr, flush=True)
        message = (f"the rayslice launcher itself failed ({type(exc).__name__}: {exc}); this is a bug in "
                   "rayslice or an unexpected Ray error, not your step's: the traceback is in the Ray job's log")
        print(format_error("LauncherError", message, tag), flush=True)
        _counted(spec, metrics, "LauncherError")
        return 1
    try:
        line = format_result(result, tag)
    except ResultTooLargeError as exc:
        print(format_error("StepFailedError", str(exc), tag), flush=True)
        _counted(spec, metrics, "StepFailedError")
        return 1
    except (TypeError, ValueError) as exc:  # json.dumps: the step's value only, never the launcher's own bugs
        err = StepFailedError(
            f"the step returned a value that is not JSON ({exc}); return lists, dicts, "
            "numbers, strings or None (e.g. `float(loss)`, `array.tolist()`)"
        )
        print(format_error(type(err).__name__, str(err), tag), flush=True)
        _counted(spec, metrics, "StepFailedError")
        return 1
    print(line, flush=True)
    _counted(spec, metrics, None)
    return 0


def _counted(spec: StepSpec, metrics: Any, error: str | None) -> None:
    """The step's outcome to the cluster's metrics (`rayslice.cluster.metrics`), after its last line.

    A job of a cluster set's step that stood by (`RanElsewhereError`: another cluster ran it) is no step of this
    cluster and no failure: the cluster that ran it counts it (what it held here, after a suspension, is in its
    goodput figures, sent as it ended)."""
    if error != RanElsewhereError.__name__:
        metrics.step(spec, "failed" if error else "succeeded", error)
    metrics.flush()


if __name__ == "__main__":
    code = main(sys.argv)
    # Everything is released and the last line printed: skip the interpreter's and Ray's shutdown
    # (a second or more on a busy machine), which the job's end and its caller would wait for.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
