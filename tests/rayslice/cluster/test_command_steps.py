"""Command steps on a real local cluster: an unmodified JAX program on every host of a simulated slice."""

from __future__ import annotations

import asyncio
import os
import sys
import textwrap
import time
from pathlib import Path

import pytest

from rayslice.client.submission import run_step_job
from rayslice.core.accelerators import AcceleratorRequest, TpuSliceRequest
from rayslice.core.exceptions import HostLostError, StepFailedError, StepTimeoutError
from rayslice.core.step import Owner, StepSpec
from tests.conftest import TOTAL_TPU_CHIPS, wait_until

#: A program as a team would have it: it imports its own helper package and calls JAX's
#: initialize() with no arguments; it knows nothing of rayslice but the documented variables.
TRAIN = textwrap.dedent('''
    import json, os, sys
    import jax
    import jax.numpy as jnp
    from jax.experimental import multihost_utils
    from helpers.numbers import double

    jax.distributed.initialize()
    total = multihost_utils.process_allgather(jnp.array([jax.process_index() + 1]))
    print(f"process {jax.process_index()} sees {jax.device_count()} devices, MODEL={os.environ['MODEL']}")
    result = {"devices": jax.device_count(), "local": jax.local_device_count(), "sum": int(total.sum()),
              "doubled": double(jax.process_index()), "model": os.environ["MODEL"], "argv": sys.argv[1:],
              "worker": os.environ["RAYSLICE_WORKER_ID"], "try": os.environ["RAYSLICE_TRY_NUMBER"],
              "cwd_has_train": os.path.exists("train.py")}
    with open(os.environ["RAYSLICE_RESULT_FILE"], "w") as f:
        json.dump(result, f)
''')


@pytest.fixture
def program(tmp_path: Path) -> Path:
    folder = tmp_path / "program"
    (folder / "helpers").mkdir(parents=True)
    (folder / "train.py").write_text(TRAIN)
    (folder / "helpers" / "__init__.py").write_text("")
    (folder / "helpers" / "numbers.py").write_text("def double(x):\n    return 2 * x\n")
    (folder / "data.bin").write_bytes(os.urandom(64))  # this test's content: a package the cluster never saw
    return folder


def job(cluster, spec: StepSpec, lines: list[str]):
    return asyncio.run(run_step_job(cluster.dashboard_url, spec, token=cluster.token, emit=lines.append))


def test_an_unmodified_jax_program_runs_on_every_host_from_its_working_dir(cluster, program):
    lines: list[str] = []
    spec = StepSpec(request=TpuSliceRequest(tpu="v6e-16"), command="python train.py --steps 3",
                    runtime_env={"working_dir": str(program), "env_vars": {"MODEL": "tiny"}},
                    owner=Owner(submission_id=f"test-cmd-{time.time_ns()}", try_number=2),
                    launcher="installed")  # as a local connection sends it: the hosts still get the runtime env
    results = job(cluster, spec, lines)
    assert [r["worker"] for r in results] == ["0", "1", "2", "3"]
    for index, result in enumerate(results):
        assert result == {"devices": 16, "local": 4, "sum": 1 + 2 + 3 + 4, "doubled": 2 * index, "model": "tiny",
                          "argv": ["--steps", "3"], "worker": str(index), "try": "2", "cwd_has_train": True}
    for index in range(4):  # every host's own lines, with its prefix
        assert any("v6e-16-" in line and f"host{index}" in line and f"process {index} sees 16 devices" in line
                   for line in lines), lines


def exit_3_on(index: int) -> list[str]:
    """Host `index` exits 3 once its peers are running; the others would sleep for minutes, each noting its pid."""
    code = ("import os, sys, time, pathlib; w = os.environ['RAYSLICE_WORKER_ID']; "
            "folder = pathlib.Path(sys.argv[1]); (folder / str(os.getpid())).write_text(w); "
            f"print('host', w, 'about to exit', flush=True) if w == '{index}' else None; "
            f"(time.sleep(0.5), sys.exit(3)) if w == '{index}' else time.sleep(600)")
    return ["python", "-c", code]


@pytest.mark.parametrize("index", [0, 1, 2, 3])
def test_a_non_zero_exit_on_any_host_fails_the_gang_naming_it_and_frees_the_slice(ray_driver, tmp_path, index):
    from rayslice.cluster import run_step

    spec = StepSpec(request=TpuSliceRequest(tpu="v6e-16"), command=exit_3_on(index) + [str(tmp_path)],
                    owner=Owner(submission_id=f"test-cmd-exit-{time.time_ns()}"))
    started = time.monotonic()
    with pytest.raises(StepFailedError) as info:
        run_step(spec)
    message = str(info.value)
    assert info.value.worker_id == index
    assert f"host{index} (slice 0, worker {index}" in message and "exit code 3" in message, message
    assert f"host {index} about to exit" in message, message  # the host's last output lines
    assert "Traceback" not in message, message  # the program's failure, not the launcher's stack
    assert time.monotonic() - started < 120  # the sleeping peers were cancelled, not waited for
    assert wait_until(lambda: ray_driver.available_resources().get("TPU") == TOTAL_TPU_CHIPS, timeout=10)
    pids = [int(p.name) for p in tmp_path.iterdir()]
    assert wait_until(lambda: not any(_alive(pid) for pid in pids), timeout=10), "a host's program outlived its gang"


def _alive(pid: int) -> bool:
    """Running (a zombie is not: a process whose parent died waits there for whoever adopted it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[0] != b"Z"
    except OSError:
        return False


def test_a_fraction_runs_the_command_once_and_a_missing_result_file_is_none(ray_driver):
    from rayslice.cluster import run_step

    spec = StepSpec(request=AcceleratorRequest(resource="GPU", count=0.25),
                    command=[sys.executable, "-c", "import os; print(os.environ['XLA_PYTHON_CLIENT_MEM_FRACTION'])"],
                    owner=Owner(submission_id=f"test-cmd-gpu-{time.time_ns()}"))
    assert run_step(spec) is None



#: An unmodified JAX program: every host joins the slice's group, then all run cross-host collectives
#: in a loop; worker 2 fails as told (argv: how, folder), noting its pid and when it failed.
FAILING = textwrap.dedent('''
    import os, pathlib, signal, sys, time
    import jax
    import jax.numpy as jnp
    from jax.experimental import multihost_utils

    how, folder = sys.argv[1], pathlib.Path(sys.argv[2])
    # Before the rendezvous: once worker 2 has passed it, its failure may end the others at any moment.
    (folder / f"pid-{os.getpid()}").write_text(os.environ["RAYSLICE_WORKER_ID"])
    jax.distributed.initialize()
    worker = jax.process_index()

    def fail():
        print(f"host {worker} fails: {how}", flush=True)
        (folder / "failed_at").write_text(repr(time.time()))
        if how == "exit-leaving-a-thread":  # a loader thread that never ends: Python joins it before exiting
            import threading
            threading.Thread(target=time.sleep, args=(600,)).start()
        if how in ("exit-after-init", "exit-mid-loop", "exit-leaving-a-thread"):
            sys.exit(3)
        if how == "os-exit":
            os._exit(4)
        os.kill(os.getpid(), signal.SIGKILL)

    if worker == 2 and how == "exit-after-init":
        fail()
    for step in range(10**6):
        if worker == 2 and step == 3:
            fail()
        multihost_utils.process_allgather(jnp.array([step]))  # the peers wait here for worker 2
        time.sleep(0.05)
''')


@pytest.mark.parametrize(("how", "ended"), [("exit-after-init", "exit code 3"), ("exit-mid-loop", "exit code 3"),
                                            ("exit-leaving-a-thread", "exit code 3"),
                                            ("os-exit", "exit code 4"), ("sigkill", "signal SIGKILL")])
def test_the_first_host_whose_program_fails_decides_the_step_at_once(ray_driver, tmp_path, how, ended):
    """Worker 2's program ends (its JAX shutdown at exit would block: its peers sit in a collective)."""
    from rayslice.cluster import run_step

    script = tmp_path / "train.py"
    script.write_text(FAILING)
    folder = tmp_path / "pids"
    folder.mkdir()
    spec = StepSpec(request=TpuSliceRequest(tpu="v6e-16"), command=[sys.executable, str(script), how, str(folder)],
                    step_timeout=60, owner=Owner(submission_id=f"test-cmd-first-{time.time_ns()}"))
    with pytest.raises(StepFailedError) as info:
        run_step(spec)
    failed_after = time.time() - float((folder / "failed_at").read_text())
    message = str(info.value)
    assert (info.value.worker_id, type(info.value)) == (2, StepFailedError), message  # not a bystander
    assert "host2 (slice 0, worker 2" in message and ended in message, message
    assert f"host 2 fails: {how}" in message, message  # its last lines
    assert failed_after < 10, f"the step failed {failed_after:.1f} s after worker 2's program ended"
    assert wait_until(lambda: ray_driver.available_resources().get("TPU") == TOTAL_TPU_CHIPS, timeout=10)
    pids = [int(p.name.removeprefix("pid-")) for p in folder.glob("pid-*")]
    assert len(pids) == 4
    assert wait_until(lambda: not any(_alive(pid) for pid in pids), timeout=10), "a host's program outlived its gang"


#: Every host starts a background child that holds the output pipes (a log shipper) and one in a
#: session of its own (a daemon), then exits 0.
LEAVES_A_CHILD = textwrap.dedent('''
    import json, os, pathlib, subprocess, sys
    folder = pathlib.Path(sys.argv[1])
    ship = "import time\\nwhile True: print('shipping', flush=True); time.sleep(1)"
    child = subprocess.Popen([sys.executable, "-c", ship])
    daemon = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    for pid in (child.pid, daemon.pid):
        (folder / f"child-{pid}").write_text("")
    print("training done", flush=True)
    with open(os.environ["RAYSLICE_RESULT_FILE"], "w") as f:
        json.dump({"worker": os.environ["RAYSLICE_WORKER_ID"]}, f)
''')


def test_a_program_that_exits_0_leaving_a_background_child_succeeds_and_leaves_nothing(ray_driver, tmp_path):
    from rayslice.cluster import run_step

    script = tmp_path / "train.py"
    script.write_text(LEAVES_A_CHILD)
    spec = StepSpec(request=TpuSliceRequest(tpu="v6e-16"), command=[sys.executable, str(script), str(tmp_path)],
                    step_timeout=60, owner=Owner(submission_id=f"test-cmd-child-{time.time_ns()}"))
    assert run_step(spec) == [{"worker": str(i)} for i in range(4)]  # before: StepTimeoutError
    children = [int(p.name.removeprefix("child-")) for p in tmp_path.glob("child-*")]
    assert len(children) == 8
    assert wait_until(lambda: not any(_alive(pid) for pid in children), timeout=10), "a background child was left"
    assert wait_until(lambda: ray_driver.available_resources().get("TPU") == TOTAL_TPU_CHIPS, timeout=10)


#: Worker 1 skips the second all-gather its peers wait in, then ends: its exit waits in JAX's shutdown barrier.
HANGS = textwrap.dedent('''
    import jax
    import jax.numpy as jnp
    from jax.experimental import multihost_utils

    jax.distributed.initialize()
    multihost_utils.process_allgather(jnp.ones(1))
    if jax.process_index() != 1:
        multihost_utils.process_allgather(jnp.ones(1))
''')


def test_a_command_step_whose_processes_all_block_in_a_collective_fails_as_a_hang(ray_driver, tmp_path):
    from rayslice.cluster import run_step
    from rayslice.core.exceptions import CollectiveHangError

    script = tmp_path / "hang.py"
    script.write_text(HANGS)
    spec = StepSpec(request=TpuSliceRequest(tpu="v6e-16"), command=[sys.executable, str(script)], hang_timeout=5,
                    step_timeout=90, owner=Owner(submission_id=f"test-cmd-hang-{time.time_ns()}"))
    with pytest.raises(CollectiveHangError) as info:  # before: StepTimeoutError
        run_step(spec)
    message = str(info.value)
    assert all(f"host{i} (slice 0, worker {i}" in message for i in range(4)), message
    assert wait_until(lambda: ray_driver.available_resources().get("TPU") == TOTAL_TPU_CHIPS, timeout=10)


def test_a_programs_reported_checkpoint_shows_in_the_steps_goodput_line(ray_driver, capfd):
    """The program reports through the context it inherited (RAYSLICE_* variables), from its own process."""
    from rayslice.cluster import run_step

    code = ("import time; from rayslice import get_step_context\n"
            "with get_step_context().checkpointing():\n    time.sleep(0.6)\n")
    spec = StepSpec(request=AcceleratorRequest(resource="GPU", count=0.25), command=[sys.executable, "-c", code],
                    owner=Owner(submission_id=f"test-cmd-goodput-{time.time_ns()}"))
    assert run_step(spec) is None
    [line] = [line for line in capfd.readouterr().out.splitlines() if line.startswith("[rayslice] goodput: ")]
    seconds = float(line.split("checkpointing ")[1].split(" s")[0])
    assert 0.6 <= seconds < 5, line


#: Issue 49's held-out check: a background child in the program's group (forked: no parent-death signal), and
#: the foreground process bash execs. `{end}` is how the foreground part ends.
BACKGROUNDED = "(exec -a {name}-bg sleep 900) & {end}"
ENDINGS = {  # ending -> (slice type, how the foreground part ends, step_timeout)
    "success": ("v6e-4", "exec -a {name}-fg sleep 3", 120),
    "failure": ("v6e-4", "sleep 3; exit 3", 120),
    "step_timeout": ("v6e-4", "exec -a {name}-fg sleep 900", 5),
    "kill": ("v6e-4", "exec -a {name}-fg sleep 900", 120),  # `ray job stop` of the step's job
    "notice": ("v6e-4", "exec -a {name}-fg sleep 900", 120),  # a drain notice (its signal goes to the group)
    "lost peer": ("v6e-16", "exec -a {name}-fg sleep 900", 120),  # another host's process dies
}


@pytest.mark.parametrize("ending", list(ENDINGS))
def test_every_ending_leaves_no_process_of_the_program_and_the_chips_free(cluster, ray_driver, monkeypatch, ending):
    """Installed launcher (this driver's own rayslice on its hosts): whatever ends the step, nothing of it is left.

    `kill` is the step's job stopped as `ray job stop` stops it: its driver, a process of its own, gets SIGTERM.
    (It was this test's process interrupting itself with SIGINT, which a suite started in the background by a
    non-interactive shell ignores, inherited: the step then ran on to its step_timeout.)"""
    import threading

    import ray

    from rayslice.cluster import notices, run_step
    from tests.rayslice.cluster.test_commands import _named

    tpu, end, timeout = ENDINGS[ending]
    name = f"rayslice-ending-{time.time_ns()}"
    sid = f"test-cmd-ending-{time.time_ns()}"
    spec = StepSpec(request=TpuSliceRequest(tpu=tpu), step_timeout=timeout, owner=Owner(submission_id=sid),
                    command=["bash", "-c", BACKGROUNDED.format(name=name, end=end.format(name=name))])
    hosts = 4 if tpu == "v6e-16" else 1

    if ending == "kill":
        log = _stopped_as_a_job(cluster, spec, name, hosts)
        assert "[rayslice] stopped on request; capacity released" in log, log[-3000:]
        assert wait_until(lambda: not _named(name), timeout=15), f"left running after {ending}: {_named(name)}"
        assert wait_until(lambda: ray_driver.available_resources().get("TPU") == TOTAL_TPU_CHIPS, timeout=15)
        return
    ender_saw: list[str] = []  # why the ending never came, for the failure's message

    def end_it() -> None:  # once every host's background child runs
        try:
            if not wait_until(lambda: len(_named(f"{name}-bg")) == hosts, timeout=120):
                ender_saw.append(f"{len(_named(f'{name}-bg'))} of {hosts} background children after 120 s")
                return
        except Exception as exc:  # noqa: BLE001 (said in the failure, not lost with the thread)
            ender_saw.append(repr(exc))
            return
        if ending == "notice":
            monkeypatch.setattr(notices, "draining", lambda nodes: dict.fromkeys(nodes, time.time() + 30))
        elif ending == "lost peer":
            for label in ("v6e-16-a/host1", "v6e-16-b/host1"):
                try:
                    ray.kill(ray.get_actor(f"rayslice:{sid}/{label}"), no_restart=True)
                except ValueError:
                    continue

    ender = threading.Thread(target=end_it, daemon=True)
    ender.start()
    try:
        outcome = run_step(spec)
    except BaseException as exc:  # noqa: BLE001 (every ending has its own; the leftovers are the point)
        outcome = exc
    ender.join(10)
    expected = {"success": list, "failure": StepFailedError, "step_timeout": StepTimeoutError,
                "notice": BaseException, "lost peer": HostLostError}[ending]
    assert isinstance(outcome, expected), (outcome, ender_saw)
    assert wait_until(lambda: not _named(name), timeout=15), f"left running after {ending}: {_named(name)}"
    assert wait_until(lambda: ray_driver.available_resources().get("TPU") == TOTAL_TPU_CHIPS, timeout=15)


def _stopped_as_a_job(cluster, spec: StepSpec, name: str, hosts: int) -> str:
    """The step submitted as a job, stopped once every host's background child runs; its driver's log."""
    from rayslice.client.jobs_client import AsyncRayJobsClient, RayJobsClient
    from rayslice.client.submission import submit_step
    from tests.rayslice.cluster.test_commands import _named

    async def submit() -> str:
        async with AsyncRayJobsClient(cluster.dashboard_url, token=cluster.token) as client:
            return await submit_step(client, spec, emit=lambda _: None)

    sid = asyncio.run(submit())
    with RayJobsClient(cluster.dashboard_url, token=cluster.token) as client:
        try:  # stopped whatever happens: a job left running would hold the slice the next tests count as free
            running = wait_until(lambda: len(_named(f"{name}-bg")) == hosts or client.get(sid).is_terminal,
                                 timeout=180, interval=0.2)
            assert running and not client.get(sid).is_terminal, client.logs(sid)[-3000:]
        finally:
            client.stop(sid)
            assert wait_until(lambda: client.get(sid).is_terminal, timeout=60, interval=0.2), client.get(sid)
        return client.logs(sid)


def test_a_step_timeout_on_the_shipped_launcher_leaves_no_background_child(cluster, ray_driver):
    """The same program submitted as a job: the launcher shipped with it (py_modules), the hosts' guard from there."""
    from tests.rayslice.cluster.test_commands import _named

    name = f"rayslice-shipped-{time.time_ns()}"
    spec = StepSpec(request=TpuSliceRequest(tpu="v6e-4"), step_timeout=5,
                    owner=Owner(submission_id=f"test-cmd-shipped-{time.time_ns()}"),
                    command=["bash", "-c", BACKGROUNDED.format(name=name, end=f"exec -a {name}-fg sleep 900")])
    with pytest.raises(StepTimeoutError):
        job(cluster, spec, [])
    assert wait_until(lambda: not _named(name), timeout=15), f"left running: {_named(name)}"
    assert wait_until(lambda: ray_driver.available_resources().get("TPU") == TOTAL_TPU_CHIPS, timeout=15)
