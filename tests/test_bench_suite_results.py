"""bench._suite_results: the KubeSpawner suite's junit xml read into results with their reasons,
the table and the last line (pure: no suite, no cluster)."""

from __future__ import annotations

import pytest

from bench import _suite_results as suite_results
from bench import kubespawner_suite as suite

FAKE_JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" errors="2" failures="2" skipped="1" tests="7">
<testcase classname="tests.test_spawner" name="test_spawn_start">
 <properties><property name="needs_cluster" value="true"/></properties>
 <failure message="AttributeError: 'NoneType' object has no attribute 'decode'">E websocket._exceptions.WebSocketBadStatusException: Handshake status 500 {"message":"error dialing backend: dial tcp: lookup node"}</failure>
</testcase>
<testcase classname="tests.test_spawner" name="test_spawn_services_enabled">
 <properties><property name="needs_cluster" value="true"/></properties>
</testcase>
<testcase classname="tests.test_spawner" name="test_spawn_internal_ssl">
 <properties><property name="needs_cluster" value="true"/></properties>
 <error message="failed on setup with &quot;RuntimeError: no running event loop&quot;">trace</error>
</testcase>
<testcase classname="tests.test_spawner" name="test_variable_expansion">
 <properties><property name="needs_cluster" value="false"/></properties>
 <error message="failed on setup with &quot;KeyError: 'x'&quot;">trace</error>
</testcase>
<testcase classname="tests.test_slugs" name="test_safe_slug[a-b]">
 <properties><property name="needs_cluster" value="false"/></properties>
</testcase>
<testcase classname="tests.test_utils" name="test_update_k8s_model">
 <failure message="assert 1 == 2&#10;second line">trace</failure>
</testcase>
<testcase classname="tests.test_profile" name="test_profile_missing">
 <properties><property name="needs_cluster" value="false"/></properties>
 <skipped type="pytest.skip" message="needs something">skip</skipped>
</testcase>
</testsuite></testsuites>
"""


def test_the_last_line_round_trips_and_anything_else_is_refused():
    summary = suite_results.Summary(195, 10, 2, 9, 20)
    line = suite_results.format_last_line(summary)
    assert line == "passed=195 failed=10 errors=2 cluster_tests_passed=9/20"
    assert suite_results.parse_last_line(line + "\n") == summary
    for bad in ("passed=195 failed=10 errors=2", "ratio=0.9", line.replace("9/20", "9")):
        with pytest.raises(ValueError):
            suite_results.parse_last_line(bad)


def test_junit_outcomes_cluster_marks_and_reasons(tmp_path):
    xml = tmp_path / "junit.xml"
    xml.write_text(FAKE_JUNIT)
    results = {r.name: r for r in suite_results.read_junit(xml)}
    assert set(results) == {
        "tests/test_spawner.py::test_spawn_start",
        "tests/test_spawner.py::test_spawn_services_enabled",
        "tests/test_spawner.py::test_spawn_internal_ssl",
        "tests/test_spawner.py::test_variable_expansion",
        "tests/test_slugs.py::test_safe_slug[a-b]",
        "tests/test_utils.py::test_update_k8s_model",
        "tests/test_profile.py::test_profile_missing",
    }
    start = results["tests/test_spawner.py::test_spawn_start"]
    assert (start.outcome, start.needs_cluster) == ("failed", True)
    # recognised in the failure's text
    assert start.reason().startswith("the API server could not reach the node's kubelet API")
    assert start.message in start.reason()  # and the original message kept beside it
    # a testcase without the plugin's property is no cluster test
    assert not results["tests/test_utils.py::test_update_k8s_model"].needs_cluster
    assert results["tests/test_utils.py::test_update_k8s_model"].reason() == "assert 1 == 2"
    assert results["tests/test_slugs.py::test_safe_slug[a-b]"].function == "test_safe_slug"

    # the known harness error is named only where its message matches: a different error of
    # test_variable_expansion is reported as it is
    ssl = results["tests/test_spawner.py::test_spawn_internal_ssl"]
    assert ssl.outcome == "error" and ssl.reason().startswith("upstream harness")
    expansion = results["tests/test_spawner.py::test_variable_expansion"]
    assert expansion.known_harness_issue() is None
    assert "KeyError" in expansion.reason()

    assert suite_results.summarize(list(results.values())) == suite_results.Summary(
        passed=2, failed=2, errors=2, cluster_tests_passed=1, cluster_tests=3
    )
    lines = suite_results.report(list(results.values()))
    assert lines[-1] == "passed=2 failed=2 errors=2 cluster_tests_passed=1/3"
    assert "skipped           0           1     1" in lines  # per outcome, cluster or not
    not_passed = [line for line in lines if " | " in line and not line.startswith("not passed")]
    assert len(not_passed) == 5  # failures, errors and the skip; never a passed test
    assert not_passed[0].startswith(
        "error   | cluster    | tests/test_spawner.py::test_spawn_internal_ssl"
    )


def test_the_known_harness_issues_are_the_two_upstream_fixture_errors():
    assert set(suite_results.KNOWN_HARNESS_ISSUES) == {
        "test_spawn_internal_ssl",
        "test_variable_expansion",
    }
    for signature, explanation in suite_results.KNOWN_HARNESS_ISSUES.values():
        assert signature == "no running event loop"
        assert explanation.startswith("upstream harness:") and "ssl_app" in explanation


def test_the_pods_deleted_after_a_failure_are_read_and_named(tmp_path):
    xml = tmp_path / "junit.xml"
    xml.write_text(
        """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" errors="0" failures="1" skipped="0" tests="2">
<testcase classname="tests.test_spawner" name="test_spawn_start_in_different_namespace">
 <properties><property name="needs_cluster" value="true"/>
  <property name="leftover_pods_deleted" value="kubespawner-another/jupyter-start"/></properties>
 <failure message="ExecError: exec exited with status 1">ConnectionRefusedError: [Errno 111]
  Connection refused</failure>
</testcase>
<testcase classname="tests.test_spawner" name="test_spawn_start">
 <properties><property name="needs_cluster" value="true"/></properties>
</testcase>
</testsuite></testsuites>"""
    )
    failed, passed = suite_results.read_junit(xml)
    assert failed.leftovers == "kubespawner-another/jupyter-start" and passed.leftovers == ""
    reason = failed.reason()
    assert reason.startswith("the single-user server did not listen yet")
    assert reason.endswith("(its leftover pods deleted: kubespawner-another/jupyter-start)")
    assert (
        suite.PLUGIN_DIR.joinpath(f"{suite.PLUGIN}.py")
        .read_text()
        .count(f'LEFTOVERS_PROPERTY = "{suite_results.LEFTOVERS_PROPERTY}"')
        == 1
    )
