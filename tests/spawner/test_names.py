"""Names shared across processes are defined once, in gpulab.spawner.names, and spelt nowhere else."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from gpulab.spawner import names

ROOT = Path(__file__).resolve().parents[2]
NAMES_FILE = ROOT / "spawner" / "names.py"
SCANNED = ("spawner", "hub", "extensions")

#: GPULAB_* variables spelt outside the names module on purpose, with the reason:
ALLOWED_LITERALS: dict[str, set[str]] = {
    # the hub's own launch settings: set by a person or by the `gpulab` CLI (hub/cli.py) for the
    # hub's config; no spawner writes them and no server reads them
    "hub/cli.py": {"GPULAB_STATE_DIR", "GPULAB_IP", "GPULAB_PORT", "GPULAB_CONFIG"},
    # `gpulab job`'s own settings, read from a person's shell or CI; no hub or server sets them
    "hub/cli_jobs.py": {"GPULAB_HUB_URL", "GPULAB_TOKEN"},
    "hub/jupyterhub_config.py": {
        "GPULAB_IP",
        "GPULAB_PORT",
        "GPULAB_HUB_PORT",
        "GPULAB_PROXY_API_URL",
        "GPULAB_CULL_IDLE_SECONDS",
        "GPULAB_METRICS_SERVICE",
        "GPULAB_METRICS_SERVICE_URL",
        "GPULAB_METRICS_SERVICE_PORT",
        "GPULAB_METRICS_CONFIG",
        "GPULAB_DECLARED_INVENTORY",
        "GPULAB_CONFIG",
    },
    "hub/services/metrics/service.py": {"GPULAB_METRICS_CONFIG"},
    # loaded through PYTHONPATH by whatever Python a kernel runs, which may lack gpulab: stdlib only
    # (test_the_caps_hook_reads_the_variables_the_spawner_writes checks its spellings)
    "spawner/singleuser/gpu_caps/sitecustomize.py": {
        "GPULAB_GPU_MEMORY_LIMIT_MIB",
        "GPULAB_GPU_FRACTION",
        "GPULAB_CAPS_HOOK",
    },
}


def _shared_values() -> dict[str, str]:
    return {k: v for k, v in vars(names).items() if k.isupper() and isinstance(v, str)}


def _gpulab_literals(path: Path) -> set[str]:
    """GPULAB_* variable names spelt as a whole string or as a keyword argument (env.update(X=..))."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            text = node.value
        elif isinstance(node, ast.keyword) and node.arg:
            text = node.arg
        else:
            continue
        if text.startswith("GPULAB_") and text.replace("_", "").isalnum() and text.isupper():
            found.add(text)
    return found


def _python_sources() -> list[Path]:
    files = []
    for top in SCANNED:
        for path in (ROOT / top).rglob("*.py"):
            parts = path.relative_to(ROOT).parts
            if "tests" in parts or "node_modules" in parts or path == NAMES_FILE:
                continue
            files.append(path)
    return sorted(files)


def test_every_shared_name_has_one_value_and_every_value_one_name():
    values = list(_shared_values().values())
    assert len(values) == len(set(values)), sorted(v for v in values if values.count(v) > 1)


def test_the_names_module_imports_nothing_so_any_process_may_import_it():
    tree = ast.parse(NAMES_FILE.read_text())
    imports = [n for n in ast.walk(tree) if isinstance(n, ast.Import | ast.ImportFrom)]
    assert all(isinstance(n, ast.ImportFrom) and n.module == "__future__" for n in imports)


def test_environment_variables_keep_their_gpulab_prefix():
    env_names = {k: v for k, v in _shared_values().items() if k.endswith("_ENV")}
    assert env_names and all(v.startswith("GPULAB_") for v in env_names.values())


@pytest.mark.parametrize("path", _python_sources(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_gpulab_variable_is_spelt_outside_the_names_module(path: Path):
    allowed = ALLOWED_LITERALS.get(str(path.relative_to(ROOT)), set())
    assert _gpulab_literals(path) - allowed == set()


def test_the_allocators_own_copies_of_the_locality_labels_are_the_shared_ones():
    from gpulab.hub.allocator import model

    assert (model.RACK_LABEL, model.ZONE_LABEL) == (names.RACK_LABEL, names.ZONE_LABEL)


def test_the_caps_hook_reads_the_variables_the_spawner_writes():
    hook = ROOT / "spawner" / "singleuser" / "gpu_caps" / "sitecustomize.py"
    assert _gpulab_literals(hook) <= set(_shared_values().values())


def test_code_run_as_the_user_imports_no_gpulab_module_but_its_own_and_the_names_module():
    # an image that runs servers needs no hub: of gpulab, gpulab.spawner.singleuser imports only
    # itself and gpulab.spawner.names
    for path in (ROOT / "spawner" / "singleuser").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                module = node.module
            elif isinstance(node, ast.Import):
                module = node.names[0].name
            else:
                continue
            if module.startswith("gpulab"):
                assert module == "gpulab.spawner.names" or module.startswith(
                    "gpulab.spawner.singleuser"
                ), f"{path.relative_to(ROOT)} imports {module}"


@pytest.mark.parametrize(
    ("name", "is_one"),
    [
        ("job-1", True),
        ("job-12345", True),
        ("dask-3-w0", True),
        ("dask-3-w12", True),
        ("job-", False),
        ("job-a", False),
        (
            "job-１",
            False,
        ),  # a full-width digit: str.isdigit says yes, an allocation id never has it
        ("dask-3-scheduler", False),  # holds no GPU: never reports
        ("dask--w1", False),
        ("dask-3-w", False),
        ("", False),
        ("train", False),
    ],
)
def test_workload_names_are_exactly_job_runs_and_dask_workers(name: str, is_one: bool) -> None:
    assert names.is_workload_name(name) is is_one
