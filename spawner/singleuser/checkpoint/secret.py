"""The hub secret that per-user checkpoint keys are derived from (pure: stdlib).

`load_or_create_secret(path)` returns the file's bytes, creating it first (32 random bytes,
mode 0600, linked into place whole so that two processes starting at once agree on one secret).
Keys are derived from it with `derive_user_key(secret, user)`; the secret itself never leaves
the hub.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path

MIN_SECRET_BYTES = 16


def load_or_create_secret(path: str | os.PathLike[str]) -> bytes:
    """The secret in `path`, created with 32 random bytes (mode 0600) when missing.
    ValueError when the file holds fewer than 16 bytes."""
    p = Path(path)
    if not p.exists():
        p.parent.mkdir(parents=True, exist_ok=True)
        # written whole under a private name, then linked into place: a process that finds the
        # file always finds all of it, and of two racing creators the first link wins
        tmp = p.with_name(f".{p.name}.{os.getpid()}.{secrets.token_hex(4)}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(secrets.token_bytes(32))
                f.flush()
                os.fsync(f.fileno())
            with contextlib.suppress(FileExistsError):  # another process won: use theirs
                os.link(tmp, p)
        finally:
            tmp.unlink(missing_ok=True)
    data = p.read_bytes()
    if len(data) < MIN_SECRET_BYTES:
        raise ValueError(
            f"checkpoint secret file {p} holds {len(data)} bytes; it needs at least "
            f"{MIN_SECRET_BYTES} random bytes (delete it to have a new one made)"
        )
    return data
