"""The node agent's rules for native sidecars (KEP-753), checked without a cluster: which init
containers are sidecars, when initialization moves on, restarts, the stop order, the phase and
conditions the kubelet derives from container statuses."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from gpulab.devcluster.agent import sidecars
from gpulab.devcluster.agent.podstate import ContainerState


def spec(name: str, restart: str | None = None) -> dict[str, Any]:
    c: dict[str, Any] = {"name": name, "image": "busybox", "command": ["true"]}
    if restart:
        c["restartPolicy"] = restart
    return c


def running(name: str, *, started: bool = True, ready: bool = True) -> dict[str, Any]:
    return {
        "name": name,
        "started": started,
        "ready": ready,
        "state": {"running": {"startedAt": "2026-01-01T00:00:00Z"}},
    }


def exited(name: str, code: int) -> dict[str, Any]:
    return {
        "name": name,
        "started": False,
        "ready": False,
        "state": {"terminated": {"exitCode": code}},
    }


def test_only_an_init_container_with_restart_policy_always_is_a_sidecar() -> None:
    assert sidecars.is_sidecar(spec("proxy", "Always"))
    assert not sidecars.is_sidecar(spec("prepare"))


@pytest.mark.parametrize("policy", ["Always", "OnFailure", "Never"])
def test_a_sidecar_restarts_whatever_the_pods_restart_policy(policy: str) -> None:
    assert sidecars.restarts(policy, 0, sidecar=True)
    assert sidecars.restarts(policy, 1, sidecar=True)


def test_other_containers_restart_as_the_pods_restart_policy_says() -> None:
    assert sidecars.restarts("Always", 0) and sidecars.restarts("Always", 1)
    assert sidecars.restarts("OnFailure", 1) and not sidecars.restarts("OnFailure", 0)
    assert not sidecars.restarts("Never", 1)


def test_initialization_moves_past_a_sidecar_once_started_and_a_regular_one_once_it_exited_0() -> (
    None
):
    side, prep = spec("proxy", "Always"), spec("prepare")
    assert sidecars.init_step_done(side, running("proxy"))
    assert not sidecars.init_step_done(side, running("proxy", started=False))  # startup probe
    assert not sidecars.init_step_done(side, None)
    assert sidecars.init_step_done(prep, exited("prepare", 0))
    assert not sidecars.init_step_done(prep, exited("prepare", 1))
    assert not sidecars.init_step_done(prep, running("prepare"))


def test_incomplete_init_names_what_keeps_the_pod_uninitialized_in_spec_order() -> None:
    specs = [spec("prepare"), spec("proxy", "Always"), spec("log", "Always")]
    statuses = [exited("prepare", 0), running("proxy", started=False)]
    assert sidecars.incomplete_init(specs, statuses) == ["proxy", "log"]
    assert (
        sidecars.incomplete_init(specs, [exited("prepare", 0), running("proxy"), running("log")])
        == []
    )


def test_a_sidecars_readiness_counts_for_the_pod_and_a_regular_init_containers_does_not() -> None:
    specs = [spec("prepare"), spec("proxy", "Always")]
    init = [exited("prepare", 0) | {"ready": False}, running("proxy", ready=False)]
    assert sidecars.unready(specs, init, [running("main")]) == ["proxy"]
    init[1] = running("proxy")
    assert sidecars.unready(specs, init, [running("main", ready=False)]) == ["main"]
    assert sidecars.unready(specs, init, [running("main")]) == []


def test_a_finished_pods_phase_is_its_main_containers_alone() -> None:
    # the sidecars' 143 after the SIGTERM that the pod's completion sends never reaches here
    assert sidecars.terminal_phase([exited("main", 0), exited("other", 0)]) == "Succeeded"
    assert sidecars.terminal_phase([exited("main", 0), exited("other", 2)]) == "Failed"


def test_sidecars_stop_after_the_main_containers_in_reverse_order_of_declaration() -> None:
    init = [spec("prepare"), spec("a", "Always"), spec("b", "Always"), spec("c", "Always")]
    main = [spec("main"), spec("worker")]
    prereqs = sidecars.stop_prerequisites(init, main, {"a", "b", "c", "main", "worker"})
    assert prereqs == {
        "main": [],
        "worker": [],
        "c": ["main", "worker"],
        "b": ["main", "worker", "c"],
        "a": ["main", "worker", "b"],
    }
    assert sidecars.stop_order(prereqs) == [["main", "worker"], ["c"], ["b"], ["a"]]


def test_containers_that_do_not_run_hold_up_no_stop() -> None:
    init = [spec("a", "Always"), spec("b", "Always"), spec("c", "Always")]
    # a finished Job pod: the main container exited, the sidecars are stopped at once in order
    prereqs = sidecars.stop_prerequisites(init, [spec("main")], {"a", "b", "c"})
    assert sidecars.stop_order(prereqs) == [["c"], ["b"], ["a"]]
    # b in back-off: as the kubelet orders each sidecar after the next one only, a no longer
    # waits for c
    prereqs = sidecars.stop_prerequisites(init, [spec("main")], {"a", "c", "main"})
    assert prereqs == {"main": [], "c": ["main"], "a": ["main"]}


def test_a_running_regular_init_container_is_stopped_at_once() -> None:
    prereqs = sidecars.stop_prerequisites(
        [spec("a", "Always"), spec("prepare")], [spec("m")], {"a", "prepare"}
    )
    assert sidecars.stop_order(prereqs) == [["prepare", "a"]]


@dataclass
class FakeProcess:
    """What ContainerState reads of a run (runtime.ContainerProcess)."""

    running: bool = True
    started_at: str = "2026-01-01T00:00:00Z"


def test_a_sidecar_reports_started_only_once_its_start_counts() -> None:
    cs = ContainerState(spec("proxy", "Always"), init=True, proc=FakeProcess())  # type: ignore[arg-type]
    cs.waiting, cs.ready = {}, True
    assert cs.sidecar
    st = cs.status()
    assert (st["started"], st["ready"]) == (False, False)  # its startup probe has not passed
    assert st["state"] == {"running": {"startedAt": "2026-01-01T00:00:00Z"}}
    cs.started = True
    assert (cs.status()["started"], cs.status()["ready"]) == (True, True)


def test_a_regular_init_container_is_ready_once_it_exited_0_as_the_kubelet_reports_it() -> None:
    cs = ContainerState(spec("prepare"), init=True, proc=FakeProcess(running=False))  # type: ignore[arg-type]
    assert not cs.sidecar
    cs.terminated = {"exitCode": 0, "reason": "Completed"}
    assert cs.status()["ready"] is True and cs.status()["started"] is False
    cs.terminated = {"exitCode": 1, "reason": "Error"}
    assert cs.status()["ready"] is False
