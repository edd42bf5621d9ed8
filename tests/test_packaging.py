"""What the wheels hold: every package of the product and its data in gpulab's wheel, the dev
cluster only in its own (a hub or a user image installs gpulab's wheel; the dev cluster is a
development tool and must not ship with it)."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _wheel_names(source: Path, out: Path) -> set[str]:
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
        + ["-w", str(out), str(source)],
        check=True,
        capture_output=True,
        cwd=out,
    )
    (wheel,) = out.glob("*.whl")
    with zipfile.ZipFile(wheel) as z:
        return set(z.namelist())


def _packages(folder: str) -> set[str]:
    """`gpulab/<folder>/...` for every folder with an __init__.py under the checkout's `folder`."""
    return {
        str(Path("gpulab") / folder / init.parent.relative_to(REPO / folder))
        for init in (REPO / folder).rglob("__init__.py")
        if "tests" not in init.relative_to(REPO / folder).parts
    }


@pytest.fixture(scope="module")
def gpulab_wheel(tmp_path_factory: pytest.TempPathFactory) -> set[str]:
    return _wheel_names(REPO, tmp_path_factory.mktemp("gpulab-wheel"))


def test_the_wheel_holds_every_package_of_the_hub_and_the_spawners(gpulab_wheel: set[str]) -> None:
    packages = _packages("hub") | _packages("spawner")
    # the user-side Dask package lives in spawner/singleuser/dask/ and ships as gpulab.dask
    # (pyproject's package-dir: a top-level dask/ would shadow the real dask)
    packages = {"gpulab/dask" if p == "gpulab/spawner/singleuser/dask" else p for p in packages}
    missing = {p for p in packages if f"{p}/__init__.py" not in gpulab_wheel}
    assert len(packages) > 10
    assert missing == set()


def test_the_wheel_holds_templates_grammar_the_caps_hook_and_the_server_config(
    gpulab_wheel: set[str],
) -> None:
    templates = {f"gpulab/hub/templates/{p.name}" for p in (REPO / "hub/templates").glob("*.html")}
    assert templates and templates <= gpulab_wheel
    assert "gpulab/hub/alerts/grammar.lark" in gpulab_wheel
    assert "gpulab/spawner/singleuser/gpu_caps/sitecustomize.py" in gpulab_wheel
    assert "gpulab/spawner/singleuser/jupyter_config/jupyter_server_config.py" in gpulab_wheel


def test_the_dev_cluster_is_not_in_gpulab_wheel_but_in_its_own(
    gpulab_wheel: set[str], tmp_path: Path
) -> None:
    assert not [name for name in gpulab_wheel if name.startswith("gpulab/devcluster/")]
    devcluster = _wheel_names(REPO / "devcluster", tmp_path)
    assert {"gpulab/devcluster/__init__.py", "gpulab/devcluster/agent/__init__.py"} <= devcluster
    assert not [
        n for n in devcluster if n.startswith("gpulab/") and not n.startswith("gpulab/devcluster/")
    ]


def test_the_wheel_holds_the_admin_panels_built_app(gpulab_wheel: set[str]) -> None:
    # built by `bash .ci/dev setup` (hub/adminpanel, git-ignored): a wheel built before it lacks it
    assert (REPO / "hub/adminpanel/static/admin-panel.js").is_file()
    assert "gpulab/hub/adminpanel/static/admin-panel.js" in gpulab_wheel
    assert not [n for n in gpulab_wheel if n.startswith("gpulab/hub/adminpanel/src/")]
