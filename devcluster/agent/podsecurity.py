"""A container's security context as the kubelet and container runtime apply it (stdlib only).

- Who the process is: runAsUser / runAsGroup (container over pod), else the "image's user",
  which here is the agent's own account (images are ignored); the primary gid of a uid without
  runAsGroup is its passwd entry's, else 0, as containerd does. Supplementary groups: fsGroup,
  then supplementalGroups.
- runAsNonRoot: the kubelet's own checks and messages (CreateContainerConfigError).
- allowPrivilegeEscalation false -> no_new_privs; capabilities.drop (ALL or names) -> dropped
  from the bounding set (and, for a root process, from its effective/permitted sets).
- fsGroup on volumes: the kubelet's SetVolumeOwnership (group-owned by fsGroup, rw-rw / r--r--
  for read-only volumes, setgid on directories).

Not applied: seccompProfile, SELinux/AppArmor options, readOnlyRootFilesystem, procMount (the
pods share the host's root filesystem; see the dev-cluster README).
"""

from __future__ import annotations

import os
import pwd
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: capability numbers (linux/capability.h), for capabilities.drop by name
CAPABILITIES = tuple(
    [
        "CHOWN",
        "DAC_OVERRIDE",
        "DAC_READ_SEARCH",
        "FOWNER",
        "FSETID",
        "KILL",
        "SETGID",
        "SETUID",
        "SETPCAP",
        "LINUX_IMMUTABLE",
        "NET_BIND_SERVICE",
        "NET_BROADCAST",
        "NET_ADMIN",
        "NET_RAW",
        "IPC_LOCK",
        "IPC_OWNER",
        "SYS_MODULE",
        "SYS_RAWIO",
        "SYS_CHROOT",
        "SYS_PTRACE",
        "SYS_PACCT",
        "SYS_ADMIN",
        "SYS_BOOT",
        "SYS_NICE",
        "SYS_RESOURCE",
        "SYS_TIME",
        "SYS_TTY_CONFIG",
        "MKNOD",
        "LEASE",
        "AUDIT_WRITE",
        "AUDIT_CONTROL",
        "SETFCAP",
        "MAC_OVERRIDE",
        "MAC_ADMIN",
        "SYSLOG",
        "WAKE_ALARM",
        "BLOCK_SUSPEND",
        "AUDIT_READ",
        "PERFMON",
        "BPF",
        "CHECKPOINT_RESTORE",
    ]
)
RW_MASK, RO_MASK, EXEC_MASK = 0o660, 0o440, 0o110


class SecurityConfigError(ValueError):
    """The container must not start as configured (kubelet: CreateContainerConfigError)."""


@dataclass(frozen=True)
class Identity:
    """What the launcher makes of the container's process before it execs the command."""

    uid: int
    gid: int
    groups: tuple[int, ...] = ()
    no_new_privs: bool = False
    drop_capabilities: tuple[int, ...] = field(default=())

    def as_spec(self) -> dict[str, Any]:
        return {
            "uid": self.uid,
            "gid": self.gid,
            "groups": list(self.groups),
            "noNewPrivs": self.no_new_privs,
            "dropCapabilities": list(self.drop_capabilities),
        }


def pod_desc(pod: dict[str, Any]) -> str:
    """The kubelet's format.Pod: name_namespace(uid)."""
    meta = pod["metadata"]
    return f"{meta['name']}_{meta['namespace']}({meta.get('uid', '')})"


def _effective(pod: dict[str, Any], container: dict[str, Any], key: str) -> Any:
    csc = container.get("securityContext") or {}
    if csc.get(key) is not None:
        return csc[key]
    return ((pod.get("spec") or {}).get("securityContext") or {}).get(key)


def fs_group(pod: dict[str, Any]) -> int | None:
    value = ((pod.get("spec") or {}).get("securityContext") or {}).get("fsGroup")
    return None if value is None else int(value)


def _capability_numbers(names: list[str]) -> tuple[int, ...]:
    last = last_capability()
    numbers: set[int] = set()
    for raw in names:
        name = str(raw).upper().removeprefix("CAP_")
        if name == "ALL":
            numbers.update(range(last + 1))
        elif name in CAPABILITIES:
            numbers.add(CAPABILITIES.index(name))
        else:
            raise SecurityConfigError(f"unknown capability {raw!r} in capabilities.drop")
    return tuple(sorted(n for n in numbers if n <= last))


def last_capability() -> int:
    try:
        return int(Path("/proc/sys/kernel/cap_last_cap").read_text())
    except (OSError, ValueError):
        return len(CAPABILITIES) - 1


def _passwd_gid(uid: int) -> int:
    try:
        return pwd.getpwuid(uid).pw_gid
    except KeyError:
        return 0


def identity(pod: dict[str, Any], container: dict[str, Any], *, image_uid: int) -> Identity:
    """The container process's uid, gids, no_new_privs and dropped capabilities; raises
    SecurityConfigError where the kubelet would refuse to create the container."""
    run_as_user = _effective(pod, container, "runAsUser")
    non_root = _effective(pod, container, "runAsNonRoot")
    name = container.get("name", "")
    if non_root:
        if run_as_user is not None and int(run_as_user) == 0:
            raise SecurityConfigError(
                f'container\'s runAsUser breaks non-root policy (pod: "{pod_desc(pod)}", '
                f"container: {name})"
            )
        if run_as_user is None and image_uid == 0:
            raise SecurityConfigError(
                f'container has runAsNonRoot and image will run as root (pod: "{pod_desc(pod)}", '
                f"container: {name})"
            )
    uid = image_uid if run_as_user is None else int(run_as_user)
    run_as_group = _effective(pod, container, "runAsGroup")
    gid = _passwd_gid(uid) if run_as_group is None else int(run_as_group)
    groups: list[int] = []
    fsg = fs_group(pod)
    if fsg is not None:
        groups.append(fsg)
    psc = (pod.get("spec") or {}).get("securityContext") or {}
    groups += [int(g) for g in psc.get("supplementalGroups") or []]
    csc = container.get("securityContext") or {}
    privileged = bool(csc.get("privileged"))
    escalation = csc.get("allowPrivilegeEscalation")
    drop = ((csc.get("capabilities") or {}).get("drop")) or []
    return Identity(
        uid=uid,
        gid=gid,
        groups=tuple(dict.fromkeys(groups)),
        no_new_privs=escalation is False and not privileged,
        drop_capabilities=() if privileged else _capability_numbers(list(drop)),
    )


def default_home(uid: int, agent_home: str) -> str:
    """HOME when the pod sets none: the agent's per-pod home for the agent's own account (root),
    else the uid's passwd home, else "/" (what a container runtime does for a uid the image's
    passwd lacks)."""
    if uid == os.getuid():
        return agent_home
    try:
        return pwd.getpwuid(uid).pw_dir or "/"
    except KeyError:
        return "/"


def set_volume_ownership(root: Path, group: int, *, read_only: bool) -> None:
    """The kubelet's SetVolumeOwnership: every file and directory under `root` group-owned by
    `group`, rw for the group (r for a read-only volume), directories setgid (new files inherit
    the group) and searchable. Symlinks are left alone (their targets are what counts)."""
    mask = RO_MASK if read_only else RW_MASK

    def change(path: str) -> None:
        st = os.lstat(path)
        if stat.S_ISLNK(st.st_mode):
            return
        os.chown(path, st.st_uid, group)
        bits = mask | (stat.S_ISGID | EXEC_MASK if stat.S_ISDIR(st.st_mode) else 0)
        os.chmod(path, stat.S_IMODE(st.st_mode) | bits)

    change(str(root))
    for dirpath, dirnames, filenames in os.walk(root):
        for n in [*dirnames, *filenames]:
            change(os.path.join(dirpath, n))


def copy_ownership(src_root: Path, dst_root: Path) -> None:
    """Give every path under `dst_root` (a copy of `src_root`) the owner and group of its
    original, as a filesystem-level snapshot keeps them: the copies are made by the agent
    (root), and a home restored as root's would lock its non-root server out of its own files."""
    for dirpath, dirnames, filenames in os.walk(dst_root):
        rel = os.path.relpath(dirpath, dst_root)
        for n in [".", *dirnames, *filenames]:
            if n == "." and rel != ".":
                continue
            dst = os.path.normpath(os.path.join(dirpath, n))
            src = os.path.normpath(os.path.join(src_root, rel, n))
            try:
                st = os.lstat(src)
            except FileNotFoundError:
                continue
            mode = os.lstat(dst).st_mode
            os.lchown(dst, st.st_uid, st.st_gid)
            if not stat.S_ISLNK(mode):
                os.chmod(dst, stat.S_IMODE(mode))  # chown drops setgid bits: put them back
