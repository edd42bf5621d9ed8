"""One cell over a kernel's websocket (Jupyter's JSON protocol), for the harness's clients."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any


class KernelCellError(AssertionError):
    """The cell raised, the kernel went away, or no idle status came in time."""


async def execute(
    ws: Any, code: str, *, session: str, username: str = "", timeout: float = 60
) -> str:
    """Send `code` as an execute_request on an open kernel websocket `ws` and return its stdout
    once the kernel reports idle for it."""
    msg_id = uuid.uuid4().hex
    ws.write_message(
        json.dumps(
            {
                "header": {
                    "msg_id": msg_id,
                    "msg_type": "execute_request",
                    "username": username,
                    "session": session,
                    "version": "5.3",
                },
                "parent_header": {},
                "metadata": {},
                "content": {
                    "code": code,
                    "silent": False,
                    "store_history": True,
                    "user_expressions": {},
                    "allow_stdin": False,
                    "stop_on_error": True,
                },
                "channel": "shell",
                "buffers": [],
            }
        )
    )
    out: list[str] = []
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise KernelCellError(f"no idle status after {timeout} s")
        raw = await asyncio.wait_for(ws.read_message(), left)
        if raw is None:
            raise KernelCellError("kernel websocket closed")
        msg = json.loads(raw)
        if msg.get("parent_header", {}).get("msg_id") != msg_id:
            continue
        if msg["msg_type"] == "stream":
            out.append(msg["content"]["text"])
        elif msg["msg_type"] == "error":
            raise KernelCellError("kernel error: " + "\n".join(msg["content"]["traceback"]))
        elif msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            return "".join(out)
