"""Per-user checkpoint keys: the hub derives one per user from its secret; the kernel signs every
checkpoint file with it and refuses to load anything it did not sign (pure: stdlib only).

A checkpoint holds pickles, and unpickling runs code, so a file is loaded only after its
HMAC-SHA256 under the owner's key checks out. Keys are per user: a checkpoint written for alice
does not verify under bob's key, even when both servers run as the same system account.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from pathlib import Path

from gpulab.spawner.names import CHECKPOINT_KEY_FILE_ENV, CHECKPOINT_USER_ENV

#: environment variable naming the file that holds the user's key (hex). The key itself is never in
#: an environment: /proc/<pid>/environ of every process would carry it, and any process of the
#: server's account that can read its parent's environment could replay it. The file is the
#: server account's own (mode 0400/0600: a local key file written by the hub, a Secret volume on
#: Kubernetes), so another user's processes cannot open it.
KEY_FILE_ENV = CHECKPOINT_KEY_FILE_ENV
#: environment variable naming the user the checkpoints belong to (defaults to JUPYTERHUB_USER)
USER_ENV = CHECKPOINT_USER_ENV

_KEY_CONTEXT = b"gpulab-checkpoint-key/v1\0"


class CheckpointRefused(Exception):
    """A checkpoint file is unsigned, signed with another key, altered, or malformed. Nothing from
    it has been unpickled."""


def derive_user_key(hub_secret: bytes, username: str) -> bytes:
    """The 32-byte checkpoint key of `username`, derived from a hub secret (e.g. the hub's
    cookie secret or a dedicated `checkpoint_secret`). Deterministic, so the hub never stores keys;
    one user's key reveals nothing about another's."""
    if len(hub_secret) < 16:
        raise ValueError(
            f"hub_secret is {len(hub_secret)} bytes; use at least 16 random bytes (e.g. the hub's cookie secret)"
        )
    if not username:
        raise ValueError("username must not be empty")
    return hmac.new(hub_secret, _KEY_CONTEXT + username.encode(), hashlib.sha256).digest()


def key_to_text(key: bytes) -> str:
    """How a key is written into its key file."""
    return key.hex()


def read_key_file(path: Path) -> bytes:
    """The key in `path` (hex text); CheckpointRefused when it is unreadable or malformed."""
    try:
        raw = path.read_text().strip()
    except OSError as e:
        raise CheckpointRefused(
            f"cannot read the checkpoint key file {path}: {e.strerror}"
        ) from None
    try:
        key = bytes.fromhex(raw)
    except ValueError:
        raise CheckpointRefused(f"{path} is not hex; the hub writes a 64-digit hex key") from None
    if len(key) < 16:
        raise CheckpointRefused(f"{path} holds {len(key)} bytes; expected 32")
    return key


def key_from_env(environ: dict[str, str] | None = None, fallback_file: Path | None = None) -> bytes:
    """The key from the file `GPULAB_CHECKPOINT_KEY_FILE` names; without it, a key file created
    on first use (0600) so that a kernel outside gpulab still signs its checkpoints."""
    env = os.environ if environ is None else environ
    named = env.get(KEY_FILE_ENV, "").strip()
    if named:
        return read_key_file(Path(named))
    path = fallback_file or Path.home() / ".gpulab" / "checkpoint-key"
    if path.exists():
        return read_key_file(path)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    key = os.urandom(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key_to_text(key))
    return key


def user_from_env(environ: dict[str, str] | None = None) -> str:
    env = os.environ if environ is None else environ
    user = env.get(USER_ENV) or env.get("JUPYTERHUB_USER")
    if user:
        return user
    import getpass

    return getpass.getuser()


def new_mac(key: bytes) -> hmac.HMAC:
    return hmac.new(key, digestmod=hashlib.sha256)


def sign(key: bytes, data: bytes) -> str:
    return hmac.new(key, data, hashlib.sha256).hexdigest()


def same(a: str, b: str) -> bool:
    return hmac.compare_digest(a, b)
