"""KubeSpawner's own test suite, unmodified, against a fresh dev cluster.

The suite of the KubeSpawner release gpulab has installed (importlib.metadata) is fetched at
set-up: from its PyPI sdist when that carries `tests/` (7.1.0's does not), else from the release
tag of its git repository (`--suite-git`, default GitHub; a local clone or mirror works too).
Nothing of it enters this repository. It runs in a virtualenv of its own, made once and cached
per version and pins under ~/.cache/gpulab/kubespawner-suite/: KubeSpawner at that version, the
JupyterHub and kubernetes_asyncio that gpulab uses, and the suite's test extra pinned
(`SUITE_PINS`: the extra is unpinned and newer pytest breaks its event-loop fixtures).

A private dev cluster (one plain node) is started for the run and always taken down; the suite
finds it through `KUBECONFIG` alone, as it would find kind or minikube. Its single-user pods run
`jupyterhub-singleuser` of the suite's venv (POD_BIN: Jupyter Server and JupyterLab, as in
upstream's image, not gpulab's server with its extensions) and its hub pods `jupyterhub` of
gpulab's venv, which the node agent finds on its PATH. The plugin
`bench/suite_plugins/kubespawner_cluster_tests.py` (loaded with `-p`) marks every test whose
fixtures include the suite's `kube_client` as a cluster test in the junit xml, which is where the
figures come from, and deletes the single-user pods a failed cluster test left behind. The
suite's namespaces are made beforehand with a NetworkPolicy that keeps other machines out (see
machine_only_policy for why).

`--shim-ssl-fixture` adds `suite_plugins/jupyterhub6_ssl_fixture.py`, which works around the one
upstream harness bug that keeps two tests from starting under JupyterHub 6; `--shim-wait-up` adds
`suite_plugins/wait_up_shim.py`, with which KubeSpawner's start() returns once the server listens
(the suite's check of a started server races its start on a slow machine, see CHECK_UP_RACE); the
table then says the run was not unmodified.

    .venv/bin/python -m bench.kubespawner_suite [--quick] [--suite-git URL|PATH] [--keep-xml F]
        [--shim-ssl-fixture] [--shim-wait-up] [-- ARGS]
    bash .ci/dev kubespawner-suite [same options]      (ARGS go to the suite's pytest, e.g. -k)

`--quick` runs only the suite's spawn-and-start tests (`tests/test_spawner.py -k
test_spawn_start`), at most 15 minutes.

Last line: passed=<n> failed=<n> errors=<n> cluster_tests_passed=<k>/<m> (every field `n/a`, the
reason on the line before, when the suite could not be had).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import importlib.metadata
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from bench._lastline import print_last_lines
from bench._suite_results import LAST_LINE_FIELDS, read_junit, report
from gpulab.devcluster import DevCluster, NodeSpec, ensure_binaries
from gpulab.devcluster.agent import netpolicy

DISTRIBUTION = "jupyterhub-kubespawner"
DEFAULT_SUITE_GIT = "https://github.com/jupyterhub/kubespawner"
#: the suite's test extra, pinned: pytest 8 and pytest-asyncio >= 0.23 break its session
#: event_loop fixture; kubernetes (the sync client, for exec) at the release issue 15 measured
SUITE_PINS = ("pytest==7.4.4", "pytest-asyncio==0.21.2", "kubernetes==36.0.3")
#: Why the suite's venv has JupyterLab although nothing of the suite imports it: the suite's
#: check of a started server (`check_up`, eight spawn tests) asks for the server's `/` and wants
#: 302. Jupyter Server redirects `/` to its default URL, which JupyterHub's extension takes from a
#: UI extension (JupyterLab: `/lab`), as in KubeSpawner's default image
#: quay.io/jupyterhub/singleuser (jupyter/base-notebook: JupyterLab and Notebook), where upstream's
#: CI runs the suite. With no UI extension the default URL is `/` itself, and Jupyter Server
#: (2.21.1) answers that with its main page, unauthenticated: 200 ("assert '200' == '302'" in six
#: tests of --quick on 2026-12-07, the first venv with pod-bin, which had no JupyterLab).
SINGLEUSER_UI = "jupyterlab"
#: taken at the versions gpulab itself runs, so the suite tests the KubeSpawner gpulab ships with;
#: jupyter_server and JupyterLab for the suite's single-user pods (see POD_BIN, SINGLEUSER_UI)
GPULAB_PINNED = ("jupyterhub", "kubernetes_asyncio", "jupyter_server", SINGLEUSER_UI)
#: Why the suite's pods get a `jupyterhub-singleuser` of the suite's venv (Jupyter Server and
#: JupyterLab with JupyterHub's extension, as upstream's image has them) rather than gpulab's: the
#: suite checks a started server from its exec pod four times a second apart, right after the pod
#: is Running, while gpulab's server first imports its seven extensions (Dask's lab extension alone
#: takes seconds) and then must reach its hub before it listens; on a loaded small machine that is
#: longer, and a test fails with "Connection refused" (issue 30: the profile-callback test).
POD_BIN = "pod-bin"
PLUGIN_DIR = Path(__file__).resolve().parent / "suite_plugins"
#: opt-in (--shim-ssl-fixture): the one upstream harness bug worked around, see its doc
SSL_FIXTURE_SHIM = "jupyterhub6_ssl_fixture"
#: opt-in (--shim-wait-up): start() returns once the server listens, see its doc and CHECK_UP_RACE
WAIT_UP_SHIM = "wait_up_shim"
#: `--quick`: the suite's spawn-and-start tests (a few minutes; the one issue 30 names among
#: them), under a shorter limit than the whole suite's
QUICK_ARGS = ("tests/test_spawner.py", "-k", "test_spawn_start")
QUICK_TIMEOUT_SECONDS = 900.0
PLUGIN = "kubespawner_cluster_tests"
#: the namespaces the suite creates and deletes (its kube_ns / kube_another_ns defaults)
SUITE_NAMESPACES = ("kubespawner-test", "kubespawner-another")


#: Why the runner makes those namespaces itself, each with the policy below: the suite's hub pods
#: listen on every address of their pod (`hub_ip = "0.0.0.0"` in their config file, the proxy
#: by default), run as root with JupyterHub's default LocalProcessSpawner, and accept the admin
#: service token "test-secret-token" that the suite publishes. Each pod has a network namespace
#: of its own, so that is only the pod's addresses; the policy admits connections to the suite's
#: pods from the cluster's pod network only (its pods, and this machine as the pods see it: the
#: suite's pytest, the agent's probes), so nothing that comes with another source address, as
#: a packet routed in from another machine would, gets in. The suite finds the namespaces existing
#: and uses them ("Using existing namespace"), and deletes them at its end as it would its own.
def machine_only_policy(pod_network: str) -> dict[str, Any]:
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": "kubespawner-suite-machine-only"},
        "spec": {
            "podSelector": {},
            "policyTypes": ["Ingress"],
            "ingress": [{"from": [{"ipBlock": {"cidr": pod_network}}]}],
        },
    }


# -- the suite and its virtualenv --------------------------------------------------------------


class SuiteUnavailable(RuntimeError):
    """The suite of this KubeSpawner version could be found neither on PyPI nor in git."""


def how_to_pass_a_clone(version: str) -> str:
    """What to do where neither the package index nor GitHub can be reached (README says it too)."""
    return (
        f"Pass a clone of KubeSpawner that has the tag {version}: on a machine with internet, "
        f"`git clone {DEFAULT_SUITE_GIT} kubespawner`, copy the folder here, then run with "
        f"`--suite-git /path/to/kubespawner` (or set "
        f"GPULAB_KUBESPAWNER_SUITE_GIT); a git URL of a reachable mirror works too. Only its "
        f"tests/ and pyproject.toml are read, once: the suite is cached in {cache_root()}."
    )


def cache_root() -> Path:
    base = os.environ.get("GPULAB_KUBESPAWNER_SUITE_CACHE")
    return Path(base) if base else Path.home() / ".cache" / "gpulab" / "kubespawner-suite"


def pins(version: str) -> list[str]:
    gpulab_side = [f"{name}=={importlib.metadata.version(name)}" for name in GPULAB_PINNED]
    return [f"{DISTRIBUTION}=={version}", *gpulab_side, *SUITE_PINS]


def cache_key(version: str, requirements: list[str]) -> str:
    python = f"{sys.version_info.major}.{sys.version_info.minor}"
    digest = hashlib.sha256("\n".join([python, *requirements]).encode()).hexdigest()[:12]
    return f"{version}-py{python}-{digest}"


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    # two runs at once wait for one set-up instead of building the same folder twice
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _run(argv: list[str], *, quiet: bool = False) -> subprocess.CompletedProcess[str]:
    """argv to completion; on failure its stderr is shown (unless quiet) and CalledProcessError
    raised."""
    done = subprocess.run(argv, text=True, capture_output=True)
    if done.returncode and not quiet:
        print(f"kubespawner_suite: {' '.join(argv[:4])} ...:\n{done.stderr}", file=sys.stderr)
    done.check_returncode()
    return done


def _suite_from_sdist(version: str, work: Path, dest: Path) -> bool:
    """Download the release's sdist from the package index; copy its tests/ if it has them."""
    _run(
        [sys.executable, "-m", "pip", "download", "-q", "--no-binary", ":all:", "--no-deps",
         f"{DISTRIBUTION}=={version}", "-d", str(work)],
        quiet=True,  # prepare() falls back to git and says why
    )  # fmt: skip
    sdist = next(work.glob("*.tar.gz"))
    with tarfile.open(sdist) as tar:
        top = tar.getnames()[0].split("/")[0]
        members = [
            m
            for m in tar.getmembers()
            if m.name.startswith(f"{top}/tests/")
            and ".." not in m.name.split("/")
            and (m.isfile() or m.isdir())
        ]
        if not any(m.name.endswith("/conftest.py") for m in members):
            return False
        # regular files and folders under tests/ only (Python 3.11.2 has no extraction filters)
        tar.extractall(work, members=[*members, tar.getmember(f"{top}/pyproject.toml")])
    shutil.copytree(work / top / "tests", dest / "tests")
    shutil.copy(work / top / "pyproject.toml", dest / "pyproject.toml")
    return True


def _suite_from_git(version: str, source: str, work: Path, dest: Path) -> None:
    """The release tag's tests/ and pyproject.toml (its pytest settings) from a git repository."""
    if Path(source).exists():
        source = Path(source).resolve().as_uri()  # a shallow clone of a local path needs file://
    clone = work / "clone"
    try:
        _run(
            ["git", "clone", "-q", "--depth", "1", "--branch", version, source, str(clone)],
            quiet=True,  # SuiteUnavailable says it
        )
    except subprocess.CalledProcessError as exc:
        raise SuiteUnavailable(
            f"KubeSpawner {version}'s sdist has no tests/ and its tag could not be cloned from "
            f"{source}: {exc.stderr.strip()}\n{how_to_pass_a_clone(version)}"
        ) from exc
    # the tag must be the release the suite is run against
    declared = re.search(
        r'__version__ = "([^"]+)"', (clone / "kubespawner/_version.py").read_text()
    )
    if not declared or declared.group(1) != version:
        raise SuiteUnavailable(
            f"tag {version} of {source} declares {declared and declared.group(1)}"
        )
    shutil.copytree(clone / "tests", dest / "tests")
    shutil.copy(clone / "pyproject.toml", dest / "pyproject.toml")


def prepare(version: str, suite_git: str, log: Callable[[str], None] = print) -> tuple[Path, Path]:
    """The suite's folder and its venv's python, made once per cache key."""
    requirements = pins(version)
    root = cache_root()
    target = root / cache_key(version, requirements)
    with _locked(root / ".lock"):
        if not (target / "ready.json").exists():
            log(f"kubespawner_suite: setting up {target} ({' '.join(requirements)})")
            # built beside the cache and moved in with one rename: never half a cache
            building = Path(tempfile.mkdtemp(prefix=".building-", dir=root))
            try:
                suite = building / "suite"
                suite.mkdir()
                with tempfile.TemporaryDirectory() as work:
                    source = "PyPI sdist"
                    try:
                        from_sdist = _suite_from_sdist(version, Path(work), suite)
                    except subprocess.CalledProcessError as exc:
                        log(f"kubespawner_suite: no sdist from the index: {exc.stderr.strip()}")
                        from_sdist = False
                    if not from_sdist:
                        _suite_from_git(version, suite_git, Path(work), suite)
                        source = f"{suite_git} tag {version}"
                # the venv is renamed into place below, so it is only ever run as
                # venv/bin/python -m ...: its scripts' shebangs name the building folder
                _run([sys.executable, "-m", "venv", str(building / "venv")])
                _run(
                    [str(building / "venv/bin/python"), "-m", "pip", "install", "-q", *requirements]
                )
                write_pod_bin(building / POD_BIN, target / "venv/bin/python")
                (building / "ready.json").write_text(
                    json.dumps({"requirements": requirements, "suite_source": source}, indent=1)
                )
                if target.exists():
                    shutil.rmtree(target)
                building.rename(target)
            finally:
                shutil.rmtree(building, ignore_errors=True)
    return target / "suite", target / "venv/bin/python"


def pod_bin(python: Path) -> Path:
    """The folder of the suite's pods' commands beside the venv of `python` (see POD_BIN)."""
    return python.parents[2] / POD_BIN


def write_pod_bin(folder: Path, python: Path) -> None:
    """`folder`/jupyterhub-singleuser running JupyterHub's single-user server with `python` (the
    venv's final place: its own scripts name the folder it was built in)."""
    folder.mkdir()
    script = folder / "jupyterhub-singleuser"
    script.write_text(f'#!/bin/sh\nexec {python} -m jupyterhub.singleuser "$@"\n')
    script.chmod(0o755)


# -- the run -------------------------------------------------------------------------------


def shimmed(shims: list[str]) -> str:
    """What the opt-in shims change, for the table's heading."""
    what = {
        SSL_FIXTURE_SHIM: "the upstream ssl_app fixture shimmed",
        WAIT_UP_SHIM: "start() waits for the server to listen",
    }
    return "; ".join(what[shim] for shim in shims)


def admit_this_machine_only(cluster: DevCluster, namespace: str) -> None:
    """machine_only_policy in `namespace` (see there for why)."""
    cluster.api(
        "POST",
        f"/apis/networking.k8s.io/v1/namespaces/{namespace}/networkpolicies",
        machine_only_policy(cluster.pod_network),
    )


def guard_namespaces(cluster: DevCluster) -> None:
    """The suite's namespaces, made before the suite runs, with machine_only_policy."""
    for namespace in SUITE_NAMESPACES:
        cluster.api("POST", "/api/v1/namespaces", {"metadata": {"name": namespace}})
        admit_this_machine_only(cluster, namespace)


def run_suite(
    suite: Path, python: Path, kubeconfig: Path, junit: Path, pytest_args: list[str], timeout: float
) -> int:
    """The suite's pytest in its folder (its own pyproject settings apply), in a session of its
    own so that a timeout ends it and every process it started."""
    env = {
        **os.environ,
        "KUBECONFIG": str(kubeconfig),
        # only the plugin's folder: no module of gpulab's can shadow one of the suite's
        "PYTHONPATH": str(PLUGIN_DIR),
    }
    for name in ("KUBESPAWNER_TEST_NAMESPACE", "KUBESPAWNER_ANOTHER_NAMESPACE", "VIRTUAL_ENV"):
        env.pop(name, None)
    argv = [str(python), "-m", "pytest", "-p", PLUGIN, "-p", "no:cacheprovider",
            f"--junitxml={junit}", "-o", "junit_logging=no", *pytest_args]  # fmt: skip
    proc = subprocess.Popen(argv, cwd=suite, env=env, start_new_session=True)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        print(f"kubespawner_suite: the suite ran past {timeout:.0f} s and was stopped")
        return -1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--suite-git",
        default=os.environ.get("GPULAB_KUBESPAWNER_SUITE_GIT", DEFAULT_SUITE_GIT),
        help="git URL or local clone to take the release tag's tests/ from when the sdist has "
        "none (default $GPULAB_KUBESPAWNER_SUITE_GIT, else GitHub)",
    )
    parser.add_argument("--timeout", type=float, default=3600, help="seconds for the suite")
    parser.add_argument("--keep-xml", type=Path, help="copy the junit xml here")
    parser.add_argument(
        "--shim-ssl-fixture",
        action="store_true",
        help="load suite_plugins/jupyterhub6_ssl_fixture.py, which works around the suite's "
        "ssl_app fixture under JupyterHub 6 (not an unmodified run: the table says so)",
    )
    parser.add_argument(
        "--shim-wait-up",
        action="store_true",
        help="load suite_plugins/wait_up_shim.py: KubeSpawner's start() returns once the server "
        "listens, as JupyterHub waits for it (the suite's check otherwise races the server's "
        "start on a slow machine, see CHECK_UP_RACE; not an unmodified run: the table says so)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="only the suite's spawn-and-start tests (tests/test_spawner.py -k test_spawn_start), "
        f"at most {QUICK_TIMEOUT_SECONDS:.0f} s",
    )
    parser.add_argument("pytest_args", nargs="*", help="passed to the suite's pytest (e.g. -k X)")
    args = parser.parse_args(argv)
    timeout = min(args.timeout, QUICK_TIMEOUT_SECONDS) if args.quick else args.timeout

    version = importlib.metadata.version(DISTRIBUTION)
    shims = [
        shim
        for shim, wanted in (
            (SSL_FIXTURE_SHIM, args.shim_ssl_fixture),
            (WAIT_UP_SHIM, args.shim_wait_up),
        )
        if wanted
    ]
    t0 = time.monotonic()
    try:
        suite, python = prepare(version, args.suite_git)
    except SuiteUnavailable as exc:
        print(f"kubespawner_suite: {exc}", file=sys.stderr)
        why = "KubeSpawner's suite could not be had (see above)"
        print_last_lines(dict.fromkeys(LAST_LINE_FIELDS), dict.fromkeys(LAST_LINE_FIELDS, why))
        return 2
    ensure_binaries()
    with tempfile.TemporaryDirectory(prefix="gpulab-kubespawner-suite-") as tmp:
        root = Path(tmp)
        junit = root / "junit.xml"
        cluster = DevCluster(root / "cluster", log=lambda msg: None, pod_bin_dirs=[pod_bin(python)])
        try:
            # one plain node: the suite's pods ask for no GPU and a little CPU and memory
            cluster.up(nodes=[NodeSpec("kubespawner-node", gpus=0, cpu=32, memory_gib=128)])
            guard_namespaces(cluster)
            if netpolicy.unavailable_reason():
                print(
                    "kubespawner_suite: WARNING: the suite's hub listens on every interface and "
                    "the node agent cannot enforce the policy that keeps other machines out: "
                    f"{netpolicy.unavailable_reason()}"
                )
            t_suite = time.monotonic()
            pytest_args = [*(QUICK_ARGS if args.quick else ()), *args.pytest_args]
            for shim in shims:
                pytest_args = ["-p", shim, *pytest_args]
            rc = run_suite(suite, python, cluster.kubeconfig, junit, pytest_args, timeout)
            suite_seconds = time.monotonic() - t_suite
        finally:
            cluster.down()
        if not junit.exists():
            print(f"kubespawner_suite: the suite wrote no junit xml (pytest exit {rc})")
            return 2
        if args.keep_xml:
            shutil.copy(junit, args.keep_xml)
        results = read_junit(junit)
    print()
    print(
        f"KubeSpawner {version}'s own suite on a fresh dev cluster: {len(results)} tests, "
        f"suite {suite_seconds:.0f} s, whole run {time.monotonic() - t0:.0f} s"
        + (f" (NOT unmodified: with {', '.join(shims)}: {shimmed(shims)})" if shims else "")
    )
    print("\n".join(report(results)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
