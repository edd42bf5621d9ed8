"""summarize_round: "would cull N servers, reclaim X GPU-h/day" and the counts per reason."""

from __future__ import annotations

from gpulab.hub.culling import CullState, decide, summarize_round
from tests.harness.culling import DRY_RUN, LIVE, NOW, RULE, idle_server, warned


def test_a_dry_round_reports_what_it_would_cull_and_the_gpu_hours_it_would_reclaim() -> None:
    full = idle_server(user="alice")
    quarter = idle_server(user="bob", profile="gpu-quarter", held_milli=250)
    fresh = idle_server(user="carol")
    busy = idle_server(user="dave", busy_kernels=1)
    typing = idle_server(user="erin", last_user_input_at=NOW - 60)
    cpu = idle_server(user="frank", profile="cpu", held_milli=0, slices={})
    decisions = [
        decide(DRY_RUN, full, warned(full, RULE.warn_seconds, shown=False), NOW),
        decide(DRY_RUN, quarter, warned(quarter, RULE.warn_seconds, shown=False), NOW),
        decide(DRY_RUN, fresh, CullState(), NOW),
        decide(DRY_RUN, busy, CullState(), NOW),
        decide(DRY_RUN, typing, CullState(), NOW),
        decide(DRY_RUN, cpu, CullState(), NOW),
    ]
    summary = summarize_round(decisions)
    assert (summary.servers, summary.would_cull, summary.warned) == (6, 2, 1)
    assert summary.reclaim_milli == 1250
    assert summary.reclaim_gpu_hours_per_day == 30.0
    assert dict(summary.by_reason) == {
        "cull/idle": 2,
        "exempt/busy-kernels": 1,
        "exempt/no-gpu": 1,
        "keep/ui-input": 1,
        "warn/idle": 1,
    }
    assert summary.text() == (
        "would cull 2 servers, reclaim 30 GPU-h/day (6 checked; cull/idle 2, "
        "exempt/busy-kernels 1, exempt/no-gpu 1, keep/ui-input 1, warn/idle 1)"
    )
    assert {d.effect for d in decisions} == {"none"}


def test_a_live_round_is_worded_as_what_it_does() -> None:
    server = idle_server(held_milli=125, profile="gpu-eighth")
    decision = decide(LIVE, server, warned(server, RULE.warn_seconds), NOW)
    assert summarize_round([decision]).text() == (
        "culls 1 server, reclaim 3 GPU-h/day (1 checked; cull/idle 1)"
    )


def test_an_empty_round_reclaims_nothing() -> None:
    assert summarize_round([], dry_run=True).text() == "would cull 0 servers, reclaim 0 GPU-h/day"


def test_every_decision_carries_its_reason_to_the_log_the_panel_and_a_metric() -> None:
    server = idle_server(user="bob", server="train", profile="gpu-quarter", held_milli=250)
    decision = decide(DRY_RUN, server, warned(server, RULE.warn_seconds, shown=False), NOW)
    assert decision.log_message() == (
        "bob/train [gpu-quarter]: cull (checkpoint-stop) (dry run): GPU 0 below 5% for 2 h and"
        " no UI input for 2 h, warned 15 min ago: checkpoint its kernels and stop it"
    )
    assert decision.metric_labels() == {
        "verdict": "cull",
        "cause": "idle",
        "profile": "gpu-quarter",
        "mode": "dry-run",
    }
    body = decision.to_json()
    assert (body["verdict"], body["effect"], body["reason"]) == (
        "cull",
        "none",
        decision.reason,
    )
