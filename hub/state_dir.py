"""The hub's state directory: private to the hub, passable for users on their way to their homes.

The embedded default keeps everything in one directory (`gpulab run --state-dir`, the hub's
working directory): the hub's database, cookie secret, checkpoint secret, allocations and the
initial admin's password, next to `homes/`, `snapshots/` and `checkpoint-keys/`, whose entries
belong to the users' accounts. So the directory is 0711: a user's process may pass through it to
her own home but cannot list it, and every file of the hub's in it is 0600 (the hub runs with
umask 077, so files it makes later are too). What users reach inside is guarded by its own owner
and mode (see `gpulab.spawner.workspaces.local`).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping
from pathlib import Path

#: directories in the state directory that users pass through to reach their own entries
USER_FACING_DIRS = frozenset({"homes", "snapshots", "checkpoint-keys", "job-runs"})


def secure_state_dir(path: str | os.PathLike[str]) -> list[str]:
    """Make `path` the hub's private state directory (see the module doc); sets this process's
    umask to 077. Returns what was tightened, for the log."""
    os.umask(0o077)
    root = Path(path)
    changed = []
    me = os.geteuid()
    for entry in [root, *root.iterdir()]:
        st = os.lstat(entry)
        if st.st_uid != me or stat.S_ISLNK(st.st_mode):
            continue
        if entry == root or (stat.S_ISDIR(st.st_mode) and entry.name in USER_FACING_DIRS):
            want = 0o711
        elif stat.S_ISDIR(st.st_mode):
            want = 0o700
        else:
            want = 0o600
        if stat.S_IMODE(st.st_mode) != want:
            os.chmod(entry, want)
            changed.append(f"{entry} {oct(stat.S_IMODE(st.st_mode))} -> {oct(want)}")
    return changed


def untraversable_ancestors(path: str | os.PathLike[str]) -> list[Path]:
    """The directories on the way to `path` (its existing ancestors and itself, as written and
    as the links in it resolve) that accounts other than their owner and group cannot pass
    through: no search bit for others. A server's account is neither the owner nor in the
    group of the directories above the hub's state (a `mktemp -d` parent is 0700 root)."""
    given = Path(os.path.abspath(path))
    blocked: list[Path] = []
    for candidate in (given, given.resolve()):
        for directory in [*reversed(candidate.parents), candidate]:
            try:
                st = os.stat(directory)
            except FileNotFoundError:
                break  # made later by the hub, with a mode users pass (secure_state_dir)
            passable = not stat.S_ISDIR(st.st_mode) or st.st_mode & stat.S_IXOTH
            if not passable and directory not in blocked:
                blocked.append(directory)
    return blocked


def unreachable_message(roots: Mapping[str, str | os.PathLike[str]]) -> str | None:
    """Why user accounts cannot reach what `roots` holds for them ({"homes": "/srv/x/homes"})
    and the fix, or None when they can."""
    blocked: list[Path] = []
    for root in roots.values():
        blocked += [d for d in untraversable_ancestors(root) if d not in blocked]
    if not blocked:
        return None
    where = ", ".join(f"{what} under {root}" for what, root in roots.items())
    modes = ", ".join(f"{d} (mode {stat.S_IMODE(os.stat(d).st_mode):04o})" for d in blocked)
    dirs = " ".join(str(d) for d in blocked)
    return (
        f"user accounts cannot reach their {where}: other accounts may not pass through "
        f"{modes}. Run `chmod o+x {dirs}` (search only: nothing becomes listable or "
        "readable), or put the hub's state directory elsewhere (gpulab run --state-dir)"
    )
