"""IPython extension: checkpoint the kernel's variables, and bring them back on the next start.

Load it with `%load_ext gpulab.spawner.singleuser.checkpoint.kernel` or
`c.InteractiveShellApp.extensions = ["gpulab.spawner.singleuser.checkpoint.kernel"]` (what
`gpulab.spawner.singleuser.checkpoint.environment.prepare_home` writes into the user's IPython profile).

- after each cell, once the kernel is idle, changed variables are saved (incremental), unless more
  than GPULAB_CHECKPOINT_INCREMENTAL_MB changed (0: no saves after cells at all);
- on kernel shutdown (atexit) and on SIGTERM (preemption, node drain, the spawner's stop), an
  exact full save runs, then the previous SIGTERM handler (or the default: exit) takes over;
- `%gpulab_save`, `%gpulab_restore`, `%gpulab_checkpoint` (what is saved / offered), and the same
  as Python functions `save()`, `restore()`, `describe()`;
- at start, the last session's checkpoint is kept aside and offered ("Restore 23 variables
  (1.2 GB, saved 10:32): run %gpulab_restore", shown with the first cell's output), or restored at
  once when GPULAB_AUTO_RESTORE=1 (the spawner sets it after a preemption or node-failure respawn).

Environment: GPULAB_CHECKPOINT_DIR (the server's checkpoint root; default
~/.gpulab/checkpoints/<JUPYTERHUB_SERVER_NAME or 'default'>), GPULAB_CHECKPOINT_SLOT (the
kernel's store under it; default derived from the notebook path jupyter_server passes as
JPY_SESSION_NAME, else 'default'), GPULAB_CHECKPOINT_KEY (hex, per user, from the hub),
GPULAB_CHECKPOINT_USER, GPULAB_AUTO_RESTORE, GPULAB_CHECKPOINT_INCREMENTAL_MB (256),
GPULAB_CHECKPOINT_IDLE_SECONDS (0.5: wait after a cell before saving), GPULAB_CHECKPOINT=0 (off).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import hashlib
import logging
import os
import re
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from gpulab.spawner.names import (
    AUTO_RESTORE_ENV,
    CHECKPOINT_DIR_ENV,
    CHECKPOINT_ENABLED_ENV,
    CHECKPOINT_IDLE_SECONDS_ENV,
    CHECKPOINT_INCREMENTAL_MB_ENV,
    CHECKPOINT_SLOT_ENV,
)
from gpulab.spawner.singleuser.checkpoint.saver import (
    NamespaceCheckpointer,
    RestoreReport,
    SaveReport,
)
from gpulab.spawner.singleuser.checkpoint.signing import (
    CheckpointRefused,
    key_from_env,
    user_from_env,
)
from gpulab.spawner.singleuser.checkpoint.store import CheckpointStore

log = logging.getLogger("gpulab.checkpoint")

# the variables the spawner sets, under this module's short names
DIR_ENV = CHECKPOINT_DIR_ENV
SLOT_ENV = CHECKPOINT_SLOT_ENV
INCREMENTAL_MB_ENV = CHECKPOINT_INCREMENTAL_MB_ENV
IDLE_ENV = CHECKPOINT_IDLE_SECONDS_ENV
ENABLED_ENV = CHECKPOINT_ENABLED_ENV

_active: CheckpointExtension | None = None


def default_root(environ: dict[str, str] | os._Environ[str] | None = None) -> Path:
    env = os.environ if environ is None else environ
    if env.get(DIR_ENV):
        return Path(env[DIR_ENV]).expanduser()
    server = env.get("JUPYTERHUB_SERVER_NAME") or "default"
    return Path.home() / ".gpulab" / "checkpoints" / server


def slot_name(environ: dict[str, str] | os._Environ[str] | None = None) -> str:
    """The kernel's store under the server's root: one per notebook."""
    env = os.environ if environ is None else environ
    if env.get(SLOT_ENV):
        return re.sub(r"[^A-Za-z0-9_.-]", "_", env[SLOT_ENV])[:100]
    session = env.get("JPY_SESSION_NAME", "")
    if not session:
        return "default"
    stem = re.sub(r"[^A-Za-z0-9_.-]", "_", Path(session).name)[:60]
    return f"{stem}-{hashlib.sha256(session.encode()).hexdigest()[:8]}"


class CheckpointExtension:
    def __init__(self, shell: Any, environ: dict[str, str] | None = None) -> None:
        env = dict(os.environ if environ is None else environ)
        self.shell = shell
        root = default_root(env)
        slot = slot_name(env)
        self.store = CheckpointStore(root / slot, key_from_env(env), user_from_env(env), slot)
        self.checkpointer = NamespaceCheckpointer(
            self.store,
            incremental_max_bytes=int(float(env.get(INCREMENTAL_MB_ENV, "256")) * 1_000_000),
        )
        self.idle_seconds = float(env.get(IDLE_ENV, "0.5"))
        self.auto_restore = env.get(AUTO_RESTORE_ENV, "") in ("1", "true", "yes")
        self.offer = ""
        self.last_save: SaveReport | None = None
        self._executing = False
        self._pending: asyncio.TimerHandle | None = None
        self._exit_after_save = False
        self._final_done = False
        self._previous_sigterm: Any = None
        self.disabled = ""

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        self.store.ensure()
        if self.auto_restore:
            try:
                report = self.restore(prefer_current=True)
                if report.restored or report.failed:
                    log.info("gpulab checkpoint: %s", report.summary())
                    self.offer = f"gpulab: {report.summary()} (automatic restore after a restart)"
            except CheckpointRefused as e:
                self.disabled = f"checkpoints are off in this kernel: {e}. Move {self.store.path} away to start afresh."
                self.offer = f"gpulab: checkpoint not restored; {self.disabled}"
        else:
            try:
                offered = self.store.offer_previous()
                if offered is not None:
                    self.offer = f"gpulab: {offered.describe()}: run %gpulab_restore"
            except CheckpointRefused as e:
                # never overwrite what does not verify under this user's key: save nothing
                self.disabled = (
                    f"checkpoints are off in this kernel: {e}. Move {self.store.path} away to "
                    "start afresh."
                )
                self.offer = f"gpulab: {self.disabled}"
            except TimeoutError as e:
                self.offer = f"gpulab: checkpoint not offered: {e}"
        events = self.shell.events
        events.register("pre_run_cell", self._pre_run_cell)
        events.register("post_run_cell", self._post_run_cell)
        atexit.register(self._at_exit)
        if threading.current_thread() is threading.main_thread():
            self._previous_sigterm = signal.signal(signal.SIGTERM, self._on_sigterm)
        self._register_magics()

    def stop(self) -> None:
        events = self.shell.events
        with contextlib.suppress(ValueError):
            events.unregister("pre_run_cell", self._pre_run_cell)
        with contextlib.suppress(ValueError):
            events.unregister("post_run_cell", self._post_run_cell)
        atexit.unregister(self._at_exit)
        if (
            self._previous_sigterm is not None
            and threading.current_thread() is threading.main_thread()
        ):
            signal.signal(signal.SIGTERM, self._previous_sigterm)
        if self._pending is not None:
            self._pending.cancel()

    # -- hooks ---------------------------------------------------------------------------------

    def _pre_run_cell(self, info: Any = None) -> None:
        self._executing = True
        if self._pending is not None:
            self._pending.cancel()
            self._pending = None
        hidden = self.shell.user_ns_hidden
        ns = self.shell.user_ns
        for name in self.checkpointer.restored_names:
            # IPython hides whatever exists when its startup ends, restored variables included
            if name in hidden and hidden[name] is ns.get(name):
                del hidden[name]
        if self.offer:
            print(self.offer)
            self.offer = ""

    def _post_run_cell(self, result: Any = None) -> None:
        self._executing = False
        if self.checkpointer.incremental_max_bytes <= 0:
            return  # per-cell saves off: only the final and on-demand saves write
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        if loop is None or self.idle_seconds <= 0:
            self._save_safely(exact=False)
            return
        # save once the kernel is idle: after the reply went out, unless another cell started
        self._pending = loop.call_later(self.idle_seconds, self._idle_save)

    def _idle_save(self) -> None:
        self._pending = None
        if not self._executing:
            self._save_safely(exact=False)

    def _save_safely(self, exact: bool) -> SaveReport | None:
        try:
            report = self.save(exact=exact)
        except Exception:  # a checkpoint must never break the user's kernel
            log.exception("gpulab checkpoint: save failed")
            return None
        if not report.committed and report.skipped != "nothing changed":
            log.info("gpulab checkpoint: %s", report.skipped)
        return report

    def _at_exit(self) -> None:
        if not self._final_done:
            self._final_done = True
            self._save_safely(exact=True)

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        if self.checkpointer.restoring:
            # still bringing the checkpoint back: nothing new to save, and it holds the lock
            self._final_done = True
            self._chain_sigterm(signum, frame)
            return
        if self.checkpointer.saving:
            # a save is under way on this thread; it finishes, then the exit continues
            self._exit_after_save = True
            return
        self._final_done = True
        self._save_safely(exact=True)
        self._chain_sigterm(signum, frame)

    def _chain_sigterm(self, signum: int, frame: Any) -> None:
        previous = self._previous_sigterm
        if callable(previous):
            previous(signum, frame)
        elif previous == signal.SIG_IGN:
            return
        else:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)

    # -- API -----------------------------------------------------------------------------------

    def save(self, exact: bool = True) -> SaveReport:
        if self.disabled:
            return SaveReport("full" if exact else "incremental", False, skipped=self.disabled)
        report = self.checkpointer.save(self.shell.user_ns, self.shell.user_ns_hidden, exact=exact)
        self.last_save = report
        if self._exit_after_save:
            self._exit_after_save = False
            self._final_done = True
            if not exact:
                self.checkpointer.save(self.shell.user_ns, self.shell.user_ns_hidden, exact=True)
            self._chain_sigterm(signal.SIGTERM, None)
        return report

    def restore(self, which: str | None = None, *, prefer_current: bool = False) -> RestoreReport:
        report = self.checkpointer.restore(self.shell.user_ns, which, prefer_current=prefer_current)
        self.offer = ""
        return report

    def describe(self) -> str | None:
        found = self.checkpointer.available()
        return found[1].describe() if found else None

    def _register_magics(self) -> None:
        def gpulab_save(line: str = "") -> None:
            """Save the kernel's variables now (exact: every change, any size)."""
            print(self.save(exact=True).summary())

        def gpulab_restore(line: str = "") -> None:
            """Restore the variables of the last checkpoint into this kernel."""
            which = {"--offered": "offered.json", "--current": "manifest.json"}.get(line.strip())
            try:
                print(self.restore(which).summary())
            except CheckpointRefused as e:
                print(f"gpulab: checkpoint refused: {e}", file=sys.stderr)

        def gpulab_checkpoint(line: str = "") -> None:
            """What is offered for restore and what the last save wrote."""
            print(self.describe() or "no checkpoint to restore")
            if self.last_save is not None:
                print(self.last_save.summary())

        for fn in (gpulab_save, gpulab_restore, gpulab_checkpoint):
            self.shell.register_magic_function(fn, "line", fn.__name__)


# -- module-level API (the extension loaded in this kernel) --------------------------------------


def _require() -> CheckpointExtension:
    if _active is None:
        raise RuntimeError(
            "the gpulab checkpoint extension is not loaded: %load_ext gpulab.spawner.singleuser.checkpoint.kernel"
        )
    return _active


def save(exact: bool = True) -> SaveReport:
    return _require().save(exact=exact)


def restore(which: str | None = None) -> RestoreReport:
    return _require().restore(which)


def describe() -> str | None:
    return _require().describe()


def load_ipython_extension(shell: Any) -> None:
    global _active
    if _active is not None or os.environ.get(ENABLED_ENV, "1") == "0":
        return
    try:
        ext = CheckpointExtension(shell)
        ext.start()
    except Exception as e:  # a bad key or an unwritable home must not keep the kernel from starting
        print(f"gpulab: kernel checkpoints are off: {type(e).__name__}: {e}", file=sys.stderr)
        return
    _active = ext


def unload_ipython_extension(shell: Any) -> None:
    global _active
    if _active is not None:
        _active.stop()
        _active = None
