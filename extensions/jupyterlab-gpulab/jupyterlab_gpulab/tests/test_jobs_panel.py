"""In a real browser through a real hub: the open notebook submitted as a GPU job from
jupyter-scheduler's "Create job" form (gpulab's backend), then gpulab's jobs panel: the run queued
or running, its log live, its outputs, its TensorBoard through the hub (no token in the URL), and
a notification when it ends; then the open script submitted with "Submit as GPU Job…"."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

import nbformat
import pytest
from traitlets.config import Config

from tests.harness.browser import log_in_as_admin, run_from_palette
from tests.harness.jobs import put

ARTIFACTS = Path(os.environ.get("GPULAB_TEST_ARTIFACTS", Path(__file__).parent / "artifacts"))
JOBS = "[data-testid=gpulab-jobs]"
RUN = f"{JOBS} [data-testid=gpulab-job-run]"
LOG = f"{JOBS} .gpulab-job-log"


def _extension_installed() -> str | None:
    if importlib.util.find_spec("jupyterlab_gpulab") is None:
        return "jupyterlab-gpulab is not installed in this venv (bash .ci/dev setup installs it)"
    return None


def _training_notebook() -> str:
    """Prints a step a second (so the log is seen while the run lasts), writes TensorBoard scalars
    and a file into the run's output directory."""
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell(
            "import os, time\n"
            "from tensorboard.summary.writer.event_file_writer import EventFileWriter\n"
            "from tensorboard.compat.proto.event_pb2 import Event\n"
            "from tensorboard.compat.proto.summary_pb2 import Summary\n"
            "out = os.environ['GPULAB_OUTPUT_DIR']\n"
            "writer = EventFileWriter(os.path.join(out, 'tb'))\n"
            "for step in range(1, 9):\n"
            "    loss = 1.0 / step\n"
            "    summary = Summary(value=[Summary.Value(tag='loss', simple_value=loss)])\n"
            "    writer.add_event(Event(wall_time=time.time(), step=step, summary=summary))\n"
            "    print('step', step, 'loss', loss, flush=True)\n"
            "    time.sleep(1)\n"
            "writer.close()\n"
            "open(os.path.join(out, 'model.txt'), 'w').write('weights')\n"
        )
    ]
    nb.metadata["kernelspec"] = {
        "name": "python3",
        "display_name": "Python 3",
        "language": "python",
    }
    return str(nbformat.writes(nb))


def _open_create_job_form(page: Any, notebook: str) -> Any:
    """The notebook toolbar's "Create a job" form, its input file filled in. jupyter-scheduler's
    command reads the notebook tracker's current widget, not the notebook whose toolbar holds the
    button: clicked before a freshly opened notebook becomes current (which a loaded machine
    delays), the form opens with no input file, and gpulab refuses it (`input_uri: a job runs a
    file in your home folder, not ''`). A person would see the empty field; so does this: it
    cancels that form, brings the notebook's tab forward and asks again."""
    form = page.locator(".jp-create-job-form")
    filled = (
        "name => [...document.querySelectorAll('.jp-create-job-form input')]"
        ".some(i => i.value.endsWith(name))"
    )
    for _ in range(6):
        page.locator(".jp-Toolbar-item[data-jp-item-name=create-job] button").click()
        form.wait_for(timeout=30_000)
        if page.evaluate(filled, notebook):
            return form
        form.get_by_role("button", name="Cancel").click()
        form.wait_for(state="detached", timeout=30_000)
        page.locator(".lm-TabBar-tab", has_text=notebook).first.click()  # her notebook, current
        page.locator(".jp-Notebook").first.click()
        page.wait_for_timeout(2_000)
    raise AssertionError(f"the create-job form never named {notebook} as its input file")


@pytest.mark.skipif(_extension_installed() is not None, reason=_extension_installed() or "")
def test_a_notebook_submitted_from_the_lab_runs_as_a_gpu_job_with_live_log_outputs_and_tensorboard(
    make_hub: Any, page: Any
) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    hub = make_hub(
        Config(
            GPUCapacity={"declared_inventory": "2 x A100-SXM4-80GB"},
            GPUJobs={"admission_interval_seconds": 0.5},
        )
    )
    log_in_as_admin(page, hub)
    page.check("#profile-cpu")
    page.click("form button[type=submit], form input[type=submit]")
    page.wait_for_url("**/user/admin/lab**", timeout=90_000)
    put(hub, "admin", "train.ipynb", _training_notebook())
    put(hub, "admin", "hello.py", "import sys\nprint('hello from a script', sys.argv[1:])\n")
    try:
        page.goto(f"{hub.url}/user/admin/lab/tree/train.ipynb")
        page.wait_for_selector(".jp-Notebook", timeout=60_000)
        # jupyter-scheduler's own form: the gpulab environment, a GPU profile as compute type
        form = _open_create_job_form(page, "train.ipynb")
        # the environments load after the form: then the compute type is a GPU profile
        page.wait_for_function(
            "sel => document.querySelector(sel)?.innerText.includes('gpu-')",
            arg=".jp-create-job-form",
            timeout=30_000,
        )
        form.get_by_role("button", name="Create").click()
        # on to its job list once created, or an error shown in the form (MUI's role=alert); the
        # submission stages the notebook and asks the hub, which a loaded CI machine makes slow
        page.wait_for_function(
            "sel => !document.querySelector(sel) || document.querySelector(`${sel} [role=alert]`)",
            arg=".jp-create-job-form",
            timeout=120_000,
        )
        assert form.count() == 0, f"the form stayed, saying: {form.inner_text()}"

        # gpulab's panel, from the palette
        run_from_palette(page, "GPU Jobs")
        run = page.locator(RUN).first
        run.wait_for(timeout=30_000)
        assert run.get_attribute("data-state") in ("queued", "admitted", "running")
        assert "gpu-" in run.inner_text()
        # the log arrives while the run still runs
        page.wait_for_function(
            "sel => document.querySelector(sel)?.textContent.includes('step 2')",
            arg=LOG,
            timeout=60_000,
        )
        # ... in pieces as it is written, not at the end in one go
        assert "step 8" not in page.locator(LOG).inner_text()
        page.wait_for_selector(f"{RUN}[data-state=succeeded]", timeout=90_000)
        # a notification says it ended, with a way back to it
        toast = page.locator(".Toastify__toast", has_text="succeeded").first
        toast.wait_for(timeout=30_000)
        assert "GPU job train #" in toast.inner_text()
        assert "step 8 loss 0.125" in page.locator(LOG).inner_text()
        outputs = page.locator(f"{JOBS} [data-testid=gpulab-job-outputs]")
        page.wait_for_function(
            "sel => document.querySelector(sel)?.textContent.includes('model.txt')",
            arg=f"{JOBS} [data-testid=gpulab-job-outputs]",
            timeout=30_000,
        )
        assert "train.ipynb" in outputs.inner_text()

        # TensorBoard of this run, one click, through the hub's proxy with the login cookie only
        with page.context.expect_page() as opened:
            page.locator(f"{JOBS} [data-testid=gpulab-job-tensorboard]").click()
        board = opened.value
        board.wait_for_load_state()
        assert board.url.startswith(f"{hub.url}/user/admin/tensorboard/")
        assert "token" not in board.url
        board.get_by_text("run-1/tb").first.wait_for(timeout=120_000)
        board.get_by_text("loss").first.wait_for(timeout=60_000)
        board.close()

        # a script, from the editor: "Submit as GPU Job…" with a profile and arguments
        page.goto(f"{hub.url}/user/admin/lab/tree/hello.py")
        page.wait_for_selector(".jp-FileEditor", timeout=60_000)
        run_from_palette(page, "Submit as GPU Job")
        dialog = page.locator(".jp-Dialog [data-testid=gpulab-submit-form]")
        dialog.wait_for(timeout=30_000)
        assert dialog.locator("select").input_value().startswith("gpu-")
        dialog.locator("[data-testid=gpulab-submit-args]").fill("--epochs 3")
        page.locator(".jp-Dialog .jp-mod-accept").click()
        page.wait_for_selector(f"{RUN}[data-run='2'][data-state=succeeded]", timeout=90_000)
        page.wait_for_function(
            "sel => document.querySelector(sel)?.textContent.includes('hello from a script')",
            arg=LOG,
            timeout=30_000,
        )
        assert "['--epochs', '3']" in page.locator(LOG).inner_text()
    finally:
        page.screenshot(path=str(ARTIFACTS / "jobs-panel.png"))
