"""The request sequence of VS Code's JupyterHub extension, replayed against a real hub.

microsoft/vscode-jupyter-hub (read at 171390d7, src/): connecting to a hub and running a cell
makes these requests, in this order, with these methods, headers and bodies:

1. `getVersion` (jupyterHubApi.ts): `GET <hub>/hub/api`, `redirect: 'manual'`,
   `Connection: keep-alive`; 200 with `{"version": ...}` or the URL is not a hub.
2. `verifyApiToken` -> `getUserInfo` (jupyterHubApi.ts; authenticator.ts tries the password as a
   token first): `GET hub/api/users/<name>` with `Authorization: token <password>`.
3. `listServers` (jupyterHubApi.ts): `GET hub/api/users/<name>?include_stopped_servers`.
4. `validateJupyterUri` (validator.ts): `GET hub/api/users/<name>` again, needs `name`.
5. `ensureServerIsRunning` -> `startIfServerNotStarted` (validator.ts): `GET hub/api/users/<name>`
   (`?include_stopped_servers` for a named server); unless `servers[name].ready`, `startServer`:
   `POST hub/api/users/<name>/server` (or `/servers/<name>`) with only the Authorization header
   and no body; then the same GET once a second until `servers[name].ready`.
6. `getUserJupyterUrl` (jupyterHubApi.ts): the same GET, `servers[name].url` is the base URL.
7. `@jupyterlab/services` with `token` and `appendToken: true` (`createServerConnectSettings`):
   REST calls carry `Authorization: token <token>` (`api/kernelspecs` from `getKernelSpecs` in
   validator.ts, then a kernel: `POST api/kernels`); the kernel websocket is
   `ws(s)://.../api/kernels/<id>/channels?session_id=<uuid>&token=<token>` from Node's `ws`,
   which sends no `Sec-Fetch-Mode` header. (jupyterIntegration.ts's `OurWebSocket` also adds the
   Authorization header to websockets the Jupyter extension opens; `token_in="header"` replays
   that variant, `token_in="url"` the URL-only one of `@jupyterlab/services` alone.)

`replay(...)` runs the whole sequence, runs one cell that prints the kernel's GPU environment,
and (unless `stop=False`) stops the server with the same token. It never raises for a failure of
the hub: the result says which step failed and why, so a benchmark can count `ok` rounds.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

import httpx
from tornado.httpclient import HTTPRequest
from tornado.websocket import websocket_connect

from tests.harness.kernel_ws import KernelCellError, execute

#: what the cell prints: the GPU variables of the kernel's environment, as JSON
GPU_ENV_CELL = (
    "import json, os; print(json.dumps({k: v for k, v in os.environ.items() if k in "
    "('CUDA_VISIBLE_DEVICES', 'NVIDIA_VISIBLE_DEVICES', 'GPULAB_PROFILE')}))"
)


@dataclass
class ReplayResult:
    """One replay: `ok` when every step passed; else `failed_step` and `error` say where."""

    ok: bool = False
    version: str = ""
    server_url: str = ""
    user_options: dict[str, Any] = field(default_factory=dict)
    kernelspecs: list[str] = field(default_factory=list)
    stdout: str = ""
    env: dict[str, str] = field(default_factory=dict)
    steps: list[str] = field(default_factory=list)
    failed_step: str = ""
    error: str = ""
    seconds: float = 0.0


class ReplayError(Exception):
    pass


def _auth(token: str) -> dict[str, str]:
    return {"Authorization": f"token {token}"}


def _user_path(username: str, include_stopped: bool) -> str:
    # getUserInfo: the flag is a bare query parameter, no value
    return f"hub/api/users/{username}" + ("?include_stopped_servers" if include_stopped else "")


async def _user_info(
    client: httpx.AsyncClient, hub_url: str, username: str, token: str, include_stopped: bool
) -> dict[str, Any]:
    r = await client.get(hub_url + _user_path(username, include_stopped), headers=_auth(token))
    if r.status_code != 200:
        raise ReplayError(f"GET user info: {r.status_code} {r.text[:300]}")
    info: dict[str, Any] = r.json()
    return info


def _server(info: dict[str, Any], server_name: str) -> dict[str, Any]:
    server: dict[str, Any] = (info.get("servers") or {}).get(server_name) or {}
    return server


async def replay(
    hub_url: str,
    username: str,
    token: str,
    server_name: str = "",
    *,
    token_in: str = "url",
    code: str = GPU_ENV_CELL,
    stop: bool = True,
    ready_timeout: float = 120,
) -> ReplayResult:
    """Connect as VS Code does, start `server_name` (empty: the default server) with an empty
    body, run `code` in a new kernel over its websocket (the token in the URL only, or in the
    header only: `token_in`), and stop the server unless `stop` is False."""
    assert token_in in ("url", "header")
    hub_url = hub_url.rstrip("/") + "/"
    result = ReplayResult()
    started = time.monotonic()
    step = "connect"
    async with httpx.AsyncClient(timeout=30, follow_redirects=False) as client:
        try:
            # 1. getVersion
            r = await client.get(hub_url + "hub/api", headers={"Connection": "keep-alive"})
            if r.status_code != 200:
                raise ReplayError(f"GET hub/api: {r.status_code}")
            result.version = r.json()["version"]
            result.steps.append(step)
            # 2. verifyApiToken (the token typed as the password)
            step = "verify token"
            info = await _user_info(client, hub_url, username, token, False)
            result.steps.append(step)
            # 3. listServers
            step = "list servers"
            await _user_info(client, hub_url, username, token, True)
            result.steps.append(step)
            # 4. validateJupyterUri
            step = "validate"
            info = await _user_info(client, hub_url, username, token, False)
            if not info.get("name"):
                raise ReplayError(f"user info without a name: {info}")
            result.steps.append(step)
            # 5. startIfServerNotStarted
            step = "start"
            named = bool(server_name)
            info = await _user_info(client, hub_url, username, token, named)
            if not _server(info, server_name).get("ready"):
                path = (
                    f"hub/api/users/{username}/servers/{quote(server_name, safe='')}"
                    if named
                    else f"hub/api/users/{username}/server"
                )
                r = await client.post(hub_url + path, headers=_auth(token))  # no body
                if r.status_code not in (201, 202):
                    raise ReplayError(f"POST {path}: {r.status_code} {r.text[:300]}")
                result.steps.append(step)
                step = "wait ready"
                deadline = time.monotonic() + ready_timeout
                while True:
                    info = await _user_info(client, hub_url, username, token, named)
                    if _server(info, server_name).get("ready"):
                        break
                    if time.monotonic() > deadline:
                        raise ReplayError(f"not ready after {ready_timeout} s: {info}")
                    await asyncio.sleep(1)  # validator.ts: sleep(1000)
            result.steps.append(step)
            # 6. getUserJupyterUrl
            step = "server url"
            info = await _user_info(client, hub_url, username, token, named)
            server = _server(info, server_name)
            if not server.get("url"):
                raise ReplayError(f"no URL for server {server_name!r}: {info}")
            result.user_options = server.get("user_options") or {}
            base = hub_url + server["url"].lstrip("/")
            result.server_url = base
            result.steps.append(step)
            # 7. @jupyterlab/services: kernelspecs, a kernel, its websocket, one cell
            step = "kernelspecs"
            r = await client.get(base + "api/kernelspecs", headers=_auth(token))
            if r.status_code != 200:
                raise ReplayError(f"GET api/kernelspecs: {r.status_code} {r.text[:300]}")
            specs = r.json()
            result.kernelspecs = sorted(specs["kernelspecs"])
            result.steps.append(step)
            step = "create kernel"
            r = await client.post(
                base + "api/kernels", headers=_auth(token), json={"name": specs["default"]}
            )
            if r.status_code != 201:
                raise ReplayError(f"POST api/kernels: {r.status_code} {r.text[:300]}")
            kernel_id = r.json()["id"]
            result.steps.append(step)
            try:
                step = "run cell"
                out = await run_cell(base, kernel_id, token, code, token_in=token_in)
                result.stdout = out
                if code == GPU_ENV_CELL:
                    # the last line: gpulab may print a notice first on a restarted server
                    # ("gpulab: Restore 2 variables ... run %gpulab_restore")
                    result.env = json.loads(out.strip().splitlines()[-1])
                result.steps.append(step)
            finally:
                await client.delete(base + f"api/kernels/{kernel_id}", headers=_auth(token))
            if stop:
                step = "stop"
                await stop_server(hub_url, username, token, server_name, client=client)
                result.steps.append(step)
            result.ok = True
        except (ReplayError, httpx.HTTPError, OSError, ValueError, KeyError, IndexError) as e:
            result.failed_step = step
            result.error = f"{type(e).__name__}: {e}"
    result.seconds = time.monotonic() - started
    return result


async def run_cell(
    base: str, kernel_id: str, token: str, code: str, *, token_in: str = "url", timeout: float = 60
) -> str:
    """Open the kernel's websocket as `@jupyterlab/services` does from Node's `ws` (no
    Sec-Fetch-Mode; the token in the URL with `appendToken`, or in the header), run `code`,
    return its stdout."""
    session_id = uuid.uuid4().hex
    ws_url = base.replace("http", "ws", 1) + f"api/kernels/{kernel_id}/channels"
    ws_url += f"?session_id={session_id}"
    headers: dict[str, str] = {}
    if token_in == "url":
        ws_url += f"&token={quote(token, safe='')}"
    else:
        headers = _auth(token)
    ws = await websocket_connect(HTTPRequest(ws_url, headers=headers, connect_timeout=timeout))
    try:
        return await execute(ws, code, session=session_id, timeout=timeout)
    except KernelCellError as e:
        raise ReplayError(str(e)) from None
    finally:
        ws.close()


async def stop_server(
    hub_url: str,
    username: str,
    token: str,
    server_name: str = "",
    *,
    client: httpx.AsyncClient | None = None,
    timeout: float = 60,
) -> None:
    """Stop the server with the same token (`DELETE`), and wait until the hub lists it as
    stopped."""
    hub_url = hub_url.rstrip("/") + "/"
    own = client is None
    client = client or httpx.AsyncClient(timeout=30)
    try:
        path = (
            f"hub/api/users/{username}/servers/{quote(server_name, safe='')}"
            if server_name
            else f"hub/api/users/{username}/server"
        )
        r = await client.delete(hub_url + path, headers=_auth(token))
        if r.status_code not in (202, 204):
            raise ReplayError(f"DELETE {path}: {r.status_code} {r.text[:300]}")
        deadline = time.monotonic() + timeout
        while server_name in (
            (await _user_info(client, hub_url, username, token, False)).get("servers") or {}
        ):
            if time.monotonic() > deadline:
                raise ReplayError(f"server {server_name!r} did not stop in {timeout} s")
            await asyncio.sleep(0.3)
    finally:
        if own:
            await client.aclose()


def make_ide_token(hub: Any, username: str) -> str:
    """A token of `username` with exactly the scopes and note of the one /hub/gpulab/ide makes
    (through the REST API with the harness's service token, for tests that need no browser)."""
    from gpulab.hub.handlers.ide import IDE_TOKEN_NOTE, IDE_TOKEN_SCOPES

    r = hub.api(
        "POST",
        f"/users/{username}/tokens",
        json={"note": IDE_TOKEN_NOTE, "scopes": list(IDE_TOKEN_SCOPES), "expires_in": 3600},
    )
    assert r.status_code == 201, r.text
    return str(r.json()["token"])
