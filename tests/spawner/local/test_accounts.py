"""System account names and the hand-over of old homes (spawner/local/accounts.py), without a hub."""

from __future__ import annotations

import os
import pwd

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpulab.spawner.local.accounts import (
    MAX_NAME,
    AccountError,
    account_comment,
    account_name,
    adopt_tree,
    check_account,
)


def test_a_valid_short_name_keeps_its_name_behind_the_prefix():
    assert account_name("alice") == "gpulab-alice"
    assert account_name("alice", "gt12ab-") == "gt12ab-alice"


def test_other_names_are_cleaned_and_made_unique_by_a_digest():
    a, b = account_name("Bob.X"), account_name("bob_x")
    assert a.startswith("gpulab-bob-x-") and len(a.rsplit("-", 1)[1]) == 8
    assert b == "gpulab-bob_x"
    assert account_name("bob.x") != account_name("bob,x")  # same cleaned text, other digests
    assert len(account_name("x" * 200)) <= MAX_NAME


@given(st.text(min_size=1, max_size=80))
def test_every_hub_name_maps_to_a_valid_posix_name(name):
    result = account_name(name)
    assert len(result) <= MAX_NAME
    assert result[0].isalpha() and all(c.isalnum() or c in "_-" for c in result)
    assert result == result.lower()


def _entry(name: str, uid: int, gecos: str) -> pwd.struct_passwd:
    return pwd.struct_passwd((name, "x", uid, uid, gecos, "/nonexistent", "/bin/bash"))


def test_an_account_is_used_only_when_made_for_that_user_in_the_range():
    check_account(
        _entry("gpulab-alice", 200001, account_comment("alice")), "alice", (200000, 299999)
    )
    with pytest.raises(AccountError, match="not made by gpulab for hub user 'alice'"):
        check_account(_entry("gpulab-alice", 200001, ""), "alice", (200000, 299999))
    with pytest.raises(AccountError, match="was not made"):  # another user's comment
        check_account(
            _entry("gpulab-alice", 200001, account_comment("mallory")), "alice", (200000, 299999)
        )
    with pytest.raises(
        AccountError, match="outside GPUSimpleLocalSpawner.system_account_uid_range"
    ):
        check_account(
            _entry("gpulab-alice", 1000, account_comment("alice")), "alice", (200000, 299999)
        )


@pytest.mark.skipif(os.geteuid() != 0, reason="changing owners needs root")
def test_adopting_a_tree_never_hands_over_a_file_linked_from_outside(tmp_path):
    outside = tmp_path / "hub-secret"
    outside.write_text("secret")
    home = tmp_path / "home"
    (home / "sub").mkdir(parents=True)
    (home / "sub" / "own.txt").write_text("mine")
    os.link(home / "sub" / "own.txt", home / "twice.txt")  # both links inside: hers
    os.link(outside, home / "planted")  # a link to a hub file planted under the old scheme
    os.symlink(outside, home / "link")
    skipped = adopt_tree(home, 54321, 54321)
    assert skipped == [str(home / "planted")]
    assert outside.stat().st_uid == 0
    for path in (home, home / "sub", home / "sub" / "own.txt", home / "twice.txt"):
        assert path.stat().st_uid == 54321, path
    assert os.lstat(home / "link").st_uid == 54321 and outside.stat().st_uid == 0
