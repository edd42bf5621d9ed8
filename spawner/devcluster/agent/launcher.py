"""Run one container's process in its own mount and PID namespace (stdlib only; run by path).

    python launcher.py SPEC.json [FD]    (status lines go to FD, default 3: the agent's pipe)

SPEC: {"argv": [...], "env": {...}, "workingDir": "/x", "mounts": [{"source", "target",
"readOnly", "file"}]}. Three processes, like a container runtime with tini:

- this launcher (host PID namespace; dies with the agent via PDEATHSIG) unshares mount + PID
  namespaces, makes mounts private and bind-mounts the volumes at their mount paths;
- its child is PID 1 of the new namespace: mounts /proc, forwards signals, reaps orphans and exits
  with the container's status; when it exits the kernel kills everything left in the namespace;
- the grandchild chdirs and execs ``argv`` with exactly ``env``.

Status lines (JSON) on fd 3: {"event": "started", "pid": <host pid of PID 1>} once the exec
succeeded, or {"event": "failed", "reason": "StartError", "message": ...}. The exit status is the
container's (128 + signal when it was killed, as Kubernetes reports it).
"""

import contextlib
import ctypes
import json
import os
import signal
import sys

CLONE_NEWNS = 0x00020000
CLONE_NEWPID = 0x20000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
PR_SET_PDEATHSIG = 1
FORWARDED = (
    signal.SIGTERM,
    signal.SIGINT,
    signal.SIGHUP,
    signal.SIGQUIT,
    signal.SIGUSR1,
    signal.SIGUSR2,
)
libc = ctypes.CDLL(None, use_errno=True)


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(source, target, fstype, flags) -> None:
    enc = [None if v is None else v.encode() for v in (source, target, fstype)]
    _check(libc.mount(enc[0], enc[1], enc[2], ctypes.c_ulong(flags), None), f"mount {target}")


def _pdeathsig() -> None:
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _report(status, **event) -> None:
    try:
        status.write(json.dumps(event) + "\n")
        status.flush()
    except OSError:
        pass


def _set_up_mounts(mounts) -> None:
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    for m in sorted(mounts, key=lambda m: m["target"].rstrip("/").count("/")):
        target = m["target"]
        if m.get("file"):
            os.makedirs(os.path.dirname(target), exist_ok=True)
            if not os.path.exists(target):
                open(target, "a").close()
        else:
            os.makedirs(target, exist_ok=True)
        _mount(m["source"], target, None, MS_BIND | MS_REC)
        if m.get("readOnly"):
            _mount(None, target, None, MS_BIND | MS_REMOUNT | MS_RDONLY)


def _exec_container(spec, err_w) -> None:
    for sig in (*FORWARDED, signal.SIGPIPE, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    try:
        os.setsid()
        wd = spec.get("workingDir") or "/"
        os.makedirs(wd, exist_ok=True)
        os.chdir(wd)
        argv = spec["argv"]
        os.execvpe(argv[0], argv, spec["env"])
    except OSError as e:
        what = "executable file not found in $PATH" if e.errno == 2 else e.strerror
        msg = f'exec: "{spec["argv"][0]}": {what}'
        os.write(err_w, msg.encode())
    except BaseException as e:  # never return into the caller's code from a forked child
        os.write(err_w, f"exec: {e}".encode())
    os._exit(128)


def _init(spec, err_w) -> None:
    """PID 1 of the pod's namespace."""
    _pdeathsig()
    with contextlib.suppress(OSError):  # a /proc of the host namespace still works for most
        _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    child = os.fork()
    if child == 0:
        _exec_container(spec, err_w)
    os.close(err_w)
    for sig in FORWARDED:
        signal.signal(sig, lambda s, _f: os.kill(child, s))
    code = 0
    while True:
        try:
            pid, st = os.waitpid(-1, 0)
        except ChildProcessError:
            break
        if pid == child:
            code = os.waitstatus_to_exitcode(st)
            code = 128 - code if code < 0 else code
            break
    os._exit(code)


def main() -> int:
    _pdeathsig()
    with open(sys.argv[1]) as fh:
        spec = json.load(fh)
    status = os.fdopen(int(sys.argv[2]) if len(sys.argv) > 2 else 3, "w")
    try:
        _check(libc.unshare(CLONE_NEWNS | CLONE_NEWPID), "unshare")
        _set_up_mounts(spec.get("mounts", []))
    except OSError as e:
        _report(status, event="failed", reason="StartError", message=f"mounting volumes: {e}")
        return 128
    err_r, err_w = os.pipe()  # close-on-exec: EOF without data means the exec succeeded
    init = os.fork()
    if init == 0:
        status.close()
        os.close(err_r)
        _init(spec, err_w)
    os.close(err_w)
    for sig in FORWARDED:
        signal.signal(sig, lambda s, _f: os.kill(init, s))
    msg = b""
    while chunk := os.read(err_r, 4096):
        msg += chunk
    os.close(err_r)
    if msg:
        _report(status, event="failed", reason="StartError", message=msg.decode(errors="replace"))
    else:
        _report(status, event="started", pid=init)
    _, st = os.waitpid(init, 0)
    code = os.waitstatus_to_exitcode(st)
    code = 128 - code if code < 0 else code
    _report(status, event="exited", exitCode=code)
    return code


if __name__ == "__main__":
    sys.exit(main())
