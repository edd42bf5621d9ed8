"""bench.admin's command line (--quick and what it selects), and bench.admin run small: the
ledger replay is exact without crashes and close with them, and the whole benchmark prints its
table and the contract's last line. No timing is asserted."""

from __future__ import annotations

import contextlib
import io
import os
from pathlib import Path

import pytest

from bench import admin as bench_admin
from bench._lastline import last_lines


def test_quick_selects_a_slice_of_the_trace_fewer_servers_and_a_few_stops() -> None:
    full, quick = bench_admin.parse_args([]), bench_admin.parse_args(["--quick"])
    assert (full.pods, full.servers, full.repeats, full.stop) == (100_000, 500, 5, 50)
    assert (quick.pods, quick.servers, quick.repeats, quick.stop) == (2_000, 100, 2, 5)
    assert quick.cull_rounds == 1 and quick.skip == []  # every phase, culling included


def test_a_size_given_wins_over_the_quick_ones() -> None:
    args = bench_admin.parse_args(["--quick", "--servers", "12", "--pods", "300"])
    assert (args.servers, args.pods, args.stop) == (12, 300, 5)


def test_a_skipped_phase_is_n_a_with_the_reason_on_the_line_before() -> None:
    args = bench_admin.parse_args(["--quick", "--skip", "culling"])
    out = bench_admin.Results(render_s=0.5, bulk_stop_s=2.0, ledger_error_pct=0.01)
    fields, why_not = bench_admin.last_fields(args, out)
    reason, last = last_lines(fields, why_not)
    assert reason == "n/a: false_culls: --skip culling"
    assert last == "render_100_s=0.500 bulk_stop_5_s=2.00 ledger_error_pct=0.0100 false_culls=n/a"


def test_the_ledger_replay_is_exact_without_crashes_and_close_with_them(tmp_path: Path) -> None:
    exact = bench_admin.replay("gpushare40", 400, 0, 1.0, tmp_path, seed=1)
    assert exact.changes > 400 and exact.crashes == 0
    assert exact.error_pct == 0.0
    assert exact.ledger_ms == {k: v for k, v in exact.record_ms.items() if v}
    crashing = bench_admin.replay("gpushare40", 400, 50, 1.0, tmp_path, seed=1)
    assert crashing.crashes > 0
    # what a crash loses (the last second's changes) is counted until the restart's
    # reconciliation: a little, never a lot
    assert 0 <= crashing.error_pct < 1
    # whole-GPU charging of fractional pods counts more than their fractions
    assert exact.whole_gpu_ms > sum(exact.record_ms.values())


@pytest.mark.slow
@pytest.mark.e2e  # the benchmark starts its own hubs and servers, as outside pytest
@pytest.mark.skipif(
    os.geteuid() != 0, reason="gpulab runs servers as users' own accounts: needs root"
)
def test_the_benchmark_run_small_prints_its_table_and_the_contracts_last_line() -> None:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        # the culling phase is the culling matrix of tests/hub/culling, which runs there
        rc = bench_admin.main(
            [
                "--pods",
                "300",
                "--servers",
                "12",
                "--repeats",
                "2",
                "--stop",
                "2",
                "--skip",
                "culling",
            ]
        )
    text = out.getvalue()
    assert rc == 0, text
    for row in (
        "ledger error, clean restarts (%)",
        "overview REST, 12 workloads",
        "panel page until all 12 rows show",
        "stock /hub/admin until its user table shows",
        "bulk stop of 2 servers, panel action",
        "stop of 2 servers, stock DELETE each",
    ):
        assert row in text, text
    last = text.splitlines()[-1]
    fields = dict(item.split("=") for item in last.split())
    assert set(fields) == {"render_12_s", "bulk_stop_2_s", "ledger_error_pct", "false_culls"}
    assert float(fields["render_12_s"]) > 0 and float(fields["bulk_stop_2_s"]) > 0
    assert float(fields["ledger_error_pct"]) >= 0
    assert fields["false_culls"] == "n/a"  # skipped here
    assert text.splitlines()[-2] == "n/a: false_culls: --skip culling"
