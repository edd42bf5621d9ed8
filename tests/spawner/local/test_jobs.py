"""The local job runner (spawner/local/jobs.py) with real processes of real per-user accounts:
scripts and notebooks run as their owner, logs, exit statuses, cancel, timeout, reattach after a
"hub restart" (a new runner), checkpoints across attempts, and what other accounts cannot see."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nbformat
import pytest

from gpulab.hub.jobs import Fail, JobSpec, Succeed, TimeOut
from gpulab.spawner.local.accounts import SystemAccount
from gpulab.spawner.local.jobs import (
    JobRunnerError,
    LocalJobRunner,
    RunAttempt,
    RunHandle,
)
from gpulab.spawner.local.processes import session_members
from gpulab.spawner.names import (
    CHECKPOINT_DIR_ENV,
    JOB_ATTEMPT_ENV,
    JOB_OUTPUT_DIR_ENV,
    JOB_RUN_ID_ENV,
)
from tests.harness.accounts import pids_of_uid
from tests.harness.hub import passable_dir

HUB_SECRET = "hub-secret-4f1c9e"  # what a hub token looks like to this test


@pytest.fixture
def runs_dir(tmp_path: Path) -> Iterator[Path]:
    """The hub's runs directory, where accounts can pass through (as under a hub's state
    directory; pytest's tmp_path is root's 0700)."""
    real = passable_dir(tmp_path / "job-runs")
    yield real / "runs"
    shutil.rmtree(real, ignore_errors=True)


@pytest.fixture
def alice(make_account: Any) -> SystemAccount:
    return make_account("alice")


def put(account: SystemAccount, relative: str, text: str) -> Path:
    """A file of the account's in its home (as a user would have written it)."""
    path = Path(account.home) / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    for p in [path, *path.relative_to(account.home).parents]:
        os.chown(Path(account.home) / p, account.uid, account.gid)
    return path


def script_attempt(account: SystemAccount, code: str, **kw: Any) -> RunAttempt:
    put(account, "projects/job.py", textwrap.dedent(code))
    values: dict[str, Any] = {
        "run_id": 7,
        "attempt": 1,
        "account": account,
        "kind": "script",
        "path": "projects/job.py",
        "output_dir": "gpulab-jobs/train",
    }
    values.update(kw)
    return RunAttempt(**values)


async def run_to_end(runner: LocalJobRunner, attempt: RunAttempt) -> tuple[Any, str, str]:
    handle = await runner.start(attempt)
    result = await runner.wait(handle)
    out, _ = await runner.tail(handle, "stdout")
    err, _ = await runner.tail(handle, "stderr")
    return result, out.decode(), err.decode()


def run_as(account: SystemAccount, code: str) -> dict[str, str]:
    """Run a probe as `account` (outside the runner); its JSON answer."""
    proc = subprocess.run(
        [sys.executable, "-c", code],
        user=account.uid,
        group=account.gid,
        extra_groups=[],
        cwd="/",
        env={"PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(proc.stdout)


PROBE = """
import json, os, sys
def attempt(fn):
    try:
        fn()
        return "allowed"
    except PermissionError:
        return "denied"
    except OSError as e:
        return type(e).__name__
results = {}
"""


# -- scripts ---------------------------------------------------------------------------------------


async def test_a_script_runs_with_its_arguments_and_its_output_is_logged(alice, runs_dir):
    runner = LocalJobRunner(runs_dir)
    attempt = script_attempt(
        alice,
        """
        import sys
        print("args", sys.argv[1:])
        print("to stderr", file=sys.stderr)
        """,
        args=("--epochs", "3", "two words"),
    )
    result, out, err = await run_to_end(runner, attempt)
    assert result.succeeded and result.recorded and result.exit_code == 0
    assert "args ['--epochs', '3', 'two words']" in out
    assert "to stderr" in err and "to stderr" not in out
    assert isinstance(result.event(1.0), Succeed)


async def test_a_shell_script_runs_with_bin_sh(alice, runs_dir):
    put(alice, "run.sh", 'echo "shell got $1"\n')
    attempt = RunAttempt(
        run_id=8,
        attempt=1,
        account=alice,
        kind="script",
        path="run.sh",
        output_dir="out",
        args=("x",),
    )
    result, out, _ = await run_to_end(LocalJobRunner(runs_dir), attempt)
    assert result.succeeded and "shell got x" in out


async def test_a_failing_script_reports_its_exit_code(alice, runs_dir):
    attempt = script_attempt(alice, "raise SystemExit(3)\n")
    result, _, _ = await run_to_end(LocalJobRunner(runs_dir), attempt)
    assert (result.exit_code, result.signal, result.succeeded) == (3, None, False)
    event = result.event(1.0)
    assert isinstance(event, Fail) and event.exit_code == 3 and event.reason == "exit code 3"


async def test_a_job_whose_folder_is_missing_fails_and_says_why(alice, runs_dir):
    attempt = RunAttempt(
        run_id=9, attempt=1, account=alice, kind="script", path="gone/job.py", output_dir="out"
    )
    result, _, err = await run_to_end(LocalJobRunner(runs_dir), attempt)
    assert result.exit_code == 126 and "cannot prepare the run" in err


async def test_the_job_runs_as_its_owners_account_never_as_root(alice, runs_dir):
    attempt = script_attempt(
        alice, "import os; print(os.getuid(), os.getgid(), sorted(os.getgroups()), os.getcwd())"
    )
    result, out, _ = await run_to_end(LocalJobRunner(runs_dir), attempt)
    uid, gid, groups, cwd = out.split(maxsplit=3)
    assert result.succeeded
    assert (int(uid), int(gid)) == (alice.uid, alice.gid)
    assert "0" not in groups.strip("[]").split(", ")
    assert cwd.strip() == str(Path(alice.home) / "projects")


def test_an_attempt_as_root_is_refused():
    root = SystemAccount("root", 0, 0, "/root")
    with pytest.raises(JobRunnerError, match="refusing to run a job as root"):
        RunAttempt(run_id=1, attempt=1, account=root, kind="script", path="a.py", output_dir="o")


async def test_a_secret_in_the_hubs_environment_does_not_reach_the_job(
    alice, runs_dir, monkeypatch
):
    monkeypatch.setenv("JUPYTERHUB_API_TOKEN", HUB_SECRET)
    monkeypatch.setenv("HUB_DATABASE_PASSWORD", HUB_SECRET)
    attempt = script_attempt(
        alice,
        "import json, os; print(json.dumps(dict(os.environ)))",
        environment={"WANDB_MODE": "offline"},
        placement_environment={"CUDA_VISIBLE_DEVICES": "GPU-1234"},
    )
    result, out, _ = await run_to_end(LocalJobRunner(runs_dir), attempt)
    env = json.loads(out)
    assert result.succeeded
    assert HUB_SECRET not in out and "JUPYTERHUB_API_TOKEN" not in env
    assert env["WANDB_MODE"] == "offline" and env["CUDA_VISIBLE_DEVICES"] == "GPU-1234"
    assert (env["HOME"], env["USER"]) == (alice.home, alice.name)
    assert (env[JOB_RUN_ID_ENV], env[JOB_ATTEMPT_ENV]) == ("7", "1")
    assert env[JOB_OUTPUT_DIR_ENV] == f"{alice.home}/gpulab-jobs/train/run-7"
    assert env[CHECKPOINT_DIR_ENV] == f"{alice.home}/gpulab-jobs/train/run-7/checkpoints"


async def test_logs_are_read_from_an_offset_on(alice, runs_dir):
    runner = LocalJobRunner(runs_dir)
    handle = await runner.start(script_attempt(alice, "print('first'); print('second')"))
    await runner.wait(handle)
    everything, end = await runner.tail(handle, "stdout")
    assert everything == b"first\nsecond\n" and end == len(everything)
    rest, offset = await runner.tail(handle, "stdout", offset=6)
    assert (rest, offset) == (b"second\n", end)
    assert await runner.tail(handle, "stdout", offset=end) == (b"", end)


async def test_the_run_lists_the_files_its_job_wrote_and_follows_no_link(alice, runs_dir):
    attempt = script_attempt(
        alice,
        """
        import os
        out = os.environ["GPULAB_OUTPUT_DIR"]
        os.makedirs(f"{out}/plots")
        open(f"{out}/plots/loss.csv", "w").write("1,2\\n")
        os.symlink("/etc/shadow", f"{out}/shadow")
        os.symlink("/etc", f"{out}/etc")
        """,
    )
    runner = LocalJobRunner(runs_dir)
    handle = await runner.start(attempt)
    assert (await runner.wait(handle)).succeeded
    assert await runner.list_outputs(handle) == [("plots/loss.csv", 4)]


# -- notebooks -------------------------------------------------------------------------------------


def write_notebook(account: SystemAccount, relative: str) -> None:
    nb = nbformat.v4.new_notebook()
    parameters = nbformat.v4.new_code_cell("lr = 0.1\nname = 'default'\nlayers = []")
    parameters.metadata["tags"] = ["parameters"]
    nb.cells = [
        nbformat.v4.new_markdown_cell("# Training"),
        parameters,
        nbformat.v4.new_code_cell("print('lr is', lr, 'name is', name, 'layers', layers)"),
        nbformat.v4.new_code_cell("result = lr * 2\nresult"),
    ]
    nb.metadata["kernelspec"] = {
        "name": "python3",
        "display_name": "Python 3",
        "language": "python",
    }
    put(account, relative, nbformat.writes(nb))


@pytest.mark.slow
async def test_a_notebook_runs_with_json_parameters_and_reports_each_cell(alice, runs_dir):
    write_notebook(alice, "notebooks/train.ipynb")
    parameters = {"lr": 1e20, "name": "big", "layers": [64, {"drop": 0.5}]}
    attempt = RunAttempt(
        run_id=11,
        attempt=1,
        account=alice,
        kind="notebook",
        path="notebooks/train.ipynb",
        output_dir="gpulab-jobs/nb",
        parameters=parameters,
    )
    result, out, err = await run_to_end(LocalJobRunner(runs_dir), attempt)
    assert result.succeeded, err
    executed = Path(alice.home) / "gpulab-jobs/nb/run-11/train.ipynb"
    nb = nbformat.read(executed, as_version=4)
    injected = [c for c in nb.cells if "injected-parameters" in c.metadata.get("tags", [])]
    assert len(injected) == 1
    assert "lr = 1e+20" in injected[0].source and 'name = "big"' in injected[0].source
    assert "lr is 1e+20 name is big layers [64, {'drop': 0.5}]" in out
    # 4 code cells (the injected one included), each with a start and an end line, in order
    progress = [line for line in out.splitlines() if line.startswith("[cell ")]
    assert [p.split("]")[0] + "]" for p in progress] == [
        f"[cell {n}/4]" for n in (1, 1, 2, 2, 3, 3, 4, 4)
    ]
    assert progress[-1].startswith("[cell 4/4] done in ")
    assert executed.stat().st_uid == alice.uid


# -- cancel, timeout, reattach ----------------------------------------------------------------------

SPAWNER_OF_CHILDREN = """
import os, signal, subprocess, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)  # this one needs SIGKILL
kids = [subprocess.Popen(["sleep", "300"]) for _ in range(2)]
shell = subprocess.Popen(["/bin/sh", "-c", "sleep 300 & sleep 300 & wait"])
stubborn = subprocess.Popen(
    ["python3", "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(300)"]
)
print("ready", os.getpgid(0), flush=True)
time.sleep(300)
"""


async def wait_for_line(runner: LocalJobRunner, handle: RunHandle, text: str) -> str:
    for _ in range(600):
        out, _ = await runner.tail(handle, "stdout")
        if text in out.decode():
            return out.decode()
        await asyncio.sleep(0.05)
    raise AssertionError(f"no {text!r} in the log: {out!r}")


async def test_cancel_kills_every_process_of_the_job_and_returns_when_they_are_gone(
    alice, runs_dir
):
    runner = LocalJobRunner(runs_dir)
    handle = await runner.start(script_attempt(alice, SPAWNER_OF_CHILDREN))
    out = await wait_for_line(runner, handle, "ready")
    assert int(out.split()[1]) == handle.pid  # the job's group is the wrapper's session
    # wrapper, job, two sleeps, sh, the stubborn one (sh's own sleeps may still be starting)
    assert len(session_members(handle.pid, handle.start_ticks)) >= 6
    await runner.cancel(handle, grace_seconds=0.5)
    assert session_members(handle.pid, handle.start_ticks) == []
    assert pids_of_uid(alice.uid) == []
    result = await runner.wait(handle)
    assert result.canceled and not result.succeeded and result.reason == "canceled"


async def test_a_job_past_its_timeout_is_killed_and_reported_timed_out(alice, runs_dir):
    runner = LocalJobRunner(runs_dir, grace_seconds=0.5)
    attempt = script_attempt(alice, "import time; time.sleep(300)", timeout_seconds=1)
    handle = await runner.start(attempt)
    result = await runner.wait(handle)
    assert result.timed_out and not result.canceled and not result.succeeded
    assert isinstance(result.event(1.0), TimeOut)
    assert pids_of_uid(alice.uid) == []


async def test_a_new_runner_reattaches_to_a_persisted_handle_and_gets_the_exit_status(
    alice, runs_dir
):
    go = Path(alice.home) / "go"
    attempt = script_attempt(
        alice,
        f"""
        import os, time
        print("waiting", flush=True)
        while not os.path.exists({str(go)!r}):
            time.sleep(0.05)
        raise SystemExit(5)
        """,
    )
    first = LocalJobRunner(runs_dir)
    handle = await first.start(attempt)
    await wait_for_line(first, handle, "waiting")
    persisted = json.dumps(handle.to_dict())

    restarted = LocalJobRunner(runs_dir)  # the hub after a restart: the job is not its child
    again = await restarted.reattach(RunHandle.from_dict(json.loads(persisted)))
    assert again == handle
    go.touch()
    result = await restarted.wait(again)
    assert (result.exit_code, result.recorded) == (5, True)
    assert await restarted.reattach(again) is None  # it is gone now
    assert (await restarted.wait(again)).exit_code == 5  # and its status stays readable


async def test_a_handle_whose_pid_now_names_another_process_is_not_reattached(alice, runs_dir):
    runner = LocalJobRunner(runs_dir)
    handle = await runner.start(script_attempt(alice, "import time; time.sleep(300)"))
    other = RunHandle.from_dict(handle.to_dict() | {"start_ticks": handle.start_ticks + 1})
    assert await runner.reattach(other) is None
    assert await runner.reattach(handle) == handle
    await runner.cancel(handle, grace_seconds=0.5)


async def test_an_attempt_that_runs_cannot_be_started_twice(alice, runs_dir):
    runner = LocalJobRunner(runs_dir)
    attempt = script_attempt(alice, "import time; time.sleep(300)")
    handle = await runner.start(attempt)
    with pytest.raises(JobRunnerError, match="already runs"):
        await runner.start(attempt)
    await runner.cancel(handle, grace_seconds=0.5)


# -- checkpoints and permissions -------------------------------------------------------------------


async def test_the_checkpoint_dir_is_the_same_for_every_attempt_and_writable_by_the_owner(
    alice, runs_dir
):
    code = """
    import os
    ckpt = os.environ["GPULAB_CHECKPOINT_DIR"]
    path = os.path.join(ckpt, "step")
    step = int(open(path).read()) if os.path.exists(path) else 0
    open(path, "w").write(str(step + 1))
    print(ckpt, step)
    """
    runner = LocalJobRunner(runs_dir)
    outs = []
    for number in (1, 2):
        result, out, err = await run_to_end(runner, script_attempt(alice, code, attempt=number))
        assert result.succeeded, err
        outs.append(out.split())
    (dir1, step1), (dir2, step2) = outs
    assert dir1 == dir2 == f"{alice.home}/gpulab-jobs/train/run-7/checkpoints"
    assert (step1, step2) == ("0", "1")  # the retry resumed from what the first attempt saved
    assert Path(dir1).stat().st_uid == alice.uid


async def test_another_account_cannot_read_the_owners_outputs_or_logs(
    alice, make_account, runs_dir
):
    mallory = make_account("mallory")
    os.chmod(alice.home, 0o755)  # even with a home others may enter, the run stays hers
    attempt = script_attempt(
        alice, "import os; open(os.environ['GPULAB_OUTPUT_DIR'] + '/model.pt', 'w').write('w')"
    )
    runner = LocalJobRunner(runs_dir)
    handle = await runner.start(attempt)
    assert (await runner.wait(handle)).succeeded
    output_dir = Path(alice.home) / handle.output_dir
    targets = {
        "outputs": f"os.listdir({str(output_dir)!r})",
        "model": f"open({str(output_dir / 'model.pt')!r}).read()",
        "log": f"open({handle.log_path('stdout')!r}).read()",
        "attempt dir": f"os.listdir({handle.attempt_dir!r})",
        "status": f"open({handle.status_path!r}).read()",
    }
    probe = PROBE + "".join(
        f"results[{name!r}] = attempt(lambda: {expr})\n" for name, expr in targets.items()
    )
    probe += "print(json.dumps(results))"
    assert set(run_as(mallory, probe).values()) == {"denied"}
    # the owner reads her log but cannot change it
    own = PROBE + (
        f"results['read'] = attempt(lambda: open({handle.log_path('stdout')!r}).read())\n"
        f"results['append'] = attempt(lambda: open({handle.log_path('stdout')!r}, 'a'))\n"
        "print(json.dumps(results))"
    )
    assert run_as(alice, own) == {"read": "allowed", "append": "denied"}


def test_an_attempt_is_made_from_a_job_spec():
    spec = JobSpec(
        owner="alice",
        name="train",
        kind="script",
        path="projects/train.py",
        profile="gpu-quarter",
        args=("--epochs", "3"),
        environment={"WANDB_MODE": "offline"},
        timeout_seconds=60,
    )
    account = SystemAccount("gpulab-alice", 200001, 200001, "/home/alice")
    attempt = RunAttempt.from_spec(
        spec, run_id=3, attempt=2, account=account, placement_environment={}
    )
    assert attempt.run_output_dir == "/home/alice/gpulab-jobs/train/run-3"
    assert attempt.checkpoint_dir == "/home/alice/gpulab-jobs/train/run-3/checkpoints"
    assert (attempt.args, attempt.timeout_seconds) == (("--epochs", "3"), 60)
