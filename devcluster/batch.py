"""Kueue and JobSet beside the dev cluster: out-of-cluster controllers on this machine, as the
Dask operator runs in gpulab's kube tests.

    with running_jobset(cluster), running_kueue(cluster):
        ...  # JobSets labelled kueue.x-k8s.io/queue-name wait for their ClusterQueue's quota

Each context builds its controller on first use (`addons.ensure_binary`: minutes, once per
machine), applies the module's CRDs (with a conversion webhook where its kustomization gives one),
makes a CA and a serving certificate for 127.0.0.1 (`pki.LoopbackPKI`), writes the controller's
Configuration (`batch_manifests`: leader election off; metrics, health and webhooks on loopback,
ports picked free), starts it with the cluster's kubeconfig, waits for its readiness probe
(certificates loaded, webhook server listening), then registers its Mutating and Validating
webhook configurations with `clientConfig.url: https://127.0.0.1:PORT/...` and the CA as
`caBundle` (the API server runs here, so it reaches loopback). On exit the webhook configurations
are deleted first (they fail closed: left behind, they would refuse every JobSet), then the
process is stopped (SIGTERM, SIGKILL after the grace). The CRDs stay, as an operator's do: the
next start applies them again (PUT) with its own port.

Kueue v0.17 with its internal certificate management off reads the metrics server's certificate
from a fixed path, `/etc/kueue/metrics/certs` (cmd/kueue/main.go). Rather than writing into the
host's /etc, Kueue runs in a mount namespace of its own (`unshare --mount`) whose /etc is an
overlay of the host's with that folder added from the state directory.

Files: `STATE/batch/<name>/` (config.yaml, pki/, the overlay's folders), logs in
`STATE/logs/<name>.log` (kept by `down`).
"""

from __future__ import annotations

import contextlib
import shutil
import time
import urllib.error
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from . import addons, batch_manifests, procs
from .addons import JOBSET, KUEUE, GoController
from .pki import LoopbackPKI
from .state import CRD_API, ClusterState, DevClusterError

WEBHOOK_APIS = {
    "MutatingWebhookConfiguration": "/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations",
    "ValidatingWebhookConfiguration": "/apis/admissionregistration.k8s.io/v1/validatingwebhookconfigurations",
}
#: the API groups whose webhooks Kueue registers here: its own and the integration it runs with
KUEUE_WEBHOOK_GROUPS = {"kueue.x-k8s.io", "jobset.x-k8s.io"}
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"


@dataclass
class RunningController:
    """A controller started by `running_kueue` / `running_jobset`."""

    name: str
    proc: procs.Proc
    log: Path
    webhook_url: str
    health_url: str
    metrics_address: str
    webhook_configurations: list[str] = field(default_factory=list)


def _put(cluster: ClusterState, collection: str, obj: dict[str, Any]) -> None:
    """Create `obj`, or replace it (keeping its resourceVersion) when it exists."""
    try:
        cluster.api("POST", collection, obj, timeout=60)
    except urllib.error.HTTPError as e:
        if e.code != 409:
            raise DevClusterError(f"creating {obj['metadata']['name']}: {_why(e)}") from e
        path = f"{collection}/{obj['metadata']['name']}"
        current = cluster.api("GET", path)
        obj = {**obj, "metadata": {**obj["metadata"], **_version(current)}}
        cluster.api("PUT", path, obj, timeout=60)


def _version(obj: dict[str, Any]) -> dict[str, str]:
    return {"resourceVersion": obj["metadata"]["resourceVersion"]}


def _why(e: urllib.error.HTTPError) -> str:
    return f"HTTP {e.code}: {e.read().decode(errors='replace')[:500]}"


def apply_crds(cluster: ClusterState, module: Path, webhook_url: str, ca_bundle: str) -> None:
    """The CRDs of the module in `module`, established (conversion through the controller where
    the module's kustomization converts)."""
    converting = batch_manifests.conversion_crd_names(module)
    names = []
    for crd in batch_manifests.crds(module):
        if crd["metadata"]["name"] in converting:
            crd = batch_manifests.with_conversion_webhook(crd, webhook_url, ca_bundle)
        _put(cluster, CRD_API, crd)
        names.append(crd["metadata"]["name"])
    cluster._wait(
        f"the CRDs {names} Established",
        time.monotonic() + 60,
        lambda: cluster.crds_established(names),
    )


def _ensure_namespace(cluster: ClusterState, name: str) -> None:
    with contextlib.suppress(urllib.error.HTTPError):  # 409: it exists
        cluster.api("POST", "/api/v1/namespaces", {"metadata": {"name": name}})


def _wait_ready(cluster: ClusterState, ctl: RunningController, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not cluster._http_ok(ctl.health_url):
        if not ctl.proc.alive():
            raise DevClusterError(f"{ctl.name} exited while starting{_tail(ctl.log)}")
        if time.monotonic() > deadline:
            raise DevClusterError(f"{ctl.name} not ready within {timeout:.0f} s{_tail(ctl.log)}")
        time.sleep(0.3)


def _tail(log: Path, lines: int = 25) -> str:
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return ""
    return f"; last lines of {log}:\n" + "\n".join(text.strip().splitlines()[-lines:])


def _register_webhooks(cluster: ClusterState, docs: list[dict[str, Any]]) -> list[str]:
    names = []
    for doc in docs:
        _put(cluster, WEBHOOK_APIS[doc["kind"]], doc)
        names.append(f"{doc['kind']}/{doc['metadata']['name']}")
    return names


def _unregister_webhooks(cluster: ClusterState, names: list[str]) -> None:
    for entry in names:
        kind, name = entry.split("/", 1)
        with contextlib.suppress(urllib.error.HTTPError):  # 404: gone already
            cluster.api("DELETE", f"{WEBHOOK_APIS[kind]}/{name}")


@contextlib.contextmanager
def _running(
    cluster: ClusterState,
    c: GoController,
    config_for: Callable[..., dict[str, Any]],
    *,
    groups: set[str] | None,
    timeout: float,
    metrics_cert_at: str | None = None,
) -> Iterator[RunningController]:
    binary = addons.ensure_binary(c)
    folder = cluster.state_dir / "batch" / c.name
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True, mode=0o700)
    pki = LoopbackPKI(folder / "pki")
    pki.create(c.name)
    webhook_port, metrics_port, health_port = (procs.free_port() for _ in range(3))
    url = f"https://127.0.0.1:{webhook_port}"
    module = addons.module_dir(c)
    apply_crds(cluster, module, url, pki.ca_bundle())
    config = config_for(
        webhook_port=webhook_port,
        cert_dir=pki.cert_dir,
        metrics_port=metrics_port,
        health_port=health_port,
    )
    if "namespace" in config:
        _ensure_namespace(cluster, config["namespace"])
    (folder / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    argv = [str(binary), f"--config={folder / 'config.yaml'}", f"--kubeconfig={cluster.kubeconfig}"]
    if metrics_cert_at:
        argv = _with_etc_overlay(folder, pki, metrics_cert_at, argv)
    log = cluster.state_dir / "logs" / f"{c.name}.log"
    proc = procs.launch(c.name, argv, log, env=None)
    ctl = RunningController(
        name=c.name,
        proc=proc,
        log=log,
        webhook_url=url,
        health_url=f"http://127.0.0.1:{health_port}/readyz",
        metrics_address=f"127.0.0.1:{metrics_port}",
    )
    try:
        _wait_ready(cluster, ctl, timeout)
        docs = batch_manifests.webhook_configurations(module, url, pki.ca_bundle(), groups)
        ctl.webhook_configurations = _register_webhooks(cluster, docs)
        cluster.log(f"{c.name} v{c.version} running (pid {proc.pid}, webhooks {url}, log {log})")
        yield ctl
    finally:
        _unregister_webhooks(cluster, ctl.webhook_configurations)
        procs.stop([proc], grace_seconds=10)


def _with_etc_overlay(folder: Path, pki: LoopbackPKI, cert_path: str, argv: list[str]) -> list[str]:
    """`argv` in a mount namespace of its own whose /etc is the host's plus `cert_path` (a
    folder under /etc) holding the loopback certificate; nothing is written to the host's /etc."""
    upper, work = folder / "etc-upper", folder / "etc-work"
    certs = upper / Path(cert_path).relative_to("/etc")
    certs.mkdir(parents=True)
    work.mkdir()
    for name in ("tls.crt", "tls.key"):
        shutil.copy2(pki.cert_dir / name, certs / name)
    script = 'mount -t overlay overlay -o "lowerdir=/etc,upperdir=$1,workdir=$2" /etc && shift 2 && exec "$@"'
    unshare = shutil.which("unshare") or "/usr/bin/unshare"
    return [unshare, "--mount", "--propagation", "private", "--", "sh", "-c", script, "sh", str(upper), str(work), *argv]  # fmt: skip


@contextlib.contextmanager
def running_jobset(cluster: ClusterState, *, timeout: float = 120) -> Iterator[RunningController]:
    """JobSet's controller manager against `cluster` while the context lasts."""
    with _running(
        cluster, JOBSET, batch_manifests.jobset_config, groups=None, timeout=timeout
    ) as c:
        yield c


@contextlib.contextmanager
def running_kueue(cluster: ClusterState, *, timeout: float = 120) -> Iterator[RunningController]:
    """Kueue against `cluster` while the context lasts, with its JobSet integration on (start
    it inside `running_jobset`: JobSet's CRD must exist). Returns once a JobSet labelled with a
    queue name comes out of admission suspended (a dry run), so the webhooks are in force."""
    with _running(
        cluster,
        KUEUE,
        batch_manifests.kueue_config,
        groups=KUEUE_WEBHOOK_GROUPS,
        timeout=timeout,
        metrics_cert_at="/etc/kueue/metrics/certs",
    ) as c:
        _wait_jobset_webhook(cluster, timeout=30)
        yield c


def probe_jobset(queue: str) -> dict[str, Any]:
    """A one-pod JobSet labelled for `queue`, not suspended (pure): what a dry run sends."""
    pod = {"restartPolicy": "Never", "containers": [{"name": "c", "image": "pause", "command": ["true"]}]}  # fmt: skip
    job = {"spec": {"template": {"spec": pod}}}
    return {
        "apiVersion": "jobset.x-k8s.io/v1alpha2",
        "kind": "JobSet",
        "metadata": {"name": "gpulab-webhook-probe", "labels": {QUEUE_LABEL: queue}},
        "spec": {"replicatedJobs": [{"name": "probe", "replicas": 1, "template": job}]},
    }


def _wait_jobset_webhook(cluster: ClusterState, timeout: float) -> None:
    path = "/apis/jobset.x-k8s.io/v1alpha2/namespaces/default/jobsets?dryRun=All"
    deadline = time.monotonic() + timeout
    last = "no answer"
    while time.monotonic() < deadline:
        try:
            made = cluster.api("POST", path, probe_jobset("gpulab-probe"))
            if made.get("spec", {}).get("suspend") is True:
                return
            last = "the JobSet came back not suspended"
        except urllib.error.HTTPError as e:
            last = _why(e)
        time.sleep(0.3)
    raise DevClusterError(f"Kueue's JobSet webhook not in force within {timeout:.0f} s: {last}")
