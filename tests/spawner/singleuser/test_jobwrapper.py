"""The job wrapper as a Kubernetes Job's container runs it: the spec from a file (the attempt's
Secret volume), no status descriptor (the exit code is the record), signals forwarded to the job.
The local runner's use (descriptors) is tested with real accounts in tests/spawner/local."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import nbformat

from gpulab.spawner.job_attempt import wrapper_spec
from gpulab.spawner.singleuser.jobwrapper import platform_failure_cause

WRAPPER = [sys.executable, "-I", "-m", "gpulab.spawner.singleuser.jobwrapper", "run"]


def spec_file(tmp_path: Path, script: str, text: str) -> Path:
    """A script in a home under tmp_path and the wrapper's spec for it, as the Secret holds it."""
    home = tmp_path / "home"
    (home / "work").mkdir(parents=True)
    (home / "work" / script).write_text(text)
    spec = wrapper_spec(
        kind="script",
        path=f"work/{script}",
        home=str(home),
        output_dir="gpulab-jobs/demo",
        run_id=7,
        python=sys.executable,
    )
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec))
    return path


def test_a_spec_file_without_a_status_descriptor_runs_the_job_and_exits_with_its_code(
    tmp_path: Path,
):
    spec = spec_file(tmp_path, "job.py", "import os; print(os.getcwd()); raise SystemExit(3)")
    done = subprocess.run(
        [*WRAPPER, "--spec-file", str(spec)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 3
    assert done.stdout.strip() == str(tmp_path / "home" / "work")
    assert (tmp_path / "home" / "gpulab-jobs" / "demo" / "run-7" / "checkpoints").is_dir()


def test_forwarded_sigterm_reaches_the_job_where_only_the_wrapper_is_signalled(tmp_path: Path):
    marker = tmp_path / "got-term"
    spec = spec_file(
        tmp_path,
        "job.sh",
        f"trap 'echo term > {marker}; exit 7' TERM\necho ready\nwhile :; do sleep 0.05; done\n",
    )
    wrapper = subprocess.Popen(
        [*WRAPPER, "--spec-file", str(spec), "--forward-signals"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert wrapper.stdout is not None
        assert wrapper.stdout.readline().strip() == "ready"
        wrapper.send_signal(signal.SIGTERM)  # the kubelet signals the container's first process
        assert wrapper.wait(timeout=30) == 7
        assert marker.read_text().strip() == "term"
    finally:
        if wrapper.poll() is None:
            wrapper.kill()
            wrapper.wait()


def test_without_forwarding_a_sigterm_to_the_wrapper_alone_leaves_the_job_running(
    tmp_path: Path,
):
    # the local runner signals the whole session itself: the wrapper only outlives the signal
    spec = spec_file(
        tmp_path,
        "job.sh",
        "echo ready\ni=0\nwhile [ $i -lt 10 ]; do sleep 0.05; i=$((i+1)); done\n",
    )
    wrapper = subprocess.Popen(
        [*WRAPPER, "--spec-file", str(spec)], stdout=subprocess.PIPE, text=True
    )
    assert wrapper.stdout is not None
    assert wrapper.stdout.readline().strip() == "ready"
    start = time.monotonic()
    wrapper.send_signal(signal.SIGTERM)
    assert wrapper.wait(timeout=30) == 0  # the job ran to its end
    assert time.monotonic() - start > 0.1


def test_the_wrapper_takes_its_spec_from_a_descriptor_or_a_file_not_both(tmp_path: Path):
    done = subprocess.run(
        [*WRAPPER, "--spec-fd", "0", "--spec-file", str(tmp_path / "s.json")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "not allowed with argument" in done.stderr


def test_list_outputs_ends_the_log_with_the_runs_files_without_following_symlinks(
    tmp_path: Path,
):
    (tmp_path / "secret.txt").write_text("not the run's")
    spec = spec_file(
        tmp_path,
        "job.py",
        "import os\n"
        "d = os.path.join(os.path.dirname(os.getcwd()), 'gpulab-jobs/demo/run-7')\n"
        "open(os.path.join(d, 'model.bin'), 'w').write('w' * 10)\n"
        "open(os.path.join(d, 'checkpoints', 'step.json'), 'w').write('{}')\n"
        f"os.symlink({str(tmp_path / 'secret.txt')!r}, os.path.join(d, 'link'))\n"
        f"os.symlink({str(tmp_path)!r}, os.path.join(d, 'dirlink'))\n"
        "raise SystemExit(2)\n",
    )
    done = subprocess.run(
        [*WRAPPER, "--spec-file", str(spec), "--list-outputs"], capture_output=True, text=True
    )
    assert done.returncode == 2, done.stderr  # listed whatever the job's end
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("gpulab job: outputs "), done.stderr
    listing = json.loads(last.removeprefix("gpulab job: outputs "))
    assert listing == {"files": [["checkpoints/step.json", 2], ["model.bin", 10]], "more": False}


def wrapped_status(tmp_path: Path, spec: Path) -> tuple[int, dict[str, object], str]:
    """The wrapper run with a status descriptor, as the local runner runs it: its exit code,
    the status it wrote and its stderr."""
    status = tmp_path / "exit.json"
    fd = os.open(status, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        done = subprocess.run(
            [*WRAPPER, "--spec-file", str(spec), "--status-fd", str(fd)],
            capture_output=True,
            text=True,
            timeout=60,
            pass_fds=(fd,),
        )
    finally:
        os.close(fd)
    return done.returncode, json.loads(status.read_text()), done.stderr


def test_a_scripts_own_exit_75_is_its_own_failure_and_not_the_platforms(tmp_path: Path):
    spec = spec_file(tmp_path, "job.py", "raise SystemExit(75)")
    code, status, _ = wrapped_status(tmp_path, spec)
    assert (code, status) == (75, {"exit_code": 75})


def test_a_notebook_whose_kernel_does_not_start_failed_before_the_jobs_code(tmp_path: Path):
    home = tmp_path / "home"
    (home / "work").mkdir(parents=True)
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("print('never')")]
    (home / "work" / "nb.ipynb").write_text(nbformat.writes(nb))
    spec = wrapper_spec(
        kind="notebook",
        path="work/nb.ipynb",
        home=str(home),
        output_dir="gpulab-jobs/demo",
        run_id=7,
        python=sys.executable,
        kernel_name="no-such-kernel",  # a kernel the machine cannot start at all
    )
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec))
    code, status, stderr = wrapped_status(tmp_path, path)
    assert (code, status) == (75, {"exit_code": 75, "platform_failure": True}), stderr
    cause = platform_failure_cause(stderr.encode())
    assert cause is not None and cause.startswith("the kernel did not start: NoSuchKernel"), stderr


def test_the_platform_failure_cause_is_the_last_such_line_of_the_log():
    prefix = b"gpulab job: failed before the job's code started: "
    assert platform_failure_cause(b"x\n" + prefix + b"a\n" + prefix + b"b\n") == "b"
    assert platform_failure_cause(prefix + b"only") == "only"
    assert platform_failure_cause(b"say " + prefix + b"not at a line's start\n") is None
    assert platform_failure_cause(b"nothing\n") is None
