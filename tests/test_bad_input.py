"""Every bad input we tried, and the error it gets: one table, which docs/errors.md mirrors.

Each case calls the real code (request models, the `ray` connection parser, the operators, the
example pipeline's trigger form, the Jobs API client against a real HTTP server that answers
malformed bodies) and checks the error type and the message users read. No cluster needed.
"""

from __future__ import annotations  # noqa: I001  (tests.airflow_env must come before airflow)

import json
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import tests.airflow_env  # noqa: F401  (configures Airflow before anything imports it)

import pytest
from airflow.sdk.exceptions import ParamValidationError

from rayslice.core.accelerators import AcceleratorRequest, TpuSliceRequest
from rayslice.core.exceptions import InvalidRequestError, RayJobsError

ERRORS_PAGE = Path(__file__).resolve().parents[1] / "docs" / "errors.md"
SECTION = "# Bad input and the errors it gets"


@dataclass(frozen=True)
class Case:
    area: str
    given: str  # what docs/errors.md shows in its "input" column
    run: Callable[[], object]
    error: type[BaseException]
    message: str  # a fragment of the message, as docs/errors.md shows it


def _operator(**kwargs):
    from rayslice.operators.tpu_slice import TpuSliceOperator

    return TpuSliceOperator(task_id="train", **kwargs)


def _step():  # a python_callable for the operator cases
    return 1


def _trigger(**params):
    """Validate trigger-form values against the example pipeline's own params (what the UI's form does)."""
    import copy

    from rayslice.dags import training_pipeline

    form = copy.deepcopy(training_pipeline.training_pipeline().params)  # the DAG's own trigger-form params
    for name, value in params.items():
        form[name] = value  # validates against the param's schema, as the trigger form does


def _dashboard(host, schema=None, port=None):
    from rayslice.hooks.ray import dashboard_url

    return dashboard_url(host, schema, port)


def _settings(extra):
    from airflow.sdk import Connection
    from rayslice.hooks.ray import settings_from_connection

    return settings_from_connection(Connection(conn_id="r", conn_type="ray", host="http://h:1",
                                               extra=json.dumps(extra)))


class _Malformed(BaseHTTPRequestHandler):
    """A real HTTP server in front of "Ray" that answers with what a broken proxy or version might."""

    bodies = {
        "/api/jobs/html": (200, "text/html", "<html>proxy login</html>"),
        "/api/jobs/no-status": (200, "application/json", json.dumps({"submission_id": "no-status"})),
        "/api/jobs/bad-status": (200, "application/json", json.dumps({"status": "EXPLODED"})),
        "/api/jobs/": (200, "application/json", json.dumps({"not": "a list"})),
        "/api/jobs/x/logs": (200, "application/json", json.dumps({"text": "no logs key"})),
    }

    def do_GET(self) -> None:  # noqa: N802
        status, kind, body = self.bodies.get(self.path, (404, "text/plain", "not found"))
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.end_headers()
        self.wfile.write(body.encode())

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def malformed_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Malformed)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def _jobs(method: str, *args):
    def call(url: str):
        from rayslice.client.jobs_client import RayJobsClient

        with RayJobsClient(url, retries=0) as client:
            return getattr(client, method)(*args)

    return call


CASES = [
    Case("request", "`TpuSliceRequest(tpu='v6e-15')`", lambda: TpuSliceRequest(tpu="v6e-15"), InvalidRequestError,
         "'v6e-15' is not a v6e slice: v6e slices have 1, 4, 8, 16, 32, 64, 128 or 256 chips"),
    Case("request", "`TpuSliceRequest(tpu='v9z-16')`", lambda: TpuSliceRequest(tpu="v9z-16"), InvalidRequestError,
         "unknown TPU version 'v9z' in 'v9z-16': known versions are v2, v3, v4, v5p, v5litepod, v6e or v7x"),
    Case("request", "`TpuSliceRequest(tpu='')`", lambda: TpuSliceRequest(tpu=""), InvalidRequestError,
         "'' is not a TPU name: use '<version>-<size>' like 'v6e-16'"),
    Case("request", "`TpuSliceRequest(tpu='v6e', topology='3x3')`",
         lambda: TpuSliceRequest(tpu="v6e", topology="3x3"), InvalidRequestError,
         "topology '3x3' is not valid for v6e: use 1x1, 2x2, 2x4, 2x8, 4x4"),
    Case("request", "`TpuSliceRequest(tpu='v6e-16', subslice='2x8')`",
         lambda: TpuSliceRequest(tpu="v6e-16", subslice="2x8"), InvalidRequestError,
         "subslice='2x8' of v6e-16 (4x4): not a subslice of that slice; valid subslices of v6e-16 are 2x2 or 2x4"),
    Case("request", "`TpuSliceRequest(tpu='v6e-8', subslice='2x2')`",
         lambda: TpuSliceRequest(tpu="v6e-8", subslice="2x2"), InvalidRequestError,
         "v6e-8 cannot be cut into subslices, it is one host: ask for a smaller slice type instead"),
    Case("request", "`TpuSliceRequest(tpu='v6e-16', num_slices=0)`",
         lambda: TpuSliceRequest(tpu="v6e-16", num_slices=0), InvalidRequestError,
         "num_slices: input should be greater than or equal to 1 (got 0)"),
    Case("request", "`TpuSliceRequest(tpu='v6e-16', num_slices=-1)`",
         lambda: TpuSliceRequest(tpu="v6e-16", num_slices=-1), InvalidRequestError,
         "num_slices: input should be greater than or equal to 1 (got -1)"),
    Case("request", "`TpuSliceRequest(tpu='v6e-4; rm -rf /')`", lambda: TpuSliceRequest(tpu="v6e-4; rm -rf /"),
         InvalidRequestError, "'v6e-4; rm -rf /' is not a TPU name"),
    Case("request", "`AcceleratorRequest(resource='GPU', count=1.5)`",
         lambda: AcceleratorRequest(resource="GPU", count=1.5), InvalidRequestError,
         "GPU count 1.5 is invalid: fractions must be ≤ 1; above 1 use whole numbers"),
    Case("request", "`AcceleratorRequest(resource='TPU', count=0.5)`",
         lambda: AcceleratorRequest(resource="TPU", count=0.5), InvalidRequestError,
         "TPU count 0.5 is invalid: Ray gives tasks 1, 2, 4 or 8 whole TPU chips"),
    Case("request", "`AcceleratorRequest(resource='HPU', count=0.25)`",
         lambda: AcceleratorRequest(resource="HPU", count=0.25), InvalidRequestError,
         "HPU count 0.25 is invalid: HPU takes whole numbers only"),
    Case("request", "`AcceleratorRequest(resource='GPU', count=0)`",
         lambda: AcceleratorRequest(resource="GPU", count=0), InvalidRequestError,
         "count: input should be greater than 0 (got 0)"),
    Case("request", "`AcceleratorRequest(resource='GPU', count=-1)`",
         lambda: AcceleratorRequest(resource="GPU", count=-1), InvalidRequestError,
         "count: input should be greater than 0 (got -1)"),
    Case("request", "`AcceleratorRequest(resource='XPU', count=1)`",
         lambda: AcceleratorRequest(resource="XPU", count=1), InvalidRequestError,
         "unknown resource 'XPU': Ray accelerator resources are GPU, NPU, TPU, neuron_cores or HPU"),
    Case("request", "`AcceleratorRequest(resource='GPU; rm -rf /', count=1)`",
         lambda: AcceleratorRequest(resource="GPU; rm -rf /", count=1), InvalidRequestError,
         "unknown resource 'GPU; rm -rf /'"),
    Case("request", "`AcceleratorRequest(resource='GPU', count=0.25, accelerator_type='H100$(reboot)')`",
         lambda: AcceleratorRequest(resource="GPU", count=0.25, accelerator_type="H100$(reboot)"),
         InvalidRequestError, "accelerator_type 'H100$(reboot)' is not a Ray accelerator type"),
    Case("connection", "`ray` connection without a host", lambda: _dashboard(None), InvalidRequestError,
         "the `ray` connection's host is empty: set the `ray` connection's host to the Ray dashboard URL"),
    Case("connection", "extra `{'checkpoint-root': 'gs://b/c'}` (a misspelled name)",
         lambda: _settings({"checkpoint-root": "gs://b/c"}), InvalidRequestError,
         "the `ray` connection has unknown extra 'checkpoint-root' (did you mean 'checkpoint_root'?): the valid "
         "extras are verify, headers, checkpoint_root, launcher, runtime_env, deployment, team, kuberay, cloud_tpu"),
    Case("connection", "host `ftp://head:8265`", lambda: _dashboard("ftp://head:8265"), InvalidRequestError,
         "the `ray` connection's host must be http(s)://host:port"),
    Case("connection", "host `http://` (no host name)", lambda: _dashboard("http://"), InvalidRequestError,
         "the `ray` connection's host 'http://' has no host name"),
    Case("dag", "`TpuSliceOperator(callable=..., python_callable=...)`",
         lambda: _operator(tpu="v6e-4", callable="pkg.mod:fn", python_callable=_step), InvalidRequestError,
         "TpuSliceOperator 'train' needs exactly one of python_callable=<function>, "
         "callable='package.module:function' or command=['python', 'train.py', ...]; got python_callable and callable"),
    Case("dag", "`TpuSliceOperator()` (none of them)", lambda: _operator(tpu="v6e-4"), InvalidRequestError,
         "needs exactly one of python_callable=<function>, callable='package.module:function' or command="),
    Case("dag", "`callable='pkg/train.py'`", lambda: _operator(tpu="v6e-4", callable="pkg/train.py"),
         InvalidRequestError, "callable 'pkg/train.py' of 'train' must look like 'package.module:function'"),
    Case("dag", "`command=[]`", lambda: _operator(tpu="v6e-4", command=[]), InvalidRequestError,
         "command must be a non-empty argv list such as ['python', 'train.py']"),
    Case("dag", "`command='python train.py {% if params.verbose %}-v{% endif %}'`",
         lambda: _operator(tpu="v6e-4", command="python train.py {% if params.verbose %}-v{% endif %}"),
         InvalidRequestError,
         "has a Jinja statement or comment ({% ... %}, {# ... #}); a command string may hold only {{ ... }} values, "
         "each rendered inside one argument"),
    Case("dag", "`command=[...]` with `op_kwargs={'steps': 100}`",
         lambda: _operator(tpu="v6e-4", command=["python", "train.py"], op_kwargs={"steps": 100}),
         InvalidRequestError,
         "op_kwargs of 'train' cannot go with command=: a program takes no keyword arguments; pass the values "
         "as arguments in command=[...] or as runtime_env={'env_vars': {...}}"),
    Case("dag", "`runtime_env={'workdir': '.'}` (a typo)",
         lambda: _operator(tpu="v6e-4", command="python train.py", runtime_env={"workdir": "."}),
         InvalidRequestError, "runtime_env of 'train' has unknown key(s) 'workdir'; valid keys: working_dir, "
         "py_modules, excludes, pip, uv, conda, env_vars, image_uri, container, config, py_executable"),
    Case("dag", "`runtime_env={'env_vars': {'STEPS': 100}}` (not a string)",
         lambda: _operator(tpu="v6e-4", command="python train.py", runtime_env={"env_vars": {"STEPS": 100}}),
         InvalidRequestError, "runtime_env of 'train'['env_vars'] must be a dict of variable names to string values"),
    Case("dag", "`python_callable='train'` (a string)", lambda: _operator(tpu="v6e-4", python_callable="train"),
         InvalidRequestError, "python_callable of 'train' is not callable: 'train'"),
    Case("dag", "`checkpoint_root='/shared/ckpt'` (not a URL)",
         lambda: _operator(tpu="v6e-4", callable="pkg.mod:fn", checkpoint_root="/shared/ckpt"),
         InvalidRequestError, "checkpoint_root of 'train' must be a URL like 'gs://bucket/checkpoints'"),
    Case("dag", "`checkpoint_root='file://ckpt'` (a relative path)",
         lambda: _operator(tpu="v6e-4", callable="pkg.mod:fn", checkpoint_root="file://ckpt"),
         InvalidRequestError, "checkpoint_root of 'train' must be a URL like 'gs://bucket/checkpoints', "
         "'s3://bucket/checkpoints' or 'file:///shared/checkpoints'; a file:// root needs an absolute path"),
    Case("dag", "`checkpoint_root='FILE:///shared/ckpt'` (an upper-case protocol)",
         lambda: _operator(tpu="v6e-4", callable="pkg.mod:fn", checkpoint_root="FILE:///shared/ckpt"),
         InvalidRequestError, "checkpoint_root of 'train' must be a URL like 'gs://bucket/checkpoints', "
         "'s3://bucket/checkpoints' or 'file:///shared/checkpoints'; its protocol 'FILE' is no lowercase name"),
    Case("dag", "`checkpoint_root='memory://ckpt'`",
         lambda: _operator(tpu="v6e-4", callable="pkg.mod:fn", checkpoint_root="memory://ckpt"),
         InvalidRequestError, "checkpoint_root of 'train' must be a URL like 'gs://bucket/checkpoints', "
         "'s3://bucket/checkpoints' or 'file:///shared/checkpoints'; memory:// is each host process's own memory"),
    Case("dag", "`kuberay_cluster='Train_Run_1'` (not a Kubernetes name)",
         lambda: _operator(tpu="v6e-4", callable="pkg.mod:fn", kuberay_cluster="Train_Run_1"), InvalidRequestError,
         "kuberay_cluster of 'train' 'Train_Run_1' is invalid: a RayCluster name is a DNS-1035 label of at most 53 "
         "characters (lowercase letters, digits and '-', starting with a letter), e.g. 'rayslice'; or 'per-run' for "
         "a name of the DAG run's own"),
    Case("dag", "`TpuSliceOperator(tpu='v6e-15', ...)` in a DAG file",
         lambda: _operator(tpu="v6e-15", callable="pkg.mod:fn"), InvalidRequestError,
         "'v6e-15' is not a v6e slice"),
    Case("trigger form", "slice type `v6e-15` (not in the list)", lambda: _trigger(slice_type="v6e-15"),
         ParamValidationError, "'v6e-15' is not one of"),
    Case("trigger form", "slice type `v6e-4; rm -rf /`", lambda: _trigger(slice_type="v6e-4; rm -rf /"),
         ParamValidationError, "'v6e-4; rm -rf /' is not one of"),
    Case("trigger form", "learning rate `5`", lambda: _trigger(learning_rate=5), ParamValidationError,
         "5 is greater than the maximum of 1.0"),
    Case("trigger form", "learning rate `0`", lambda: _trigger(learning_rate=0), ParamValidationError,
         "0 is less than the minimum of 0.0001"),
    Case("trigger form", "learning rate `\"fast\"`", lambda: _trigger(learning_rate="fast"), ParamValidationError,
         "'fast' is not of type 'number'"),
    Case("jobs api", "job status answered with an HTML page", _jobs("get", "html"), RayJobsError, "not JSON"),
    Case("jobs api", "job without `status`", _jobs("get", "no-status"), RayJobsError, "status"),
    Case("jobs api", "job with status `EXPLODED`", _jobs("get", "bad-status"), RayJobsError, "status"),
    Case("jobs api", "job list that is not a list", _jobs("list_jobs"), RayJobsError, "not a list of jobs"),
    Case("jobs api", "logs without `logs`", _jobs("logs", "x"), RayJobsError, "logs"),
]


def _id(case: Case) -> str:
    return re.sub(r"[^a-z0-9]+", "-", f"{case.area} {case.given}".lower()).strip("-")[:60]


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_bad_input_gets_its_error(case, malformed_server):
    run = (lambda: case.run(malformed_server)) if case.area == "jobs api" else case.run
    with pytest.raises(case.error) as info:
        run()
    assert case.message in str(info.value), str(info.value)


def readme_rows() -> list[tuple[str, str, str]]:
    text = ERRORS_PAGE.read_text()
    assert SECTION in text, f"docs/errors.md has no '{SECTION}' heading"
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| area")]
    return [tuple(cell.strip().replace("\\|", "|") for cell in re.split(r"(?<!\\)\|", row)[1:4])
            for row in rows if not set(row) <= set("|- ")]


def render_rows() -> str:
    """The docs/errors.md table, generated from CASES (paste it when the table changes)."""
    lines = ["| area | input | error (fragment of the message) |", "|---|---|---|"]
    for c in CASES:
        lines.append(f"| {c.area} | {c.given.replace('|', chr(92) + '|')} | "
                     f"{c.error.__name__}: "
                     f"{c.message.replace('|', chr(92) + '|')} |")
    return "\n".join(lines)


def test_readme_table_is_this_table():
    expected = [tuple(cell.strip().replace("\\|", "|") for cell in re.split(r"(?<!\\)\|", row)[1:4])
                for row in render_rows().splitlines()[2:]]
    assert readme_rows() == expected, "docs/errors.md's table differs from CASES; regenerate:\n" + render_rows()
