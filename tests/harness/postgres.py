"""A real PostgreSQL server for tests: Debian's binaries, a throw-away cluster, one database.

`running_postgres()` initialises a cluster in a fresh directory, starts it on a free loopback
port (its unix socket in the same directory, never in /var/run/postgresql where a system server
may live), yields a `PostgresServer` whose `new_database()` creates an empty database and returns
its SQLAlchemy URL, and stops the server with `pg_ctl stop -m fast` on the way out, whatever
happened. Each pytest-xdist worker has its own
session and so its own server and port.

PostgreSQL refuses to run as root. As root the cluster belongs to the `postgres` system account
that Debian's package creates (the directory is made for it in /tmp, since pytest's own temporary
directories are 0700 root and the account could not reach them); as anyone else it belongs to
the caller. Where the binaries are missing, root installs the `postgresql` package with apt-get
(`.ci/dev` installs it too, so a fresh machine has it before the tests); anyone else is told what
to install.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

from tests.harness.ports import free_port
from tests.harness.tiers import note_started

#: the superuser initdb creates; the tests connect as it, with trust authentication on loopback
SUPERUSER = "gpulab"
#: the system account Debian's postgresql package creates
SYSTEM_ACCOUNT = "postgres"


class PostgresUnavailable(RuntimeError):
    """The binaries are missing and cannot be installed here; says what to install."""


def postgres_bin_dir(install: bool = True) -> Path:
    """The newest `/usr/lib/postgresql/<major>/bin` that has initdb and pg_ctl; as root, installs
    Debian's `postgresql` package first when there is none."""
    found = _bin_dirs()
    if not found and install and os.geteuid() == 0:
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        subprocess.run(["apt-get", "update", "-q"], check=True, env=env)
        subprocess.run(["apt-get", "install", "-y", "-q", "postgresql"], check=True, env=env)
        found = _bin_dirs()
    if not found:
        raise PostgresUnavailable(
            "no PostgreSQL server binaries in /usr/lib/postgresql/*/bin (initdb, pg_ctl); "
            "install them with `apt-get install postgresql` (as root the tests do it themselves)"
        )
    return found[-1]


def _bin_dirs() -> list[Path]:
    dirs = [Path(p).parent for p in glob.glob("/usr/lib/postgresql/*/bin/initdb")]
    usable = [d for d in dirs if (d / "pg_ctl").exists()]
    # by major version as a number: "9.6" < "15" < "16"
    return sorted(usable, key=lambda d: [int(x) for x in d.parent.name.split(".") if x.isdigit()])


class _Runner:
    """Runs the server's binaries as the account that owns the cluster."""

    def __init__(self) -> None:
        self.as_root = os.geteuid() == 0
        if self.as_root:
            try:
                account = pwd.getpwnam(SYSTEM_ACCOUNT)
            except KeyError:
                raise PostgresUnavailable(
                    f"running as root, but there is no {SYSTEM_ACCOUNT!r} account to run "
                    "PostgreSQL as (Debian's postgresql package creates it)"
                ) from None
            self.uid, self.gid = account.pw_uid, account.pw_gid
        else:
            self.uid, self.gid = os.geteuid(), os.getegid()

    def run(self, argv: list[str]) -> subprocess.CompletedProcess[str]:
        if not self.as_root:
            return subprocess.run(argv, check=True, capture_output=True, text=True, cwd="/")
        return subprocess.run(
            argv,
            check=True,
            capture_output=True,
            text=True,
            cwd="/",  # the account may not enter the caller's working directory
            user=self.uid,
            group=self.gid,
            extra_groups=[],
        )


class PostgresServer:
    """A started server: ``new_database()`` gives each test an empty database of its own."""

    def __init__(self, bin_dir: Path, runner: _Runner, socket_dir: Path, port: int) -> None:
        self.bin_dir = bin_dir
        self.runner = runner
        self.socket_dir = socket_dir
        self.port = port
        self._databases = 0

    def url(self, database: str) -> str:
        """The SQLAlchemy URL of ``database`` on this server (psycopg 3, over TCP)."""
        return f"postgresql+psycopg://{SUPERUSER}@127.0.0.1:{self.port}/{database}"

    def new_database(self) -> str:
        """Create an empty database; returns its URL."""
        self._databases += 1
        name = f"gpulab_test_{self._databases}"
        self.runner.run(
            [str(self.bin_dir / "createdb"), "-h", str(self.socket_dir), "-p", str(self.port)]
            + ["-U", SUPERUSER, name]
        )
        return self.url(name)


@contextlib.contextmanager
def running_postgres() -> Iterator[PostgresServer]:
    """A started PostgreSQL of its own, stopped (``pg_ctl stop -m fast``) and removed on exit."""
    bin_dir = postgres_bin_dir()
    runner = _Runner()
    # short and reachable by the server's account: a unix socket path must fit in 107 bytes
    root = Path(tempfile.mkdtemp(prefix="gpulab-pg-"))
    os.chown(root, runner.uid, runner.gid)
    data, log = root / "data", root / "server.log"
    try:
        runner.run(
            [
                str(bin_dir / "initdb"),
                "-D",
                str(data),
                "-U",
                SUPERUSER,
                "--auth=trust",
                "--encoding=UTF8",
                "--no-sync",
            ]
        )
        port = _start(bin_dir, runner, data, root, log)
        note_started("e2e")
        yield PostgresServer(bin_dir, runner, root, port)
    finally:
        # also after a start that timed out: the postmaster may be up without having answered
        if (data / "postmaster.pid").exists():
            runner.run([str(bin_dir / "pg_ctl"), "stop", "-D", str(data), "-m", "fast", "-w"])
        shutil.rmtree(root, ignore_errors=True)


def _start(bin_dir: Path, runner: _Runner, data: Path, socket_dir: Path, log: Path) -> int:
    """Start the server on a free port; returns the port. Another process may take the port
    between free_port() and the server's bind, so a failed start is retried on a new port."""
    last = ""
    for _ in range(3):
        port = free_port()
        options = (
            f"-p {port} -k {socket_dir} -c listen_addresses=127.0.0.1"
            # a test database need not survive a power cut; the tests' durability is a reopened
            # store against a running server, which fsync has nothing to do with
            " -c fsync=off -c full_page_writes=off"
        )
        try:
            runner.run(
                [str(bin_dir / "pg_ctl"), "start", "-D", str(data), "-w", "-t", "60"]
                + ["-l", str(log), "-o", options]
            )
            return port
        except subprocess.CalledProcessError as exc:
            last = f"{exc.stdout}{exc.stderr}\n{log.read_text() if log.exists() else ''}"
    raise RuntimeError(f"PostgreSQL did not start in {data}:\n{last[-4000:]}")
