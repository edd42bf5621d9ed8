"""In a real browser: the workspaces page restores a snapshot and clones it into a new server,
and the picker of that server offers its snapshots."""

from __future__ import annotations

import os
from pathlib import Path

from tests.harness.browser import log_in_as_admin

ARTIFACTS = Path(os.environ.get("GPULAB_TEST_ARTIFACTS", Path(__file__).parent / "artifacts"))


def test_person_restores_and_clones_a_workspace_from_the_workspaces_page(make_hub, page, tmp_path):
    hub = make_hub()
    hub.start_server("admin")
    (hub.home("admin") / "thesis.tex").write_text("chapter 1\n")
    hub.stop_server("admin")
    (hub.home("admin") / "thesis.tex").unlink()
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    log_in_as_admin(page, hub)

    page.goto(f"{hub.url}/hub/gpulab/workspaces")
    row = page.locator("tr.gpulab-snapshot").first
    assert "on-stop" in row.inner_text()
    row.locator("button.gpulab-restore").click()
    page.wait_for_selector(".gpulab-done")
    assert "Restored default server" in page.locator(".gpulab-done").inner_text()
    assert (hub.home("admin") / "thesis.tex").read_text() == "chapter 1\n"

    row = page.locator("tr.gpulab-snapshot", has_text="on-stop").first
    row.locator("input.gpulab-clone-name").fill("thesis-v2")
    row.locator("button.gpulab-clone").click()
    page.wait_for_selector(".gpulab-done")
    assert "into new server 'thesis-v2'" in page.locator(".gpulab-done").inner_text()
    assert page.locator("section[data-server=thesis-v2]").count() == 1
    page.screenshot(path=str(ARTIFACTS / "workspaces.png"), full_page=True)

    page.goto(f"{hub.url}/hub/spawn/admin")
    fieldset = page.locator("fieldset.gpulab-workspace")
    options = fieldset.locator("select[name=restore_snapshot] option").all_inner_texts()
    assert options[0] == "As you left them" and any("on-stop" in o for o in options[1:])
    page.screenshot(path=str(ARTIFACTS / "picker-workspace.png"), full_page=True)
    assert (hub.home("admin", "thesis-v2") / "thesis.tex").read_text() == "chapter 1\n"
