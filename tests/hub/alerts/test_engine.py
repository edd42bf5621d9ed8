"""RuleEngine over synthetic series: FOR holds and breaks, gaps, resolve, None metrics, devices."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpulab.hub.alerts import AlertEvent, RuleEngine, Sample, parse_rule, parse_rules

LIMIT = 81920.0  # MiB


def util(t: float, pct: float | None, used: float = 1000.0) -> Sample:
    return Sample(t=t, utilization_pct=pct, memory_used_mib=used, memory_limit_mib=LIMIT)


def feed(engine: RuleEngine, device: str, samples: list[Sample]) -> list[AlertEvent]:
    return [e for s in samples for e in engine.observe(device, s)]


HIGH = parse_rule('IF gpu_utilization > 90% FOR 5m THEN alert("HIGH_LOAD", severity="critical")')


def test_for_fires_once_the_comparison_held_for_the_whole_duration():
    engine = RuleEngine([HIGH])
    events = feed(engine, "gpu0", [util(t, 95) for t in range(0, 300, 10)])
    assert events == []  # 0..290 s: not yet 5 minutes
    events = engine.observe("gpu0", util(300, 95))
    assert events == [
        AlertEvent(
            "HIGH_LOAD",
            "critical",
            "HIGH_LOAD: gpu_utilization > 90% FOR 5m",
            "gpu0",
            "firing",
            300,
            300,
        )
    ]
    assert feed(engine, "gpu0", [util(310, 99), util(320, 91)]) == []  # transitions only
    [active] = engine.active()
    assert (active.state, active.since, active.t) == ("firing", 300, 320)


def test_a_false_sample_breaks_the_streak_and_resolves():
    engine = RuleEngine([HIGH])
    feed(engine, "gpu0", [util(t, 95) for t in range(0, 310, 10)])
    assert [e.state for e in engine.active()] == ["firing"]
    [resolved] = engine.observe("gpu0", util(310, 50))
    assert (resolved.state, resolved.since, resolved.t) == ("resolved", 300, 310)
    assert engine.active() == []
    # the streak starts again at the next true sample
    assert feed(engine, "gpu0", [util(t, 95) for t in range(320, 620, 10)]) == []
    assert [e.state for e in engine.observe("gpu0", util(620, 95))] == ["firing"]


def test_a_dip_inside_the_window_delays_firing():
    engine = RuleEngine([HIGH])
    series = [util(t, 95) for t in range(0, 200, 10)] + [util(200, 10)]
    series += [util(t, 95) for t in range(210, 520, 10)]
    fired = [e for e in feed(engine, "gpu0", series) if e.state == "firing"]
    assert [e.t for e in fired] == [510]  # 210 + 300


def test_a_gap_longer_than_max_gap_restarts_the_streak():
    engine = RuleEngine([HIGH], max_gap_seconds=30)
    series = [util(t, 95) for t in range(0, 200, 10)] + [util(t, 95) for t in range(260, 600, 10)]
    fired = [e for e in feed(engine, "gpu0", series) if e.state == "firing"]
    assert [e.t for e in fired] == [560]  # the 60 s gap after 190 restarts the clock at 260


def test_a_gap_resolves_a_firing_for_alert():
    engine = RuleEngine([HIGH], max_gap_seconds=30)
    feed(engine, "gpu0", [util(t, 95) for t in range(0, 310, 10)])
    [event] = engine.observe("gpu0", util(400, 95))
    assert (event.state, event.since, event.t) == ("resolved", 300, 400)


def test_gaps_up_to_max_gap_keep_the_streak():
    engine = RuleEngine([HIGH], max_gap_seconds=30)
    fired = feed(engine, "gpu0", [util(t, 95) for t in range(0, 301, 30)])
    assert [e.t for e in fired] == [300]


def test_default_max_gap_is_three_typical_spacings_but_at_least_30_s():
    engine = RuleEngine([HIGH])
    # 1 s samples, one 25 s pause: below the 30 s floor, the streak survives
    series = [util(t, 95) for t in range(0, 100)] + [util(t, 95) for t in range(125, 301)]
    assert [e.t for e in feed(engine, "a", series) if e.state == "firing"] == [300]
    # 20 s scrapes: a missed scrape (40 s) is within 3 x 20 s; two missed (80 s) is not
    engine = RuleEngine([HIGH])
    series = [util(t, 95) for t in range(0, 160, 20)] + [util(t, 95) for t in range(180, 400, 20)]
    assert [e.t for e in feed(engine, "b", series) if e.state == "firing"] == [300]
    engine = RuleEngine([HIGH])
    series = [util(t, 95) for t in range(0, 160, 20)] + [util(t, 95) for t in range(220, 600, 20)]
    assert [e.t for e in feed(engine, "c", series) if e.state == "firing"] == [520]


def test_unavailable_metric_is_false_and_breaks_the_streak():
    engine = RuleEngine([HIGH])
    series = [util(t, 95) for t in range(0, 150, 10)] + [util(150, None)]
    series += [util(t, 95) for t in range(160, 470, 10)]
    assert [e.t for e in feed(engine, "gpu0", series) if e.state == "firing"] == [460]
    hot = RuleEngine(parse_rules('IF gpu_temperature > 80C THEN alert("HOT")'))
    assert hot.observe("share", util(0, 100)) == []  # a fractional share has no temperature
    not_hot = RuleEngine(parse_rules('IF NOT gpu_temperature > 80C THEN alert("COOL")'))
    assert [e.rule for e in not_hot.observe("share", util(0, 100))] == ["COOL"]


def test_memory_percentages_are_of_the_share_limit_and_need_one():
    engine = RuleEngine(parse_rules('IF gpu_memory_used > 95% THEN alert("FULL")'))
    assert engine.observe("d", util(0, 0, used=0.9 * LIMIT)) == []
    assert [e.state for e in engine.observe("d", util(1, 0, used=0.96 * LIMIT))] == ["firing"]
    no_limit = Sample(t=2, utilization_pct=0, memory_used_mib=0.96 * LIMIT)
    assert [e.state for e in engine.observe("d", no_limit)] == ["resolved"]


def test_absolute_memory_and_free_memory():
    rules = parse_rules(
        'IF gpu_memory_used >= 70GiB THEN alert("BIG")\n'
        'IF gpu_memory_free < 2GiB THEN alert("LOW_FREE")\n'
        'IF gpu_memory_free < 5% THEN alert("LOW_FREE_PCT")\n'
    )
    engine = RuleEngine(rules)
    assert engine.observe("d", util(0, 0, used=60 * 1024)) == []
    fired = {e.rule for e in engine.observe("d", util(1, 0, used=LIMIT - 1024))}
    assert fired == {"BIG", "LOW_FREE", "LOW_FREE_PCT"}


def test_each_condition_has_its_own_for():
    rule = parse_rule(
        'IF gpu_utilization > 90% FOR 5m AND gpu_memory_used > 95% FOR 1m THEN alert("HIGH_LOAD")'
    )
    engine = RuleEngine([rule])
    full = 0.99 * LIMIT
    # utilisation high from t=0, memory full only from t=400: fires at 460, not 300
    series = [util(t, 95, used=1000) for t in range(0, 400, 10)]
    series += [util(t, 95, used=full) for t in range(400, 500, 10)]
    assert [e.t for e in feed(engine, "d", series)] == [460]


def test_or_fires_on_either_and_resolves_when_neither_holds():
    rule = parse_rule('IF gpu_temperature > 85C OR gpu_power > 300W FOR 1m THEN alert("HOT")')
    engine = RuleEngine([rule])

    def s(t, temp, power):
        return Sample(t=t, temperature_c=temp, power_w=power)

    assert engine.observe("d", s(0, 90, 100))[0].state == "firing"
    # cool again: resolves, though the power streak begins at 10
    assert engine.observe("d", s(10, 70, 350))[0].state == "resolved"
    assert feed(engine, "d", [s(t, 70, 350) for t in range(20, 70, 10)]) == []
    [event] = engine.observe("d", s(70, 70, 350))
    assert (event.state, event.since) == ("firing", 70)


def test_devices_are_independent():
    engine = RuleEngine([HIGH])
    for t in range(0, 310, 10):
        engine.observe("alice/gpu0", util(t, 95))
        engine.observe("bob/gpu0", util(t, 95 if t < 200 else 20))
    assert [(e.device, e.state) for e in engine.active()] == [("alice/gpu0", "firing")]
    assert sorted(engine.devices()) == ["alice/gpu0", "bob/gpu0"]


def test_several_rules_fire_separately():
    rules = parse_rules(
        'IF gpu_utilization > 90% THEN alert("BUSY")\nIF gpu_utilization < 5% THEN alert("IDLE")'
    )
    engine = RuleEngine(rules)
    assert [(e.rule, e.state) for e in engine.observe("d", util(0, 99))] == [("BUSY", "firing")]
    assert [(e.rule, e.state) for e in engine.observe("d", util(1, 1))] == [
        ("BUSY", "resolved"),
        ("IDLE", "firing"),
    ]


def test_old_and_duplicate_samples_are_ignored():
    engine = RuleEngine(parse_rules('IF gpu_utilization > 90% THEN alert("BUSY")'))
    assert len(engine.observe("d", util(10, 99))) == 1
    assert engine.observe("d", util(10, 0)) == []
    assert engine.observe("d", util(5, 0)) == []
    assert len(engine.active()) == 1


def test_forget_resolves_the_alerts_of_a_device_that_went_away():
    engine = RuleEngine(parse_rules('IF gpu_utilization > 90% THEN alert("BUSY")'))
    engine.observe("d", util(10, 99))
    [event] = engine.forget("d", t=42)
    assert (event.state, event.since, event.t) == ("resolved", 10, 42)
    assert engine.active() == [] and engine.devices() == []
    assert engine.forget("d") == []


def test_max_gap_must_be_positive():
    with pytest.raises(ValueError, match="max_gap_seconds"):
        RuleEngine([HIGH], max_gap_seconds=0)


def oracle_holds(series: list[tuple[float, float | None]], i: int, d: float, gap: float) -> bool:
    """Brute force: some earlier sample j with t_i - t_j >= d, all of j..i above, no long gap."""
    for j in range(i, -1, -1):
        t, value = series[j]
        if value is None or not value > 50:
            return False
        if j < i and series[j + 1][0] - t > gap:
            return False
        if series[i][0] - t >= d:
            return True
    return False


@settings(max_examples=300)
@given(
    st.lists(
        st.tuples(
            st.integers(1, 25),
            st.one_of(st.none(), st.sampled_from([0.0, 49.0, 50.0, 51.0, 99.0])),
        ),
        max_size=60,
    )
)
def test_engine_matches_a_brute_force_oracle(steps):
    rule = parse_rule('IF gpu_utilization > 50% FOR 30s THEN alert("BUSY")')
    engine = RuleEngine([rule], max_gap_seconds=15)
    series: list[tuple[float, float | None]] = []
    t, firing, since = 0.0, False, None
    for dt, value in steps:
        t += dt
        series.append((t, value))
        events = engine.observe("d", util(t, value))
        expected = oracle_holds(series, len(series) - 1, 30, 15)
        if expected and not firing:
            since = t
            assert [(e.state, e.since, e.t) for e in events] == [("firing", t, t)]
        elif firing and not expected:
            assert [(e.state, e.since, e.t) for e in events] == [("resolved", since, t)]
        else:
            assert events == []
        firing = expected
        assert len(engine.active()) == (1 if firing else 0)
