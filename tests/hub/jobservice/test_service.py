"""The job service with its real parts and no hub process: a GPUCapacity on a declared inventory
(the allocator, quotas), the job store on SQLite, and the local executor running attempts as real
processes of a real per-user account. Admission in queue order, waiting reasons, refusals, a
cancel that frees the share before it returns, retries from a checkpoint, a quota shared with a
notebook server, and a "hub restart" (a new service on the same store and allocations)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import shutil
import sys
import textwrap
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import nbformat
import pytest
from traitlets.config import Config

from gpulab.hub.allocator import NoCapacity, Request
from gpulab.hub.capacity import GPUCapacity
from gpulab.hub.jobs import PLATFORM_RETRIES, JobSpec, JobStore, RunState
from gpulab.hub.jobservice import JobRefused, JobService, allocation_id
from gpulab.spawner.local.accounts import SystemAccount
from gpulab.spawner.local.jobs import LocalJobExecutor, LocalJobRunner
from tests.harness.hub import passable_dir
from tests.harness.jobs import CHECKPOINTING_SCRIPT
from tests.harness.wait import wait_for_async

PROFILES = [
    {"slug": "cpu", "gpus": 0, "default": True},
    {"slug": "quarter", "gpus": "1/4"},
    {"slug": "half", "gpus": "1/2"},
    {"slug": "whole", "gpus": 1},
    {"slug": "two", "gpus": 2},
]


@pytest.fixture
def capacity_config(tmp_path: Path) -> Config:
    c = Config()
    c.GPUCapacity.inventory_source = "declared"
    c.GPUCapacity.declared_inventory = "1 x A100-SXM4-80GB"
    c.GPUCapacity.db_url = f"sqlite:///{tmp_path / 'alloc.sqlite'}"
    c.GPUCapacity.profiles = PROFILES
    c.GPUCapacity.user_quota_gpus = {"alice": "1/2"}
    return c


@pytest.fixture
def runs_dir(tmp_path: Path) -> Iterator[Path]:
    real = passable_dir(tmp_path / "job-runs")
    yield real / "runs"
    shutil.rmtree(real, ignore_errors=True)


@pytest.fixture
def alice(make_account: Any) -> SystemAccount:
    return make_account("alice")


Make = Callable[..., JobService]


@pytest.fixture
async def make_service(
    tmp_path: Path, capacity_config: Config, runs_dir: Path, alice: SystemAccount
) -> AsyncIterator[Make]:
    """A job service as a hub builds it: the same store file and allocator database every time
    (a second call is the service of a restarted hub)."""
    made: list[tuple[JobService, JobStore]] = []

    def make(kernel_start_timeout_seconds: int = 60) -> JobService:
        capacity = GPUCapacity(config=capacity_config)
        store = JobStore(f"sqlite:///{tmp_path / 'jobs.sqlite'}")

        async def workspace_for(owner: str) -> tuple[SystemAccount, str]:
            assert owner == "alice"
            return alice, alice.home

        runner = LocalJobRunner(
            runs_dir,
            grace_seconds=2.0,
            kernel_start_timeout_seconds=kernel_start_timeout_seconds,
        )
        executor = LocalJobExecutor(runner, workspace_for, capacity.gpu_by_uuid)
        service = JobService(
            store,
            capacity,
            executor,
            admission_interval_seconds=0.5,
            platform_retry_backoff_seconds=0.1,
        )
        made.append((service, store))
        return service

    yield make
    for service, store in made:
        await service.stop()
        store.close()


def script(alice: SystemAccount, name: str, code: str) -> str:
    path = Path(alice.home) / "projects" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(code))
    for p in (path, path.parent):
        shutil.chown(p, alice.uid, alice.gid)
    return f"projects/{name}"


def spec(path: str, **kw: Any) -> JobSpec:
    values: dict[str, Any] = {
        "owner": "alice",
        "name": "train",
        "kind": "script",
        "path": path,
        "profile": "quarter",
    }
    values.update(kw)
    return JobSpec(**values)


async def until_state(service: JobService, run_id: int, *states: RunState) -> Any:
    async def check() -> Any:
        run = await asyncio.to_thread(service.store.get_run, run_id)
        return run if run.state in states else None

    return await wait_for_async(f"run {run_id} to reach {states}", check, 60)


def holders(service: JobService) -> set[str]:
    return {p.request.id for p in service.capacity.allocator.allocations()}


async def test_a_run_is_admitted_runs_as_its_owner_on_its_share_and_gives_it_back(
    make_service: Make, alice: SystemAccount
) -> None:
    service = make_service()
    await service.start()
    path = script(
        alice,
        "gpu.py",
        """
        import os
        print(os.getuid(), os.environ["CUDA_VISIBLE_DEVICES"], flush=True)
        out = os.environ["GPULAB_OUTPUT_DIR"]
        open(os.path.join(out, "model.txt"), "w").write("weights")
        """,
    )
    run = await service.submit(spec(path))
    assert run.state is RunState.QUEUED
    done = await until_state(service, run.id, RunState.SUCCEEDED, RunState.FAILED)
    assert done.state is RunState.SUCCEEDED, done
    (attempt,) = done.attempts
    handle = await asyncio.to_thread(service.store.handle, run.id, 1)
    log, _ = await service.executor.tail(handle, "stdout")
    uid, devices = log.decode().split()
    assert int(uid) == alice.uid
    (gpu,) = service.capacity.inventory.nodes[0].gpus
    assert devices == gpu.uuid  # the share the allocator placed it on
    assert attempt.placement.gpus and attempt.placement.node == gpu_node(service)
    outputs = await asyncio.to_thread(service.store.outputs, run.id)
    assert [(o.path, o.size_bytes) for o in outputs] == [("model.txt", 7)]
    assert allocation_id(done) not in holders(service)  # the share is free again


def server_request(service: JobService, profile: str, owner: str) -> Request:
    """What `owner`'s default server on `profile` asks the allocator for (on-demand)."""
    found = service.capacity.profile(profile)
    assert found is not None
    return service.capacity.request_for(
        found, allocation_id=f"{owner}/", owner=owner, groups=frozenset()
    )


def gpu_node(service: JobService) -> str:
    return service.capacity.inventory.nodes[0].name


async def test_a_run_that_does_not_fit_waits_with_its_reason_and_starts_when_a_cancel_frees_the_gpu(
    make_service: Make, alice: SystemAccount
) -> None:
    service = make_service()
    await service.start()
    sleeper = script(alice, "sleep.py", "import time\ntime.sleep(600)\n")
    quick = script(alice, "quick.py", "print('done')\n")
    first = await service.submit(spec(sleeper, profile="half"))
    await until_state(service, first.id, RunState.RUNNING)
    # a second half GPU would fit the machine but not alice's 1/2 GPU quota while the first runs
    second = await service.submit(spec(quick, profile="half"))

    async def reason() -> str | None:
        await service.admit()
        return service.waiting_reason(await asyncio.to_thread(service.store.get_run, second.id))

    text = await wait_for_async("a waiting reason", reason, 30)
    assert "quota" in text, text
    assert (await asyncio.to_thread(service.store.get_run, second.id)).state is RunState.QUEUED
    canceled = await service.cancel(first.id)
    # cancel returns when nothing of the run is left and its share is free
    assert canceled.state is RunState.CANCELED
    assert canceled.reason == "canceled by its owner"
    assert allocation_id(canceled) not in holders(service)
    done = await until_state(service, second.id, RunState.SUCCEEDED, RunState.FAILED)
    assert done.state is RunState.SUCCEEDED


async def test_runs_that_can_never_start_are_refused_naming_the_field(make_service: Make) -> None:
    service = make_service()
    with pytest.raises(JobRefused) as unknown:
        await service.submit(spec("projects/x.py", profile="nope"))
    assert (unknown.value.status, unknown.value.field) == (400, "profile")
    assert "quarter" in unknown.value.message  # names what may be chosen
    with pytest.raises(JobRefused) as too_big:
        await service.submit(spec("projects/x.py", profile="two"))
    assert too_big.value.status == 400 and "larger than any machine" in too_big.value.message
    with pytest.raises(JobRefused) as over:
        await service.submit(spec("projects/x.py", profile="whole"))  # alice may hold 1/2
    assert over.value.status == 403 and "quota" in over.value.message
    assert await asyncio.to_thread(service.store.list_runs) == []  # nothing half-made


async def test_a_failed_attempt_is_retried_and_resumes_from_its_checkpoint(
    make_service: Make, alice: SystemAccount
) -> None:
    service = make_service()
    await service.start()
    path = script(
        alice,
        "flaky.py",
        """
        import os, sys
        mark = os.path.join(os.environ["GPULAB_CHECKPOINT_DIR"], "step")
        if not os.path.exists(mark):
            open(mark, "w").write("1")
            sys.exit(1)
        print("resumed from", open(mark).read())
        """,
    )
    run = await service.submit(spec(path, max_retries=1))
    done = await until_state(service, run.id, RunState.SUCCEEDED)
    assert [a.outcome for a in done.attempts] == ["failed", "succeeded"]
    handle = await asyncio.to_thread(service.store.handle, run.id, 2)
    log, _ = await service.executor.tail(handle, "stdout")
    assert log.decode().strip() == "resumed from 1"


async def test_a_job_and_a_notebook_server_share_one_quota(
    make_service: Make, alice: SystemAccount
) -> None:
    service = make_service()
    await service.start()
    server = server_request(service, "half", "alice")
    await service.capacity.place(server)
    run = await service.submit(spec(script(alice, "q.py", "print(1)\n"), profile="quarter"))

    async def reason() -> str | None:
        await service.admit()
        return service.waiting_reason(await asyncio.to_thread(service.store.get_run, run.id))

    assert "quota" in await wait_for_async("the job to wait for quota", reason, 30)
    await service.capacity.release(server.id)  # the server stops
    service.wake()
    done = await until_state(service, run.id, RunState.SUCCEEDED, RunState.FAILED)
    assert done.state is RunState.SUCCEEDED


async def test_a_restarted_hub_finds_a_running_attempt_again_and_settles_it(
    make_service: Make, alice: SystemAccount
) -> None:
    first = make_service()
    await first.start()
    gate = Path(alice.home) / "projects" / "go"
    path = script(
        alice,
        "gate.py",
        f"""
        import os, time
        while not os.path.exists({str(gate)!r}):
            time.sleep(0.1)
        print("went on")
        """,
    )
    run = await first.submit(spec(path))
    await until_state(first, run.id, RunState.RUNNING)
    await first.stop()  # the hub goes away; its attempt keeps running
    assert allocation_id(run) in await asyncio.to_thread(first.live_allocation_ids)

    second = make_service()  # the restarted hub: new store, allocator and runner objects
    assert allocation_id(run) in holders(second)  # the allocator's own store kept the share
    await second.start()
    gate.write_text("")
    done = await until_state(second, run.id, RunState.SUCCEEDED, RunState.FAILED)
    assert done.state is RunState.SUCCEEDED
    assert allocation_id(run) not in holders(second)
    handle = await asyncio.to_thread(second.store.handle, run.id, 1)
    log, _ = await second.executor.tail(handle, "stdout")
    assert log.decode().strip() == "went on"


async def test_on_demand_work_preempts_a_preemptible_job_which_resumes_from_its_checkpoint(
    make_service: Make, alice: SystemAccount
) -> None:
    service = make_service()
    await service.start()
    path = script(alice, "long.py", CHECKPOINTING_SCRIPT)
    run = await service.submit(spec(path, profile="half", preemptible=True, max_retries=0))
    await until_state(service, run.id, RunState.RUNNING)
    await asyncio.sleep(1)  # some steps done
    whole = server_request(service, "whole", "bob")
    placement = await service.capacity.place(whole)  # as bob's server spawn asks
    assert placement.gpus[0].milli == 1000
    # place returned once nothing of the job ran: the run is preempted and queued again
    preempted = await asyncio.to_thread(service.store.get_run, run.id)
    assert preempted.attempts[0].outcome == "preempted", preempted
    assert "preempted for on-demand work bob/" in (preempted.attempts[0].reason or "")
    assert preempted.state in (RunState.QUEUED, RunState.PREEMPTED)
    assert holders(service) == {"bob/"}  # the share is bob's alone
    handle = await asyncio.to_thread(service.store.handle, run.id, 1)
    first_log, _ = await service.executor.tail(handle, "stdout")
    assert first_log.decode().strip() == "resumed from 0"

    async def reason() -> str | None:
        await service.admit()
        return service.waiting_reason(await asyncio.to_thread(service.store.get_run, run.id))

    assert "waiting for a free" in await wait_for_async("the run to wait for a GPU", reason, 30)
    await service.capacity.release("bob/")  # bob's server stops
    service.wake()
    again = await until_state(service, run.id, RunState.RUNNING)
    assert (
        len(again.attempts) == 2
    )  # retried although max_retries is 0: preemption is not a failure
    handle = await asyncio.to_thread(service.store.handle, run.id, 2)

    async def resumed() -> int | None:
        log, _ = await service.executor.tail(handle, "stdout")
        text = log.decode().strip()
        return int(text.split()[-1]) if text else None

    steps = await wait_for_async("the second attempt's first line", resumed, 30)
    assert steps > 0  # resumed from the checkpoint the first attempt wrote at SIGTERM
    await service.cancel(run.id)


async def test_on_demand_work_never_evicts_what_no_evictor_owns(make_service: Make) -> None:
    service = make_service()
    await service.start()
    capacity = service.capacity
    spot = server_request(service, "whole", "carol")
    await capacity.place(dataclasses.replace(spot, priority="preemptible"))
    with pytest.raises(NoCapacity) as refused:
        await capacity.place(
            server_request(service, "whole", "dave")
        )  # a preemptible *server* is its spawner's to evict
    assert "Preempting" not in refused.value.reason  # the plain refusal, not the search's
    assert holders(service) == {"carol/"}


def notebook(alice: SystemAccount, name: str, sources: list[str]) -> str:
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(source) for source in sources]
    nb.metadata["kernelspec"] = {
        "name": "python3",
        "display_name": "Python 3",
        "language": "python",
    }
    return script(alice, name, nbformat.writes(nb))


@pytest.mark.slow
async def test_a_preempted_notebook_job_resumes_from_its_kernel_checkpoint_at_the_next_cell(
    make_service: Make, alice: SystemAccount
) -> None:
    service = make_service()
    await service.start()
    gate = Path(alice.home) / "projects" / "go"
    path = notebook(
        alice,
        "train.ipynb",
        [
            "import os, time\nx = 41",
            "x += 1\nprint('x is', x)",  # must not run twice: x would be 43
            f"while not os.path.exists({str(gate)!r}):\n    time.sleep(0.1)",
            "print('final', x)",
        ],
    )
    run = await service.submit(spec(path, kind="notebook", profile="half", preemptible=True))

    async def at_the_gate() -> bool:
        r = await asyncio.to_thread(service.store.get_run, run.id)
        if r.state is not RunState.RUNNING:
            return False
        handle = await asyncio.to_thread(service.store.handle, run.id, 1)
        log, _ = await service.executor.tail(handle, "stdout")
        return "[cell 3/4] while" in log.decode()

    await wait_for_async("the notebook to wait at its third cell", at_the_gate, 60)
    await asyncio.sleep(1)  # the kernel's idle save after cell 2 may run; SIGTERM saves anyway
    server = server_request(service, "whole", "bob")
    await service.capacity.place(server)
    stopped = await asyncio.to_thread(service.store.get_run, run.id)
    assert stopped.attempts[0].outcome == "preempted", stopped
    gate.write_text("")
    await service.capacity.release("bob/")
    service.wake()
    done = await until_state(service, run.id, RunState.SUCCEEDED, RunState.FAILED)
    handle2 = await asyncio.to_thread(service.store.handle, run.id, 2)
    log, _ = await service.executor.tail(handle2, "stdout")
    text = log.decode()
    assert done.state is RunState.SUCCEEDED, text
    assert "[resume] 2 of 4 code cells restored" in text, text
    assert "final 42" in text and "x is" not in text, text  # cell 2 did not run again
    executed = nbformat.read(
        Path(alice.home) / "gpulab-jobs" / "train" / f"run-{run.id}" / "train.ipynb", as_version=4
    )
    restored = executed.cells[1]
    assert restored.metadata["gpulab"] == {"restored_from_checkpoint": True}
    assert "x is 42" in restored.outputs[0]["text"]  # its output from the first attempt
    assert len(executed.cells) == 4  # the hidden checkpoint cell is not in the output


def processes_of(uid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if entry.stat().st_uid == uid:
                    found.append(int(entry.name))
            except FileNotFoundError:
                continue
    return found


@pytest.mark.slow
async def test_cancel_of_a_notebook_job_returns_only_when_its_kernel_is_gone_too(
    make_service: Make, alice: SystemAccount
) -> None:
    """papermill starts the kernel in a session of its own, out of reach of a signal to the
    attempt's session: the wrapper stops it itself."""
    service = make_service()
    await service.start()
    path = notebook(
        alice, "wait.ipynb", ["import time\nprint('in', flush=True)", "time.sleep(600)"]
    )
    run = await service.submit(spec(path, kind="notebook"))

    async def in_second_cell() -> bool:
        r = await asyncio.to_thread(service.store.get_run, run.id)
        if r.state is not RunState.RUNNING:
            return False
        handle = await asyncio.to_thread(service.store.handle, run.id, 1)
        log, _ = await service.executor.tail(handle, "stdout")
        return "[cell 2/2] time.sleep" in log.decode()

    await wait_for_async("the notebook's second cell", in_second_cell, 60)
    assert len(processes_of(alice.uid)) >= 3  # wrapper, papermill and the kernel
    canceled = await service.cancel(run.id)
    assert canceled.state is RunState.CANCELED
    assert processes_of(alice.uid) == []


def slow_kernel(alice: SystemAccount, *, first_attempt_only: bool) -> None:
    """Her own kernelspec "python3" (found before the built-in one, as Jupyter looks in the
    user's data folder first): a kernel that sleeps 30 s before it starts, on every start or on
    the first only (a marker file in her home says it slept)."""
    marker = Path(alice.home) / ".slept-once"
    sleep = (
        f"[ -e {marker} ] || {{ touch {marker}; sleep 30; }}" if first_attempt_only else "sleep 30"
    )
    kernels = Path(alice.home) / ".local" / "share" / "jupyter" / "kernels" / "python3"
    kernels.mkdir(parents=True, exist_ok=True)
    argv = [
        "/bin/sh",
        "-c",
        f'{sleep}; exec {sys.executable} -m ipykernel_launcher -f "$0"',
        "{connection_file}",
    ]
    spec_file = kernels / "kernel.json"
    spec_file.write_text(json.dumps({"argv": argv, "display_name": "slow", "language": "python"}))
    for path in [spec_file, *spec_file.parents]:
        if path == Path(alice.home):
            break
        shutil.chown(path, alice.uid, alice.gid)


@pytest.mark.slow
async def test_a_kernel_that_does_not_start_in_time_is_retried_as_the_platforms_failure(
    make_service: Make, alice: SystemAccount
) -> None:
    # 10 s: a real kernel starts within it on a loaded machine, the sleeping one does not
    service = make_service(kernel_start_timeout_seconds=10)
    await service.start()
    slow_kernel(alice, first_attempt_only=True)
    path = notebook(alice, "train.ipynb", ["print('cell ran')"])
    run = await service.submit(spec(path, kind="notebook", max_retries=0))
    # a failed run waiting for its retry is not over: wait for its end
    done = await wait_for_async("the run to end", lambda: _terminal(service, run.id), 120)
    assert done.state is RunState.SUCCEEDED, done  # max_retries=0, and still a second attempt
    first, *others = done.attempts
    assert first.platform_failure and first.outcome is RunState.FAILED, first
    assert first.exit_code == 75
    assert first.reason.startswith("failed before the job's code started: the kernel did not")
    assert "10 seconds" in first.reason, first.reason  # nbclient's "didn't respond in 10 seconds"
    assert done.counted_attempts == 1  # the succeeded one only
    assert all(a.platform_failure for a in others[:-1]) and not others[-1].platform_failure


@pytest.mark.slow
async def test_a_kernel_that_never_starts_ends_its_run_after_the_bounded_platform_retries(
    make_service: Make, alice: SystemAccount
) -> None:
    service = make_service(kernel_start_timeout_seconds=1)
    await service.start()
    slow_kernel(alice, first_attempt_only=False)
    path = notebook(alice, "train.ipynb", ["print('cell ran')"])
    run = await service.submit(spec(path, kind="notebook", max_retries=0))
    done = await wait_for_async("the run to end", lambda: _terminal(service, run.id), 120)
    assert done.state is RunState.FAILED, done
    assert len(done.attempts) == PLATFORM_RETRIES + 1, done.attempts
    for attempt in done.attempts:
        assert attempt.platform_failure, attempt
        assert "didn't respond in 1 seconds" in attempt.reason, attempt.reason
    assert done.max_retries == 0  # the run's own budget was never touched to get there


async def test_a_cell_that_raises_is_the_jobs_own_failure_and_counts_against_max_retries(
    make_service: Make, alice: SystemAccount
) -> None:
    service = make_service()
    await service.start()
    path = notebook(alice, "broken.ipynb", ["raise ValueError('her bug')"])
    run = await service.submit(spec(path, kind="notebook", max_retries=1))
    done = await wait_for_async("the run to end", lambda: _terminal(service, run.id), 120)
    assert [a.platform_failure for a in done.attempts] == [False, False], done.attempts
    assert [a.exit_code for a in done.attempts] == [1, 1]
    assert done.counted_attempts == 2


async def _terminal(service: JobService, run_id: int) -> Any:
    run = await asyncio.to_thread(service.store.get_run, run_id)
    return run if run.is_terminal else None
