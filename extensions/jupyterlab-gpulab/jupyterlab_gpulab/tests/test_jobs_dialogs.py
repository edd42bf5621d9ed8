"""In a real browser through a real hub: the jobs panel's badge follows the run's log (it said
"queued" while the log already streamed), and the job and Dask dialogs disable the profiles a
submission would be refused for, with the reason, as the spawn picker does (they listed them as
if they fitted, and the hub refused them only after Submit)."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
from traitlets.config import Config

from tests.harness.browser import log_in_as_admin, run_from_palette
from tests.harness.jobs import put, user_client

JOBS = "[data-testid=gpulab-jobs]"
RUN = f"{JOBS} [data-testid=gpulab-job-run]"
LOG = f"{JOBS} .gpulab-job-log"
#: every option of a dialog's profile list: [slug, disabled, the reason it is refused]
OPTIONS = "os => os.map(o => [o.value, o.disabled, o.dataset.refused || ''])"


def _extension_missing() -> str | None:
    if importlib.util.find_spec("jupyterlab_gpulab") is None:
        return "jupyterlab-gpulab is not installed in this venv (bash .ci/dev setup installs it)"
    return None


pytestmark = pytest.mark.skipif(_extension_missing() is not None, reason=_extension_missing() or "")


def _open_lab(page: Any, hub: Any) -> None:
    log_in_as_admin(page, hub)
    page.check("#profile-cpu")
    page.click("form button[type=submit], form input[type=submit]")
    page.wait_for_url("**/user/admin/lab**", timeout=90_000)


def test_the_runs_badge_says_running_once_its_log_streams(make_hub: Any, page: Any) -> None:
    hub = make_hub(
        Config(
            GPUCapacity={"declared_inventory": "1 x A100-SXM4-80GB"},
            GPUJobs={"admission_interval_seconds": 0.5},
        )
    )
    _open_lab(page, hub)
    put(hub, "admin", "nap.py", "import time\ntime.sleep(600)\n")
    put(hub, "admin", "talk.py", "import time\nprint('started', flush=True)\ntime.sleep(600)\n")
    client = user_client(hub, "admin")
    jobs = "/users/admin/jobs"
    body = {"kind": "script", "profile": "gpu-1"}
    nap = client.post(jobs, json=body | {"name": "nap", "path": "nap.py"})
    assert nap.status_code == 201, nap.text
    talk = client.post(jobs, json=body | {"name": "talk", "path": "talk.py"})
    assert talk.status_code == 201, talk.text
    talk_id = talk.json()["id"]
    try:
        run_from_palette(page, "GPU Jobs")  # opens on the newest run: talk, and its log
        badge = f"{RUN}[data-run='{talk_id}']"
        page.wait_for_selector(f"{badge}[data-state=queued]", timeout=30_000)  # behind nap
        canceled = client.delete(f"{jobs}/{nap.json()['id']}")
        assert canceled.status_code == 200, canceled.text
        # the badge as it is in the first frame whose log shows the run's first line
        shown = page.wait_for_function(
            """([log, badge]) => {
                const text = document.querySelector(log)?.textContent ?? '';
                return text.includes('started')
                    ? document.querySelector(badge)?.dataset.state ?? 'no badge'
                    : false;
            }""",
            arg=[LOG, badge],
            timeout=90_000,
        ).json_value()
        assert shown == "running"
    finally:
        client.delete(f"{jobs}/{talk_id}")


def test_the_job_and_dask_dialogs_disable_the_profiles_a_submission_would_be_refused_for(
    make_hub: Any, page: Any
) -> None:
    hub = make_hub(
        Config(
            GPUCapacity={
                "declared_inventory": "1 x A100-SXM4-80GB",
                "user_quota_gpus": {"admin": "1/2"},
            }
        )
    )
    _open_lab(page, hub)
    put(hub, "admin", "hello.py", "print('hello')\n")
    page.goto(f"{hub.url}/user/admin/lab/tree/hello.py")
    page.wait_for_selector(".jp-FileEditor", timeout=60_000)

    run_from_palette(page, "Submit as GPU Job")
    form = page.locator(".jp-Dialog [data-testid=gpulab-submit-form]")
    form.wait_for(timeout=30_000)
    job = {slug: (off, why) for slug, off, why in form.locator("option").evaluate_all(OPTIONS)}
    assert job["gpu-8"] == (True, "Larger than any machine here")
    off, why = job["gpu-1"]  # within the machine, beyond her whole quota: it could never start
    assert off and why.startswith("gpu-1 needs 1 GPU, more than your whole GPU quota"), why
    assert job["gpu-quarter"] == (False, "")
    picked = form.locator("select").input_value()
    assert not job[picked][0]  # the dialog opens on a profile it may submit
    page.keyboard.press("Escape")
    form.wait_for(state="detached", timeout=30_000)

    run_from_palette(page, "New GPU Cluster")
    form = page.locator(".jp-Dialog [data-testid=gpulab-dask-form]")
    form.wait_for(timeout=30_000)
    dask = {slug: (off, why) for slug, off, why in form.locator("option").evaluate_all(OPTIONS)}
    assert dask["gpu-8"] == (True, "Larger than any machine here")
    off, why = dask["gpu-1"]  # a worker beyond the quota she has left
    assert off and why.startswith("Needs 1 GPU; your GPU quota has"), why
    assert dask["gpu-quarter"] == (False, "")
    assert not dask[form.locator("select").input_value()][0]
