"""The cross-user attack catalogue (tests/harness/isolation.py) against a real embedded-default hub with
per-user accounts: every attempt must be refused, none may leak or fail with a 5xx."""

from __future__ import annotations

import os

import pytest
from traitlets.config import Config

from tests.harness.isolation import (
    VICTIM,
    kernel_attacks,
    local_attack_suite,
    prepare_victim,
    table,
)

pytestmark = pytest.mark.slow


@pytest.mark.skipif(os.geteuid() != 0, reason="per-user accounts need a hub running as root")
async def test_no_attack_of_the_catalogue_succeeds_on_the_local_backend(make_hub):
    hub = make_hub()
    attempts = await local_attack_suite(hub)
    assert len(attempts) >= 30  # the catalogue ran whole
    failed = [a for a in attempts if a.outcome != "refused"]
    assert not failed, table(attempts)
    # and the victim is as she was: her server still runs, her snapshot is still hers
    assert hub.server_model(VICTIM)["ready"]


@pytest.mark.skipif(os.geteuid() != 0, reason="the shared-account contrast needs a root hub")
async def test_the_catalogue_finds_the_leaks_of_a_shared_account_install(make_hub):
    # the same probes against servers that all run as root (a single-person install opened to
    # two users): they must report leaks, or the test above would prove nothing
    shared = {"server_accounts": "hub", "allow_root_servers": True, "shared_account_max_users": 2}
    hub = make_hub(Config(GPUSimpleLocalSpawner=shared))
    await prepare_victim(hub)
    attempts = await kernel_attacks(hub)
    leaked = {a.name for a in attempts if a.outcome == "leak"}
    assert {"victim's file", "victim's key file", "hub cookie secret"} <= leaked, table(attempts)
