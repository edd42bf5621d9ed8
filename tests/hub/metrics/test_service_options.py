"""gpulab-metrics' options: refused at load time naming the option, the staleness that follows the
hub's push interval, and a bad config file that leaves the service on its defaults."""

from __future__ import annotations

import pytest
from traitlets import TraitError

from gpulab.hub.services.metrics.service import MetricsService
from tests.harness.metrics_service import SERVICE_TOKEN


def test_bad_options_are_refused_at_load_time_with_the_option():
    with pytest.raises(TraitError, match=r"MetricsService.rules: line 1, column 4: unknown metric"):
        MetricsService(rules='IF gpu_idle < 5% THEN alert("X")')
    with pytest.raises(TraitError, match="listing_interval_seconds must be more than 0"):
        MetricsService(listing_interval_seconds=0)
    with pytest.raises(TraitError, match="max_push_bytes must be at least 1"):
        MetricsService(max_push_bytes=0)


def test_staleness_follows_the_push_interval_the_hub_sets(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("GPULAB_METRICS_PUSH_INTERVAL_SECONDS", "2")
    service = MetricsService()
    assert (service.push_interval_seconds, service.stale_after_seconds) == (2.0, 6.0)


def test_a_bad_config_file_keeps_the_service_running_on_defaults_and_says_why(
    tmp_path, monkeypatch
):
    config = tmp_path / "metrics_config.py"
    config.write_text("c.MetricsService.rules = 'IF gpu_utilization < 5 THEN alert(\"IDLE\")'\n")
    monkeypatch.setenv("JUPYTERHUB_API_TOKEN", SERVICE_TOKEN)
    service = MetricsService(config_file=str(config))
    service.initialize([])
    body = service.aggregate.alerts_payload()
    assert "MetricsService.rules: line 1, column 22: missing unit after 5" in body["config_error"]
    assert body["rules"] == [
        'IF gpu_utilization < 5% FOR 30m THEN alert("IDLE_GPU", severity="warning")'
    ]
