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
