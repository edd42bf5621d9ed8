"""Build the control plane (kube-apiserver, kube-scheduler, kube-controller-manager, kube-proxy)
and etcd from Go modules once; cache them.

No Kubernetes server binary is in the registries this project can reach, but the Go module proxy
serves Kubernetes' source as modules, and every generated file is committed since 1.24, so plain
`go build` builds it. `k8s.io/kubernetes` itself cannot be `go install`ed: its go.mod maps each
`k8s.io/<staging>` module to `./staging/...`, which a dependency's replace cannot do. So a small
build module of our own requires `k8s.io/kubernetes vX` and replaces each staging module by its
published `v0.X.Y` twin, the way projects that build kube-scheduler out of tree do it
(kubernetes-sigs/scheduler-plugins). The list of staging modules, the `go` and `godebug` lines
are read from Kubernetes' own go.mod as the proxy serves it, never written out here.

Version stamps go in with `-ldflags` (`k8s.io/component-base/version`, `k8s.io/client-go/pkg/
version`): without them `/version` says v0.0.0, and Helm refuses a chart whose `kubeVersion`
asks for a real one. Build flags as upstream's: static (`CGO_ENABLED=0`), `-trimpath -s -w`,
tags `selinux,notest`.

etcd is built the same way in a module of its own: in Kubernetes' module, version selection
would lift the API server's etcd client to the server's version. etcd's own go.mod replaces its
siblings by paths too (etcd-io/etcd#18501), hence the build module rather than `go install`.

Each build runs in a work folder next to the cache and the finished binaries are moved in with
one `rename`, so an interrupted build never leaves a half-filled cache; a file lock keeps two
callers from building twice. Go's own module and build caches (`~/go/pkg/mod`,
`~/.cache/go-build`) make a rebuild a relink.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

KUBE_VERSION = "1.37.2"
#: the etcd release of Kubernetes 1.37 (its API server's client is go.etcd.io/etcd/client/v3
#: v3.7.0); the newest patch
ETCD_VERSION = "3.7.4"
#: kube-proxy: Services' ClusterIPs and NodePorts, as on a real node (iptables mode)
BINARIES = ("kube-apiserver", "kube-scheduler", "kube-controller-manager", "kube-proxy", "etcd")
KUBE_COMMANDS = tuple(f"k8s.io/kubernetes/cmd/{name}" for name in BINARIES if name != "etcd")
ETCD_COMMAND = "go.etcd.io/etcd/server/v3"
#: upstream's tags for the control plane (kubernetes/kubernetes hack/lib/golang.sh)
BUILD_TAGS = "selinux,notest"
#: the Go command (GOTOOLCHAIN=local: this machine's, which must be no older than the `go` line
#: of Kubernetes' go.mod)
GO = "go"


class BuildError(RuntimeError):
    """The control-plane binaries could not be installed or built; the message says which step."""


def cache_root() -> Path:
    """Where binaries are cached: `$GPULAB_KUBE_CACHE` or `~/.cache/gpulab/kubernetes-<version>`
    (etcd's version in the name too: a new etcd is a new cache)."""
    env = os.environ.get("GPULAB_KUBE_CACHE")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "gpulab" / f"kubernetes-{KUBE_VERSION}-etcd-{ETCD_VERSION}"


def bin_dir() -> Path:
    return cache_root() / "bin"


def cached_binaries() -> dict[str, Path] | None:
    """The binaries if the cache holds all of them, else None."""
    d = bin_dir()
    paths = {name: d / name for name in BINARIES}
    if all(p.is_file() and os.access(p, os.X_OK) for p in paths.values()):
        return paths
    return None


def _log(msg: str) -> None:
    print(f"gpulab dev-cluster: {msg}", file=sys.stderr, flush=True)


#: nftables: the node agent enforces NetworkPolicies with it; iproute2: it makes the pods'
#: network namespaces and veths with `ip`; dnsmasq-base: the cluster's DNS; iptables (Debian's:
#: the nf_tables backend) and conntrack: kube-proxy's; procps: `sysctl` in the nodes' namespace;
#: openssl: the cluster's PKI
RUNTIME_PACKAGES = (
    "openssl",
    "nftables",
    "iproute2",
    "dnsmasq-base",
    "iptables",
    "conntrack",
    "procps",
)


def missing_system_packages(wanted: tuple[str, ...] = RUNTIME_PACKAGES) -> list[str]:
    """apt packages whose files are absent (checked by file, so no dpkg query is needed)."""
    checks = {
        "openssl": shutil.which("openssl"),
        "nftables": shutil.which("nft") or Path("/usr/sbin/nft").exists(),
        "iproute2": shutil.which("ip") or Path("/usr/sbin/ip").exists(),
        "dnsmasq-base": shutil.which("dnsmasq") or Path("/usr/sbin/dnsmasq").exists(),
        "iptables": shutil.which("iptables") or Path("/usr/sbin/iptables").exists(),
        "conntrack": shutil.which("conntrack") or Path("/usr/sbin/conntrack").exists(),
        "procps": shutil.which("sysctl") or Path("/usr/sbin/sysctl").exists(),
    }
    return [pkg for pkg, ok in checks.items() if not ok and pkg in wanted]


def ensure_system_packages(packages: list[str] | None = None) -> None:
    """Install the apt packages the control plane and the node agent need, if any is missing."""
    missing = missing_system_packages() if packages is None else packages
    if not missing:
        return
    if os.geteuid() != 0:
        raise BuildError(
            f"missing system packages {' '.join(missing)}; install them with "
            f"'sudo apt-get install -y {' '.join(missing)}' (or run as root)"
        )
    _log(f"installing {' '.join(missing)} with apt")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    _run(["apt-get", "update", "-q"], env=env, what="apt-get update")
    _run(["apt-get", "install", "-y", "-q", *missing], env=env, what="apt-get install")


def _run(cmd: list[str], *, what: str, log: Path | None = None, **kw) -> str:
    """Run `cmd`; its output (also appended to `log`). A failure raises BuildError with the
    output's last lines."""
    if log is None:
        proc = subprocess.run(cmd, capture_output=True, text=True, **kw)
        out = proc.stdout + proc.stderr
    else:
        with log.open("a") as fh:
            fh.write(f"\n$ {' '.join(cmd)}\n")
            fh.flush()
            # own process group: an interrupted build takes the compilers with it
            proc = subprocess.Popen(
                cmd,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,
                **kw,
            )
            try:
                out, _ = proc.communicate()
            except BaseException:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                raise
            fh.write(out)
    if proc.returncode != 0:
        tail = "\n".join(out.strip().splitlines()[-25:])
        where = f" (full log: {log})" if log else ""
        raise BuildError(f"{what} failed with exit code {proc.returncode}{where}:\n{tail}")
    return out


def go_environment(work: Path) -> dict[str, str]:
    """The build's environment: this machine's Go only (never a toolchain download), static
    binaries, no VCS stamping (the build module is no repository)."""
    if not shutil.which(GO):
        raise BuildError(
            "Go is not installed: the control plane is built from Go modules "
            "(Go >= 1.26 and the Go module proxy; see devcluster/build.py)"
        )
    env = dict(os.environ, GOTOOLCHAIN="local", CGO_ENABLED="0", GOFLAGS="-buildvcs=false")
    env.setdefault("HOME", str(work))
    return env


def staging_replaces(kubernetes_go_mod: str, version: str) -> list[str]:
    """`module=module@v0.X.Y` for each `k8s.io/<staging> => ./staging/...` line of Kubernetes'
    go.mod (pure): the published twin of each staging module at release `version` (1.X.Y)."""
    twin = "v0." + version.split(".", 1)[1]
    names = re.findall(r"^\s*(k8s\.io/\S+)\s+=>\s+\./staging/", kubernetes_go_mod, re.MULTILINE)
    if not names:
        raise BuildError(
            "Kubernetes' go.mod maps no staging module: not a k8s.io/kubernetes go.mod"
        )
    return [f"{name}={name}@{twin}" for name in sorted(set(names))]


def directives(go_mod: str, word: str) -> list[str]:
    """The values of the `word` lines of a go.mod (`go`, `godebug`), single-line form (pure)."""
    return re.findall(rf"^{word}\s+(\S+)\s*$", go_mod, re.MULTILINE)


def version_ldflags(version: str, build_date: str) -> str:
    """`-ldflags` for Kubernetes binaries reporting `version` (pure)."""
    major, minor = version.split(".")[:2]
    flags = ["-s", "-w"]
    for package in ("k8s.io/component-base/version", "k8s.io/client-go/pkg/version"):
        for key, value in (
            ("gitVersion", f"v{version}"),
            ("gitMajor", major),
            ("gitMinor", minor),
            ("gitTreeState", "clean"),
            ("buildDate", build_date),
        ):
            flags.append(f"-X {package}.{key}={value}")
    return " ".join(flags)


def ensure_binaries(*, force: bool = False) -> dict[str, Path]:
    """Return the cached binaries, building them first if the cache lacks them (minutes, cold)."""
    return locked_build(
        cache_root(),
        cached_binaries,
        _build,
        force=force,
        missing=f"the build finished but {bin_dir()} lacks {', '.join(BINARIES)}",
    )


def locked_build(
    root: Path,
    cached: Callable[[], T | None],
    build: Callable[[Path], None],
    *,
    force: bool,
    missing: str,
) -> T:
    """What `cached()` finds in the cache under `root`, after `build(root)` under the cache's
    file lock when it finds nothing (or `force`); BuildError(`missing`) if the build left
    nothing. A caller that finds the lock held waits for the other's build and uses it."""
    if not force and (found := cached()):
        return found
    root.mkdir(parents=True, exist_ok=True)
    with (root / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another caller may be building: wait for it
        if not force and (found := cached()):
            return found
        build(root)
    found = cached()
    if not found:
        raise BuildError(missing)
    return found


@contextlib.contextmanager
def staged_build(
    root: Path, what: str, binaries: Sequence[str]
) -> Iterator[tuple[Path, Path, Path, dict[str, str]]]:
    """A build of `binaries` into the cache under `root`: yields (work folder, staging folder,
    log, Go's environment); once the body returns, each binary must be in the staging folder,
    which then replaces `root/bin` with one `rename` (an interrupted build leaves no half-filled
    cache), and `BUILD_SECONDS` records the time. The work folder is removed either way."""
    for stale in [*root.glob("build-*"), *root.glob("bin-*")]:  # left by an interrupted build
        shutil.rmtree(stale, ignore_errors=True)
    work = Path(tempfile.mkdtemp(prefix="build-", dir=root))
    log = root / "build.log"
    log.write_text("")
    start = time.monotonic()
    _log(
        f"building {what} from Go modules in {work} "
        f"(minutes cold on 2 cores, a relink when Go's caches are warm; log {log})"
    )
    try:
        staged = Path(tempfile.mkdtemp(prefix="bin-", dir=root))
        os.chmod(staged, 0o755)
        yield work, staged, log, go_environment(work)
        for name in binaries:
            if not (staged / name).is_file():
                raise BuildError(f"the build left no {name} in {staged}; log {log}")
            os.chmod(staged / name, 0o755)
        final = root / "bin"
        if final.exists():  # incomplete or forced rebuild: replace it
            old = root / f"bin-old-{os.getpid()}"
            final.rename(old)
            shutil.rmtree(old, ignore_errors=True)
        staged.rename(final)
        (root / "BUILD_SECONDS").write_text(f"{time.monotonic() - start:.0f}\n")
        _log(f"built {what} in {time.monotonic() - start:.0f} s; cached in {final}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _module(work: Path, name: str, env: dict[str, str], log: Path) -> Path:
    folder = work / name
    folder.mkdir()
    _run(
        [GO, "mod", "init", f"gpulab.invalid/{name}"],
        what="go mod init",
        log=log,
        cwd=folder,
        env=env,
    )
    return folder


def _build_kubernetes(work: Path, out: Path, env: dict[str, str], log: Path) -> None:
    module = _module(work, "k8s-build", env, log)
    info = download_info(f"k8s.io/kubernetes@v{KUBE_VERSION}", module, env)
    go_mod = Path(info["GoMod"]).read_text()
    edits = [f"-go={v}" for v in directives(go_mod, "go")]
    edits += [f"-godebug={v}" for v in directives(go_mod, "godebug")]
    edits += [f"-replace={r}" for r in staging_replaces(go_mod, KUBE_VERSION)]
    _run([GO, "mod", "edit", *edits], what="go mod edit", log=log, cwd=module, env=env)
    commands = [f"{c}@v{KUBE_VERSION}" for c in KUBE_COMMANDS]
    _run([GO, "get", "-tool", *commands], what="go get (Kubernetes)", log=log, cwd=module, env=env)
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    _run(
        [
            GO,
            "build",
            "-trimpath",
            "-tags",
            BUILD_TAGS,
            "-ldflags",
            version_ldflags(KUBE_VERSION, date),
            "-o",
            f"{out}/",
            *KUBE_COMMANDS,
        ],
        what="go build (Kubernetes)",
        log=log,
        cwd=module,
        env=env,
    )


def download_info(
    module_version: str, cwd: Path, env: dict[str, str], need: str = "GoMod"
) -> dict[str, Any]:
    """`go mod download -json`'s answer for one module (downloading it if needed): `Dir` (its
    files in Go's module cache), `GoMod`, `Origin` (the commit, where the proxy tells it);
    BuildError when the proxy refuses it or the answer lacks `need`."""
    proc = subprocess.run(
        [GO, "mod", "download", "-json", module_version],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env,
    )
    try:
        info = json.loads(proc.stdout)
    except ValueError:
        info = {}
    if proc.returncode != 0 or need not in info:
        why = info.get("Error") or proc.stderr.strip()[-2000:]
        raise BuildError(f"the Go module proxy did not give {module_version}: {why}")
    return dict(info)


def _build_etcd(work: Path, out: Path, env: dict[str, str], log: Path) -> None:
    module = _module(work, "etcd-build", env, log)
    _run(
        [GO, "get", "-tool", f"{ETCD_COMMAND}@v{ETCD_VERSION}"],
        what="go get (etcd)",
        log=log,
        cwd=module,
        env=env,
    )
    # -o names it: the package's own name would be "v3"
    _run(
        [GO, "build", "-trimpath", "-ldflags", "-s -w", "-o", str(out / "etcd"), ETCD_COMMAND],
        what="go build (etcd)",
        log=log,
        cwd=module,
        env=env,
    )


def _build(root: Path) -> None:
    what = f"Kubernetes {KUBE_VERSION} and etcd {ETCD_VERSION}"
    with staged_build(root, what, BINARIES) as (work, staged, log, env):
        _build_kubernetes(work, staged, env, log)
        _build_etcd(work, staged, env, log)
