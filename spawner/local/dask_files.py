"""A local Dask cluster's files: its TLS credentials, its Dask config and where its processes
write, made by the hub for the cluster's owner (``gpulab.spawner.local.dask`` starts the
processes that read them).

Files and their owners::

    <state_dir>/dask-clusters/          root 0711 (the hub's)
      forkserver-<uid>.log              root 0600: the owner's fork server's own messages
      cluster-<id>/                     root:<owner's group> 0750 (0711 if that group is shared)
        tls.crt, tls.key                the owner's, 0600: the cluster's ClusterTLS
        dask.yaml                       the owner's, 0600: TLS paths, require-encryption, the
                                        dashboard prefix, no worker HTTP routes (DASK_CONFIG of
                                        every process)
        scheduler.log, w<n>.log         root:<owner's group> 0640 (0600 if shared), appended
                                        (kept after the cluster ended; the rest goes then)
        run/                            the owner's, 0700: scheduler files, workers' spill
                                        (Dask's temporary-directory)

The key and config are 0600 files of the owner in a directory other accounts cannot list, and
never in argv (every account reads /proc/<pid>/cmdline) nor in the environment of another
account.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from gpulab.hub.daskservice.executor import ClusterTLS
from gpulab.spawner.local.accounts import SystemAccount
from gpulab.spawner.local.processes import ProcessError, hub_dir, private_group
from gpulab.spawner.singleuser.dask_scheduler import DASHBOARD_PREFIX_KEY


class DaskExecutorError(ProcessError):
    """A scheduler or worker could not be started or stopped; the message says why."""


@dataclass(frozen=True)
class ClusterFiles:
    """Where one cluster's files are (see the module docstring)."""

    root: Path

    @property
    def cert(self) -> Path:
        return self.root / "tls.crt"

    @property
    def key(self) -> Path:
        return self.root / "tls.key"

    @property
    def config(self) -> Path:
        return self.root / "dask.yaml"

    @property
    def run(self) -> Path:
        return self.root / "run"

    def log(self, name: str) -> Path:
        return self.root / f"{name}.log"


def dashboard_prefix(tls: ClusterTLS) -> str:
    """The dashboard's secret path prefix: derived from the cluster's key, so every start of
    the cluster (and the hub after a restart) computes the same one, and no one without the key
    (who could run code in the cluster anyway) can guess it."""
    digest = hmac.new(tls.key_pem.encode(), b"gpulab dask dashboard prefix", hashlib.sha256)
    return digest.hexdigest()[:32]


def dask_config(files: ClusterFiles, tls: ClusterTLS) -> dict[str, Any]:
    """The Dask config of every process of the cluster (its ``DASK_CONFIG``)."""
    pair = {"cert": str(files.cert), "key": str(files.key)}
    return {
        "distributed": {
            "comm": {
                # nothing connects without the cluster's certificate, whatever the address
                "require-encryption": True,
                "default-scheme": "tls",
                "tls": {
                    "ca-file": str(files.cert),
                    "scheduler": pair,
                    "worker": pair,
                    "client": pair,
                },
            },
            # A worker always runs an HTTP server (distributed starts it even with
            # --no-dashboard), on 127.0.0.1 here, which every local account reaches, and it
            # asks no one who they are: it serves no route at all (a 404 to anyone), so her
            # workers' metrics, health and task names reach no other tenant. Nothing of
            # gpulab's reads them; the scheduler's dashboard, through the hub, is hers.
            "worker": {"http": {"routes": []}},
        },
        "temporary-directory": str(files.run),
        # nested as dask.config.get reads a dotted key
        DASHBOARD_PREFIX_KEY.split(".")[0]: {
            DASHBOARD_PREFIX_KEY.split(".")[1]: dashboard_prefix(tls)
        },
    }


def write_owner_file(path: Path, text: str, account: SystemAccount) -> None:
    """Replace ``path`` by a 0600 file of the owner's holding ``text`` (written under a
    temporary name and renamed, so a process never reads half of it)."""
    temporary = path.with_name(f".{path.name}.new")
    with contextlib.suppress(FileNotFoundError):
        temporary.unlink()
    fd = os.open(
        temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600
    )
    try:
        if os.geteuid() == 0:
            os.fchown(fd, account.uid, account.gid)
        os.fchmod(fd, 0o600)
        os.write(fd, text.encode())
    finally:
        os.close(fd)
    os.replace(temporary, path)


def prepare_cluster_files(
    clusters_dir: Path, cluster_id: int, account: SystemAccount, tls: ClusterTLS
) -> ClusterFiles:
    """The cluster's directory with its TLS files and config (rewritten at every start: the
    same content for the same credentials) and the owner's ``run/``."""
    private = private_group(account)
    files = ClusterFiles(clusters_dir / f"cluster-{cluster_id}")
    # her processes must pass through it; others may not list it (and read none of its files)
    hub_dir(
        files.root,
        0o750 if private else 0o711,
        account.gid if private else None,
        DaskExecutorError,
    )
    write_owner_file(files.cert, tls.cert_pem, account)
    write_owner_file(files.key, tls.key_pem, account)
    write_owner_file(files.config, yaml.safe_dump(dask_config(files, tls)), account)
    with contextlib.suppress(FileExistsError):
        files.run.mkdir(mode=0o700)
        if os.geteuid() == 0:
            os.chown(files.run, account.uid, account.gid, follow_symlinks=False)
    st = files.run.lstat()
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != account.uid:
        raise DaskExecutorError(f"{files.run} is not a directory of {account.name!r}; remove it")
    return files


def remove_cluster_files(clusters_dir: Path, cluster_id: int) -> None:
    """The cluster's key, certificate, config and ``run/`` go; its logs stay."""
    files = ClusterFiles(clusters_dir / f"cluster-{cluster_id}")
    for path in (files.cert, files.key, files.config):
        for name in (path, path.with_name(f".{path.name}.new")):
            with contextlib.suppress(FileNotFoundError):
                name.unlink()
    # the owner's folder: rmtree removes its entries without following her symlinks
    shutil.rmtree(files.run, ignore_errors=True)


def last_log_line(path: str, limit: int = 4096) -> str:
    """The last non-empty line of a log (its last ``limit`` bytes), at most 200 characters."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return ""
    try:
        size = os.fstat(fd).st_size
        data = os.pread(fd, limit, max(0, size - limit))
    finally:
        os.close(fd)
    lines = [line.strip() for line in data.decode(errors="replace").splitlines() if line.strip()]
    return lines[-1][:200] if lines else ""
