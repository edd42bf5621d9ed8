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
`jupyterhub-singleuser` and its hub pods `jupyterhub`, which the node agent finds on its PATH
(gpulab's venv). The plugin `bench/suite_plugins/kubespawner_cluster_tests.py` (loaded with
`-p`) marks every test whose fixtures include the suite's `kube_client` as a cluster test in the
junit xml, which is where the figures come from. The suite's namespaces are made beforehand
with a NetworkPolicy that keeps other machines out (see machine_only_policy for why).

`--shim-ssl-fixture` adds `suite_plugins/jupyterhub6_ssl_fixture.py`, which works around the one
upstream harness bug that keeps two tests from starting under JupyterHub 6; the table then says
the run was not unmodified.

    .venv/bin/python -m bench.kubespawner_suite [--suite-git URL|PATH] [--keep-xml F]
        [--shim-ssl-fixture] [-- ARGS]
    bash .ci/dev kubespawner-suite [same options]      (ARGS go to the suite's pytest, e.g. -k)

Last line: passed=<n> failed=<n> errors=<n> cluster_tests_passed=<k>/<m>.
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
import xml.etree.ElementTree as ET
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpulab.devcluster import DevCluster, NodeSpec, ensure_binaries
from gpulab.devcluster.agent import netpolicy

DISTRIBUTION = "jupyterhub-kubespawner"
DEFAULT_SUITE_GIT = "https://github.com/jupyterhub/kubespawner"
#: the suite's test extra, pinned: pytest 8 and pytest-asyncio >= 0.23 break its session
#: event_loop fixture; kubernetes (the sync client, for exec) at the release issue 15 measured
SUITE_PINS = ("pytest==7.4.4", "pytest-asyncio==0.21.2", "kubernetes==36.0.3")
#: taken at the versions gpulab itself runs, so the suite tests the KubeSpawner gpulab ships with
GPULAB_PINNED = ("jupyterhub", "kubernetes_asyncio")
PLUGIN_DIR = Path(__file__).resolve().parent / "suite_plugins"
#: opt-in (--shim-ssl-fixture): the one upstream harness bug worked around, see its doc
SSL_FIXTURE_SHIM = "jupyterhub6_ssl_fixture"
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


#: errors of the suite's own harness, not of the cluster or of KubeSpawner: test name ->
#: (what the error message says, why). Only an error whose message matches is put down to it.
KNOWN_HARNESS_ISSUES: dict[str, tuple[str, str]] = {
    name: (
        "no running event loop",
        "upstream harness: the session fixture ssl_app is synchronous and calls "
        "JupyterHub().init_internal_ssl(), whose HTTP client needs a running event loop since "
        "JupyterHub 6 (fails with or without a cluster)",
    )
    for name in ("test_spawn_internal_ssl", "test_variable_expansion")
}

#: what the dev cluster lacks, recognised in a failure's text (first match wins): the cause
#: printed beside the test, so the helpers closing these gaps see which tests each one holds back
KNOWN_CLUSTER_GAPS: tuple[tuple[str, str], ...] = (
    (
        "error dialing backend",
        "the API server could not reach the node's kubelet API for exec/logs (the agent's "
        "kubeletapi; the suite checks a started server from inside a pod with exec)",
    ),
    (
        "where False = isinstance(None, int)",
        "a fresh spawner's poll() found a server already running: the pod an earlier test left "
        "when it failed at exec (run alone, this test fails at exec itself)",
    ),
)


@dataclass(frozen=True)
class TestResult:
    """One testcase of the junit xml."""

    __test__ = False  # not a test class, whatever pytest thinks of its name

    name: str  # module::test[param]
    outcome: str  # passed, failed, error, skipped
    needs_cluster: bool
    message: str  # the first line of the failure, error or skip message ("" if passed)
    text: str = ""  # the whole failure text, where the causes are recognised

    @property
    def function(self) -> str:
        return self.name.split("::")[-1].split("[")[0]

    def known_harness_issue(self) -> str | None:
        known = KNOWN_HARNESS_ISSUES.get(self.function)
        if known and self.outcome == "error" and known[0] in self.message:
            return known[1]
        return None

    def reason(self) -> str:
        """One line: a known harness issue, else a known cluster gap, else the message."""
        harness = self.known_harness_issue()
        if harness:
            return harness
        for signature, cause in KNOWN_CLUSTER_GAPS:
            if signature in self.text:
                return f"{cause} [{self.message}]"
        return self.message or "(no message)"


@dataclass(frozen=True)
class Summary:
    passed: int
    failed: int
    errors: int
    cluster_tests_passed: int
    cluster_tests: int


LAST_LINE = re.compile(r"^passed=(\d+) failed=(\d+) errors=(\d+) cluster_tests_passed=(\d+)/(\d+)$")


def format_last_line(summary: Summary) -> str:
    return (
        f"passed={summary.passed} failed={summary.failed} errors={summary.errors} "
        f"cluster_tests_passed={summary.cluster_tests_passed}/{summary.cluster_tests}"
    )


def parse_last_line(line: str) -> Summary:
    match = LAST_LINE.match(line.strip())
    if not match:
        raise ValueError(f"not a kubespawner_suite last line: {line!r}")
    return Summary(*(int(group) for group in match.groups()))


# -- results -----------------------------------------------------------------------------------


def _first_line(text: str | None, limit: int = 140) -> str:
    line = next((part.strip() for part in (text or "").splitlines() if part.strip()), "")
    return line if len(line) <= limit else line[: limit - 3] + "..."


def read_junit(path: Path) -> list[TestResult]:
    """The testcases of a pytest junit xml; a testcase with an <error> (a fixture failed in
    set-up or teardown) counts as an error even if its call passed or failed, as pytest does."""
    results = []
    for case in ET.parse(path).getroot().iter("testcase"):
        module = (case.get("classname") or "").replace(".", "/")
        name = f"{module}.py::{case.get('name')}" if module else str(case.get("name"))
        props = {p.get("name"): p.get("value") for p in case.iter("property")}
        outcome, message, text = "passed", "", ""
        for tag in ("error", "failure", "skipped"):
            element = case.find(tag)
            if element is not None:
                outcome = {"error": "error", "failure": "failed", "skipped": "skipped"}[tag]
                message = _first_line(element.get("message") or element.text)
                text = f"{element.get('message') or ''}\n{element.text or ''}"
                break
        needs_cluster = props.get("needs_cluster") == "true"
        results.append(TestResult(name, outcome, needs_cluster, message, text))
    return results


def summarize(results: list[TestResult]) -> Summary:
    counts = Counter(r.outcome for r in results)
    cluster = [r for r in results if r.needs_cluster]
    return Summary(
        passed=counts["passed"],
        failed=counts["failed"],
        errors=counts["error"],
        cluster_tests_passed=sum(r.outcome == "passed" for r in cluster),
        cluster_tests=len(cluster),
    )


def report(results: list[TestResult]) -> list[str]:
    """The table: outcomes split by cluster / no cluster, then every test that did not pass
    (skips included) with its reason; the last line is format_last_line's."""
    lines = [f"{'outcome':<10} {'cluster':>8} {'no cluster':>11} {'all':>5}"]
    for outcome in ("passed", "failed", "error", "skipped"):
        with_cluster = sum(r.outcome == outcome and r.needs_cluster for r in results)
        without = sum(r.outcome == outcome and not r.needs_cluster for r in results)
        lines.append(f"{outcome:<10} {with_cluster:>8} {without:>11} {with_cluster + without:>5}")
    lines.append(
        f"{'total':<10} {sum(r.needs_cluster for r in results):>8} "
        f"{sum(not r.needs_cluster for r in results):>11} {len(results):>5}"
    )
    not_passed = [r for r in results if r.outcome != "passed"]
    if not_passed:
        lines.append("")
        lines.append("not passed (outcome | needs cluster | test | reason):")
        for r in sorted(not_passed, key=lambda r: (not r.needs_cluster, r.outcome, r.name)):
            reason = r.reason()
            cluster = "cluster" if r.needs_cluster else "no-cluster"
            lines.append(f"{r.outcome:<7} | {cluster:<10} | {r.name} | {reason}")
    lines.append(format_last_line(summarize(results)))
    return lines


# -- the suite and its virtualenv --------------------------------------------------------------


class SuiteUnavailable(RuntimeError):
    """The suite of this KubeSpawner version could be found neither on PyPI nor in git."""


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
            f"{source}: {exc.stderr.strip()} (pass --suite-git with a reachable clone or URL)"
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
                (building / "ready.json").write_text(
                    json.dumps({"requirements": requirements, "suite_source": source}, indent=1)
                )
                if target.exists():
                    shutil.rmtree(target)
                building.rename(target)
            finally:
                shutil.rmtree(building, ignore_errors=True)
    return target / "suite", target / "venv/bin/python"


# -- the run -------------------------------------------------------------------------------


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
    parser.add_argument("pytest_args", nargs="*", help="passed to the suite's pytest (e.g. -k X)")
    args = parser.parse_args(argv)

    version = importlib.metadata.version(DISTRIBUTION)
    t0 = time.monotonic()
    suite, python = prepare(version, args.suite_git)
    ensure_binaries()
    with tempfile.TemporaryDirectory(prefix="gpulab-kubespawner-suite-") as tmp:
        root = Path(tmp)
        junit = root / "junit.xml"
        cluster = DevCluster(root / "cluster", log=lambda msg: None)
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
            pytest_args = list(args.pytest_args)
            if args.shim_ssl_fixture:
                pytest_args = ["-p", SSL_FIXTURE_SHIM, *pytest_args]
            rc = run_suite(suite, python, cluster.kubeconfig, junit, pytest_args, args.timeout)
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
        + (
            f" (NOT unmodified: with {SSL_FIXTURE_SHIM}, the upstream ssl_app fixture shimmed)"
            if args.shim_ssl_fixture
            else ""
        )
    )
    print("\n".join(report(results)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
