"""Both workspace backends keep the one contract the hub holds them to
(`gpulab.hub.workspaces.Workspaces`): the same members with the same signatures, the shared
options defined once, and the same behaviour through a real hub (the Kubernetes run of the same
scenario is in tests/spawner/kube/test_workspaces.py, on that module's dev cluster)."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest
from jupyterhub.spawner import LocalProcessSpawner
from kubespawner import KubeSpawner
from traitlets import HasTraits

from gpulab.hub.workspaces import Workspaces, keeps_workspaces
from gpulab.spawner.kube import GPUKubeSpawner
from gpulab.spawner.local import GPULocalSpawner, GPUSimpleLocalSpawner
from gpulab.spawner.workspaces.base import WorkspaceSpawnerMixin
from gpulab.spawner.workspaces.kube import KubeWorkspaceMixin
from gpulab.spawner.workspaces.local import LocalWorkspaceMixin
from tests.harness.workspace_contract import check_workspace_contract

BACKENDS = [GPULocalSpawner, GPUSimpleLocalSpawner, GPUKubeSpawner]
#: the options both backends have: defined once, in WorkspaceSpawnerMixin
SHARED_OPTIONS = [
    "checkpoints",
    "checkpoint_grace_seconds",
    "checkpoint_secret_file",
    "snapshot_keep_last",
    "snapshot_keep_daily",
    "snapshot_interval_seconds",
]


def _members() -> list[str]:
    return sorted(
        name
        for name in vars(Workspaces)
        if not name.startswith("_") and name not in ("register",)  # Protocol machinery
    )


def _comparable(sig: inspect.Signature) -> list[tuple[str, object, object]]:
    """The parameters a caller of the contract may pass: a backend may add keyword-only ones
    with defaults, which no contract caller uses."""
    return [
        (p.name, p.kind, p.default)
        for p in sig.parameters.values()
        if not (p.kind is p.KEYWORD_ONLY and p.default is not p.empty)
    ]


def test_the_contract_names_what_the_hub_calls() -> None:
    assert _members() == [
        "clone_workspace",
        "list_workspace_snapshots",
        "restore_workspace",
        "snapshot_store",
        "take_workspace_snapshot",
        "workspace_dir_name",
        "workspace_home_id",
        "workspace_offer",
        "workspaces_enabled",
    ]


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda c: c.__name__)
def test_each_backend_implements_the_contract_with_its_signatures(backend: type) -> None:
    for name in _members():
        wanted, given = (
            inspect.getattr_static(Workspaces, name),
            inspect.getattr_static(backend, name),
        )
        if isinstance(wanted, property):
            assert isinstance(given, property), f"{backend.__name__}.{name} must be a property"
            continue
        assert inspect.iscoroutinefunction(given) == inspect.iscoroutinefunction(wanted), name
        assert _comparable(inspect.signature(given)) == _comparable(inspect.signature(wanted)), (
            f"{backend.__name__}.{name}{inspect.signature(given)} differs from the contract's "
            f"{inspect.signature(wanted)}"
        )


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda c: c.__name__)
def test_the_shared_options_are_defined_once(backend: type) -> None:
    for option in SHARED_OPTIONS:
        owners = [c for c in backend.__mro__ if option in vars(c)]
        assert len(owners) == 1, f"{option} is defined by {[c.__name__ for c in owners]}"
        assert issubclass(owners[0], WorkspaceSpawnerMixin) or option == "snapshot_interval_seconds"
        assert backend.class_traits()[option].help, option


def test_a_spawner_that_is_not_gpulabs_keeps_no_workspace() -> None:
    assert not keeps_workspaces(LocalProcessSpawner())
    for other in (LocalProcessSpawner, KubeSpawner):
        assert not issubclass(other, WorkspaceSpawnerMixin)
        assert all(inspect.getattr_static(other, m, None) is None for m in _members()), other


def test_the_kube_backend_derives_its_grace_from_the_pods_grace_period() -> None:
    # the one shared option whose default differs: half of what the preStop hook leaves
    derive = inspect.getattr_static(GPUKubeSpawner, "_default_checkpoint_grace")
    assert derive(SimpleNamespace(delete_grace_period=45)) == 20
    assert derive(SimpleNamespace(delete_grace_period=2)) == 1
    assert GPULocalSpawner().checkpoint_grace_seconds == 30


async def test_the_local_backend_keeps_the_workspace_contract(make_hub) -> None:
    await check_workspace_contract(make_hub(), "carol")


@pytest.mark.parametrize(
    "mixin, upstream",
    [
        (WorkspaceSpawnerMixin, LocalProcessSpawner),
        (WorkspaceSpawnerMixin, KubeSpawner),
        (LocalWorkspaceMixin, LocalProcessSpawner),
        (KubeWorkspaceMixin, KubeSpawner),
    ],
    ids=lambda c: c.__name__,
)
def test_no_workspace_name_shadows_the_upstream_spawners(mixin: type, upstream: type) -> None:
    # a mixin attribute named like one of the spawner's (KubeSpawner's `volumes` trait, say)
    # silently replaces it for every gpulab server
    machinery = set(vars(HasTraits)) | {"_instance_inits", "_static_immutable_initial_values"}
    clashes = sorted(
        name
        for name in vars(mixin)
        if not name.startswith("__") and name not in machinery and hasattr(upstream, name)
    )
    assert not clashes, f"{mixin.__name__} shadows {upstream.__name__}.{clashes}"
