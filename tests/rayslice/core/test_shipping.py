"""A function from a DAG file travels with the helpers that file imports from its own folder tree."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap
import time

from rayslice.core.accelerators import TpuSliceRequest
from rayslice.core.step import StepSpec

DAG_FILE = textwrap.dedent("""
    import helpers
    from include.utils import double

    def step(x):
        return {"tripled": helpers.triple(x), "doubled": double(x), "scale": helpers.SCALE}
""")


def test_helpers_from_sibling_modules_of_the_dags_folder_travel_with_the_function(tmp_path, monkeypatch):
    dags = tmp_path / "dags"
    (dags / "include").mkdir(parents=True)
    (dags / "helpers.py").write_text("SCALE = 3\n\ndef triple(x):\n    return SCALE * x\n")
    (dags / "include" / "__init__.py").write_text("")
    (dags / "include" / "utils.py").write_text("def double(x):\n    return 2 * x\n")
    (dags / "train_dag.py").write_text(DAG_FILE)
    monkeypatch.syspath_prepend(str(dags))  # as Airflow puts the DAGs folder on sys.path
    spec_ = importlib.util.spec_from_file_location("unusual_prefix_abc_train_dag", dags / "train_dag.py")
    module = importlib.util.module_from_spec(spec_)
    monkeypatch.setitem(sys.modules, spec_.name, module)
    try:
        spec_.loader.exec_module(module)
        spec = StepSpec.for_function(module.step, request=TpuSliceRequest(tpu="v6e-4"))
    finally:
        for name in ("helpers", "include", "include.utils"):
            sys.modules.pop(name, None)

    # The cluster: a fresh Python elsewhere, without the DAGs folder.
    code = ("import base64, sys, cloudpickle; fn = cloudpickle.loads(base64.b64decode(sys.stdin.read())); "
            "print(fn(5))")
    out = subprocess.run([sys.executable, "-c", code], input=spec.pickled, capture_output=True, text=True,
                         cwd=tmp_path.parent, env={"PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "{'tripled': 15, 'doubled': 10, 'scale': 3}"


def test_functions_pickled_from_many_threads_at_once_all_travel_by_value(monkeypatch):
    """Threads that ship functions of one module at once (a driver running steps in parallel, the
    triggerer) each get a blob that carries the module by value, and none fails because another
    thread gave the module's by-value registration back in the middle of its pickling."""
    import threading

    import cloudpickle

    from rayslice.core.step import pickle_function

    dumps = cloudpickle.dumps

    def slow_dumps(*args, **kwargs):
        """Each pickling takes a while, as a big DAG file's does: the other threads run meanwhile, so
        without a guard one of them gives the registration back mid-pickling in every round."""
        time.sleep(0.002)
        return dumps(*args, **kwargs)

    monkeypatch.setattr(cloudpickle, "dumps", slow_dumps)

    errors: list[BaseException] = []
    blobs: list[str] = []
    start = threading.Barrier(8)

    def ship() -> None:
        start.wait()
        for _ in range(10):
            try:
                blobs.append(pickle_function(_local_step))
            except BaseException as exc:  # collected: a failing thread must not hide the others
                errors.append(exc)

    threads = [threading.Thread(target=ship) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert len(blobs) == 80
    # By value: a Python that cannot import this test module runs it.
    assert len(set(blobs)) == 1
    code = "import base64, sys, cloudpickle; print(cloudpickle.loads(base64.b64decode(sys.stdin.read()))(41))"
    out = subprocess.run([sys.executable, "-I", "-c", code], input=blobs[0], capture_output=True, text=True,
                         cwd="/", env={"PATH": "/usr/bin:/bin"})
    assert out.returncode == 0 and out.stdout.strip() == "42", out.stderr
    assert not cloudpickle.cloudpickle._is_registered_pickle_by_value(sys.modules[__name__])  # given back


def _local_step(x):
    return x + 1
