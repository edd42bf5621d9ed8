"""Checkpointed workspace state for gpulab's local backend: kernel variables (the IPython extension
in `kernel`), home-volume snapshots (`snapshots`) and the environment that keeps installed
packages in the home (`environment`).

What the spawner and hub call:

- `derive_user_key(hub_secret, username)`: the per-user key that signs kernel checkpoints;
- `persistent_env(home, ...)` / `prepare_home(home)`: the single-user server's environment;
- `snapshots.snapshot / list_snapshots / restore / clone / apply_retention`: volume snapshots;
- `describe(path, key, user)` / `list_checkpoints(root, key, user)`: what a restore would bring back.
"""

from gpulab.spawner.singleuser.checkpoint.signing import (
    CheckpointRefused,
    derive_user_key,
    key_to_text,
)
from gpulab.spawner.singleuser.checkpoint.store import describe, list_checkpoints

__all__ = ["CheckpointRefused", "derive_user_key", "describe", "key_to_text", "list_checkpoints"]
