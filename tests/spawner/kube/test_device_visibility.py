"""An image's `ENV NVIDIA_VISIBLE_DEVICES=all` never widens a server's share on Kubernetes.

The pod spec GPUKubeSpawner builds (placement -> `placed_pod`, the configured environment, then
`container_device_environment`, rendered by KubeSpawner's own `make_pod`) for every kind of
profile, with `all` configured as an image or `c.GPUKubeSpawner.environment` would set it; and
GPUKubeSpawner.get_env itself, on a spawner that never reaches a cluster."""

from __future__ import annotations

from fractions import Fraction
from typing import Any

import pytest
from jupyterhub.objects import Hub, Server
from kubespawner.objects import make_pod

from gpulab.hub.allocator import GPU, GpuShare, Placement, Request
from gpulab.hub.profiles import Profile
from gpulab.spawner.kube import GPUKubeSpawner
from gpulab.spawner.kube.gpu_resources import (
    HAMI,
    MIG,
    TIME_SLICING,
    container_device_environment,
    placed_pod,
)

A100 = "A100-SXM4-80GB"
A100_MIB = 81920
#: what an image built on jupyter/docker-stacks' CUDA images (or an admin's config) carries
WIDE_OPEN = {"NVIDIA_VISIBLE_DEVICES": "all", "TZ": "UTC"}

WHOLE_TWO = Profile("a100-2", "2 A100", Fraction(2), frozenset({A100}))
QUARTER = Profile("a100-quarter", "1/4 A100", Fraction(1, 4), frozenset({A100}))
CPU = Profile("cpu", "CPU only")


def server_pod(
    profile: Profile, gpus: tuple[GpuShare, ...], device: GPU | None, sharing: str
) -> dict[str, Any]:
    """The server pod's manifest as GPUKubeSpawner makes it: the placement's environment over
    the configured one, then the device rule (get_env), the placement's limits (KubeSpawner's
    extra_resource_limits)."""
    request = Request(
        id="alice/",
        owner="alice",
        num_gpu=profile.num_gpu,
        gpu_milli=profile.gpu_milli,
        gpu_models=profile.gpu_models,
        priority="on-demand",
    )
    placement = Placement(request=request, node="gpu-node-1", gpus=gpus, created_at=0.0)
    placed = placed_pod(
        profile,
        placement,
        sharing=sharing,
        priority="on-demand",
        device=device,
        gpu_memory_mib=A100_MIB,
    )
    env = container_device_environment(
        {**WIDE_OPEN, **placed.environment}, holds_gpus=bool(placement.gpus)
    )
    pod = make_pod(
        name="jupyter-alice",
        cmd=["jupyterhub-singleuser"],
        port=8888,
        image="ghcr.io/gpulab/gpulab-singleuser:0.1.0",
        env=env,
        extra_resource_limits=placed.gpu.limits,
    )
    return pod.to_dict() if hasattr(pod, "to_dict") else pod


def container_env(pod: dict[str, Any]) -> dict[str, str]:
    (container,) = pod["spec"]["containers"]
    return {e["name"]: e["value"] for e in container["env"] or []}


def gpu_limits(pod: dict[str, Any]) -> dict[str, str]:
    (container,) = pod["spec"]["containers"]
    limits = (container["resources"] or {}).get("limits") or {}
    return {k: v for k, v in limits.items() if k.startswith("nvidia.com/")}


@pytest.mark.parametrize(
    ("profile", "gpus", "device", "sharing", "limits"),
    [
        pytest.param(
            WHOLE_TWO,
            (GpuShare("gpu-node-1/gpu-0", 1000), GpuShare("gpu-node-1/gpu-1", 1000)),
            GPU("gpu-node-1/gpu-0", A100, A100_MIB),
            MIG,
            {"nvidia.com/gpu": "2"},
            id="whole",
        ),
        pytest.param(
            QUARTER,
            (GpuShare("gpu-node-1/mig-2g.20gb-0", 250),),
            GPU("gpu-node-1/mig-2g.20gb-0", A100, 20480, capacity_milli=250, mig_profile="2g.20gb"),
            MIG,
            {"nvidia.com/mig-2g.20gb": "1"},
            id="mig",
        ),
        pytest.param(
            QUARTER,
            (GpuShare("GPU-dddd", 300),),
            GPU("GPU-dddd", A100, A100_MIB, share_step_milli=100),
            HAMI,
            {"nvidia.com/gpu": "1", "nvidia.com/gpumem": "24576", "nvidia.com/gpucores": "30"},
            id="fractional-hami",
        ),
        pytest.param(
            QUARTER,
            (GpuShare("gpu-node-1/gpu-0/replica-1", 250),),
            GPU("gpu-node-1/gpu-0/replica-1", A100, A100_MIB, capacity_milli=250),
            TIME_SLICING,
            {"nvidia.com/gpu.shared": "1"},
            id="fractional-time-slicing",
        ),
    ],
)
def test_a_gpu_pod_leaves_its_devices_to_the_device_plugin_over_an_image_that_says_all(
    profile: Profile,
    gpus: tuple[GpuShare, ...],
    device: GPU,
    sharing: str,
    limits: dict[str, str],
) -> None:
    pod = server_pod(profile, gpus, device, sharing)
    # the plugin answers for exactly these resources; its NVIDIA_VISIBLE_DEVICES replaces the
    # image's, and a value in the pod spec would replace the plugin's
    assert gpu_limits(pod) == limits
    env = container_env(pod)
    assert "NVIDIA_VISIBLE_DEVICES" not in env
    assert env["TZ"] == "UTC"  # the rest of the configured environment is kept


def test_a_cpu_pod_hides_every_gpu_over_an_image_that_says_all() -> None:
    pod = server_pod(CPU, (), None, MIG)
    assert gpu_limits(pod) == {}  # no device plugin answers for it, so the spec must say so
    env = container_env(pod)
    assert env["NVIDIA_VISIBLE_DEVICES"] == "void"
    assert env["CUDA_VISIBLE_DEVICES"] == ""


@pytest.mark.parametrize("configured", ["all", "0,1", "none", ""])
def test_the_device_rule_wins_over_any_configured_value(configured: str) -> None:
    env = {"NVIDIA_VISIBLE_DEVICES": configured}
    assert container_device_environment(env, holds_gpus=True) == {}
    assert container_device_environment(env, holds_gpus=False) == {"NVIDIA_VISIBLE_DEVICES": "void"}


# -- GPUKubeSpawner.get_env ---------------------------------------------------------------------

# (the fixture offline_kube_config is in conftest.py)


def configured_spawner(gpus: tuple[GpuShare, ...]) -> GPUKubeSpawner:
    user = type("User", (), {})()
    user.name = user.escaped_name = "alice"
    user.id, user.url, user.server, user.settings = 1, "/user/alice/", Server(), {}
    spawner = GPUKubeSpawner(
        _mock=True, user=user, hub=Hub(), environment={"NVIDIA_VISIBLE_DEVICES": "all"}
    )
    spawner.api_token = "unused"
    request = Request(
        id="alice/",
        owner="alice",
        num_gpu=len(gpus),
        gpu_milli=0,
        gpu_models=frozenset(),
        priority="on-demand",
    )
    spawner.gpulab_placement = Placement(request=request, node="n", gpus=gpus, created_at=0.0)
    return spawner


async def test_the_spawner_drops_a_configured_all_from_a_gpu_servers_env(offline_kube_config):
    spawner = configured_spawner((GpuShare("n/gpu-0", 1000),))
    assert "NVIDIA_VISIBLE_DEVICES" not in spawner.get_env()


async def test_the_spawner_replaces_a_configured_all_with_void_for_a_cpu_server(
    offline_kube_config,
):
    spawner = configured_spawner(())
    assert spawner.get_env()["NVIDIA_VISIBLE_DEVICES"] == "void"
