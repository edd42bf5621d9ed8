"""The server side of GPU-aware culling without a hub: which input counts, busy kernels from the
kernel manager's execution states, where the report goes, the warning's countdown."""

from __future__ import annotations

import time
from types import SimpleNamespace

from jupyterlab_gpulab.culling import ActivityReporter

HUB_ENV = {
    "JUPYTERHUB_API_URL": "http://127.0.0.1:8081/hub/api",
    "JUPYTERHUB_USER": "alice b",
    "JUPYTERHUB_SERVER_NAME": "exp",
    "JUPYTERHUB_API_TOKEN": "t0ken",
}


class Kernels:
    def __init__(self, states: dict[str, str]) -> None:
        self.states = states

    def list_kernel_ids(self) -> list[str]:
        return list(self.states)

    def get_kernel(self, kernel_id: str) -> SimpleNamespace:
        return SimpleNamespace(execution_state=self.states[kernel_id])


def test_only_a_persons_input_is_kept() -> None:
    reporter = ActivityReporter(Kernels({}), env=HUB_ENV)
    assert reporter.record_input("gpu-panel-poll") is False
    assert reporter.record_input("api-request") is False
    assert reporter.report()["input_seconds_ago"] == {}
    assert reporter.record_input("terminal-input") is True
    ages = reporter.report()["input_seconds_ago"]
    assert list(ages) == ["terminal-input"] and 0 <= ages["terminal-input"] < 1


def test_busy_kernels_are_the_ones_executing_now() -> None:
    reporter = ActivityReporter(Kernels({"a": "busy", "b": "idle", "c": "starting"}), env=HUB_ENV)
    body = reporter.report(keep_alive=True)
    assert (body["busy_kernels"], body["kernels"], body["keep_alive"]) == (1, 3, True)


def test_the_report_goes_to_the_hubs_api_for_this_server() -> None:
    reporter = ActivityReporter(Kernels({}), env=HUB_ENV)
    assert reporter.base == "http://127.0.0.1:8081/hub/api/gpulab/users/alice%20b/servers/exp"
    default = ActivityReporter(Kernels({}), env={**HUB_ENV, "JUPYTERHUB_SERVER_NAME": ""})
    assert default.base.endswith("/gpulab/users/alice%20b")
    outside = ActivityReporter(Kernels({}), env={})
    assert outside.base == "" and outside.state()["reporting"] is False


def test_the_warning_counts_down_from_the_hubs_answer() -> None:
    reporter = ActivityReporter(Kernels({}), env=HUB_ENV)
    assert reporter.warning() is None
    reporter.answer = {"culling": True, "warning": {"seconds_left": 100.0, "action": "stop"}}
    reporter.answered_at = time.monotonic() - 30
    warning = reporter.warning()
    assert warning is not None and 69 <= warning["seconds_left"] <= 70
    assert reporter.state()["culling"] is True
