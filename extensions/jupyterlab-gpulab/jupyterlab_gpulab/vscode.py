"""VS Code in the browser: code-server behind jupyter-server-proxy at <base_url>vscode/.

One code-server per user server, started by jupyter-server-proxy on the first request (the
launcher's "VS Code" entry) as a child of this server: it inherits the server's environment, so
the GPU share's variables (CUDA_VISIBLE_DEVICES, NVIDIA_VISIBLE_DEVICES, GPULAB_*, PYTHONPATH
with the caps hook) reach its terminals and its extension host.

Security: the route is jupyter-server-proxy's, behind this server's own authentication (the
hub's OAuth: the owner's login cookie or a token with access to this server), so only the
server's owner reaches it and code-server itself runs with `--auth none`. code-server listens on
a unix socket in a directory jupyter-server-proxy creates for it (0700), never on a TCP port that
other accounts of the same machine could reach.

Activity: an open workbench talks all the time (VS Code's protocol sends a keep-alive every few
seconds, acknowledges every message, and jupyter-server-proxy would count every frame and ping
as this server's activity: an open tab would keep a server from being culled, nebari#1902).
So jupyter-server-proxy records nothing for this route (`update_last_activity: False`) and
`count_only_input` makes the route's websocket count only the calls a person's input makes the
workbench send (a key in a terminal, typing or moving the cursor in an editor: INPUT_CALLS),
never its keep-alives, acknowledgements or background calls: those become this server's activity
(jupyter_server's `last_activity_times`, which jupyterhub-singleuser reports to the hub) and
gpulab's "terminal-input" / "ui-input" for the culler (culling.py). The hub's proxy gives the
route a proxy route of its own whose traffic the hub does not count (gpulab.hub.proxy).

Which code-server: GPULAB_CODE_SERVER names the executable; otherwise the one `bash .ci/dev
setup` links into this environment's bin/, otherwise `code-server` on PATH. With none, there is
no launcher entry and one log line says why.
"""

from __future__ import annotations

import logging
import os
import shutil
import struct
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from jupyter_server.utils import url_path_join

from gpulab.spawner import names

log = logging.getLogger(__name__)

#: the environment variable naming the code-server executable
CODE_SERVER_ENV = names.CODE_SERVER_ENV
#: the route's name below the server's base URL (jupyter-server-proxy's entry point name)
NAME = "vscode"
#: code-server answers within seconds; a loaded machine may take longer
START_TIMEOUT_SECONDS = 60
#: the key in jupyter_server's `last_activity_times` (the server's last activity is the latest)
ACTIVITY_KEY = "gpulab-vscode"

# VS Code's PersistentProtocol (src/vs/base/parts/ipc/common/ipc.net.ts): each message is a
# 13-byte header (type u8, id u32, ack u32, size u32, big-endian) and `size` bytes of data; the
# browser may batch several messages into one websocket message.
_HEADER = struct.Struct(">BIII")
#: ProtocolMessageType.Regular: the workbench's calls (the others: keep-alives, acks, control)
_REGULAR = 1


def _call(name: str, channel: str = "") -> bytes:
    """A call as it appears in a message: the length-prefixed channel and method names (VS Code's
    IPC for channels, its RPC protocol for the extension host)."""
    method = bytes([len(name)]) + name.encode()
    return bytes([len(channel)]) + channel.encode() + b"\x01" + method if channel else method


#: what a person's input makes the workbench send, by gpulab's input kind. Measured on code-server
#: 4.100.3: an open, untouched workbench sends every second or two only `$onFileEvent` (file
#: watcher events for the extension host; its own lock file changes every second) and the
#: `telemetry` channel's `ping`, besides keep-alives; none of those is here.
INPUT_CALLS: dict[str, tuple[bytes, ...]] = {
    # each key typed into a terminal; the extension host hears of the interaction
    "terminal-input": (_call("$input", "remoteterminal"), _call("$acceptTerminalInteraction")),
    # typing in an editor (the document changed), moving its cursor or selection (keys, clicks)
    "ui-input": (_call("$acceptModelChanged"), _call("$acceptEditorPropertiesChanged")),
}


def find_code_server(env: dict[str, str] | None = None) -> tuple[str | None, str]:
    """The code-server executable and where it came from, or (None, why there is none)."""
    env = dict(os.environ) if env is None else env
    named = env.get(CODE_SERVER_ENV, "")
    if named:
        found = shutil.which(named)
        if found:
            return found, f"${CODE_SERVER_ENV}"
        return None, f"${CODE_SERVER_ENV}={named[:200]!r} is not an executable"
    beside = Path(sys.prefix) / "bin" / "code-server"
    if os.access(beside, os.X_OK):
        return str(beside), "this environment's bin/"
    found = shutil.which("code-server", path=env.get("PATH"))
    if found:
        return found, "PATH"
    return None, (
        f"no code-server in {beside.parent} or on PATH, and ${CODE_SERVER_ENV} is not set "
        "(bash .ci/dev setup installs one)"
    )


def user_data_dir(home: str | None = None) -> str:
    """code-server's settings, state and extensions of the owner, kept in her home."""
    return os.path.join(home or os.path.expanduser("~"), ".local", "share", "gpulab-code-server")


def command(executable: str, home: str | None = None) -> list[str]:
    data = user_data_dir(home)
    return [
        executable,
        "--auth",
        "none",  # this server's own authentication stands in front (see the module's docstring)
        "--socket",
        "{unix_socket}",
        "--disable-telemetry",
        "--disable-update-check",
        "--disable-workspace-trust",
        "--disable-getting-started-override",
        "--disable-proxy",  # ports go through jupyter-server-proxy's /proxy/<port>/, behind auth
        "--config",
        os.path.join(data, "config.yaml"),  # not ~/.config/code-server with a password in it
        "--user-data-dir",
        data,
        "--extensions-dir",
        os.path.join(data, "extensions"),
        home or os.path.expanduser("~"),
    ]


def server_process() -> dict[str, Any]:
    """jupyter-server-proxy's entry (`jupyter_serverproxy_servers` in pyproject.toml); raises when
    there is no code-server, and jupyter-server-proxy then leaves the route and launcher out."""
    executable, source = find_code_server()
    if executable is None:
        log.warning("jupyterlab_gpulab: VS Code in the browser is off: %s", source)
        raise RuntimeError(f"VS Code in the browser is off: {source}")
    log.info("jupyterlab_gpulab: VS Code in the browser with %s (from %s)", executable, source)
    return {
        "command": command(executable),
        "unix_socket": True,
        "timeout": START_TIMEOUT_SECONDS,
        "new_browser_tab": True,
        # only real input counts, and not through jupyter-server-proxy (count_only_input)
        "update_last_activity": False,
        "launcher_entry": {
            "enabled": True,
            "title": "VS Code",
            "icon_path": str(Path(__file__).parent / "icons" / "vscode.svg"),
        },
    }


def input_kind(message: str | bytes) -> str | None:
    """The kind of input a websocket message from the workbench carries ("terminal-input",
    "ui-input"), or None: keep-alives, acknowledgements, control messages and the workbench's
    own background calls are no input."""
    if isinstance(message, str):
        return None  # the protocol is binary; a text message is no workbench call
    offset, found = 0, None
    while offset + _HEADER.size <= len(message):
        kind, _id, _ack, size = _HEADER.unpack_from(message, offset)
        start = offset + _HEADER.size
        if kind == _REGULAR:
            data = message[start : start + size]
            for input_kind_, calls in INPUT_CALLS.items():
                if any(call in data for call in calls):
                    if input_kind_ == "terminal-input":
                        return input_kind_
                    found = input_kind_
        offset = start + size
    return found


def count_only_input(web_app: Any) -> bool:
    """Make the vscode route's websocket count as activity only the messages that carry input.

    jupyter-server-proxy (loaded before this extension: extensions load in name order) made one
    handler class for the route; it is replaced by a subclass whose `on_message` also records
    this server's activity and gpulab's input for the messages `input_kind` names.
    False when the route is not there (no code-server)."""
    # jupyter-server-proxy's route: <base_url>vscode/(.*) (its make_handlers)
    path = url_path_join(web_app.settings.get("base_url", "/"), NAME, "(.*)")
    for rule in _rules(web_app):
        target = rule.target
        regex = getattr(rule.matcher, "regex", None)
        if not isinstance(target, type) or regex is None or regex.pattern.rstrip("$") != path:
            continue
        if getattr(target, "_gpulab_input_only", False):
            return True
        rule.target = _input_counting(target)
        return True
    return False


def _rules(web_app: Any) -> list[Any]:
    """tornado's routing rules, the nested ones of `add_handlers(host, ...)` included."""
    rules: list[Any] = []
    pending = [*web_app.default_router.rules, *web_app.wildcard_router.rules]
    while pending:
        rule = pending.pop()
        nested = getattr(rule.target, "rules", None)
        if nested is not None:
            pending.extend(nested)
        else:
            rules.append(rule)
    return rules


def _input_counting(base: type) -> type:
    class InputCountingProxy(base):  # type: ignore[misc, valid-type]
        _gpulab_input_only = True

        def on_message(self, message: str | bytes) -> Any:
            kind = input_kind(message)
            if kind is not None:
                record_input(self.settings, kind)
            return super().on_message(message)

    InputCountingProxy.__name__ = f"InputCounting{base.__name__}"
    return InputCountingProxy


def record_input(settings: dict[str, Any], kind: str) -> None:
    """A person's input in the workbench: this server's activity, and gpulab's input of `kind`
    for the culler."""
    times = settings.setdefault("last_activity_times", {})
    times[ACTIVITY_KEY] = datetime.now(timezone.utc)
    reporter = settings.get("gpulab_culling")
    if reporter is not None:
        reporter.record_input(kind)
