"""Evaluate four checkpoints with a quarter of a GPU each: dynamic task mapping over one GPU.

Ray packs fractions onto one device before the next, so the four shares fit on one GPU.
Each mapped task returns its checkpoint, the GPU Ray gave it and a small JAX result.
"""

from __future__ import annotations

from datetime import datetime

from airflow.sdk import dag, task

CHECKPOINTS = ["ckpt-100", "ckpt-200", "ckpt-300", "ckpt-400"]


def checkpoint_step(checkpoint: str) -> int:
    """A stand-in for loading a checkpoint: its step number."""
    return int(checkpoint.rsplit("-", 1)[1])


@dag(
    dag_id="rayslice_gpu_fraction_sweep",
    schedule=None,
    start_date=datetime(2026, 1, 1),
    catchup=False,
    tags=["rayslice", "gpu"],
)
def gpu_fraction_sweep():
    @task.ray_accelerator(accelerator="GPU", count=0.25)
    def evaluate(checkpoint: str) -> dict:
        import os

        import jax.numpy as jnp

        scale = checkpoint_step(checkpoint) / 100
        score = float(jnp.mean(jnp.tanh(jnp.arange(8.0) * scale)))
        return {
            "checkpoint": checkpoint,
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "memory_fraction": os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION"),
            "score": round(score, 6),
        }

    evaluate.expand(checkpoint=CHECKPOINTS)


gpu_fraction_sweep()
