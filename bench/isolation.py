"""Tenant isolation, counted: the cross-user attack catalogue (tests/isolation.py) against a real
embedded-default hub with per-user accounts, as a table of attempts by category.

    .venv/bin/python -m bench.isolation      (as root)

Last line: attempts=<n> leaks=<n> server_errors=<n> (the goal: leaks 0, server_errors 0).
"""

from __future__ import annotations

import asyncio
import os
import tempfile
from pathlib import Path

from tests.hubtools import Hub
from tests.isolation import local_attack_suite, table


async def run() -> int:
    with tempfile.TemporaryDirectory(prefix="gpulab-bench-isolation-") as tmp:
        hub = Hub(Path(tmp) / "hub")
        try:
            hub.start()
            attempts = await local_attack_suite(hub)
        finally:
            hub.close()
            hub.cleanup()
    print(table(attempts))
    leaks = sum(a.outcome == "leak" for a in attempts)
    errors = sum(a.outcome == "server_error" for a in attempts)
    print(f"attempts={len(attempts)} leaks={leaks} server_errors={errors}")
    return 0


def main() -> int:
    if os.geteuid() != 0:
        print("bench.isolation: per-user accounts need a hub running as root")
        return 2
    return asyncio.run(run())


if __name__ == "__main__":
    raise SystemExit(main())
