"""The versions a cluster that rayslice sets up runs: the `docker/` images and the Cloud TPU startup script.

They are the ones ``requirements.lock`` pins (what rayslice is tested with); ``tests/test_pins.py``
fails when this module, the Dockerfiles and the lock disagree, so they cannot drift apart.
"""

from __future__ import annotations

from rayslice import __version__

__all__ = ["DEFAULT_GPU_IMAGE", "DEFAULT_IMAGE", "JAX_VERSION", "KUBERAY_FLOOR", "KUBERAY_HELM_VERSION",
           "PYTHON_MATCH_LEVEL_ENV", "PYTHON_VERSION", "RAYSLICE_VERSION", "RAY_VERSION"]

RAYSLICE_VERSION = __version__
RAY_VERSION = "2.60.0"
JAX_VERSION = "0.12.0.1"
#: The cluster's Python: functions shipped by value need the Airflow side's minor version.
PYTHON_VERSION = "3.12"
#: Ray refuses a node whose Python differs from the head's at patch level unless the joining node's environment
#: sets this to ``minor`` (``ray._private.utils.check_version_info``, default ``patch``); the Cloud TPU startup
#: script sets it, so hosts whose uv-picked 3.12.x differs from the head's still join.
PYTHON_MATCH_LEVEL_ENV = "RAY_DEFAULT_PYTHON_VERSION_MATCH_LEVEL"
#: The oldest KubeRay the rendered token-auth clusters work on: ``authOptions.secretName`` first shipped in
#: KubeRay 1.6.0 (ray-project/kuberay PR #4554). On 1.5.x rayslice refuses before creating anything.
KUBERAY_FLOOR = "1.6.0"
#: The KubeRay Helm chart version the docs install (tests check the manifests against its CRDs).
KUBERAY_HELM_VERSION = "1.7.0"
#: What `docker build -f docker/Dockerfile.tpu -t <this> .` makes (CPU and TPU hosts, and the head).
DEFAULT_IMAGE = f"rayslice-cluster:{RAYSLICE_VERSION}-tpu"
#: What `docker build -f docker/Dockerfile.gpu -t <this> .` makes (GPU hosts).
DEFAULT_GPU_IMAGE = f"rayslice-cluster:{RAYSLICE_VERSION}-gpu"
