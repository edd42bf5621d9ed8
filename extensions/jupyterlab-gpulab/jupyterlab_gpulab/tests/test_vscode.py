"""VS Code in the browser, without a server: which code-server, its command line, and which of the
workbench's websocket messages are a person's input (vscode.py)."""

from __future__ import annotations

import os
import struct
from pathlib import Path

import pytest

from jupyterlab_gpulab import vscode
from jupyterlab_gpulab.vscode import CODE_SERVER_ENV, find_code_server, input_kind


def _message(data: bytes, kind: int = 1) -> bytes:
    """One PersistentProtocol message: type, id, ack, size, then the data."""
    return struct.pack(">BIII", kind, 7, 3, len(data)) + data


# recorded from code-server 4.100.3 (an untouched workbench, then a terminal typed into)
KEEP_ALIVE = _message(b"", kind=9)
TELEMETRY_PING = _message(b"\x04\x04\x06d\x06\x88\x04\x01\ttelemetry\x01\x04ping\x00")
FILE_EVENT = _message(
    b"\x01\x00\x00\x00FX\x0c$onFileEvent\x00\x00\x00\xc8"
    b'[{"created":[],"changed":[{"$mid":1,"path":"/home/a/x.lock"}],"deleted":[]}]'
)
TERMINAL_KEY = _message(b"\x04\x04\x06d\x06\xc6\x04\x01\x0eremoteterminal\x01\x06$input\x04\x02e")
TERMINAL_INTERACTION = _message(
    b"\x01\x00\x00\x00oa\x1a$acceptTerminalInteraction\x00\x00\x00\x03[1]"
)
EDIT = _message(b"\x01\x00\x00\x01\x00a\x13$acceptModelChanged\x00\x00\x00\x02[]")
ACK = _message(b"", kind=3)


@pytest.mark.parametrize(
    "message", [KEEP_ALIVE, ACK, TELEMETRY_PING, FILE_EVENT, "a text message", b"", b"\x01\x00"]
)
def test_an_untouched_workbench_sends_no_input(message: bytes | str) -> None:
    assert input_kind(message) is None


def test_terminal_keys_and_editing_are_input_of_their_kind() -> None:
    assert input_kind(TERMINAL_KEY) == "terminal-input"
    assert input_kind(TERMINAL_INTERACTION) == "terminal-input"
    assert input_kind(EDIT) == "ui-input"


def test_input_is_found_among_batched_messages() -> None:
    assert input_kind(FILE_EVENT + KEEP_ALIVE + EDIT) == "ui-input"
    assert input_kind(EDIT + TERMINAL_KEY) == "terminal-input"
    assert input_kind(FILE_EVENT + TELEMETRY_PING + KEEP_ALIVE) is None


def test_a_call_name_only_counts_inside_a_regular_message() -> None:
    # a control message (type 2) carrying the same bytes is no call of the workbench
    assert input_kind(_message(TERMINAL_KEY[13:], kind=2)) is None


def _executable(path: Path) -> Path:
    path.write_text("#!/bin/sh\n")
    path.chmod(0o755)
    return path


def test_the_named_code_server_wins(tmp_path: Path) -> None:
    named = _executable(tmp_path / "my-code-server")
    assert find_code_server({CODE_SERVER_ENV: str(named), "PATH": ""}) == (
        str(named),
        f"${CODE_SERVER_ENV}",
    )
    missing, why = find_code_server({CODE_SERVER_ENV: str(tmp_path / "nope"), "PATH": ""})
    assert missing is None and "is not an executable" in why


def test_without_code_server_there_is_no_route_and_the_log_says_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(vscode.sys, "prefix", str(tmp_path))  # no bin/code-server beside it
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv(CODE_SERVER_ENV, raising=False)
    with pytest.raises(RuntimeError, match="no code-server in"):
        vscode.server_process()
    assert "VS Code in the browser is off: no code-server in" in caplog.text


def test_code_server_listens_on_the_proxys_socket_without_auth_or_telemetry(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _executable(tmp_path / "code-server")
    monkeypatch.setenv(CODE_SERVER_ENV, str(tmp_path / "code-server"))
    monkeypatch.setenv("HOME", str(tmp_path))
    process = vscode.server_process()
    cmd = process["command"]
    assert cmd[cmd.index("--socket") + 1] == "{unix_socket}" and process["unix_socket"] is True
    assert "--bind-addr" not in cmd  # never a TCP port other accounts could reach
    assert cmd[cmd.index("--auth") + 1] == "none"
    assert {"--disable-telemetry", "--disable-update-check", "--disable-proxy"} <= set(cmd)
    assert cmd[cmd.index("--user-data-dir") + 1].startswith(str(tmp_path) + os.sep)
    assert cmd[-1] == str(tmp_path)  # opens the home
    assert process["update_last_activity"] is False
    assert process["launcher_entry"]["title"] == "VS Code"
    assert Path(process["launcher_entry"]["icon_path"]).is_file()
