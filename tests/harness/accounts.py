"""Real system accounts for tests that run processes as users without a hub (the local job
runner's): made by gpulab's own `ensure_account`, in the reserved uid range, with a prefix of
their own so that tests running at once never share one, and homes under PASSABLE_ROOT (a place
every account can pass through; pytest's tmp_path is root's 0700). `close()` kills what runs as
them (by pid, from /proc), removes the accounts and their homes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import secrets
import shutil
import tempfile
from pathlib import Path

from gpulab.spawner.local.accounts import SystemAccount, ensure_account
from tests.harness import leftovers
from tests.harness.hub import PASSABLE_ROOT, pids_of_uid, remove_account

__all__ = ["UID_RANGE", "TestAccounts", "pids_of_uid"]

#: the test hubs' range too (tests/spawner/local/test_accounts_in_kernels.py)
UID_RANGE = (200000, 299999)


class TestAccounts:
    """Accounts made on demand (`make(name)`), removed by `close()`."""

    __test__ = False  # not a test class, for pytest

    def __init__(self) -> None:
        self.prefix = f"gj{secrets.token_hex(2)}-"
        PASSABLE_ROOT.mkdir(mode=0o711, exist_ok=True)
        self.root = Path(tempfile.mkdtemp(prefix="accounts-", dir=PASSABLE_ROOT))
        os.chmod(self.root, 0o711)
        leftovers.claim(self.root, account_prefix=self.prefix)  # a killed run's: swept later
        self.accounts: list[SystemAccount] = []

    def make(self, name: str) -> SystemAccount:
        """A new account for hub user `name`, with a home of its own (0700, the account's)."""
        home = self.root / name
        made = ensure_account(name, prefix=self.prefix, uid_range=UID_RANGE, home=str(home))
        # a thread of its own, so that async tests (in a running loop) may make accounts too
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            account = pool.submit(asyncio.run, made).result()
        self.accounts.append(account)
        home.mkdir(mode=0o700)
        os.chown(home, account.uid, account.gid)
        return account

    def close(self) -> None:
        for account in self.accounts:
            remove_account(account.name, account.uid)
        shutil.rmtree(self.root, ignore_errors=True)
