"""What `dags/training_pipeline.py:fit` must end with, computed with numpy in this process.

Full-batch gradient descent on the same batches (`batch` is a function of seed, step and process
only), so a run that was suspended, resumed or moved to other slices must end where this ends.
With `global_rows` (`fit(..., global_rows=...)`), each step's batch is a function of seed and step
only (`step_batch`), so the reference needs no host count: a run that changed its slice count
between checkpoints must end where this ends.
"""

from __future__ import annotations

import numpy as np


def reference_fit(dataset: dict, learning_rate: float, steps: int, hosts: int | None = None, chips_per_host: int = 4,
                  global_rows: int | None = None) -> dict:
    """`fit`'s final loss and weights on `hosts` processes of `chips_per_host` devices each.

    With `global_rows`: `fit(..., global_rows=global_rows)`'s, on any number of hosts and devices
    (`hosts` and `chips_per_host` are then not used).
    """
    from rayslice.dags.training_pipeline import batch, step_batch

    if global_rows is None and hosts is None:
        raise TypeError("reference_fit needs `hosts` (per-process batches) or `global_rows` (one global batch)")
    rows = dataset["rows_per_device"] * chips_per_host

    def global_batch(step: int):
        if global_rows is not None:
            return step_batch(dataset, step, global_rows)
        parts = [batch(dataset, step, rows, process) for process in range(hosts)]
        return np.concatenate([x for x, _ in parts]), np.concatenate([y for _, y in parts])

    w = np.zeros(dataset["features"], dtype=np.float32)
    for step in range(steps):
        x, y = global_batch(step)
        w = w - np.float32(learning_rate) * (2.0 / len(x)) * (x.T @ (x @ w - y))
    x, y = global_batch(steps)
    return {"loss": float(np.mean((x @ w - y) ** 2)), "weights": [float(v) for v in w]}


def assert_matches(results: list[dict], reference: dict, tolerance: float = 1e-4) -> None:
    """Every host's result is the reference's, within `tolerance`."""
    import pytest

    assert results
    for result in results:
        assert result["loss"] == pytest.approx(reference["loss"], abs=tolerance)
        assert result["weights"] == pytest.approx(reference["weights"], abs=tolerance)
