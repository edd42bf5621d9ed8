"""A warm pool member of the embedded default: a single-user server process started before its
user is known, with the server's heavy imports done, that becomes one user's server at claim.

    python -m gpulab.spawner.singleuser.warm_server --control-fd N

The hub starts it (as the hub's account, in a new session, with a clean environment holding only
PATH, the locale and its GPU reservation's variables) and keeps the other end of the control
channel, a socket pair inherited as fd N. The member imports JupyterHub's single-user server,
Jupyter Server, JupyterLab and every enabled server extension, says `ready`, then waits for
one claim: the user's account (uid, gid, groups), home, environment and server arguments. It
drops to that account for good, prepares the home as a cold start's prepare step does, answers
`bound` and runs the server in this process: JupyterHub then sees it come up as any server.

Why another tenant cannot use it, and why it is the claimant's own:
- Before the claim it holds nobody's data: no token, no home, no listening socket; its
  environment is the hub's choice (never the hub's own: no secrets), its only channel the hub's
  socket pair, which no user process holds. It has run no user code.
- It serves one claim only: the hub takes a member out of the pool before sending the claim and
  never reuses one; a claim that fails ends the member (the start goes cold).
- The drop is complete and checked before anything of the user's is touched: supplementary
  groups, then real/effective/saved gid and uid, then a check that all three ids are hers and that
  it cannot become root again. Every descriptor but stdio and the control channel is closed
  first. Her token arrives in the claim and is only ever held by her process.
- Afterwards it is marked dumpable again (the kernel clears that on a change of credentials),
  so she may inspect her own server (/proc, py-spy) as she could a cold one: its memory holds the
  imported modules anyone's server loads, her environment and nothing of the hub's. Members are
  separate processes, not forks of one template, so no two share random state.
- The hub checks the result from outside too (/proc/<pid>/status: every uid and gid hers) before
  it answers the start.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import importlib
import json
import os
import shutil
import site
import socket
import sys
import time
from pathlib import Path
from typing import Any

from gpulab.spawner.singleuser.checkpoint.prepare import prepare
from gpulab.spawner.singleuser.lab_start import pin_npm_registry

#: modules a server imports before it serves (the single-user app, Jupyter Server, JupyterLab);
#: enabled server extensions are added from the Jupyter config
WARM_MODULES = (
    "jupyterhub.singleuser",
    "jupyterhub.singleuser.extension",
    "jupyter_server.serverapp",
    "jupyter_server.services.kernels.kernelmanager",
    "jupyter_server.services.contents.largefilemanager",
    "jupyterlab.labapp",
)

#: variables read while Python starts or while the modules above are imported: a claim whose
#: value differs from the member's cannot be served warm (its server would not be the one a
#: cold start makes), so the start goes cold. PYTHONPATH and PYTHONUSERBASE are applied at claim
#: (sys.path: `apply_python_path`).
IMPORT_TIME_PREFIXES = ("PYTHON", "JUPYTERHUB_SINGLEUSER_")
APPLIED_AT_CLAIM = ("PYTHONPATH", "PYTHONUSERBASE")

PR_SET_DUMPABLE = 4
#: the scheduling priority a member imports at, until its claim
MEMBER_NICE = 19


def enabled_extension_modules() -> list[str]:
    """The server extensions Jupyter's config enables (what a server will load)."""
    try:
        from jupyter_core.paths import jupyter_config_path
        from jupyter_server.extension.config import ExtensionConfigManager

        manager = ExtensionConfigManager(read_config_path=jupyter_config_path())
        extensions = manager.get_jpserver_extensions()  # type: ignore[no-untyped-call]
        return sorted(name for name, on in extensions.items() if on)
    except Exception:  # a broken config is the server's to report, at its start
        return []


def warm_imports() -> list[str]:
    """Import what a server imports; the names that imported (a failure is the server's to
    report when it starts: nothing is gained or lost by it here). JupyterLab's registry is
    pinned first, as a cold start's configuration does (`lab_start`): no yarn run at refill;
    the claim's configuration pins it again from her environment."""
    pin_npm_registry()
    done = []
    for name in [*WARM_MODULES, *enabled_extension_modules()]:
        with contextlib.suppress(Exception):
            importlib.import_module(name)
            done.append(name)
    return done


def unwarmable(member_env: dict[str, str], claim_env: dict[str, str]) -> list[str]:
    """Variables whose value a claim would need at interpreter start or import (pure)."""
    keys = {k for k in [*member_env, *claim_env] if k.startswith(IMPORT_TIME_PREFIXES)}
    return sorted(k for k in keys - set(APPLIED_AT_CLAIM) if member_env.get(k) != claim_env.get(k))


def claim_priority() -> None:
    """Back to the scheduling priority of a cold server: a member imports at the lowest priority
    (`MEMBER_NICE`, so refilling the pool never takes CPU from people's starts), and only
    the hub's account may raise it again, so this runs before the drop."""
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, 0, 0)


def drop_to(uid: int, gid: int, groups: list[int]) -> None:
    """Become `uid`/`gid` with `groups` for good, or raise PermissionError. The hub's own
    account (servers shared with it on purpose: `server_accounts = 'hub'`) stays as it is."""
    if uid == os.geteuid() and gid == os.getegid():
        return
    os.setgroups(groups)
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)
    if os.getresuid() != (uid, uid, uid) or os.getresgid() != (gid, gid, gid):
        raise PermissionError(f"could not become uid {uid} gid {gid} for good")
    if uid != 0:
        try:
            os.setuid(0)
        except PermissionError:
            pass
        else:
            raise PermissionError("could become root again after the drop")
    # the kernel makes a process non-dumpable when its credentials change; its memory is hers
    # now (see the module's docstring), so her own tools may inspect it as a cold server
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_DUMPABLE, 1, 0, 0, 0)


def _private_socket(fd: int) -> bool:
    """Whether `fd` is an unnamed Unix socket (one end of a socket pair this process made, such
    as an event loop's self-pipe): it reaches nothing outside the process."""
    try:
        sock = socket.socket(fileno=os.dup(fd))
    except OSError:
        return False
    with sock:
        try:
            return (
                sock.family == socket.AF_UNIX
                and not sock.getsockname()
                and not (sock.getpeername())
            )
        except OSError:
            return False


def close_other_descriptors(keep: int) -> list[str]:
    """Close every descriptor that could carry the hub account's access into the user's
    process: files, directories, devices and sockets that reach anything. Kept: stdio, `keep`
    (the control channel) and what imports made inside the process (an event loop's epoll,
    eventfd, pipes and socket pairs), which reach nothing. Returns what was closed."""
    closed = []
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd in (0, 1, 2, keep):
            continue
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # the listing's own descriptor, already gone
        inside = target.startswith(("anon_inode:", "pipe:")) or (
            target.startswith("socket:") and _private_socket(fd)
        )
        if not inside:
            with contextlib.suppress(OSError):
                os.close(fd)
                closed.append(target)
    return closed


def apply_python_path(env: dict[str, str]) -> None:
    """What starting Python with the claim's environment would have put on sys.path: its
    PYTHONPATH first, and the user's own site-packages under her home when user sites are on."""
    entries = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    for entry in reversed(entries):
        if entry not in sys.path:
            sys.path.insert(1, entry)
    if site.ENABLE_USER_SITE:
        site.USER_BASE = None
        site.USER_SITE = None
        user_site = site.getusersitepackages()
        if os.path.isdir(user_site):
            site.addsitedir(user_site)


def send(channel: Any, message: dict[str, Any]) -> None:
    channel.write(json.dumps(message) + "\n")
    channel.flush()


def serve(claim: dict[str, Any]) -> int:
    """Run the single-user server of `claim` in this process (after the drop)."""
    env = {str(k): str(v) for k, v in claim["env"].items()}
    env = prepare(Path(claim["home"]), bool(claim.get("directory_only")), env)
    os.environ.clear()
    os.environ.update(env)
    apply_python_path(env)
    argv = [str(a) for a in claim["argv"]]
    sys.argv = argv
    from jupyterhub.singleuser import main as singleuser_main

    return int(singleuser_main() or 0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--control-fd", type=int, required=True)
    args = parser.parse_args(argv)
    started = time.monotonic()
    # refilling the pool takes only CPU nobody's start wants (claim_priority undoes it)
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, 0, MEMBER_NICE)
    # sys.path[0] is where `python -m` ran: a cold server's is its script's folder
    script = shutil.which("jupyterhub-singleuser")
    sys.path[0] = os.path.dirname(script) if script else sys.path[0]
    sock = socket.socket(fileno=args.control_fd)
    channel = sock.makefile("rw", encoding="utf-8")
    imported = warm_imports()
    send(
        channel, {"ready": os.getpid(), "seconds": time.monotonic() - started, "imported": imported}
    )
    line = channel.readline()
    if not line:  # the hub let it go (surplus, stale, hub stopped): nothing else to do
        return 0
    claim = json.loads(line)
    refused = unwarmable(dict(os.environ), claim["env"])
    if refused:
        send(channel, {"refused": f"needs {', '.join(refused)} at start"})
        return 0
    try:
        channel.flush()
        close_other_descriptors(sock.fileno())
        claim_priority()
        drop_to(int(claim["uid"]), int(claim["gid"]), [int(g) for g in claim["groups"]])
    except OSError as e:
        send(channel, {"refused": f"could not become the user: {e}"})
        return 1
    send(channel, {"bound": os.getpid(), "uid": os.getuid(), "gid": os.getgid()})
    channel.close()
    sock.close()
    return serve(claim)


if __name__ == "__main__":
    raise SystemExit(main())
