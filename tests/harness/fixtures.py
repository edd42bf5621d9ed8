"""pytest fixtures of the harness, loaded as a plugin for every test folder (`-p tests.harness.fixtures`
in pyproject.toml), the extension's own tests included; and the one rule that gives tests their tier.

Tiers. A test's tier is the most expensive real thing it starts, and it starts real things only
through the fixtures below, so the tier is read from the fixtures it requests (directly or through
other fixtures: pytest's fixture closure) and never written by hand:

    make_hub, make_module_hub, make_lab_server,
    postgres                                     -> marker `e2e`      (real server processes)
    page                                         -> marker `browser`  (Chromium)
    dev_cluster, make_dev_cluster, kube, kube_ns -> marker `kube`     (a dev cluster)
    none of them                                 -> unit (no marker)

A fixture parametrized over such fixtures' names, which requests the one its parameter names with
`request.getfixturevalue(request.param)` (a store tested on SQLite and on PostgreSQL), counts as
requesting that one: pytest's closure cannot see a fixture requested at run time, so the plugin
reads the parameter. A test gets the marker of every such fixture it requests (a browser test also starts a hub, so it is
`e2e` and `browser`; a GPUKubeSpawner test is `e2e` and `kube`), and its tier is the most expensive
one: kube > browser > e2e > unit. So `-m kube` is exactly the tests that start a dev cluster
(`bash .ci/dev test` runs them apart) and `-m "not e2e and not kube and not browser"` the unit tier.
`slow` and `gpu` stay hand-written: they are about time and hardware, not about what a test starts.

Safety net: the harness notes each hub, lab server, cluster and browser it starts
(tests/harness/tiers.py); a test that started one without the matching marker (it went around the
fixtures, e.g. `Hub(...).start()` in its body) fails, naming the fixture to use.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from hypothesis import settings
from traitlets.config import Config

from tests.harness import leftovers
from tests.harness.hub import PASSABLE_ROOT, Hub
from tests.harness.tiers import take_started

# The dev cluster, Playwright and the lab server are imported where a fixture starts one: the plugin
# loads for every test run, and a unit run needs none of them installed.
if TYPE_CHECKING:
    from gpulab.devcluster import DevCluster, NodeSpec
    from gpulab.spawner.local.accounts import SystemAccount
    from tests.harness.kube import Kube
    from tests.harness.labserver import LabServer
    from tests.harness.postgres import PostgresServer

# Hypothesis' per-example deadline is a timing assertion: on a loaded 2-core machine it fails tests
# whose logic is fine. Properties are about correctness only here.
settings.register_profile("gpulab", deadline=None)
settings.load_profile("gpulab")

#: harness fixture -> the marker of the real thing it starts (see the module docstring)
TIER_MARKERS = {
    "make_hub": "e2e",
    "make_module_hub": "e2e",
    "make_lab_server": "e2e",
    "postgres": "e2e",
    "page": "browser",
    "dev_cluster": "kube",
    "make_dev_cluster": "kube",
}


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by these markers
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        names = list(getattr(item, "fixturenames", ()))
        callspec = getattr(item, "callspec", None)
        if callspec is not None:  # fixtures requested by a parametrized fixture (module doc)
            names += [v for v in callspec.params.values() if isinstance(v, str)]
        for name in names:
            marker = TIER_MARKERS.get(name)
            if marker is not None and item.get_closest_marker(marker) is None:
                item.add_marker(marker)
    # the tests that need the batch controllers last: on a cold machine their Go builds (Kueue and
    # JobSet, about 11 minutes beside the other tests) then overlap every other dev-cluster test,
    # where the first of them used to wait for the builds with the whole half behind it (a stable
    # sort: each module's tests stay together, in their order)
    items.sort(key=lambda item: item.get_closest_marker("batch_controllers") is not None)


def _check_started(item: pytest.Item) -> None:
    """The safety net: a test that started a hub, cluster, lab server or browser around the
    fixtures (Hub(...).start() in its body) would run in the wrong tier; fail it, saying how."""
    unmarked = sorted(m for m in take_started() if item.get_closest_marker(m) is None)
    if unmarked:
        pytest.fail(
            f"{item.nodeid} started a real {'/'.join(unmarked)} thing without requesting its "
            f"harness fixture ({', '.join(n for n, m in TIER_MARKERS.items() if m in unmarked)}), "
            "so its tier marker is missing",
            pytrace=False,
        )


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Any:
    take_started()  # what earlier tests' teardowns or other code noted is not this test's
    result = yield
    _check_started(item)
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Any:
    result = yield
    _check_started(item)
    return result


def pytest_sessionstart(session: pytest.Session) -> None:
    """What an earlier run that was killed before its teardowns left (hubs, their servers,
    kernels and Dask clusters, test accounts) is removed first (tests/harness/leftovers.py)."""
    removed = leftovers.sweep(PASSABLE_ROOT)
    if removed:
        print(f"tests: removed what killed test runs left: {', '.join(removed)}")


# The dev-cluster tests (marked `kube`) never share a pytest with pytest-xdist workers: `bash
# .ci/dev test` runs them in a pytest of their own (beside the rest, or after it), since two
# clusters at once in one run would share pod addresses and the node agents' nftables table. (An xdist_group set here was never seen:
# pytest-xdist reads groups before conftest hooks add them.)


# -- hubs ----------------------------------------------------------------------------------------


class _Hubs:
    """Hubs started under one directory; close() stops them all and removes their accounts."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.hubs: list[Hub] = []

    def __call__(
        self,
        overlay: Config | str = "",
        *,
        start: bool = True,
        name: str = "hub",
        env: dict[str, str] | None = None,
    ) -> Hub:
        hub = Hub(self.root / name, overlay, env)
        self.hubs.append(hub)
        if start:
            hub.start()
        return hub

    def close(self) -> None:
        for hub in self.hubs:
            hub.close()
        for hub in self.hubs:
            hub.cleanup()


@pytest.fixture
def make_hub(tmp_path: Path) -> Iterator[Callable[..., Hub]]:
    """Start real hubs with a config overlay (a traitlets Config, or source text for code); every
    hub and server is stopped at teardown."""
    hubs = _Hubs(tmp_path)
    yield hubs
    hubs.close()


@pytest.fixture(scope="module")
def make_module_hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., Hub]]:
    """make_hub for a hub a whole module shares (tests that leave it as they found it)."""
    hubs = _Hubs(tmp_path_factory.mktemp("module-hubs"))
    yield hubs
    hubs.close()


# -- lab servers ---------------------------------------------------------------------------------


@pytest.fixture
def make_lab_server(tmp_path: Path) -> Iterator[Callable[..., LabServer]]:
    """Start real `jupyter server`s with gpulab's extension (LabServer's arguments, the state
    directory's name first); all are stopped at teardown."""
    from tests.harness.labserver import LabServer

    servers: list[LabServer] = []

    def make(name: str = "lab", *, start: bool = True, **kw: Any) -> LabServer:
        server = LabServer(tmp_path / name, **kw)
        servers.append(server)
        if start:
            server.start()
        return server

    yield make
    for server in servers:
        server.stop()


# -- system accounts -----------------------------------------------------------------------------


@pytest.fixture
def make_account() -> Iterator[Callable[[str], SystemAccount]]:
    """Real system accounts in the reserved uid range, each with a home of its own
    (`make_account("alice")`), for processes run as users without a hub; what runs as them is
    killed and they are removed at teardown. Skipped unless the tests run as root."""
    import os

    from tests.harness.accounts import TestAccounts

    if os.geteuid() != 0:
        pytest.skip("system accounts need root")
    accounts = TestAccounts()
    yield accounts.make
    accounts.close()


# -- PostgreSQL ----------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def postgres() -> Iterator[PostgresServer]:
    """A real PostgreSQL server for the session (each xdist worker has its own, on its own port);
    `postgres.new_database()` gives a test an empty database's URL. Debian's binaries, installed
    with apt-get when missing and running as root; stopped at the end of the session."""
    from tests.harness.postgres import running_postgres

    with running_postgres() as server:
        yield server


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A folder every account can read (servers run as their users' own accounts, and pytest's
    tmp_path is private to the test's): for files a test hands its servers, such as simulated
    GPU figures."""
    path = Path(tempfile.mkdtemp(prefix="gpulab-shared-"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(params=["sqlite", "postgres"])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """An empty database's URL for a store's tests, run twice: a SQLite file, then a database on
    the session's PostgreSQL (the fixture `postgres`, which marks those tests e2e)."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/store.sqlite"
    return str(request.getfixturevalue(request.param).new_database())


# -- browsers ------------------------------------------------------------------------------------


@pytest.fixture
def page(tmp_path: Path) -> Iterator[Any]:
    """A Playwright page of a fresh headless Chromium, closed after the test (the test is skipped,
    with the reason, where there is no Chromium or Playwright)."""
    from tests.harness.browser import chromium_missing_reason, open_browser_page

    missing = chromium_missing_reason()
    if missing is not None:
        pytest.skip(missing)
    with open_browser_page(tmp_path) as page:
        yield page


# -- dev clusters --------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def dev_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevCluster]:
    """The session's cluster: KUBE_NODES, fast node-failure timing, stopped at the end."""
    from tests.harness.cluster import running_dev_cluster
    from tests.harness.kube import KUBE_NODES

    with running_dev_cluster(tmp_path_factory.mktemp("dev-cluster"), KUBE_NODES) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def make_dev_cluster(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Callable[..., DevCluster]]:
    """Start a dev cluster with the given nodes for one module; stopped when the module is done."""
    from tests.harness.cluster import running_dev_cluster

    with contextlib.ExitStack() as stack:

        def make(nodes: Sequence[NodeSpec], name: str = "dev-cluster") -> DevCluster:
            return stack.enter_context(running_dev_cluster(tmp_path_factory.mktemp(name), nodes))

        yield make


@pytest.fixture
def kube(dev_cluster: DevCluster) -> Iterator[Kube]:
    """REST helpers over the session's cluster (namespace default); deletes what the test made."""
    from tests.harness.kube import Kube

    k = Kube(dev_cluster)
    yield k
    k.close()


@pytest.fixture
def kube_ns(dev_cluster: DevCluster) -> Iterator[Kube]:
    """Like `kube`, in a fresh namespace (ready for pods: its ServiceAccount token exists);
    the namespace is deleted afterwards."""
    from tests.harness.kube import fresh_namespace

    with fresh_namespace(dev_cluster) as k:
        yield k
