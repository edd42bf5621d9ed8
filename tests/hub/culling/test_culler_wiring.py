"""How GPUCuller turns what it knows of a server into the policy's observation, without a hub:
reports, the ledger's live figures, job runs, Dask work and keep-alive clicks. (The in-hub tests
drive the same code with real servers; the Dask exemption is tested here only: a Dask cluster
with running tasks next to a culled-in-seconds server does not fit a test's time on a 2-core
machine, where a cluster's scheduler and worker alone take most of a minute to start.)"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from gpulab.hub.allocator import GpuShare, Placement, Request
from gpulab.hub.culling import CullConfigError, CullState, decide
from gpulab.hub.cullservice import GPUCuller
from gpulab.hub.cullservice.hub import RunningServer
from gpulab.hub.cullservice.reports import ReportRefused, parse_report
from gpulab.hub.daskservice.core import _Tracked
from gpulab.hub.daskservice.hub import GPUDask
from gpulab.hub.daskservice.service import DaskService
from gpulab.hub.ledger.store import LiveFigure

NOW = 1_000_000.0
POLICY = {
    "dry_run": False,
    "default": {"ui_idle_seconds": 60, "gpu_idle_seconds": 60, "warn_seconds": 30},
}


@pytest.fixture
def culler() -> Iterator[GPUCuller]:
    culler = GPUCuller(policy=POLICY)
    culler.load_policy(["cpu", "gpu-quarter"])
    culler._capacity = SimpleNamespace(gpu_by_uuid=lambda uuid: SimpleNamespace(index=3))  # type: ignore[assignment]
    yield culler
    GPUDask.clear_instance()


def _server(started_at: float = NOW - 3600, profile: str = "gpu-quarter") -> RunningServer:
    request = Request(id="alice/", owner="alice", gpu_milli=250, profile=profile)
    placement = Placement(request, "n1", (GpuShare("GPU-a", 250),), created_at=started_at)
    user = SimpleNamespace(name="alice")
    spawner = SimpleNamespace(name="", user_options={"profile": profile})
    return RunningServer(user, spawner, placement, started_at)


def _idle_figure(t: float = NOW - 5) -> LiveFigure:
    return LiveFigure("alice", "", "GPU-a", t, 0.0, 100.0, 20480.0, NOW - 3000, 5.0)


def _observe(culler: GPUCuller, figures: dict[str, LiveFigure], **jobs: int) -> Any:
    assert culler.parsed is not None
    return culler.observation_of(culler.parsed, _server(), figures, Counter(jobs), NOW)


def _verdict(culler: GPUCuller, observation: Any) -> tuple[str, tuple[str, ...]]:
    assert culler.parsed is not None
    d = decide(culler.parsed, observation, CullState(), NOW)
    return d.verdict, d.causes


def test_an_idle_server_without_a_report_is_idle(culler: GPUCuller) -> None:
    obs = _observe(culler, {"GPU-a": _idle_figure()})
    assert obs.held_milli == 250 and obs.profile == "gpu-quarter"
    assert obs.last_user_input_at is None and obs.busy_kernels == 0
    assert list(obs.slices) == ["GPU 3"]
    assert obs.slices["GPU 3"].below_since == NOW - 3000
    assert _verdict(culler, obs) == ("warn", ("idle",))


def test_a_slice_without_a_current_figure_is_unknown_never_idle(culler: GPUCuller) -> None:
    obs = _observe(culler, {})
    assert _verdict(culler, obs) == ("keep", ("gpu-unknown",))


def test_dask_tasks_of_clusters_made_from_the_server_exempt_it(culler: GPUCuller) -> None:
    service = DaskService.__new__(DaskService)  # only its tracking table is read
    service._tracked = {
        1: _Tracked(scheduler_tasks=7, origin=("alice", "")),
        2: _Tracked(scheduler_tasks=5, origin=("alice", "other")),  # another of her servers
        3: _Tracked(scheduler_tasks=9, origin=("bob", "")),
    }
    GPUDask.instance().service = service
    obs = _observe(culler, {"GPU-a": _idle_figure()})
    assert obs.dask_tasks == 7
    assert _verdict(culler, obs) == ("exempt", ("dask-work",))
    service._tracked[1].scheduler_tasks = 0  # its scheduler said: nothing left
    assert _verdict(culler, _observe(culler, {"GPU-a": _idle_figure()})) == ("warn", ("idle",))


def test_the_owners_running_job_runs_exempt_the_server(culler: GPUCuller) -> None:
    obs = _observe(culler, {"GPU-a": _idle_figure()}, alice=1, bob=3)
    assert obs.running_jobs == 1
    assert _verdict(culler, obs) == ("exempt", ("running-jobs",))


def test_a_report_of_input_and_busy_kernels_reaches_the_observation(culler: GPUCuller) -> None:
    report, keep = parse_report({"input_seconds_ago": {"ui-input": 10}, "busy_kernels": 1}, NOW)
    culler.receive_report(("alice", ""), report, keep)
    obs = _observe(culler, {"GPU-a": _idle_figure()})
    assert obs.last_user_input_at == NOW - 10 and obs.busy_kernels == 1
    assert _verdict(culler, obs) == ("exempt", ("busy-kernels",))


def test_a_report_from_an_earlier_run_of_the_server_is_ignored(culler: GPUCuller) -> None:
    report, _ = parse_report({"busy_kernels": 2}, NOW - 7200)
    culler.receive_report(("alice", ""), report, False)
    assert _observe(culler, {"GPU-a": _idle_figure()}).busy_kernels == 0


def test_keep_alive_lasts_the_rules_keep_alive_seconds(culler: GPUCuller) -> None:
    report, keep = parse_report({"keep_alive": True}, NOW)
    culler.receive_report(("alice", ""), report, keep)
    assert culler.keep_alive_until[("alice", "")] == NOW + 14400
    assert _verdict(culler, _observe(culler, {"GPU-a": _idle_figure()}))[1] == ("keep-alive",)


def test_only_a_persons_input_counts_in_a_report() -> None:
    report, keep = parse_report(
        {
            "input_seconds_ago": {
                "gpu-panel-poll": 0,
                "api-request": 0,
                "kernel-execute": 300,
                "terminal-input": None,
            },
            "busy_kernels": 0,
            "kernels": 3,
        },
        NOW,
    )
    assert report.last_user_input_at == NOW - 300
    assert report.kernels == 3 and keep is False
    # input "in the future" is input now, no more
    assert parse_report({"input_seconds_ago": {"ui-input": -50}}, NOW)[0].last_user_input_at == NOW


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ([], "body"),
        ({"busy_kernels": -1}, "busy_kernels"),
        ({"kernels": "3"}, "kernels"),
        ({"keep_alive": "yes"}, "keep_alive"),
        ({"input_seconds_ago": {"ui-input": "soon"}}, "input_seconds_ago.ui-input"),
        ({"input_seconds_ago": [1]}, "input_seconds_ago"),
        ({"colour": 1}, "colour"),
    ],
)
def test_a_report_the_hub_cannot_read_names_the_field(body: Any, field: str) -> None:
    with pytest.raises(ReportRefused) as e:
        parse_report(body, NOW)
    assert e.value.field == field and str(e.value).startswith(f"{field}: ")


def test_a_policy_error_names_the_culler_option() -> None:
    culler = GPUCuller(policy={"profiles": {"gpu-ful": {}}})
    with pytest.raises(CullConfigError) as e:
        culler.load_policy(["gpu-full"])
    assert e.value.field == "GPUCuller.policy.profiles.gpu-ful"
    short = GPUCuller(policy={"default": {"ui_idle_seconds": 5}})
    with pytest.raises(CullConfigError, match="GPUCuller.policy.default.ui_idle_seconds: 5 s"):
        short.load_policy([])
    short.min_idle_seconds = 1  # a test's or demo's seconds-long rules
    assert short.load_policy([]).default.ui_idle_seconds == 5


def test_the_check_interval_must_be_positive() -> None:
    with pytest.raises(CullConfigError, match="GPUCuller.check_interval_seconds: 0 s"):
        GPUCuller(check_interval_seconds=0)
