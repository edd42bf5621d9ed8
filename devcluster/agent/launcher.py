"""Run one container's process in its own mount and PID namespace (stdlib only; run by path).

    python launcher.py SPEC.json [FD]    (status lines go to FD, default 3: the agent's pipe)

SPEC: {"argv": [...], "env": {...}, "workingDir": "/x", "mounts": [{"source", "target",
"readOnly", "file"}], "identity": {"uid", "gid", "groups", "noNewPrivs", "dropCapabilities"},
"logPath": "CONTAINER.log", "netns": "/run/netns/NAME", "hostname": "POD"}. Three processes,
like a container runtime with tini:

- this launcher (host PID namespace; dies with the agent via PDEATHSIG) enters the pod's network
  namespace (made by the agent, `podnet`), unshares mount, PID and UTS namespaces (the pod's
  hostname), makes mounts private and bind-mounts the volumes at their mount paths; then, as
  containerd's shim, it writes what the container sends to its stdout and stderr pipes to
  logPath as CRI log records (crilog.py);
- its child is PID 1 of the new namespace: mounts /proc, becomes the container's identity (drops
  capabilities from the bounding set, sets no_new_privs, groups, gid, uid: nothing in the pod's
  namespace keeps root's powers), forwards signals, reaps orphans and exits with the container's
  status; when it exits the kernel kills everything left in the namespace;
- the grandchild chdirs and execs ``argv`` with exactly ``env``.

Status lines (JSON) on fd 3: {"event": "started", "pid": <host pid of PID 1>} once the exec
succeeded, or {"event": "failed", "reason": "StartError", "message": ...}. The exit status is the
container's (128 + signal when it was killed, as Kubernetes reports it).
"""

import contextlib
import ctypes
import json
import os
import select
import signal
import stat
import sys

import crilog  # this folder: the launcher runs by path, its folder is sys.path[0]

CLONE_NEWNS = 0x00020000
CLONE_NEWNET = 0x40000000
CLONE_NEWUTS = 0x04000000
CLONE_NEWPID = 0x20000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
PR_SET_PDEATHSIG = 1
PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 24, 38, 47, 4
_LINUX_CAPABILITY_VERSION_3 = 0x20080522
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


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint32) for n in ("effective", "permitted", "inheritable")]


def _drop_bounding(caps) -> None:
    """Out of the bounding set: no exec can regain them (dropping needs CAP_SETPCAP: first)."""
    for cap in caps:
        _check(libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0), f"dropping capability {cap}")
    libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)


def _drop_held(caps) -> None:
    """Out of the effective, permitted and inheritable sets of a process that stays root."""
    header, data = _CapHeader(_LINUX_CAPABILITY_VERSION_3, 0), (_CapData * 2)()
    _check(libc.capget(ctypes.byref(header), data), "capget")
    for cap in caps:
        word, bit = divmod(cap, 32)
        for name in ("effective", "permitted", "inheritable"):
            setattr(data[word], name, getattr(data[word], name) & ~(1 << bit))
    _check(libc.capset(ctypes.byref(header), data), "capset")


def _become(ident) -> None:
    """The container's identity: bounding set, groups, gid, uid (which clears every capability
    of a process leaving uid 0), then what a process staying root must still lose."""
    if not ident:
        return
    caps = ident.get("dropCapabilities") or []
    _drop_bounding(caps)
    uid, gid = int(ident["uid"]), int(ident["gid"])
    os.setgroups([int(g) for g in ident.get("groups") or []])
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)
    if caps and os.geteuid() == 0:
        _drop_held(caps)
    if ident.get("noNewPrivs"):
        _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")


def _blocked_at(path):
    """The first directory on the way to `path` this process may not search, or None."""
    parts = os.path.abspath(path).split("/")[1:]
    here = "/"
    for part in parts[:-1]:
        here = os.path.join(here, part)
        if not os.access(here, os.X_OK):
            return here
    return None


def _permission_hint(path) -> str:
    blocked = _blocked_at(path)
    if blocked is None:
        return ""
    st = os.stat(blocked)
    return (
        f"; {blocked} (mode {stat.filemode(st.st_mode)}, uid {st.st_uid}) is not searchable by "
        f"uid {os.getuid()} gid {os.getgid()}: the pod's command, its Python environment and the "
        "checkout it imports must be reachable by the pod's runAsUser (chmod o+x on the parent "
        "directories)"
    )


def _exec_container(spec, err_w) -> None:
    for sig in (*FORWARDED, signal.SIGPIPE, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    wd = spec.get("workingDir") or "/"
    try:
        os.setsid()
        try:
            os.chdir(wd)
        except OSError as e:
            msg = f'chdir to cwd ("{wd}") set in config.json failed: {e.strerror}'
            os.write(err_w, (msg + _permission_hint(os.path.join(wd, "."))).encode())
            os._exit(128)
        argv = spec["argv"]
        os.execvpe(argv[0], argv, spec["env"])
    except OSError as e:
        if e.errno == 2:
            what = "executable file not found in $PATH"
        elif e.errno == 13:
            exe = _which(spec["argv"][0], spec["env"].get("PATH", ""))
            what = f"permission denied{_permission_hint(exe)}"
        else:
            what = e.strerror
        msg = f'exec: "{spec["argv"][0]}": {what}'
        os.write(err_w, msg.encode())
    except BaseException as e:  # never return into the caller's code from a forked child
        os.write(err_w, f"exec: {e}".encode())
    os._exit(128)


def _which(name, path) -> str:
    if "/" in name:
        return name
    for d in path.split(os.pathsep):
        candidate = os.path.join(d or ".", name)
        if os.path.exists(candidate):
            return candidate
    return name


def _init(spec, err_w) -> None:
    """PID 1 of the pod's namespace."""
    _pdeathsig()
    with contextlib.suppress(OSError):  # a /proc of the host namespace still works for most
        _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    try:
        # as a runtime creates a missing cwd (as root) before the process starts
        os.makedirs(spec.get("workingDir") or "/", exist_ok=True)
        _become(spec.get("identity"))
    except OSError as e:
        os.write(err_w, f"setting the container's identity: {e}".encode())
        os._exit(128)
    _pdeathsig()  # a change of credentials clears it
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


def _copy_output(spec, streams) -> None:
    """The container's output as CRI records in its log file, until every process of the pod
    that holds the pipes is gone (they all are once PID 1 of the namespace exits)."""
    log_fd = os.open(spec["logPath"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    writers = {fd: crilog.StreamWriter(log_fd, name) for fd, name in streams.items()}
    open_fds = list(writers)
    while open_fds:
        ready, _, _ = select.select(open_fds, [], [])
        for fd in ready:
            chunk = os.read(fd, 65536)
            if chunk:
                writers[fd].feed(chunk)
            else:
                writers[fd].close()
                os.close(fd)
                open_fds.remove(fd)
    os.close(log_fd)


def _enter_netns(path) -> None:
    """The pod's network namespace, shared by its containers (as a pause container's)."""
    if not path:
        return
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        _check(libc.setns(fd, CLONE_NEWNET), f"setns {path}")
    finally:
        os.close(fd)


def _set_hostname(name) -> None:
    """The pod's hostname in a UTS namespace of the container's own (every container of the pod
    sets the same name, as they would share the pause container's)."""
    if not name:
        return
    raw = name.encode()
    _check(libc.sethostname(raw, len(raw)), f"sethostname {name}")


def main() -> int:
    _pdeathsig()
    with open(sys.argv[1]) as fh:
        spec = json.load(fh)
    status = os.fdopen(int(sys.argv[2]) if len(sys.argv) > 2 else 3, "w")
    try:
        _enter_netns(spec.get("netns"))
    except OSError as e:
        _report(status, event="failed", reason="StartError", message=f"network namespace: {e}")
        return 128
    try:
        _check(libc.unshare(CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWUTS), "unshare")
        _set_hostname(spec.get("hostname"))
        _set_up_mounts(spec.get("mounts", []))
    except OSError as e:
        _report(status, event="failed", reason="StartError", message=f"mounting volumes: {e}")
        return 128
    err_r, err_w = os.pipe()  # close-on-exec: EOF without data means the exec succeeded
    # the container's stdout and stderr come back here, to be written as CRI log records (as
    # containerd's shim does): the kubelet API needs each line's stream and time
    out_r, out_w = os.pipe()
    errout_r, errout_w = os.pipe()
    init = os.fork()
    if init == 0:
        status.close()
        for fd in (err_r, out_r, errout_r):
            os.close(fd)
        os.dup2(out_w, 1)
        os.dup2(errout_w, 2)
        os.close(out_w)
        os.close(errout_w)
        _init(spec, err_w)
    os.close(err_w)
    os.close(out_w)
    os.close(errout_w)
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
    _copy_output(spec, {out_r: "stdout", errout_r: "stderr"})
    _, st = os.waitpid(init, 0)
    code = os.waitstatus_to_exitcode(st)
    code = 128 - code if code < 0 else code
    _report(status, event="exited", exitCode=code)
    return code


if __name__ == "__main__":
    sys.exit(main())
