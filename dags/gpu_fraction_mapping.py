"""Score 32 data shards on a quarter of a GPU each: dynamic task mapping, deferrable.

Each mapped task is its own Ray job on 0.25 GPU (Ray packs four onto one device before the
next). With `deferrable=True` a step that waits for a free quarter, or runs, holds no Airflow
worker slot, only a trigger in the triggerer: 32 mapped steps need no more workers than one.
`bench/fraction_throughput.py --mode airflow` runs this DAG next to the same `score_shard`
as plain Ray tasks.
"""

from __future__ import annotations

from datetime import datetime

from airflow.sdk import dag, task

SHARDS = 32


def score_shard(shard: int) -> dict:
    """One shard's work: a small JAX computation on the step's quarter GPU."""
    import os
    import time

    start = time.time()
    import jax.numpy as jnp

    x = jnp.linspace(0.0, 1.0, 4096).reshape(64, 64) + shard / SHARDS
    score = float(jnp.mean(jnp.tanh(x @ x.T / 64)))
    return {
        "shard": shard,
        "score": round(score, 6),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "start": start,
        "end": time.time(),
    }


@dag(
    dag_id="rayslice_gpu_fraction_mapping",
    schedule=None,
    start_date=datetime(2026, 1, 1),
    catchup=False,
    max_active_tasks=SHARDS,
    tags=["rayslice", "gpu"],
)
def gpu_fraction_mapping():
    @task.ray_accelerator(accelerator="GPU", count=0.25, deferrable=True)
    def score(shard: int) -> dict:
        return score_shard(shard)

    score.expand(shard=list(range(SHARDS)))


gpu_fraction_mapping()
