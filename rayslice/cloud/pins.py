"""The versions a cluster that rayslice sets up runs: the `docker/` images and the Cloud TPU startup script.

They are the ones ``requirements.lock`` pins (what rayslice is tested with); ``tests/test_pins.py``
fails when this module, the Dockerfiles and the lock disagree, so they cannot drift apart.
"""

from __future__ import annotations

from rayslice import __version__

__all__ = ["DEFAULT_GPU_IMAGE", "DEFAULT_IMAGE", "JAX_VERSION", "PYTHON_VERSION", "RAYSLICE_VERSION", "RAY_VERSION"]

RAYSLICE_VERSION = __version__
RAY_VERSION = "2.60.0"
JAX_VERSION = "0.12.0.1"
#: The cluster's Python: functions shipped by value need the Airflow side's minor version.
PYTHON_VERSION = "3.12"
#: What `docker build -f docker/Dockerfile.tpu -t <this> .` makes (CPU and TPU hosts, and the head).
DEFAULT_IMAGE = f"rayslice-cluster:{RAYSLICE_VERSION}-tpu"
#: What `docker build -f docker/Dockerfile.gpu -t <this> .` makes (GPU hosts).
DEFAULT_GPU_IMAGE = f"rayslice-cluster:{RAYSLICE_VERSION}-gpu"
