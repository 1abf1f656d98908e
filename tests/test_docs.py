"""The docs say what the code does: every documented name, flag and default is checked against the code.

- docs/operators.md: each operator's parameter table equals its signature (inherited parameters too),
  defaults included;
- docs/connection.md: the extras table lists exactly the extras the hook reads, with their defaults;
- docs/cli.md: its synopsis lists exactly each command's flags; every `--flag` in the README and docs is
  a flag of the `rayslice` command or a named other tool's;
- `@task.<name>` decorators and `...Operator` names in the docs exist;
- the Python requirement is stated one way.
"""

from __future__ import annotations  # noqa: I001  (tests.airflow_env must come before airflow)

import inspect
import re

import tests.airflow_env  # noqa: F401  (configures Airflow before anything imports it)

import pytest
import typer

from tests.airflow_env import REPO

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
#: Flags of other tools that the docs show (kubectl, gcloud, pip/uv, docker, bench scripts, programs).
OTHER_TOOLS_FLAGS = {"--xla", "--no-write", "--no-index", "--find-links", "--compile-bytecode", "--steps", "--seed",
                     "--pod-types",
                     "--no-baseline", "--idle-minutes", "--from-literal", "--config", "--conf", "--help",
                     "--out-dir", "--reservation-affinity", "--metrics-export-port",
                     # gcloud's, named in deploying-gke.md's prose (its commands' flags: CHECKED_GCLOUD in
                     # tests/test_deploying_docs.py, each checked against Google's reference)
                     "--cluster-version", "--tpu-topology", "--placement-policy",
                     # gcloud's, named in the prose of deploying-gke.md, deploying-tpu-vms.md and metrics.md (issue 50):
                     # https://cloud.google.com/sdk/gcloud/reference/container/clusters/update (Ray add-on
                     # monitoring and logging), .../compute/accelerator-types/list (--filter: gcloud-wide),
                     # .../compute/tpus/queued-resources/delete (--force), .../compute/instances/create
                     # (--image-family, --image-project)
                     "--enable-cost-allocation", "--filter", "--enable-ray-cluster-monitoring",
                     "--enable-ray-cluster-logging", "--location", "--zone", "--force", "--image-family",
                     "--image-project",
                     # `ray start --labels`, named in cli.md for `rayslice launcher-label`'s value
                     "--labels"}
BLOCK = re.compile(r"^```(\w*)\n.*?^```$", re.S | re.M)
#: Parameters that are not for users: set by rayslice itself (the decorators).
INTERNAL = {"shipped_callable"}


def _text() -> dict[str, str]:
    return {page.name: page.read_text() for page in PAGES}


def _signature(cls) -> dict[str, object]:
    """Keyword parameters of ``cls`` and its rayslice bases, as documented (default, or "required")."""
    from airflow.sdk import BaseOperator

    params: dict[str, object] = {}
    for klass in reversed(cls.__mro__):
        if not issubclass(klass, BaseOperator) or klass is BaseOperator or "__init__" not in vars(klass):
            continue
        if not klass.__module__.startswith("rayslice."):
            continue
        for name, p in inspect.signature(klass.__init__).parameters.items():
            if p.kind is p.KEYWORD_ONLY and name not in INTERNAL:
                params[name] = "required" if p.default is p.empty else f"`{p.default!r}`"
    return params


def _tables(markdown: str) -> dict[str, dict[str, str]]:
    """``### `Name` `` -> {parameter: default cell} of the first table under it."""
    tables: dict[str, dict[str, str]] = {}
    current = None
    for line in markdown.splitlines():
        if m := re.match(r"^#{2,3} `([A-Za-z]+)`$", line):
            current = tables.setdefault(m[1], {})
        elif current is not None and (m := re.match(r"^\| `(\w+)` \| (.+?) \|", line)):
            current[m[1]] = m[2]
    return tables


def test_the_operator_reference_equals_the_code():
    from rayslice.operators.step import RayStepOperator

    from rayslice import operators

    tables = _tables((REPO / "docs" / "operators.md").read_text())
    names = ["RayStepOperator", "TpuSliceOperator", "AcceleratorOperator", "CreateRayClusterOperator",
             "DeleteRayClusterOperator", "CreateTpuSliceOperator", "DeleteTpuSliceOperator"]
    exported = {n for n in dir(operators) if n.endswith("Operator")}
    assert exported <= set(names), f"operators without a reference table: {exported - set(names)}"
    base = _signature(RayStepOperator)
    for name in names:
        cls = RayStepOperator if name == "RayStepOperator" else getattr(operators, name)
        want = _signature(cls)
        if name in ("TpuSliceOperator", "AcceleratorOperator"):  # documented as "RayStepOperator's, and:"
            want = {k: v for k, v in want.items() if k not in base}
        assert tables.get(name) == want, f"docs/operators.md, {name}: table {tables.get(name)} != code {want}"


def test_the_connection_extras_table_equals_the_hook():
    from rayslice.hooks.ray import EXTRAS, RayConnectionSettings

    rows = re.findall(r"^\| extra `(\w+)` \| .+? \| (.+?) \|$", (REPO / "docs" / "connection.md").read_text(), re.M)
    assert [name for name, _ in rows] == list(EXTRAS)
    defaults = dict(rows)
    assert defaults["verify"] == f"`{str(RayConnectionSettings.verify).lower()}`"
    assert defaults["launcher"] == f"`{RayConnectionSettings.launcher}`"


def _cli_commands() -> dict[tuple[str, ...], set[str]]:
    from rayslice.cli import app

    def walk(group, path):
        for name, command in group.commands.items():
            if hasattr(command, "commands"):
                yield from walk(command, (*path, name))
            else:
                yield (*path, name), command

    root = typer.main.get_command(app)
    found = {(): {o for p in root.params for o in (*p.opts, *p.secondary_opts) if o.startswith("--")}}
    for path, command in walk(root, ()):
        found[path] = {o for p in command.params if not getattr(p, "hidden", False)
                       for o in (*p.opts, *p.secondary_opts) if o.startswith("--")}
    return {path: flags - {"--help"} for path, flags in found.items()}


def _synopsis() -> dict[tuple[str, ...], set[str]]:
    """The first bash block of docs/cli.md: command path -> the flags its line(s) name."""
    block = re.search(r"```bash\n(.*?)```", (REPO / "docs" / "cli.md").read_text(), re.S)[1]
    logical: list[str] = []
    for line in block.splitlines():
        if line.startswith(" ") and logical:
            logical[-1] += " " + line.strip()
        elif line.strip():
            logical.append(line.strip())
    found: dict[tuple[str, ...], set[str]] = {}
    for line in logical:
        line = line.split("  #")[0]
        words = line.split()[1:]
        path = []
        for word in words:
            if word.startswith(("-", "[")):
                break
            path.append(word)
        flags = set(re.findall(r"--[a-z][a-z0-9-]*", line))
        for last in (path[-1].split("|") if path else [None]):
            key = tuple(path[:-1]) + ((last,) if last else ())
            found[key] = found.get(key, set()) | flags
    return found


def test_the_cli_synopsis_lists_every_command_and_flag():
    assert _synopsis() == _cli_commands()


def test_every_flag_the_docs_name_exists():
    """In prose and in the commands users run here (`bash` blocks); other blocks are other tools' commands."""
    known = set().union(*_cli_commands().values()) | OTHER_TOOLS_FLAGS | _test_suite_flags()
    for page, text in _text().items():
        text = BLOCK.sub(lambda m: m[0] if m[1] == "bash" else "", text)
        unknown = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", text)) - known
        assert not unknown, f"{page} names flags no command has: {sorted(unknown)}"


def _test_suite_flags() -> set[str]:
    """`scripts/test`'s options, which the README names: pytest's own and its plugins' (xdist's `--dist`), read
    from `pytest --help` with the project's plugins loaded (tests/timing_report.py's `--suite-budget-minutes`)."""
    import subprocess
    import sys

    shown = subprocess.run([sys.executable, "-m", "pytest", "--help", "-p", "tests.timing_report"], cwd=REPO,
                           capture_output=True, text=True, check=True).stdout
    return set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", shown))


def test_decorators_and_operators_the_docs_name_exist():
    from rayslice import operators
    from rayslice.provider import get_provider_info

    decorators = {d["name"] for d in get_provider_info()["task-decorators"]}
    for page, text in _text().items():
        named = set(re.findall(r"@task\.(\w+)", text))
        assert named <= decorators | {"python", "bash"}, f"{page}: unknown decorators {named - decorators}"
        ops = set(re.findall(r"\b([A-Z]\w+Operator)\b", text)) - {"BaseOperator", "RaySubmitJobOperator",
                                                                   "RayStepOperator", "RayOperator"}
        missing = {o for o in ops if not hasattr(operators, o)}
        assert not missing, f"{page} names operators that do not exist: {missing}"


def test_the_python_requirement_is_stated_one_way():
    from rayslice.cloud.pins import PYTHON_VERSION

    cells = {page: re.findall(r"^\| Python \| (.+?) \|", text, re.M) for page, text in _text().items()}
    stated = {cell for found in cells.values() for cell in found}
    assert len(stated) == 1, cells
    assert next(iter(stated)).startswith(PYTHON_VERSION)


@pytest.mark.parametrize("page", ["deploying-gke.md", "deploying-tpu-vms.md", "troubleshooting.md",
                                  "operators.md", "upgrading.md"])
def test_the_pages_users_expect_exist_and_are_linked_from_the_readme(page):
    assert (REPO / "docs" / page).is_file()
    assert f"(docs/{page})" in (REPO / "README.md").read_text()


def test_the_operator_reference_says_templated_exactly_for_template_fields():
    """Review of issue 41: a DAG author reading "(templated)" (or its absence) gets what the code renders."""
    from rayslice.operators.step import RayStepOperator

    from rayslice import operators

    rows: dict[str, dict[str, str]] = {}
    current = None
    for line in (REPO / "docs" / "operators.md").read_text().splitlines():
        if m := re.match(r"^#{2,3} `([A-Za-z]+)`$", line):
            current = rows.setdefault(m[1], {})
        elif current is not None and (m := re.match(r"^\| `(\w+)` \| .+ \|$", line)):
            current[m[1]] = line
    wrong = []
    for name, table in rows.items():
        cls = RayStepOperator if name == "RayStepOperator" else getattr(operators, name, None)
        if cls is None:
            continue
        for param, line in table.items():
            if ("(templated)" in line) != (param in cls.template_fields):
                wrong.append(f"{name}.{param}: docs {'do' if '(templated)' in line else 'do not'} say templated")
    assert not wrong, wrong
