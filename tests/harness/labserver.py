"""A real `jupyter server` with gpulab's extension in a subprocess, for tests and the bench; its
config overlay a traitlets Config (or source text), as for the Hub harness."""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from traitlets.config import Config

from tests.harness.hub import config_source
from tests.harness.ports import free_port
from tests.harness.tiers import note_started

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
EXTENSION_SRC = REPO / "extensions" / "jupyterlab-gpulab"


def pids_with_marker(marker: str) -> list[int]:
    """Processes started for one LabServer (the marker is in their environment)."""
    needle = f"GPULAB_TEST_SERVER={marker}".encode()
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "environ").read_bytes():
                out.append(int(entry.name))
        except OSError:
            continue
    return out


class LabServer:
    def __init__(
        self,
        state_dir: Path,
        *,
        env: dict[str, str] | None = None,
        config: Config | str = "",
        extensions: dict[str, bool] | None = None,
    ) -> None:
        self.state_dir = state_dir
        self.home = state_dir / "home"
        self.home.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.token = secrets.token_hex(16)
        self.marker = secrets.token_hex(8)
        self.url = f"http://127.0.0.1:{self.port}"
        self.ws_url = f"ws://127.0.0.1:{self.port}"
        self.headers = {"Authorization": f"token {self.token}"}
        self.extensions = extensions or {"jupyterlab_gpulab": True}
        if isinstance(config, Config):
            config = config_source(config)
        self.config_path = state_dir / "jupyter_server_config.py"
        self.config_path.write_text(
            "c = get_config()  # noqa\n"
            f"c.ServerApp.jpserver_extensions = {self.extensions!r}\n"
            f"c.IdentityProvider.token = {self.token!r}\n"
            f"c.ServerApp.root_dir = {str(self.home)!r}\n" + config
        )
        self.extra_env = env or {}
        self.log_path = state_dir / "server.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.client = httpx.Client(base_url=self.url, headers=self.headers, timeout=30)

    def start(self, timeout: float = 60) -> None:
        note_started("e2e")
        env = dict(os.environ)
        pythonpath = [str(EXTENSION_SRC), str(REPO), env.get("PYTHONPATH", "")]
        env.update(
            HOME=str(self.home),
            JUPYTER_CONFIG_DIR=str(self.state_dir / "config"),
            JUPYTER_DATA_DIR=str(self.state_dir / "data"),
            JUPYTER_RUNTIME_DIR=str(self.state_dir / "runtime"),
            PYTHONPATH=os.pathsep.join(p for p in pythonpath if p),
            GPULAB_TEST_SERVER=self.marker,
        )
        env.update(self.extra_env)
        args = [
            str(BIN / "jupyter"),
            "server",
            f"--config={self.config_path}",
            f"--port={self.port}",
            "--ip=127.0.0.1",
            "--no-browser",
        ]
        if os.geteuid() == 0:
            args.append("--allow-root")
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                args,
                cwd=self.home,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"server exited with {self.proc.returncode}:\n{self.log()[-4000:]}"
                )
            try:
                if self.client.get("/api/status", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"server did not come up in {timeout} s:\n{self.log()[-4000:]}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def get(self, path: str, **kw: Any) -> httpx.Response:
        return self.client.get(f"/gpulab/monitor/{path}", **kw)

    def request(self, method: str, path: str, **kw: Any) -> httpx.Response:
        return self.client.request(method, f"/gpulab/monitor/{path}", **kw)

    def stop(self, timeout: float = 20) -> None:
        """SIGTERM, then SIGKILL for whatever of the server's process group is left."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        for pid in pids_with_marker(self.marker):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.client.close()
