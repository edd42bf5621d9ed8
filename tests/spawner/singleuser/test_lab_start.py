"""A gpulab server's JupyterLab starts without running yarn (`lab_start`): a `node` on the
server's PATH that records every call sees none from the start, the lab page or the extension
manager, and users' own `node` still runs."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import httpx

from gpulab.spawner.singleuser.lab_start import CONFIG_DIR, with_config_dir
from tests.harness.hub import BIN, passable_dir, run_in_kernel

REAL_NODE = "/usr/bin/node"


def recording_node(folder: Path) -> tuple[Path, Path]:
    """A directory holding a `node` that appends its arguments to a log anyone may write (the
    servers run as their users' accounts), then runs the real one; the directory and the log."""
    bin_dir = passable_dir(folder / "bin")
    log = bin_dir / "node-calls.log"
    log.touch()
    os.chmod(log, 0o666)  # test-only: the users' servers append; nothing secret is written
    node = bin_dir / "node"
    node.write_text(f'#!/bin/sh\necho "$*" >> {log}\nexec {REAL_NODE} "$@"\n')
    os.chmod(node, 0o755)
    return bin_dir, log


def yarn_calls(log: Path) -> list[str]:
    return [line for line in log.read_text().splitlines() if "yarn.js" in line]


def test_the_config_directory_goes_first_and_keeps_the_ones_named_before() -> None:
    env = with_config_dir({"JUPYTER_CONFIG_PATH": f"/etc/site{os.pathsep}/opt/more"})
    assert env["JUPYTER_CONFIG_PATH"].split(os.pathsep) == [
        str(CONFIG_DIR),
        "/etc/site",
        "/opt/more",
    ]
    assert with_config_dir(env) == env  # once only
    assert with_config_dir({})["JUPYTER_CONFIG_PATH"] == str(CONFIG_DIR)
    assert (CONFIG_DIR / "jupyter_server_config.py").is_file()


def test_a_pinned_registry_is_the_one_the_environment_names_and_yarn_never_runs(
    tmp_path: Path,
) -> None:
    bin_dir, log = recording_node(tmp_path)
    code = (
        "from gpulab.spawner.singleuser.lab_start import pin_npm_registry; pin_npm_registry(); "
        "import jupyterlab.labapp; from jupyterlab.commands import AppOptions; "
        "print(AppOptions().registry, AppOptions(registry='https://given.example').registry)"
    )
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    env["npm_config_registry"] = "https://npm.mirror.example/"
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.split() == ["https://npm.mirror.example/", "https://given.example"]
    assert yarn_calls(log) == []


async def test_a_server_start_the_lab_page_and_the_extension_manager_run_no_yarn(
    make_hub, tmp_path: Path
) -> None:
    bin_dir, log = recording_node(tmp_path)
    hub = make_hub(env={"PATH": os.pathsep.join([str(bin_dir), str(BIN), os.environ["PATH"]])})
    hub.create_user("alice")
    hub.start_server("alice")
    base = f"{hub.url}/user/alice/"
    headers = {"Authorization": f"token {hub.token}"}
    async with httpx.AsyncClient(headers=headers, timeout=60) as client:
        page = await client.get(f"{base}lab")
        assert page.status_code == 200, page.text[:2000]
        found = re.search(r'id="jupyter-config-data"[^>]*>(.*?)</script>', page.text, re.S)
        assert found, page.text[:2000]
        config = json.loads(found.group(1))
        assert config["extensionManager"]["name"] == "PyPI"  # the stock manager, not a fallback
        listing = await client.get(f"{base}lab/api/extensions")
        assert listing.status_code == 200, listing.text[:2000]
        names = {e["name"] for e in listing.json()}
        assert "jupyterlab-gpulab" in names, names
    assert yarn_calls(log) == [], log.read_text()
    # her own node is the one on PATH and still runs (so the log would have caught yarn)
    out = await run_in_kernel(
        hub,
        "alice",
        "import subprocess; print(subprocess.run(['node', '-e', 'process.stdout.write(`${6*7}`)'],"
        " capture_output=True, text=True).stdout)",
    )
    assert out.strip() == "42"
    assert "process.stdout.write" in log.read_text()
