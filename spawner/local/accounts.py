"""One unprivileged system account per hub user, made by the hub on that user's first spawn.

On the embedded default every user's servers and kernels run as that user's own account, so the
kernel's file permissions and process boundaries keep users apart: another user's home, snapshots,
checkpoint key, processes and their environments (tokens) belong to another uid, and the hub's own
state is root's. The hub (root) makes the account with `useradd` and never runs user code as root.

Names: `<prefix><hub name>` (prefix `gpulab-` by default) when the hub name is already a valid,
short POSIX user name; otherwise `<prefix><cleaned name>-<8 hex of its SHA-256>`. Either way the
account's comment (GECOS) records a digest of the hub name it was made for, and an existing account
is used only when that digest matches and its uid lies in the reserved range: a hub user whose name
happens to map onto another user's account, or onto an account gpulab did not make, is refused
instead of being given it.

uids and gids come from a reserved range (`GPUSimpleLocalSpawner.system_account_uid_range`,
200000-299999 by default) passed to useradd, so they never collide with people's accounts (from
1000) or system accounts, and no subordinate uid range is allocated for them.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import pwd
import re
import stat
from dataclasses import dataclass
from pathlib import Path

#: longest user name useradd accepts without --badname
MAX_NAME = 32
_VALID = re.compile(r"^[a-z_][a-z0-9_-]*$")
_COMMENT_PREFIX = "gpulab hub user sha256 "  # useradd refuses ':' and ',' in a comment


class AccountError(Exception):
    """The account exists but is not this hub user's; the message says why and what to change."""


class AccountCreationFailed(Exception):
    """useradd failed (the message has its exit status and what it said)."""


@dataclass(frozen=True)
class SystemAccount:
    name: str
    uid: int
    gid: int
    home: str  # the account's passwd home: the directory that holds the user's server homes

    @classmethod
    def from_pwd(cls, entry: pwd.struct_passwd) -> SystemAccount:
        return cls(entry.pw_name, entry.pw_uid, entry.pw_gid, entry.pw_dir)


def _digest(hub_user: str) -> str:
    return hashlib.sha256(hub_user.encode()).hexdigest()


def account_name(hub_user: str, prefix: str = "gpulab-") -> str:
    """The system account name of `hub_user` (pure: deterministic, no look-ups)."""
    if not hub_user:
        raise AccountError("a hub user name is empty")
    plain = prefix + hub_user
    if _VALID.match(plain) and len(plain) <= MAX_NAME:
        return plain
    cleaned = re.sub(r"[^a-z0-9_-]+", "-", hub_user.lower()).strip("-") or "user"
    room = MAX_NAME - len(prefix) - 9
    if room < 1:
        raise AccountError(f"system_account_prefix {prefix!r} leaves no room for a user name")
    name = f"{prefix}{cleaned[:room]}-{_digest(hub_user)[:8]}"
    if not _VALID.match(name):
        raise AccountError(f"system_account_prefix {prefix!r} does not start a valid user name")
    return name


def account_comment(hub_user: str) -> str:
    """The GECOS comment that ties an account to the hub user it was made for."""
    return _COMMENT_PREFIX + _digest(hub_user)[:32]


def check_account(entry: pwd.struct_passwd, hub_user: str, uid_range: tuple[int, int]) -> None:
    """AccountError unless `entry` is the account gpulab made for `hub_user`."""
    lo, hi = uid_range
    if entry.pw_gecos != account_comment(hub_user):
        raise AccountError(
            f"system account {entry.pw_name!r} exists but was not made by gpulab for hub user "
            f"{hub_user!r}; rename or remove it, or change GPUSimpleLocalSpawner.system_account_prefix"
        )
    if not lo <= entry.pw_uid <= hi:
        raise AccountError(
            f"system account {entry.pw_name!r} has uid {entry.pw_uid}, outside "
            f"GPUSimpleLocalSpawner.system_account_uid_range {lo}-{hi}"
        )


_creating = asyncio.Lock()


async def ensure_account(
    hub_user: str,
    *,
    prefix: str,
    uid_range: tuple[int, int],
    home: str,
    shell: str = "/bin/bash",
    useradd: str = "useradd",
    attempts: int = 5,
) -> SystemAccount:
    """The account of `hub_user`, made with useradd when missing (the hub must be root).
    AccountError when it exists but is not gpulab's for this user, or useradd fails."""
    name = account_name(hub_user, prefix)
    lo, hi = uid_range
    async with _creating:  # one useradd at a time in this hub; useradd locks /etc/passwd itself
        for attempt in range(attempts):
            try:
                entry = pwd.getpwnam(name)
            except KeyError:
                pass
            else:
                check_account(entry, hub_user, uid_range)
                return SystemAccount.from_pwd(entry)
            proc = await asyncio.create_subprocess_exec(
                useradd,
                "--no-create-home",
                "--home-dir",
                home,
                "--shell",
                shell,
                "--comment",
                account_comment(hub_user),
                "--user-group",
                "--no-log-init",
                *("-K", f"UID_MIN={lo}", "-K", f"UID_MAX={hi}"),
                *("-K", f"GID_MIN={lo}", "-K", f"GID_MAX={hi}"),
                # no subordinate uid/gid range: these accounts never run containers of their own
                *("-K", "SUB_UID_COUNT=0", "-K", "SUB_GID_COUNT=0"),
                name,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
            )
            _, err = await proc.communicate()
            if proc.returncode == 0:
                continue  # read it back (and check it) on the next pass
            if proc.returncode in (1, 10) and attempt + 1 < attempts:
                # 10: /etc/passwd or /etc/group locked by another useradd (another hub, a
                # package install); 1: could not update the password file. Both pass.
                await asyncio.sleep(0.5 * (attempt + 1))
                continue
            if proc.returncode == 9:  # the name appeared meanwhile: check it on the next pass
                continue
            raise AccountCreationFailed(
                f"could not create system account {name!r} for hub user {hub_user!r}: "
                f"useradd exited {proc.returncode}: {err.decode(errors='replace').strip()}"
            )
    raise AccountCreationFailed(
        f"could not create system account {name!r}: /etc/passwd stayed locked"
    )


def adopt_tree(root: Path, uid: int, gid: int) -> list[str]:
    """Give `root` and what lies under it to uid:gid (files made by the hub before servers ran as
    their users' accounts). Symlinks are re-owned, never followed. A file with hard links outside
    the tree is left alone and listed: re-owning its inode would hand over whatever else links
    to it (under the old single-account scheme any user could have linked a hub file there)."""
    entries: list[tuple[str, os.stat_result]] = []
    links: dict[tuple[int, int], int] = {}
    for top, dirs, files in os.walk(root, followlinks=False):
        for name in [*dirs, *files]:
            path = os.path.join(top, name)
            st = os.lstat(path)
            entries.append((path, st))
            if stat.S_ISREG(st.st_mode):
                links[(st.st_dev, st.st_ino)] = links.get((st.st_dev, st.st_ino), 0) + 1
    skipped = []
    for path, st in entries:
        if stat.S_ISREG(st.st_mode) and st.st_nlink > links[(st.st_dev, st.st_ino)]:
            skipped.append(path)
            continue
        if stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode) or stat.S_ISLNK(st.st_mode):
            os.chown(path, uid, gid, follow_symlinks=False)
    os.chown(root, uid, gid, follow_symlinks=False)
    return skipped
