"""Build kube-apiserver, kube-scheduler, kube-controller-manager and kube-proxy once; cache them.

No Kubernetes server binary is in the registries this project can reach, but Debian's source
package of Kubernetes 1.20.2 is, with its full ``vendor/`` tree, and Debian's Go builds it (see
``shared/notes/kubernetes-control-plane.md``). The build runs in a work folder next to the cache
and the finished binaries are moved in with one ``rename``, so an interrupted build never leaves a
half-filled cache; a file lock keeps two concurrent callers from building twice.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

KUBE_VERSION = "1.20.2"
#: kube-proxy: Services' ClusterIPs and NodePorts, as on a real node (iptables mode)
BINARIES = ("kube-apiserver", "kube-scheduler", "kube-controller-manager", "kube-proxy")
APT_PACKAGES = (
    "golang-go",
    "etcd-server",
    "rsync",
    "golang-github-modern-go-reflect2-dev",
    "openssl",
)
REFLECT2_SRC = Path("/usr/share/gocode/src/github.com/modern-go/reflect2")
DEBIAN_SRC_LINE = "deb-src http://deb.debian.org/debian bookworm main"


class BuildError(RuntimeError):
    """The control-plane binaries could not be installed or built; the message says which step."""


def cache_root() -> Path:
    """Where binaries are cached: ``$GPULAB_KUBE_CACHE`` or ``~/.cache/gpulab/kubernetes-1.20.2``."""
    env = os.environ.get("GPULAB_KUBE_CACHE")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "gpulab" / f"kubernetes-{KUBE_VERSION}"


def bin_dir() -> Path:
    return cache_root() / "bin"


def cached_binaries() -> dict[str, Path] | None:
    """The binaries if the cache holds all of them, else None (a cache from before kube-proxy
    was added lacks it: the next build replaces the whole folder)."""
    d = bin_dir()
    paths = {name: d / name for name in BINARIES}
    if all(p.is_file() and os.access(p, os.X_OK) for p in paths.values()):
        return paths
    return None


def _log(msg: str) -> None:
    print(f"gpulab dev-cluster: {msg}", file=sys.stderr, flush=True)


#: nftables: the node agent enforces NetworkPolicies with it; iproute2: it makes the pods'
#: network namespaces and veths with `ip`; dnsmasq-base: the cluster's DNS; iptables (Debian's:
#: the nf_tables backend) and conntrack: kube-proxy's; procps: `sysctl` in the nodes' namespace
RUNTIME_PACKAGES = (
    "etcd-server",
    "openssl",
    "nftables",
    "iproute2",
    "dnsmasq-base",
    "iptables",
    "conntrack",
    "procps",
)


def missing_system_packages(wanted: tuple[str, ...] = APT_PACKAGES) -> list[str]:
    """apt packages whose files are absent (checked by file, so no dpkg query is needed)."""
    checks = {
        "golang-go": shutil.which("go") or Path("/usr/lib/go/bin/go").exists(),
        "etcd-server": shutil.which("etcd"),
        "rsync": shutil.which("rsync"),
        "golang-github-modern-go-reflect2-dev": REFLECT2_SRC.is_dir(),
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
    """Install the apt packages the build and the control plane need, if any is missing."""
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


def _run(cmd: list[str], *, what: str, log: Path | None = None, **kw) -> None:
    if log is None:
        proc = subprocess.run(cmd, capture_output=True, text=True, **kw)
        out = proc.stdout + proc.stderr
    else:
        with log.open("a") as fh:
            fh.write(f"\n$ {' '.join(cmd)}\n")
            fh.flush()
            # own process group: an interrupted build takes make's compiler children with it
            proc = subprocess.Popen(
                cmd, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True, **kw
            )
            try:
                proc.wait()
            except BaseException:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                raise
        out = log.read_text(errors="replace")
    if proc.returncode != 0:
        tail = "\n".join(out.strip().splitlines()[-25:])
        where = f" (full log: {log})" if log else ""
        raise BuildError(f"{what} failed with exit code {proc.returncode}{where}:\n{tail}")


def ensure_binaries(*, force: bool = False) -> dict[str, Path]:
    """Return the cached binaries, building them first if the cache lacks them (minutes, cold)."""
    if not force and (found := cached_binaries()):
        return found
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    with (root / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another caller may be building: wait for it
        if not force and (found := cached_binaries()):
            return found
        ensure_system_packages()
        _build(root)
    found = cached_binaries()
    if not found:
        raise BuildError(f"the build finished but {bin_dir()} lacks {', '.join(BINARIES)}")
    return found


def _build(root: Path) -> None:
    for stale in [*root.glob("build-*"), *root.glob("bin-*")]:  # left by an interrupted build
        shutil.rmtree(stale, ignore_errors=True)
    work = Path(tempfile.mkdtemp(prefix="build-", dir=root))
    log = root / "build.log"
    log.write_text("")
    start = time.monotonic()
    _log(f"building Kubernetes {KUBE_VERSION} control plane in {work} (about 5+ min; log {log})")
    try:
        src_list = work / "src.list"
        src_list.write_text(DEBIAN_SRC_LINE + "\n")
        (work / "lists" / "partial").mkdir(parents=True)
        apt_opts = [
            "-o",
            f"Dir::Etc::SourceList={src_list}",
            "-o",
            "Dir::Etc::SourceParts=/dev/null",
            "-o",
            f"Dir::State::Lists={work / 'lists'}",
        ]
        _run(["apt-get", *apt_opts, "update"], what="apt-get update (deb-src)", log=log)
        _run(
            ["apt-get", *apt_opts, "source", "--download-only", "kubernetes"],
            what="apt-get source kubernetes",
            log=log,
            cwd=work,
        )
        tarballs = sorted(work.glob("kubernetes_*.orig.tar.gz"))
        if not tarballs:
            raise BuildError(f"apt-get source left no kubernetes_*.orig.tar.gz in {work}")
        _run(["tar", "xzf", str(tarballs[0]), "-C", str(work)], what="unpacking", log=log)
        k = work / f"kubernetes-{KUBE_VERSION}"
        if not k.is_dir():
            raise BuildError(f"the source tarball did not unpack to {k}")
        # Go >= 1.18 segfaults with the vendored reflect2 v1.0.1: use Debian's 1.0.2
        vendored = k / "vendor" / "github.com" / "modern-go" / "reflect2"
        shutil.rmtree(vendored)
        shutil.copytree(REFLECT2_SRC, vendored, symlinks=False)
        for f in [*vendored.glob("*_test.go"), vendored / "go.mod"]:
            f.unlink(missing_ok=True)
        gopath = work / "gp"
        (gopath / "src" / "k8s.io").mkdir(parents=True)
        (gopath / "src" / "k8s.io" / "kubernetes").symlink_to(k)
        (work / "home").mkdir()
        env = dict(
            os.environ,
            GOPATH=str(gopath),
            CGO_ENABLED="0",
            HOME=str(work / "home"),
        )
        env.pop("GOFLAGS", None)
        _run(
            ["make", "WHAT=" + " ".join(f"cmd/{b}" for b in BINARIES)],
            what="make (Kubernetes build)",
            log=log,
            cwd=gopath / "src" / "k8s.io" / "kubernetes",
            env=env,
        )
        out = k / "_output" / "local" / "bin" / "linux" / "amd64"
        staged = Path(tempfile.mkdtemp(prefix="bin-", dir=root))
        os.chmod(staged, 0o755)
        for name in BINARIES:
            shutil.copy2(out / name, staged / name)
            os.chmod(staged / name, 0o755)
        final = root / "bin"
        if final.exists():  # incomplete or forced rebuild: replace it
            old = root / f"bin-old-{os.getpid()}"
            final.rename(old)
            shutil.rmtree(old, ignore_errors=True)
        staged.rename(final)
        (root / "BUILD_SECONDS").write_text(f"{time.monotonic() - start:.0f}\n")
        _log(f"built in {time.monotonic() - start:.0f} s; binaries cached in {final}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
