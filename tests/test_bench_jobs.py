"""bench.jobs: its SSE reading and tick latencies on hand-made pieces, and the whole benchmark run
small (jupyter-scheduler and a real hub): its table, and a last line in the contract's format
with no run lost. No timing is asserted."""

from __future__ import annotations

import contextlib
import io
import math
import os

import pytest

from bench import jobs as bench_jobs
from bench.jobs_node_loss import node_loss_unavailable


def test_a_tick_line_cut_across_pieces_is_timed_when_its_last_piece_arrives() -> None:
    pieces = iter(
        [
            (10.0, "tick 0 9.5\ntick 1 9."),
            (10.5, "75\n[cell 2/2] done\n"),
            (11.0, "tick 2 10.9"),  # never completed by a newline: not counted
        ]
    )
    assert bench_jobs.tick_latencies(pieces) == {0: 0.5, 1: 0.75}


def test_the_node_loss_phase_runs_exactly_when_the_kubernetes_backend_runs_jobs() -> None:
    from gpulab.hub.jobservice.executor import RunsJobs
    from gpulab.spawner.kube.spawner import GPUKubeSpawner

    why = node_loss_unavailable()
    if isinstance(GPUKubeSpawner, RunsJobs):
        assert why is None
    else:
        assert why is not None and "job_executor" in why


@pytest.mark.slow
@pytest.mark.e2e  # by hand: the benchmark starts its own hub and lab server, as outside pytest
@pytest.mark.skipif(os.geteuid() != 0, reason="gpulab runs jobs as users' own accounts: needs root")
def test_the_benchmark_run_small_prints_its_table_and_the_contracts_last_line() -> None:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = bench_jobs.main(["--quick", "--no-node-loss"])
    text = out.getvalue()
    assert rc == 0, text
    for row in (
        "submit-to-running, jupyter-scheduler ",
        "submit-to-done, gpulab (hub job service)",
        "submit-to-done, ratio gpulab/anchor",
        "cancel-to-free (capacity shows the share)",
        "log line to client (SSE through the proxy)",
        "runs lost through restarts and culls",
        "node loss: NotReady to resumed on another node",
    ):
        assert row in text, text
    assert "not measured: --no-node-loss" in text
    *_, reason, last = text.splitlines()
    assert reason == "n/a: node_loss_resume_s: not measured: --no-node-loss"  # says why
    fields = dict(item.split("=") for item in last.split())
    assert list(fields) == [
        "submit_ratio",
        "cancel_free_p95_s",
        "log_p95_s",
        "lost_runs",
        "node_loss_resume_s",
    ], last
    for name in ("submit_ratio", "cancel_free_p95_s", "log_p95_s"):
        assert math.isfinite(float(fields[name])) and float(fields[name]) > 0, last
    assert fields["lost_runs"] == "0", text
    assert fields["node_loss_resume_s"] == "n/a", last
    assert " 2 hub restarts, 2 culls" in text and "0 lines missing" in text, text
