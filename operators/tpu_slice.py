"""Run a step on whole TPU slices: one process per host, every chip of every host."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rayslice.operators.step import RayStepOperator

from rayslice.core.accelerators import TpuSliceRequest

__all__ = ["TpuSliceOperator"]


class TpuSliceOperator(RayStepOperator):
    """``TpuSliceOperator(task_id=..., tpu="v6e-16", python_callable=train)``; XCom: one result per host.

    :param tpu: the slice type, e.g. "v6e-16" or "v5p-8", or the generation alone with ``topology`` (templated).
    :param topology: the chip layout, e.g. ``tpu="v6e", topology="4x4"`` (templated).
    :param num_slices: how many such slices (templated), or ``(min, max)`` for an elastic count: the step
        starts on as many slices as are free (at least ``min``) after ``elastic_wait`` seconds, may grow at a
        checkpoint, and resumes on what is left after a loss (docs/elastic.md).
    :param multislice: wire the slices into one JAX job over DCN (MEGASCALE_*).
    :param chips_per_host: override the host layout of ambiguous topologies.
    :param elastic_wait: seconds an elastic step waits for all ``max`` slices before it starts on fewer.
    """

    template_fields: Sequence[str] = (*RayStepOperator.template_fields, "tpu", "topology", "num_slices",
                                      "multislice", "chips_per_host", "elastic_wait")
    request_fields = ("tpu", "topology", "num_slices", "multislice", "chips_per_host", "elastic_wait")

    def __init__(
        self,
        *,
        tpu: str,
        topology: str | None = None,
        num_slices: int | str | tuple[int, int] = 1,
        multislice: bool | str = False,
        chips_per_host: int | str | None = None,
        elastic_wait: float | str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.tpu = tpu
        self.topology = topology
        self.num_slices = num_slices
        self.multislice = multislice
        self.chips_per_host = chips_per_host
        self.elastic_wait = elastic_wait
        self.validate_literal_request()
        self.plan_trigger_start()

    @staticmethod
    def make_request(tpu: Any, topology: Any = None, num_slices: Any = 1, multislice: Any = False,
                     chips_per_host: Any = None, elastic_wait: Any = None) -> TpuSliceRequest:
        return TpuSliceRequest(tpu=tpu, topology=topology, num_slices=num_slices, multislice=multislice,
                               chips_per_host=chips_per_host, elastic_wait=elastic_wait)

    def deferral_limit(self) -> tuple[float | None, str]:
        """As every step's, with one more attempt for each slice an elastic step may grow by."""
        limit, why = super().deferral_limit()
        if limit is None or self.execution_timeout is not None:
            return limit, why
        try:
            request = self.build_request()
        except Exception:
            return limit, why
        if not request.elastic:
            return limit, why
        attempts = 1 + self.preemption_retries
        return limit * (attempts + request.num_slices - (request.min_slices or 0)) / attempts, why
