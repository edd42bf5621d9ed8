"""Pure parts of the dev cluster: node resources and labels, env and command-line rules."""

from __future__ import annotations

import signal
import stat
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from gpulab.devcluster import NodeSpec
from gpulab.devcluster.agent import pause
from gpulab.devcluster.agent.devices import Devices
from gpulab.devcluster.agent.netpolicy import PodNet, compile_ruleset, pod_to_pod
from gpulab.devcluster.agent.podenv import (
    EnvError,
    container_argv,
    container_env,
    expand,
    field_value,
)
from gpulab.devcluster.agent.podsecurity import SecurityConfigError, identity
from gpulab.devcluster.spec import annotations, capacity, labels, taints


def test_a_gpu_is_offered_one_way_as_nvidias_device_plugin_does() -> None:
    # MIG (mixed strategy): MIG-enabled GPUs only as instances, the others as nvidia.com/gpu
    mig = NodeSpec("n", gpus=3, mig={"1g.10gb": 7}, mig_gpus=1)
    cap = capacity(mig)
    assert cap["nvidia.com/gpu"] == "2" and cap["nvidia.com/mig-1g.10gb"] == "7"
    assert labels(mig)["nvidia.com/gpu.count"] == "3"
    assert labels(mig)["nvidia.com/mig.strategy"] == "mixed"
    assert labels(mig)["nvidia.com/mig-1g.10gb.count"] == "7"
    # time-slicing with renameByDefault: replicas only, no nvidia.com/gpu, -SHARED product
    ts = NodeSpec("t", gpus=2, sharing="time-slicing", replicas=3)
    cap = capacity(ts)
    assert "nvidia.com/gpu" not in cap and cap["nvidia.com/gpu.shared"] == "6"
    assert labels(ts)["nvidia.com/gpu.product"] == "NVIDIA-A100-SXM4-80GB-SHARED"
    assert labels(ts)["nvidia.com/gpu.replicas"] == "3"
    # HAMi: split virtual GPUs per GPU, memory and cores, the registration annotation
    hami = NodeSpec("h", gpus=2, sharing="hami")
    cap = capacity(hami)
    assert cap["nvidia.com/gpu"] == "20"
    assert cap["nvidia.com/gpumem"] == str(2 * 81920) and cap["nvidia.com/gpucores"] == "200"
    register = annotations(hami)["hami.io/node-nvidia-register"].split(":")
    assert register[1] == "GPU-h-1,10,81920,100,NVIDIA-A100-SXM4-80GB,0,true"
    # whole GPUs: no sharing resources at all
    plain = capacity(NodeSpec("p", gpus=2))
    assert plain["nvidia.com/gpu"] == "2" and plain["pods"] == "110"
    assert not {"nvidia.com/gpumem", "nvidia.com/gpu.shared"} & plain.keys()


def test_a_mig_layout_must_fit_one_gpu() -> None:
    with pytest.raises(ValueError, match="does not fit one GPU"):
        NodeSpec("n", mig={"3g.40gb": 3})  # 9 compute slices of 7
    with pytest.raises(ValueError, match="not a MIG profile"):
        NodeSpec("n", mig={"big": 1})
    with pytest.raises(ValueError, match="NodeSpec.sharing"):
        NodeSpec("n", sharing="mps")


def test_spot_node_is_labelled_and_tainted() -> None:
    spec = NodeSpec("s", spot=True)
    assert labels(spec)["gpulab.io/capacity-type"] == "spot"
    assert taints(spec) == [{"key": "gpulab.io/spot", "value": "true", "effect": "NoSchedule"}]


def test_node_spec_rejects_bad_values_with_the_field_name() -> None:
    with pytest.raises(ValueError, match="NodeSpec.gpus"):
        NodeSpec("n", gpus=-1)
    with pytest.raises(ValueError, match="NodeSpec.name"):
        NodeSpec("Bad Name")


def test_node_spec_round_trips_through_a_dict() -> None:
    spec = NodeSpec("n", mig={"3g.40gb": 2}, labels={"a": "b"})
    assert NodeSpec.from_dict(spec.to_dict()) == spec


def test_expand_follows_kubernetes_rules() -> None:
    env = {"A": "1"}
    assert expand("$(A)-$(B)-$$(A)", env) == "1-$(B)-$(A)"


def test_env_resolves_field_refs_and_keeps_the_any_address() -> None:
    pod = {
        "metadata": {"name": "p", "namespace": "ns", "uid": "u", "labels": {"app": "x"}},
        "spec": {"nodeName": "n1"},
        "status": {"podIP": "127.9.1.5"},
    }
    container = {
        "name": "c",
        "env": [
            {"name": "IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {"name": "URL", "value": "http://0.0.0.0:8888/"},
            {"name": "SELF", "value": "$(IP)"},
        ],
        "args": ["--ip=0.0.0.0", "$(SELF)"],
    }
    env = container_env(pod, container, base={}, configmaps={}, secrets={}, node_capacity={})
    # a pod's 0.0.0.0 is its own network namespace's: left as it is
    assert env == {"IP": "127.9.1.5", "URL": "http://0.0.0.0:8888/", "SELF": "127.9.1.5"}
    assert container_argv(container, env) == ["--ip=0.0.0.0", "127.9.1.5"]
    assert field_value(pod, "metadata.labels['app']") == "x"


def test_missing_configmap_key_is_a_config_error_that_names_it() -> None:
    container = {
        "name": "c",
        "env": [{"name": "X", "valueFrom": {"configMapKeyRef": {"name": "cm", "key": "k"}}}],
    }
    pod = {"metadata": {"name": "p", "namespace": "ns"}, "spec": {}, "status": {}}
    with pytest.raises(EnvError, match='configmap "cm" has no key "k"'):
        container_env(
            pod, container, base={}, configmaps={"cm": {"data": {}}}, secrets={}, node_capacity={}
        )


def test_device_plugin_hands_out_distinct_gpus_and_mig_instances() -> None:
    devices = Devices(NodeSpec("n", gpus=5, mig={"1g.10gb": 2}, mig_gpus=1))

    def ask(res: str, n: int) -> dict:
        return {"name": "c", "resources": {"limits": {res: str(n)}}}

    a = devices.allocate("pod-a/c", ask("nvidia.com/gpu", 2))["NVIDIA_VISIBLE_DEVICES"]
    b = devices.allocate("pod-b/c", ask("nvidia.com/gpu", 2))["NVIDIA_VISIBLE_DEVICES"]
    assert len(set(a.split(",")) | set(b.split(","))) == 4
    assert devices.allocate("pod-a/c", ask("nvidia.com/gpu", 2))["NVIDIA_VISIBLE_DEVICES"] == a
    mig = devices.allocate("pod-c/c", ask("nvidia.com/mig-1g.10gb", 1))
    assert mig["NVIDIA_VISIBLE_DEVICES"].startswith("MIG-n-0-1g.10gb-")
    assert "GPU-n-0" not in a + b  # the MIG-enabled GPU is never handed out whole
    devices.release("pod-a")
    again = devices.allocate("pod-d/c", ask("nvidia.com/gpu", 2))["NVIDIA_VISIBLE_DEVICES"]
    assert set(again.split(",")) == set(a.split(","))


def test_hami_virtual_gpus_of_one_container_sit_on_different_gpus() -> None:
    devices = Devices(NodeSpec("n", gpus=2, sharing="hami", replicas=4))
    two = devices.allocate("p/c", {"name": "c", "resources": {"limits": {"nvidia.com/gpu": "2"}}})
    assert sorted(two["NVIDIA_VISIBLE_DEVICES"].split(",")) == ["GPU-n-0", "GPU-n-1"]
    for k in range(6):  # 8 virtual GPUs in all, 2 taken
        one = devices.allocate(
            f"q{k}/c", {"name": "c", "resources": {"limits": {"nvidia.com/gpu": "1"}}}
        )
        assert one["NVIDIA_VISIBLE_DEVICES"] in ("GPU-n-0", "GPU-n-1")


def test_hami_limits_appear_as_hami_environment() -> None:
    devices = Devices(NodeSpec("n", gpus=1, sharing="hami"))
    c = {
        "name": "c",
        "resources": {
            "limits": {
                "nvidia.com/gpu": "1",
                "nvidia.com/gpumem": "10000",
                "nvidia.com/gpucores": "30",
            }
        },
    }
    env = devices.allocate("p/c", c)
    assert env == {
        "NVIDIA_VISIBLE_DEVICES": "GPU-n-0",
        "CUDA_DEVICE_MEMORY_LIMIT_0": "10000m",
        "CUDA_DEVICE_SM_LIMIT": "30",
    }


# -- security context and NetworkPolicy rules (pure) ----------------------------------------------


def _pod(spec_sc: dict | None = None, **container_sc: object) -> tuple[dict, dict]:
    container = {"name": "main", "securityContext": dict(container_sc)}
    pod = {
        "metadata": {"name": "p", "namespace": "ns", "uid": "u-1"},
        "spec": {"securityContext": spec_sc or {}, "containers": [container]},
    }
    return pod, container


def test_the_containers_security_context_overrides_the_pods() -> None:
    pod, c = _pod(
        {"runAsUser": 1000, "runAsGroup": 100, "fsGroup": 100, "supplementalGroups": [5, 100]},
        runAsUser=1234,
        allowPrivilegeEscalation=False,
        capabilities={"drop": ["NET_RAW", "cap_sys_admin"]},
    )
    ident = identity(pod, c, image_uid=0)
    assert (ident.uid, ident.gid, ident.groups) == (1234, 100, (100, 5))
    assert ident.no_new_privs is True
    assert ident.drop_capabilities == (13, 21)


def test_privileged_keeps_capabilities_and_may_escalate() -> None:
    pod, c = _pod(
        {"runAsUser": 1000},
        privileged=True,
        allowPrivilegeEscalation=False,
        capabilities={"drop": ["ALL"]},
    )
    ident = identity(pod, c, image_uid=0)
    assert (ident.no_new_privs, ident.drop_capabilities) == (False, ())


def test_run_as_non_root_passes_for_a_non_root_image_user_and_unknown_capabilities_fail() -> None:
    pod, c = _pod({"runAsNonRoot": True})
    assert identity(pod, c, image_uid=1000).uid == 1000  # an image whose USER is not root
    pod, c = _pod(capabilities={"drop": ["FLY"]})
    with pytest.raises(SecurityConfigError, match="unknown capability 'FLY'"):
        identity(pod, c, image_uid=0)


WEB = PodNet("w", "ns", {"app": "web"}, "10.200.1.2", {"http": ("tcp", 8000)})
CLIENT = PodNet("c", "ns", {"role": "client"}, "10.200.1.3")
OTHER_NS = PodNet("o", "other", {"role": "client"}, "10.200.1.4")


def _policy(ns: str, selector: dict, **spec: object) -> dict:
    return {"metadata": {"name": "p", "namespace": ns}, "spec": {"podSelector": selector, **spec}}


def test_a_connection_needs_the_senders_egress_and_the_receivers_ingress() -> None:
    ingress = _policy(
        "ns",
        {"matchLabels": {"app": "web"}},
        ingress=[{"from": [{"podSelector": {}}], "ports": [{"port": "http"}, {"port": 9000}]}],
    )
    egress = _policy(
        "ns",
        {"matchExpressions": [{"key": "role", "operator": "Exists"}]},
        policyTypes=["Egress"],
        egress=[
            {
                "to": [{"ipBlock": {"cidr": "10.200.1.0/24", "except": ["10.200.1.4/32"]}}],
                "ports": [{"port": 8000}, {"port": 8001}],
            }
        ],
    )
    assert pod_to_pod(CLIENT, WEB, [ingress], {}) == {("tcp", 8000), ("tcp", 9000)}
    assert pod_to_pod(CLIENT, WEB, [ingress, egress], {}) == {("tcp", 8000)}
    # a podSelector alone means the policy's namespace: a pod of another namespace is refused
    assert pod_to_pod(OTHER_NS, WEB, [ingress], {}) == frozenset()
    by_ns = _policy(
        "ns",
        {"matchLabels": {"app": "web"}},
        ingress=[{"from": [{"namespaceSelector": {"matchLabels": {"team": "a"}}}]}],
    )
    assert pod_to_pod(OTHER_NS, WEB, [by_ns], {"other": {"team": "a"}}) is None  # every port
    assert pod_to_pod(OTHER_NS, WEB, [by_ns], {"other": {"team": "b"}}) == frozenset()
    assert pod_to_pod(WEB, CLIENT, [ingress], {}) is None  # CLIENT is selected by nothing


def test_the_ruleset_knows_pods_by_address_and_refuses_what_no_rule_allows() -> None:
    policy = _policy(
        "ns",
        {"matchLabels": {"app": "web"}},
        ingress=[{"from": [{"ipBlock": {"cidr": "10.200.0.1/32"}}], "ports": [{"port": "http"}]}],
    )
    text = compile_ruleset("t", [WEB, CLIENT], [policy], {})
    forward = text.split("chain forward {")[1].split("}\n", 1)[0]
    output = text.split("chain output {")[1].split("}\n", 1)[0]
    for hook in (forward, output):  # from pods and from host processes
        assert "ip daddr 10.200.1.2 jump to_10_200_1_2" in hook
    to_web = text.split("chain to_10_200_1_2 {")[1].split("}\n", 1)[0]
    assert "ip saddr 10.200.0.1/32 meta l4proto tcp th dport { 8000 } accept" in to_web
    assert "ip saddr 10.200.1.3 " not in to_web  # CLIENT may not connect: no line lets it
    assert "ip saddr { 10.200.1.2, 10.200.1.3 } jump refuse" in to_web
    # but a pod reaching itself through a Service (hairpin) always passes, and first
    assert to_web.strip().splitlines()[0] == "ip saddr 10.200.1.2 accept"
    assert to_web.rstrip().endswith("reject")
    to_client = text.split("chain to_10_200_1_3 {")[1].split("}\n", 1)[0]
    assert "ip saddr 10.200.1.2 accept" in to_client  # CLIENT is open to all
    assert to_client.rstrip().endswith("accept")
    assert "masquerade" not in text  # this machine's table does (podnet.host_table)


@pytest.mark.parametrize(
    ("image", "is_pause"),
    [
        ("registry.k8s.io/pause:3.9", True),
        ("k8s.gcr.io/pause", True),
        ("gcr.io/google_containers/pause-amd64:3.1", True),
        ("registry.k8s.io/pause@sha256:" + "0" * 64, True),
        ("ghcr.io/gpulab/gpulab-singleuser:0.1.0", False),
        ("example.org/pauses:1", False),
        ("localhost:5000/pause", True),
    ],
)
def test_pause_images_are_recognised_by_repository_name(image: str, is_pause: bool) -> None:
    assert pause.is_pause_image(image) is is_pause


def _catches(pid: int, signum: int) -> bool:
    with open(f"/proc/{pid}/status") as f:
        caught = next(int(line.split()[1], 16) for line in f if line.startswith("SigCgt:"))
    return bool(caught & (1 << (signum - 1)))


def test_the_pause_command_sleeps_until_sigterm_and_exits_0() -> None:
    proc = subprocess.Popen(pause.argv())
    try:
        # SIGTERM only once its handler is in place (SigCgt: the signals it catches)
        deadline = time.monotonic() + 30
        while not _catches(proc.pid, signal.SIGTERM):
            assert proc.poll() is None, "pause exited before it was told to"
            assert time.monotonic() < deadline, "pause never installed its SIGTERM handler"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
    finally:
        proc.kill()
        proc.wait()


class _Response:
    """What a kubernetes_asyncio call with _preload_content=False returns (the parts `raw` reads)."""

    def __init__(self, status: int, body: dict[str, Any] | None = None) -> None:
        self.status, self.reason, self._body = status, "", body or {}

    async def text(self) -> str:
        return str(self._body)

    async def json(self) -> dict[str, Any]:
        return self._body

    def release(self) -> None:
        pass


class _Core:
    """The two PersistentVolume calls of the provisioner, on a dict of PVs."""

    def __init__(self) -> None:
        self.pvs: dict[str, dict[str, Any]] = {}

    async def read_persistent_volume(self, name: str, **_: Any) -> _Response:
        return _Response(200, self.pvs[name]) if name in self.pvs else _Response(404)

    async def create_persistent_volume(self, pv: dict[str, Any], **_: Any) -> _Response:
        if pv["metadata"]["name"] in self.pvs:
            return _Response(409)
        self.pvs[pv["metadata"]["name"]] = pv
        return _Response(201, pv)


class _Events:
    async def emit(self, *_: Any, **__: Any) -> None:
        pass


async def test_a_claims_later_event_leaves_its_provisioned_folder_as_its_pod_made_it(
    tmp_path: Path,
) -> None:
    """Controllers update a claim between its PV's creation and its binding, and each update is
    an event without volumeName; provisioning it again reset the folder to 0755 after its pod's
    fsGroup had made it group-writable (a burst of 10 spawns: 4 homes refused the server)."""
    from kubernetes_asyncio import client

    from gpulab.devcluster.agent.podsecurity import set_volume_ownership
    from gpulab.devcluster.agent.volumes import STORAGE_CLASS, Provisioner

    api = client.ApiClient()
    provisioner = Provisioner(api, tmp_path / "volumes")
    provisioner.core = _Core()  # type: ignore[assignment]
    provisioner.events = _Events()  # type: ignore[assignment]
    claim = {
        "metadata": {"name": "gpulab-home-ann", "namespace": "default", "uid": "u-1"},
        "spec": {"storageClassName": STORAGE_CLASS, "resources": {"requests": {"storage": "1Gi"}}},
    }
    await provisioner._on_pvc("ADDED", claim)
    folder = tmp_path / "volumes" / "pvc-u-1"
    assert stat.S_IMODE(folder.stat().st_mode) == 0o755
    set_volume_ownership(folder, 100, read_only=False)  # the pod's start
    made = stat.S_IMODE(folder.stat().st_mode)
    assert made & stat.S_IWGRP and made & stat.S_ISGID
    await provisioner._on_pvc("MODIFIED", claim)  # an annotation, no volumeName yet
    assert stat.S_IMODE(folder.stat().st_mode) == made
    assert list(provisioner.core.pvs) == ["pvc-u-1"]  # type: ignore[attr-defined]
    await api.close()
