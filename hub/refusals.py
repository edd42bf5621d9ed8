"""Bounded input and readable refusals, shared by gpulab's hub handlers and spawners.

A refusal is an HTTP 4xx with one sentence saying what was wrong and what would be right. Anything
a user typed is echoed only shortened (`shown`), request bodies are capped (`MAX_BODY_BYTES`), and
an expected refusal is one log line without a traceback (`QuietRefusals`), so a 10 MB request can
neither come back in the reply nor fill the hub's log.
"""

from __future__ import annotations

import logging
from typing import Any

from tornado import web

#: the largest request body a gpulab endpoint (and the spawn API behind gpulab's handlers) reads;
#: every legitimate body (spawn options, a clone's name, an alert rule) is far smaller
MAX_BODY_BYTES = 64 * 1024
#: how much of a user's value an error message repeats
MAX_SHOWN_CHARS = 80


def shown(value: Any, limit: int = MAX_SHOWN_CHARS) -> str:
    """`repr(value)` cut to `limit` characters plus '…' (the full value is never echoed)."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "…"


def refusal(status: int, message: str) -> web.HTTPError:
    """An HTTPError whose message JupyterHub also shows on its own pages: the spawn form, the
    spawn-pending page and its progress events print `jupyterhub_message` instead of "Spawn
    failed" with the reason left in the log."""
    error = web.HTTPError(status, message)
    error.jupyterhub_message = message  # type: ignore[attr-defined]
    return error


def check_body_size(handler: web.RequestHandler, limit: int = MAX_BODY_BYTES) -> None:
    """413 when the request's body is over `limit` bytes (checked before anything parses it)."""
    declared = handler.request.headers.get("Content-Length", "")
    size = max(len(handler.request.body or b""), int(declared) if declared.isdigit() else 0)
    if size > limit:
        raise refusal(
            413, f"The request body is {size} bytes; gpulab accepts at most {limit} bytes"
        )


def is_expected_refusal(exc: BaseException | None) -> bool:
    """A 4xx HTTPError: the caller's mistake, reported to them, not a fault of the hub."""
    return isinstance(exc, web.HTTPError) and 400 <= exc.status_code < 500


class QuietRefusals(logging.Filter):
    """Drops the traceback from log records about expected 4xx refusals.

    JupyterHub logs a refused spawn with `log.exception` (apply_user_options) and
    `exc_info=True` (the spawn form): a traceback per refusal that says nothing the one-line
    message does not. Records are kept, only their `exc_info` goes; 5xx errors keep theirs.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and is_expected_refusal(record.exc_info[1]):
            exc = record.exc_info[1]
            record.msg = f"{record.getMessage()}: {exc}"
            record.args = None
            record.exc_info = None
            record.exc_text = None
        return True


def install_quiet_refusals(log: logging.Logger) -> None:
    """Add `QuietRefusals` to `log` once (the hub's logger: spawners and handlers log there)."""
    if not any(isinstance(f, QuietRefusals) for f in log.filters):
        log.addFilter(QuietRefusals())
