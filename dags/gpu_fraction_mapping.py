"""Score data shards on a quarter of a GPU each: dynamic task mapping over an upstream task's output.

Each mapped task is its own Ray job on 0.25 GPU (Ray packs four onto one device before the
next). The steps are deferrable (the default): each starts, waits for a free quarter, runs and
ends in the triggerer, so 32 mapped steps hold no Airflow worker slot at all. How many shards is
a run parameter (`shards`, 32 unless the trigger says otherwise); `summarize` reads every step's
result as a downstream task does. `bench/fraction_throughput.py --mode airflow` runs this DAG
next to the same `score_shard` as plain Ray tasks.
"""

from __future__ import annotations

from datetime import datetime

from airflow.sdk import Param, dag, task

SHARDS = 32


def score_shard(shard: int, size: int = 64) -> dict:
    """One shard's work: a small JAX computation on the step's quarter GPU."""
    import os
    import time

    start = time.time()
    import jax.numpy as jnp

    x = jnp.linspace(0.0, 1.0, size * size).reshape(size, size) + shard / SHARDS
    score = float(jnp.mean(jnp.tanh(x @ x.T / size)))
    print(f"shard {shard}: score {score:.6f} on device {os.environ.get('CUDA_VISIBLE_DEVICES')}", flush=True)
    return {
        "shard": shard,
        "size": size,
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
    params={"shards": Param(SHARDS, type="integer", minimum=1, maximum=1024, description="how many shards to score")},
    tags=["rayslice", "gpu"],
)
def gpu_fraction_mapping():
    @task
    def list_shards(params=None) -> list[int]:
        return list(range(params["shards"]))

    @task.ray_accelerator(accelerator="GPU", count=0.25)
    def score(shard: int, size: int) -> dict:
        return score_shard(shard, size)

    @task
    def summarize(results: list[dict]) -> dict:
        scores = [result["score"] for result in results]
        return {"shards": len(scores), "mean_score": round(sum(scores) / len(scores), 6)}

    summarize(score.partial(size=64).expand(shard=list_shards()))


gpu_fraction_mapping()
