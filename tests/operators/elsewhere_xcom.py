"""An XCom backend that keeps values elsewhere and only a reference in Airflow's table.

It behaves like common.io's object-storage backend with a threshold of 0: a reader that bypasses
the configured backend gets the reference string, not the value. Configured with
``AIRFLOW__CORE__XCOM_BACKEND=tests.operators.elsewhere_xcom.ElsewhereXCom``.
"""

from __future__ import annotations

from typing import Any

from airflow.sdk import BaseXCom

PREFIX = "elsewhere://"
#: reference -> value
STORE: dict[str, Any] = {}


class ElsewhereXCom(BaseXCom):
    @staticmethod
    def serialize_value(value: Any, *, key: str | None = None, task_id: str | None = None,
                        dag_id: str | None = None, run_id: str | None = None, map_index: int | None = None) -> Any:
        ref = f"{PREFIX}{dag_id}/{run_id}/{task_id}/{map_index}/{key}"
        STORE[ref] = value
        return BaseXCom.serialize_value(ref)

    @staticmethod
    def deserialize_value(result: Any) -> Any:
        ref = BaseXCom.deserialize_value(result)
        return STORE[ref] if isinstance(ref, str) and ref.startswith(PREFIX) else ref

    @classmethod
    def purge(cls, xcom: Any, *args: Any) -> None:
        ref = BaseXCom.deserialize_value(xcom) if xcom is not None and xcom.value is not None else None
        if isinstance(ref, str):
            STORE.pop(ref, None)
