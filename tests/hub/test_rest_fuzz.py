"""Fuzzing gpulab's REST endpoints from their published OpenAPI description (docs/rest-api.yaml).

schemathesis generates requests for every operation, valid and invalid ones, and sends them to a
real hub (tests/harness/hub.py) with a normal user's token. A refusal must be a 4xx: no answer may
be a 5xx; and every answer must be one the description documents (status, content type, body
schema), so the published description stays true. Bounded in examples per operation (each request is a real round trip to the hub), and
derandomized, so a failure is the same request on the next run.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.core.failures import FailureGroup
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)
from traitlets.config import Config

from gpulab.hub.apihandlers import default_handlers as rest_handlers
from tests.harness.hub import REPO, Hub

pytestmark = pytest.mark.slow

DESCRIPTION = REPO / "docs" / "rest-api.yaml"
USER = "fuzz"
NAMED = "exp"
EXAMPLES_PER_OPERATION = 15
MODES = [GenerationMode.POSITIVE, GenerationMode.NEGATIVE]
CONFORMANCE = [status_code_conformance, content_type_conformance, response_schema_conformance]


@dataclass
class Fuzzed:
    hub: Hub
    token: str  # the fuzzing user's own token: no admin, no other user's servers
    snapshot: str  # a snapshot of her default server


@pytest.fixture
def fuzzed(make_hub: Any) -> Fuzzed:
    """A hub where the fuzzing user has a stopped default server with a snapshot and a stopped
    named server cloned from it, and her token."""
    hub = make_hub(
        # the fuzzed "snapshot now" requests must not prune the snapshot the others name
        Config(GPUSimpleLocalSpawner={"snapshot_keep_last": 10000}),
        env={"GPULAB_METRICS_SERVICE": "0"},
    )
    hub.create_user(USER)
    hub.start_server(USER)
    hub.stop_server(USER)  # a stop takes a snapshot: restore and clone have something to find
    snapshots = hub.api("GET", f"/gpulab/users/{USER}/snapshots").json()["snapshots"]
    assert snapshots, "the stop took no snapshot"
    snapshot = str(snapshots[0]["id"])
    r = hub.api("POST", f"/gpulab/users/{USER}/snapshots/{snapshot}/clone", json={"name": NAMED})
    assert r.status_code == 201, r.text
    r = hub.api("POST", f"/users/{USER}/tokens", json={"note": "fuzzing"})
    assert r.status_code == 201, r.text
    return Fuzzed(hub, r.json()["token"], snapshot)


@dataclass
class Outcome:
    server_errors: list[str] = field(default_factory=list)  # 5xx answers, as curl commands
    undocumented: list[str] = field(default_factory=list)  # answers the description lacks
    statuses: Counter[int] = field(default_factory=Counter)


def breaks_http_framing(case: schemathesis.Case) -> bool:
    """Whether a generated header makes the request malformed HTTP (a Content-Length that is
    no number, a Transfer-Encoding): tornado answers those with a bare 400 before any handler
    runs, so they say nothing of gpulab's API or its description."""
    for name, value in (case.headers or {}).items():
        lowered = name.lower()
        if lowered == "content-length" and not str(value).strip().isdigit():
            return True
        if lowered == "transfer-encoding":
            return True
    return False


def fuzz(
    hub: Hub,
    token: str,
    mode: GenerationMode,
    path_parameters: dict[str, str] | None = None,
    fix_token: bool = False,
) -> Outcome:
    """Every operation, EXAMPLES_PER_OPERATION generated requests each (path parameters named in
    `path_parameters` fixed; the token too with `fix_token`, else negative mode also sends no or
    broken Authorization headers)."""
    schema = schemathesis.openapi.from_path(DESCRIPTION)
    headers = {"Authorization": f"token {token}"}
    base_url = f"{hub.url}/hub/api"
    outcome = Outcome()
    for result in schema.get_all_operations():
        operation = result.ok()
        names = {p.name for p in operation.path_parameters}
        fixed = {k: v for k, v in (path_parameters or {}).items() if k in names}

        @settings(
            max_examples=EXAMPLES_PER_OPERATION,
            deadline=None,
            database=None,
            derandomize=True,
            phases=[Phase.explicit, Phase.generate],
            suppress_health_check=list(HealthCheck),
        )
        @given(
            case=operation.as_strategy(
                generation_mode=mode,
                path_parameters=fixed or None,
                headers=headers if fix_token else None,
            )
        )
        def send(case: schemathesis.Case) -> None:
            response = case.call(base_url=base_url, headers=headers, timeout=30)
            outcome.statuses[response.status_code] += 1
            request = f"{response.status_code} from {case.as_curl_command(headers)}"
            if response.status_code >= 500:
                outcome.server_errors.append(f"{request}\n  {response.text[:300]}")
                return
            if response.status_code == 400 and breaks_http_framing(case):
                return  # the HTTP server's own bare 400, before any handler of gpulab's
            try:
                case.validate_response(response, checks=CONFORMANCE, headers=headers)
            except (FailureGroup, AssertionError) as e:
                outcome.undocumented.append(f"{request}\n  {str(e)[:600]}")

        try:
            send()
        except Unsatisfiable:
            # negative mode with the token and path fixed: an operation with no other input
            # (GET capacity, POST snapshots) has nothing left to make invalid
            assert mode is GenerationMode.NEGATIVE and fix_token, operation.label
    return outcome


def check(outcome: Outcome, hub: Hub) -> None:
    errors = "\n".join(outcome.server_errors)
    assert not outcome.server_errors, f"5xx answers:\n{errors}\nhub log:\n{hub.log()[-4000:]}"
    assert not outcome.undocumented, "not as docs/rest-api.yaml says:\n" + "\n".join(
        outcome.undocumented
    )


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
def test_no_generated_request_gets_a_server_error(fuzzed: Fuzzed, mode: GenerationMode) -> None:
    outcome = fuzz(fuzzed.hub, fuzzed.token, mode)
    check(outcome, fuzzed.hub)
    assert sum(outcome.statuses.values()) >= EXAMPLES_PER_OPERATION, outcome.statuses


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
def test_requests_on_the_users_own_servers_and_snapshot_get_no_server_error(
    fuzzed: Fuzzed, mode: GenerationMode
) -> None:
    # past the ownership checks: her name, her named server, a snapshot that exists
    fixed = {"user": USER, "server": NAMED, "snapshot": fuzzed.snapshot}
    outcome = fuzz(fuzzed.hub, fuzzed.token, mode, fixed, fix_token=True)
    check(outcome, fuzzed.hub)
    # the requests reached the handlers' own checks, not only the 403 of someone else's name
    assert set(outcome.statuses) - {403}, outcome.statuses


def test_the_description_names_every_gpulab_rest_route() -> None:
    schema = schemathesis.openapi.from_path(DESCRIPTION)
    paths = {result.ok().path for result in schema.get_all_operations()}
    as_routes = {
        "/api"
        + path.replace("{user}", "([^/]+)")
        .replace("{server}", "([^/]+)")
        .replace("{snapshot}", "([^/]+)")
        .replace("{run}", "([^/]+)")
        .replace("{cluster}", "([^/]+)")
        for path in paths
    }
    # every REST route of hub/apihandlers/ (the HTML workspaces page is in hub/handlers/)
    assert as_routes == {pattern for pattern, _ in rest_handlers}
