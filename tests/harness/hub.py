"""A real JupyterHub (with configurable-http-proxy) in a subprocess, for end-to-end tests.

The hub runs gpulab's shipped config (hub/jupyterhub_config.py) with a test overlay: loopback
ports picked at random, a service token with admin scopes for the REST API, and whatever
GPUCapacity/spawner settings a test passes.

A test passes its settings as a `traitlets.config.Config` (as JupyterHub's and kubespawner's own
tests do); the harness writes it out as `c.Section.key = value` lines, lazy values
(`c.JupyterHub.tornado_settings.update(...)`) as the same calls, into the config file the shipped
config loads last (GPULAB_CONFIG). Only plain data goes into a Config this way (config_source
refuses anything else); source text is still accepted for an overlay that must run code (a hook
function), though no test needs one today (the metrics test's request recorder is a jupyter
server config, not a hub overlay).
"""

from __future__ import annotations

import ast
import contextlib
import copy
import os
import pwd
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
from tornado.httpclient import HTTPRequest
from tornado.websocket import websocket_connect
from traitlets.config import Config, LazyConfigValue

from tests.harness import leftovers
from tests.harness.kernel_ws import execute
from tests.harness.ports import free_port
from tests.harness.tiers import note_started

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
SHIPPED_CONFIG = REPO / "hub" / "jupyterhub_config.py"


#: where hubs keep their state: a directory every account can pass through (pytest's own tmp_path is
#: 0700 root, and pytest resets it to that, so a user's server could never reach its home there)
PASSABLE_ROOT = Path(tempfile.gettempdir()) / "gpulab-test-hubs"


def _live_uid_of(pid: int) -> int | None:
    """The uid `pid` runs as; None when it is gone or a zombie (an exited process its parent has
    not reaped yet: on some machines pid 1 reaps orphans late)."""
    try:
        fields = dict(
            line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
        )
    except (FileNotFoundError, ProcessLookupError):
        return None
    if fields.get("State", "").split()[:1] == ["Z"]:
        return None
    return int(fields["Uid"].split()[0])


def pids_of_uid(uid: int) -> list[int]:
    """The live processes running as `uid` (zombies are gone: they hold no memory and no GPU)."""
    return [int(p) for p in os.listdir("/proc") if p.isdigit() and _live_uid_of(int(p)) == uid]


def remove_account(name: str, uid: int, timeout: float = 10.0) -> None:
    """Kill what runs as `uid` and remove the account. `userdel` refuses an account that still
    has a process, and SIGKILL is not instant (a process in the kernel, or reaped late by its
    parent): so wait until none is left, and try `userdel` again while it says the account is
    in use. A test account left behind would stay on the machine for good."""
    deadline = time.monotonic() + timeout
    while True:
        pids = pids_of_uid(uid)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if not pids:
            result = subprocess.run(["userdel", name], check=False, capture_output=True)
            if result.returncode in (0, 6):  # removed, or no such account
                return
        if time.monotonic() > deadline:
            print(f"tests: could not remove account {name} (uid {uid}): {pids_of_uid(uid)} left")
            return
        time.sleep(0.1)


def passable_dir(requested: Path) -> Path:
    """A fresh directory under PASSABLE_ROOT for a hub's state, linked from `requested` so that a
    test finds the hub's files where it asked for them."""
    PASSABLE_ROOT.mkdir(mode=0o711, exist_ok=True)
    st = PASSABLE_ROOT.lstat()
    if st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise RuntimeError(f"{PASSABLE_ROOT} must be this account's and writable by it alone")
    os.chmod(PASSABLE_ROOT, 0o711)
    real = Path(tempfile.mkdtemp(prefix=f"{requested.name}-", dir=PASSABLE_ROOT))
    os.chmod(real, 0o711)
    requested.parent.mkdir(parents=True, exist_ok=True)
    if requested.is_symlink() or requested.exists():
        # a second Hub over the same directory (a restart test): keep the first one's state
        return requested.resolve()
    requested.symlink_to(real, target_is_directory=True)
    return real


def merged(*overlays: Config) -> Config:
    """One overlay from several, later ones winning (copies: the arguments stay as they were)."""
    out = Config()
    for overlay in overlays:
        out.merge(copy.deepcopy(overlay))
    return out


def _literal(value: object, where: str) -> str:
    """`value` as Python source that evaluates back to it; plain data only (code needs source)."""
    text = repr(value)
    try:
        if ast.literal_eval(text) == value:
            return text
    except (ValueError, SyntaxError):
        pass
    raise TypeError(f"{where}: {value!r} is not plain data; pass the overlay as source text")


def config_source(overlay: Config) -> str:
    """The overlay as config-file lines, one per setting, in the order they were set."""
    lines = []
    for section, values in overlay.items():
        if not isinstance(values, Config):
            raise TypeError(f"overlay: {section!r} is not a class section (c.{section}.<name>)")
        for key, value in values.items():
            target = f"c.{section}.{key}"
            if not isinstance(value, LazyConfigValue):
                lines.append(f"{target} = {_literal(value, target)}")
                continue
            # c.X.y.update(...) and friends: kept as calls, so they add to what the shipped
            # config set instead of replacing it
            ops = value.to_dict()
            for method in ("extend", "prepend", "update"):
                if method in ops:
                    lines.append(f"{target}.{method}({_literal(ops[method], target)})")
            for index, item in ops.get("inserts", []):
                lines.append(f"{target}.insert({index}, {_literal(item, target)})")
    return "".join(line + "\n" for line in lines)


def _pids_of_hub(api_port: int, *, servers_only: bool = False) -> list[int]:
    """Processes that talk to the hub on `api_port`: single-user servers and their kernels, and
    (unless `servers_only`) the hub's managed services, which live as long as the hub does."""
    # any address: a hub whose servers run in dev-cluster pods is reached at the host's address
    # on the pod network
    marker = f":{api_port}/hub/api".encode()
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        if marker not in environ:
            continue
        if servers_only and b"\0JUPYTERHUB_SERVICE_NAME=" in b"\0" + environ:
            continue
        out.append(int(entry.name))
    return out


class Hub:
    def __init__(
        self, state_dir: Path, overlay: Config | str = "", env: dict[str, str] | None = None
    ) -> None:
        if isinstance(overlay, Config):
            overlay = config_source(overlay)
        self.extra_env = {"GPULAB_CULL_IDLE_SECONDS": "0", **(env or {})}
        self.state_dir = passable_dir(state_dir)
        # system accounts of this hub's users: a prefix of its own, so that hubs running at once
        # (two test workers) never share an account, and cleanup() removes exactly these
        prefix_file = self.state_dir / "test-account-prefix"
        if not prefix_file.exists():  # a second Hub over the same state keeps the accounts
            prefix_file.write_text(f"gt{secrets.token_hex(2)}-")
        self.account_prefix = prefix_file.read_text()
        self.port, self.hub_port, self.proxy_api_port = free_port(), free_port(), free_port()
        self.token = secrets.token_hex(16)
        self.url = f"http://127.0.0.1:{self.port}"
        self.overlay_path = self.state_dir / "test_config.py"
        # what a killed test run leaves of this hub, the next run removes (leftovers.py)
        leftovers.claim(
            self.state_dir,
            account_prefix=self.account_prefix,
            marker=f"GPULAB_CONFIG={self.overlay_path}",
        )
        self.overlay_path.write_text(
            "c = get_config()  # noqa\n"
            f"c.JupyterHub.services.append({{'name': 'gpulab-test', 'api_token': {self.token!r}}})\n"
            "c.JupyterHub.load_roles.append({'name': 'gpulab-test-admin', 'services': ['gpulab-test'],"
            " 'scopes': ['admin:users', 'admin:servers', 'admin:server_state', 'access:servers',"
            " 'admin:groups', 'read:hub', 'tokens']})\n"
            "c.Spawner.poll_interval = 1\n"
            "c.JupyterHub.last_activity_interval = 2\n"
            "c.GPUSimpleLocalSpawner.home_dir_template = "
            f"{str(self.state_dir / 'homes' / '{username}' / '{servername}')!r}\n"
            f"c.GPUSimpleLocalSpawner.system_account_prefix = {self.account_prefix!r}\n" + overlay
        )
        self.proc: subprocess.Popen[bytes] | None = None
        #: a system account to run the hub as instead of root (tests of a non-root hub); the state
        #: directory must then be that account's
        self.run_as: str | None = None
        self.log_path = self.state_dir / "hub.log"
        self.client = httpx.Client(
            base_url=f"{self.url}/hub/api",
            headers={"Authorization": f"token {self.token}"},
            timeout=30,
        )

    # -- process -------------------------------------------------------------------------------

    def start(self, timeout: float = 60, expect_failure: bool = False) -> None:
        note_started("e2e")
        env = dict(os.environ)
        env.update(
            GPULAB_IP="127.0.0.1",
            GPULAB_PORT=str(self.port),
            GPULAB_HUB_PORT=str(self.hub_port),
            GPULAB_PROXY_API_URL=f"http://127.0.0.1:{self.proxy_api_port}",
            GPULAB_CONFIG=str(self.overlay_path),
            PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}",
        )
        env.update(self.extra_env)
        with open(self.log_path, "ab") as log:
            if self.run_as:
                env.update(HOME=str(self.state_dir), USER=self.run_as)
            self.proc = subprocess.Popen(
                [str(BIN / "jupyterhub"), "-f", str(SHIPPED_CONFIG)],
                cwd=self.state_dir,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                user=self.run_as,
                group=pwd.getpwnam(self.run_as).pw_gid if self.run_as else None,
                extra_groups=[] if self.run_as else None,
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                if expect_failure:
                    return
                raise RuntimeError(f"hub exited with {self.proc.returncode}:\n{self.log()[-4000:]}")
            try:
                # up, and ours: another hub answering on this port would refuse our token
                if self.client.get("/user", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"hub did not come up in {timeout} s:\n{self.log()[-4000:]}")

    def wait_exit(self, timeout: float = 30) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop_hub(self) -> None:
        """Stop the hub process only (servers keep running: cleanup_servers is False)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def close(self) -> None:
        """Stop every server this hub started, then the hub and its proxy."""
        if self.proc is not None and self.proc.poll() is None:
            try:
                for user in self.client.get("/users", params={"state": "active"}).json():
                    for name in user.get("servers", {}):
                        self.client.delete(f"/users/{user['name']}/servers/{name}")
            except (httpx.HTTPError, ValueError):
                pass
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and _pids_of_hub(self.hub_port, servers_only=True):
                time.sleep(0.3)
        self.stop_hub()
        for pid in _pids_of_hub(self.hub_port):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.client.close()

    def accounts(self) -> list[pwd.struct_passwd]:
        """The system accounts this hub made for its users."""
        return [e for e in pwd.getpwall() if e.pw_name.startswith(self.account_prefix)]

    def account(self, user: str) -> pwd.struct_passwd:
        (entry,) = [e for e in self.accounts() if e.pw_name == self.account_prefix + user]
        return entry

    def cleanup(self) -> None:
        """After close(): remove this hub's user accounts (their processes are gone) and state."""
        for entry in self.accounts():
            remove_account(entry.pw_name, entry.pw_uid)
        shutil.rmtree(self.state_dir, ignore_errors=True)

    # -- REST helpers --------------------------------------------------------------------------

    def home(self, user: str, server: str = "") -> Path:
        """The home directory of a local server (one per user and server)."""
        return self.state_dir / "homes" / user / (server or "default")

    def api(self, method: str, path: str, **kw: Any) -> httpx.Response:
        return self.client.request(method, path, **kw)

    def create_user(self, name: str, groups: tuple[str, ...] = ()) -> None:
        r = self.api("POST", f"/users/{name}")
        assert r.status_code in (201, 409), r.text
        for g in groups:
            r = self.api("POST", f"/groups/{g}")
            assert r.status_code in (201, 409), r.text
            r = self.api("POST", f"/groups/{g}/users", json={"users": [name]})
            assert r.status_code == 200, r.text

    def spawn(
        self, user: str, server: str = "", profile: str | None = None, **options: Any
    ) -> httpx.Response:
        body = dict(options)
        if profile is not None:
            body["profile"] = profile
        path = f"/users/{user}/servers/{server}" if server else f"/users/{user}/server"
        return self.api("POST", path, json=body)

    def server_model(self, user: str, server: str = "") -> dict[str, Any] | None:
        model = self.api("GET", f"/users/{user}").json()
        return model.get("servers", {}).get(server)

    def wait_ready(self, user: str, server: str = "", timeout: float = 90) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            model = self.server_model(user, server)
            if model and model.get("ready"):
                return model
            if model is None:
                raise AssertionError(f"server {user}/{server} went away:\n{self.log()[-3000:]}")
            time.sleep(0.3)
        raise TimeoutError(f"server {user}/{server} not ready after {timeout} s")

    def start_server(
        self, user: str, server: str = "", profile: str | None = None
    ) -> dict[str, Any]:
        r = self.spawn(user, server, profile)
        assert r.status_code in (201, 202), f"{r.text}\n{self.log()[-3000:]}"
        return self.wait_ready(user, server)

    def stop_server(self, user: str, server: str = "", timeout: float = 60) -> None:
        path = f"/users/{user}/servers/{server}" if server else f"/users/{user}/server"
        r = self.api("DELETE", path)
        assert r.status_code in (202, 204), r.text
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.server_model(user, server) is None:
                return
            time.sleep(0.3)
        raise TimeoutError(f"server {user}/{server} did not stop")

    def login(self, username: str, password: str) -> httpx.Client:
        """A browser-like session: the login form, cookies and the _xsrf token."""
        session = httpx.Client(base_url=self.url, timeout=30, follow_redirects=True)
        session.get("/hub/login")
        r = session.post(
            "/hub/login",
            data={
                "username": username,
                "password": password,
                "_xsrf": session.cookies.get("_xsrf", ""),
            },
        )
        assert r.status_code == 200 and "/hub/login" not in str(r.url), (r.url, r.text[-2000:])
        return session

    def admin_password(self) -> str:
        return (self.state_dir / "initial-admin-password").read_text().strip()

    def capacity(self) -> dict[str, dict[str, Any]]:
        r = self.api("GET", "/gpulab/capacity")
        assert r.status_code == 200, r.text
        return {p["slug"]: p for p in r.json()["profiles"]}

    def allocations(self) -> dict[str, dict[str, Any]]:
        r = self.api("GET", "/gpulab/allocations")
        assert r.status_code == 200, r.text
        return {a["id"]: a for a in r.json()["allocations"]}

    def ledger_intervals(self) -> list[Any]:
        """Every interval of the hub's GPU-hour ledger (its SQLite file in the state directory),
        read as an admin's audit would; the hub writes it within moments of a change."""
        from gpulab.hub.ledger.store import SQLITE_FILE, LedgerStore

        store = LedgerStore(f"sqlite:///{self.state_dir / SQLITE_FILE}")
        try:
            return store.intervals(0, 2**40)
        finally:
            store.close()

    def server_pid(self, user: str, server: str = "") -> int:
        model = self.server_model(user, server)
        assert model is not None
        return int(model["state"]["pid"])

    def server_env(self, user: str, server: str = "") -> dict[str, str]:
        raw = Path(f"/proc/{self.server_pid(user, server)}/environ").read_bytes()
        return dict(item.split("=", 1) for item in raw.decode().split("\0") if "=" in item)


async def run_in_kernel(
    hub: Hub,
    user: str,
    code: str,
    server: str = "",
    timeout: float = 60,
    *,
    keep_kernel: bool = False,
) -> str:
    """Start a real kernel on the user's server, run `code`, return its stdout.

    The kernel is shut down afterwards unless `keep_kernel` (a test that stops the server with the
    kernel still alive, as a user closing the browser would).
    """
    base = f"{hub.url}/user/{user}/{server + '/' if server else ''}"
    headers = {"Authorization": f"token {hub.token}"}
    async with httpx.AsyncClient(headers=headers, timeout=timeout) as client:
        r = await client.post(f"{base}api/kernels", json={"name": "python3"})
        assert r.status_code == 201, r.text
        kernel_id = r.json()["id"]
        try:
            ws_url = base.replace("http://", "ws://") + f"api/kernels/{kernel_id}/channels"
            ws = await websocket_connect(
                HTTPRequest(ws_url, headers=headers, connect_timeout=timeout)
            )
            try:
                return await execute(
                    ws, code, session=uuid.uuid4().hex, username=user, timeout=timeout
                )
            finally:
                ws.close()
        finally:
            if not keep_kernel:
                await client.delete(f"{base}api/kernels/{kernel_id}")


def fast_metrics_env(folder: Path, config_text: str = "") -> dict[str, str]:
    """The hub environment for a gpulab-metrics that lists the hub every second and takes
    pushes every second (on a port of this test worker's), with `config_text` appended to its
    config file (in `folder`)."""
    config = folder / "metrics_config.py"
    config.write_text("c.MetricsService.listing_interval_seconds = 1\n" + config_text)
    return {
        "GPULAB_METRICS_SERVICE_PORT": str(free_port()),
        "GPULAB_METRICS_CONFIG": str(config),
        "GPULAB_METRICS_PUSH_INTERVAL_SECONDS": "1",
    }
