"""gpulab.hub.refusals in-process: shortened echoes, refusals JupyterHub's pages can show, and
one-line log records for expected 4xx refusals."""

from __future__ import annotations

import logging
import sys

from tornado import web

from gpulab.hub.refusals import (
    MAX_SHOWN_CHARS,
    QuietRefusals,
    install_quiet_refusals,
    refusal,
    shown,
)


def test_shown_keeps_short_values_and_cuts_long_ones():
    assert shown("gpu-1") == "'gpu-1'"
    assert shown(5) == "5"
    long = shown("x" * 10_000)
    assert long == "'" + "x" * (MAX_SHOWN_CHARS - 1) + "…"
    assert len(long) == MAX_SHOWN_CHARS + 1


def test_a_refusal_carries_its_message_for_jupyterhubs_pages():
    error = refusal(409, "1/4 GPU: none free; 100% used")
    assert error.status_code == 409
    assert error.get_message() == "1/4 GPU: none free; 100% used"
    assert error.jupyterhub_message == "1/4 GPU: none free; 100% used"  # type: ignore[attr-defined]


def _record(exc: BaseException) -> logging.LogRecord:
    try:
        raise exc
    except BaseException:
        return logging.LogRecord(
            "JupyterHub",
            logging.ERROR,
            __file__,
            1,
            "Exception applying user_options for %s",
            ("alice/",),
            sys.exc_info(),
        )


def test_expected_refusals_lose_their_traceback_and_server_errors_keep_it():
    quiet = QuietRefusals()
    refused = _record(web.HTTPError(400, "Unknown profile 'gpu-17'"))
    assert quiet.filter(refused)
    assert refused.exc_info is None
    assert refused.getMessage() == (
        "Exception applying user_options for alice/: HTTP 400: Bad Request (Unknown profile 'gpu-17')"
    )
    failed = _record(web.HTTPError(500, "database locked"))
    assert quiet.filter(failed) and failed.exc_info is not None
    crashed = _record(RuntimeError("bug"))
    assert quiet.filter(crashed) and crashed.exc_info is not None


def test_the_filter_is_installed_once():
    log = logging.getLogger("gpulab-test-refusals")
    install_quiet_refusals(log)
    install_quiet_refusals(log)
    assert sum(isinstance(f, QuietRefusals) for f in log.filters) == 1
