"""bench.admin run small: the ledger replay is exact without crashes and close with them, and the
whole benchmark prints its table and the contract's last line. No timing is asserted."""

from __future__ import annotations

import contextlib
import io
import os
from pathlib import Path

import pytest

from bench import admin as bench_admin


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
