"""The workspace contract the hub holds spawners to: what its pages, REST API and picker may ask
of any spawner that keeps workspaces (a server's home, its snapshots, its kernels' checkpoints).

One required interface, `Workspaces` (as Kueue's `jobframework.GenericJob`): the hub asks
`keeps_workspaces(spawner)` and then calls these, never `hasattr`; a spawner that is not a gpulab
spawner (any other `spawner_class`) keeps none and is refused with a readable 400. The contract
lives on the hub's side because the hub is what depends on it; both backends implement it
(`gpulab.spawner.workspaces.local` and `.kube`, sharing `gpulab.spawner.workspaces.base`), and
`tests/spawner/workspaces/test_contract.py` checks them against it.
"""

from __future__ import annotations

from typing import Any, Protocol, TypedDict, runtime_checkable

#: the home directory name of the default server: no named server may be called that
DEFAULT_HOME = "default"


class SnapshotListing(TypedDict, total=False):
    """A snapshot as the hub lists it. Every backend gives id, label, created (epoch seconds),
    files and bytes (None where the storage does not say) and size (human readable); a backend
    may add its own keys (Kubernetes: ready, error, pvc)."""

    id: str
    label: str
    created: float
    files: int | None
    bytes: int | None
    size: str


class WorkspaceOffer(TypedDict):
    """What the picker offers before a start: kernel checkpoints (one per notebook) and the
    home snapshots to start from."""

    kernels: list[dict[str, Any]]
    snapshots: list[SnapshotListing]


class RestoreResult(TypedDict):
    restored: str
    #: the snapshot of the home as it was just before (None when there was no home)
    before_restore: str | None


class CloneResult(TypedDict):
    cloned: str
    server: str


@runtime_checkable
class Workspaces(Protocol):
    """Required of a spawner that keeps workspaces (see the module docstring)."""

    @property
    def workspaces_enabled(self) -> bool:
        """Whether this server keeps a workspace now (the `checkpoints` option, and on
        Kubernetes no upstream `profile_list`)."""

    @property
    def workspace_dir_name(self) -> str:
        """The name of the server's home and checkpoint directory: the server's name when its
        workspace was created (a renamed server keeps its home), `default` for the default one."""

    def workspace_home_id(self) -> str:
        """What identifies the storage the server's home lives on: two servers with the same id
        share a home, so neither may be restored while the other runs."""

    def snapshot_store(self) -> str:
        """Where this server's snapshots are kept, for people to read (a path, or a label query)."""

    async def list_workspace_snapshots(self) -> list[SnapshotListing]:
        """This server's complete snapshots, newest first."""

    async def take_workspace_snapshot(self, label: str = "on-demand") -> SnapshotListing | None:
        """A snapshot now (the server may be running); None when it has no home yet."""

    async def restore_workspace(self, snapshot_id: str) -> RestoreResult:
        """Put the stopped server's home back as it was in `snapshot_id`, keeping the current
        home as a 'before-restore' snapshot. KeyError: no such snapshot of this server."""

    async def clone_workspace(self, snapshot_id: str, target: Any) -> CloneResult:
        """Give `target`, a new never started server of the same user and backend, a home with
        the content of `snapshot_id`. KeyError: no such snapshot; FileExistsError: the target
        has a home already."""

    async def workspace_offer(self) -> WorkspaceOffer | None:
        """The picker's offer; None when workspaces are off."""


def keeps_workspaces(spawner: object) -> bool:
    """Whether `spawner` implements the contract (every gpulab spawner does; others do not)."""
    return isinstance(spawner, Workspaces)


__all__ = [
    "DEFAULT_HOME",
    "CloneResult",
    "RestoreResult",
    "SnapshotListing",
    "WorkspaceOffer",
    "Workspaces",
    "keeps_workspaces",
]
