"""The Dask fork server's protocol with a real fork server process (spawner/singleuser/
dask_forkserver.py): malformed requests are answered with an error and change nothing, a child
reports its exit status, the server ends when the hub closes its end; and which environments
the hub lets it fork (spawner/local/dask.py's `forkable`)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpulab.spawner.local.dask import FORKSERVER_MODULE, forkable


@pytest.fixture
def forkserver() -> Iterator[tuple[socket.socket, subprocess.Popen[bytes]]]:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    proc = subprocess.Popen(
        [sys.executable, "-m", FORKSERVER_MODULE, "--control-fd", str(theirs.fileno())],
        pass_fds=[theirs.fileno()],
        start_new_session=True,
    )
    theirs.close()
    ours.settimeout(60)
    try:
        assert json.loads(ours.recv(4096))["ready"] is True
        yield ours, proc
    finally:
        ours.close()
        try:
            proc.wait(timeout=30)
        finally:
            proc.kill()


def ask(control: socket.socket, request: object, fds: list[int]) -> dict[str, object]:
    socket.send_fds(control, [json.dumps(request).encode()], fds)
    return dict(json.loads(control.recv(4096)))


def test_malformed_requests_are_refused_and_a_childs_end_is_reported(
    forkserver: tuple[socket.socket, subprocess.Popen[bytes]], tmp_path: Path
) -> None:
    control, proc = forkserver
    log = os.open(tmp_path / "w1.log", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        good = {"id": 1, "launcher": "worker", "argv": ["--help"], "env": {"PATH": "/usr/bin"}}
        for bad, why in [
            ({**good, "launcher": "kernel"}, "launcher must be one of"),
            ({**good, "argv": "--help"}, "argv must be a list of strings"),
            ({**good, "env": {"A": 1}}, "env must map strings to strings"),
            ({**good, "id": "1"}, "id must be an integer"),
        ]:
            assert why in str(ask(control, bad, [log])["error"])
        assert "exactly one log fd" in str(ask(control, good, [])["error"])
        answer = ask(control, good, [log])  # `dask worker --help`: prints and exits 0
        pid = answer["pid"]
        assert isinstance(pid, int)
        assert json.loads(control.recv(4096)) == {"exited": pid, "status": 0}
    finally:
        os.close(log)
    assert "Usage: dask worker" in (tmp_path / "w1.log").read_text()
    control.close()  # the hub's end: the fork server ends
    assert proc.wait(timeout=30) == 0


def test_only_environments_python_starts_the_same_way_with_are_forked() -> None:
    assert forkable({"PATH": "/usr/bin", "PYTHONPATH": "/x", "PYTHONUNBUFFERED": "1"})
    for name in ("PYTHONHASHSEED", "PYTHONHOME", "PYTHONSTARTUP", "PYTHONWARNINGS"):
        assert not forkable({"PATH": "/usr/bin", name: "0"}), name
