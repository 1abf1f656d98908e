"""A function from a DAG file travels with the helpers that file imports from its own folder tree."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap

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
