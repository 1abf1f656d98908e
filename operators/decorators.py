"""TaskFlow: ``@task.tpu_slice(tpu="v6e-16")`` and ``@task.ray_accelerator(accelerator="GPU", count=0.25)``.

The decorated function runs on the cluster, shipped by value with the helpers of its DAG
file; its call arguments become its keyword arguments there (they must be JSON), and its
return value is the task's XCom (one item per host for slices). Function parameters named
like JSON-friendly context keys (``ds``, ``params``, ``run_id``, ``map_index``...) are filled in
from the task's context; objects such as ``ti`` cannot travel to the cluster.

Registered through the provider's ``task-decorators``, so ``from airflow.sdk import task``
finds them. Mapping works as for ``@task``: ``evaluate.expand(checkpoint=[...])``.

Deferrable by default: the function is pickled where it is decorated (DAG parse time), so that the
triggerer can start the step without a worker (`rayslice.operators.start_trigger`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from datetime import date, datetime
from typing import TYPE_CHECKING, Any

from airflow.sdk.bases.decorator import DecoratedOperator, TaskDecorator, task_decorator_factory
from rayslice.operators.accelerator import AcceleratorOperator
from rayslice.operators.start_trigger import CannotStart, ship_function
from rayslice.operators.step import RayStepOperator, is_templated
from rayslice.operators.tpu_slice import TpuSliceOperator

from rayslice.core import runtime_env as runtime_envs
from rayslice.core.exceptions import InvalidRequestError

if TYPE_CHECKING:
    from airflow.sdk import Context

__all__ = ["ray_accelerator_task", "tpu_slice_task"]

_JSON_SCALARS = (str, int, float, bool, type(None))


class _RayStepDecoratedMixin:
    """Turns the decorated call's arguments (and any requested context keys) into step kwargs."""

    python_callable: Callable[..., Any]
    op_args: Sequence[Any]
    op_kwargs: dict[str, Any]
    task_id: str

    def step_kwargs(self, context: Context) -> dict[str, Any]:
        signature = inspect.signature(self.python_callable)
        if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in signature.parameters.values()):
            raise InvalidRequestError(
                f"{self.task_id}: a step function cannot take *args (its arguments travel as keywords); "
                "give it named parameters"
            )
        bound = signature.bind_partial(*self.op_args, **self.op_kwargs).arguments
        for name, param in signature.parameters.items():
            if name in bound or name not in context or param.kind is inspect.Parameter.VAR_KEYWORD:
                continue
            bound[name] = _from_context(self.task_id, name, context[name])  # type: ignore[literal-required]
        return dict(bound)


def _from_context(task_id: str, name: str, value: Any) -> Any:
    if isinstance(value, datetime | date):
        return value.isoformat()
    if isinstance(value, _JSON_SCALARS):
        return value
    if name == "params":
        return {k: value[k] for k in value}  # ParamsDict: resolved values
    raise InvalidRequestError(
        f"{task_id}: the step function asks for the context key {name!r} ({type(value).__name__}), which "
        "cannot travel to the cluster; pass the values it needs as arguments instead"
    )


def _once(*names: str) -> tuple[str, ...]:
    """Template fields without repeats: a field rendered twice renders the XCom values the first pass read
    (`op_kwargs` is both the decorator's and the operator's)."""
    return tuple(dict.fromkeys(names))


class _TpuSliceDecoratedOperator(_RayStepDecoratedMixin, DecoratedOperator, TpuSliceOperator):
    template_fields: Sequence[str] = _once(*DecoratedOperator.template_fields, *TpuSliceOperator.template_fields)
    template_fields_renderers = {**DecoratedOperator.template_fields_renderers,
                                 **TpuSliceOperator.template_fields_renderers}
    custom_operator_name = "@task.tpu_slice"

    def __init__(self, *, python_callable: Callable[..., Any], op_args: Any = None, op_kwargs: Any = None,
                 **kwargs: Any) -> None:
        super().__init__(python_callable=python_callable, op_args=op_args, op_kwargs=op_kwargs,
                         kwargs_to_upstream={"python_callable": python_callable, "op_kwargs": op_kwargs},
                         **kwargs)


class _AcceleratorDecoratedOperator(_RayStepDecoratedMixin, DecoratedOperator, AcceleratorOperator):
    template_fields: Sequence[str] = _once(*DecoratedOperator.template_fields, *AcceleratorOperator.template_fields)
    template_fields_renderers = {**DecoratedOperator.template_fields_renderers,
                                 **AcceleratorOperator.template_fields_renderers}
    custom_operator_name = "@task.ray_accelerator"

    def __init__(self, *, python_callable: Callable[..., Any], op_args: Any = None, op_kwargs: Any = None,
                 **kwargs: Any) -> None:
        super().__init__(python_callable=python_callable, op_args=op_args, op_kwargs=op_kwargs,
                         kwargs_to_upstream={"python_callable": python_callable, "op_kwargs": op_kwargs},
                         **kwargs)


class _BlockingTpuSliceDecoratedOperator(_TpuSliceDecoratedOperator):
    """``deferrable=False``: a worker submits and waits (also when mapped)."""

    start_from_trigger = False
    start_trigger_args = None


class _BlockingAcceleratorDecoratedOperator(_AcceleratorDecoratedOperator):
    """``deferrable=False``: a worker submits and waits (also when mapped)."""

    start_from_trigger = False
    start_trigger_args = None


def _shipping(decorator: Any, kwargs: Mapping[str, Any]) -> Any:
    """The decorator, or its factory, with the function pickled for the triggerer where it is decorated."""
    if kwargs.get("deferrable", True) is False:
        return decorator

    def ship(task_decorator: Any) -> Any:
        import attr

        try:
            shipped: dict[str, Any] = ship_function(task_decorator.function)
        except CannotStart as exc:
            shipped = {"cannot_start": str(exc)}
        return attr.evolve(task_decorator, kwargs={**task_decorator.kwargs, "shipped_callable": shipped})

    if hasattr(decorator, "function"):
        return ship(decorator)
    return lambda python_callable: ship(decorator(python_callable))


def _check_now(operator: type[RayStepOperator], kwargs: dict[str, Any]) -> None:
    """Validate literal request arguments and the runtime env where the decorator is applied (DAG parse time)."""
    runtime_envs.validate(kwargs.get("runtime_env"))
    fields = {name: kwargs[name] for name in operator.request_fields if name in kwargs}
    if any(is_templated(v) for v in fields.values()):
        return
    try:
        inspect.signature(operator.make_request).bind(**fields)
    except TypeError:
        return  # a required argument is missing: the operator says so when the task is created
    operator.make_request(**fields)


def tpu_slice_task(python_callable: Callable[..., Any] | None = None, multiple_outputs: bool | None = None,
                   **kwargs: Any) -> TaskDecorator:
    """``@task.tpu_slice(tpu="v6e-16", num_slices=1, multislice=False, runtime_env=None, ray_conn_id="ray_default")``.

    ``tpu="v6e", topology="4x4"`` names a slice by its layout; ``runtime_env`` is Ray's, for every host.

    The XCom is a list (one result per host), so it is never unrolled into several XComs,
    whatever the function's return annotation says.
    """
    if multiple_outputs:
        raise InvalidRequestError("@task.tpu_slice returns one result per host (a list): "
                                  "multiple_outputs=True cannot apply; index the list downstream instead")
    _check_now(TpuSliceOperator, kwargs)
    cls = _BlockingTpuSliceDecoratedOperator if kwargs.get("deferrable", True) is False else _TpuSliceDecoratedOperator
    return _shipping(task_decorator_factory(python_callable=python_callable, multiple_outputs=False,
                                            decorated_operator_class=cls, **kwargs), kwargs)


def ray_accelerator_task(python_callable: Callable[..., Any] | None = None,
                         multiple_outputs: bool | None = None, **kwargs: Any) -> TaskDecorator:
    """``@task.ray_accelerator(accelerator="GPU", count=0.25, accelerator_type=None)``."""
    _check_now(AcceleratorOperator, kwargs)
    cls = (_BlockingAcceleratorDecoratedOperator if kwargs.get("deferrable", True) is False
           else _AcceleratorDecoratedOperator)
    return _shipping(task_decorator_factory(python_callable=python_callable, multiple_outputs=multiple_outputs,
                                            decorated_operator_class=cls, **kwargs), kwargs)
