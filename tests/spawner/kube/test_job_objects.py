"""The Kubernetes manifests of a job run's attempt, compared whole (builders in
gpulab.spawner.kube.job_objects): the Job and its spec Secret for each sharing backend, on-demand
and preemptible, with and without a timeout, and what they must never carry."""

from __future__ import annotations

import base64
import json
import re
from fractions import Fraction
from typing import Any

import pytest

from gpulab.hub.allocator import GPU, GpuShare, Placement, Request
from gpulab.hub.jobs import JobSpec
from gpulab.hub.profiles import Profile
from gpulab.spawner.job_attempt import wrapper_spec
from gpulab.spawner.kube.gpu_resources import HAMI, MIG, TIME_SLICING, PlacedPod, placed_pod
from gpulab.spawner.kube.job_objects import (
    KubeJobSettings,
    job_run_manifest,
    job_run_name,
    job_run_secret_manifest,
    job_run_secret_name,
    secret_owner_patch,
)
from gpulab.spawner.kube.objects import placement_from_pod

A100 = "A100-SXM4-80GB"
A100_MIB = 81920
CREATED = 1767225600.0
SETTINGS = KubeJobSettings(
    namespace="gpulab", image="quay.io/jupyter/pytorch-notebook:cuda12-2025-12-01"
)
WHOLE = Profile("a100", "1 A100", Fraction(1), frozenset({A100}), cpu_limit=8, mem_limit_mib=65536)
QUARTER = Profile("a100-quarter", "1/4 A100", Fraction(1, 4), frozenset({A100}))
DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
LABEL_VALUE = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")


def job_spec(**overrides: Any) -> JobSpec:
    fields: dict[str, Any] = {
        "owner": "alice",
        "name": "train",
        "kind": "script",
        "path": "work/train.py",
        "profile": "a100",
        "args": ("--epochs", "3"),
        "environment": {"WANDB_API_KEY": "wandb-secret-7f3a"},
        "timeout_seconds": 3600,
    }
    fields.update(overrides)
    return JobSpec(**fields)


def placement_of(
    profile: Profile, gpus: tuple[GpuShare, ...], priority: str = "on-demand"
) -> Placement:
    request = Request(
        id="job/12",
        owner="alice",
        num_gpu=profile.num_gpu,
        gpu_milli=profile.gpu_milli,
        gpu_models=profile.gpu_models,
        priority=priority,  # type: ignore[arg-type]
    )
    return Placement(request=request, node="gpu-node-1", gpus=gpus, created_at=CREATED)


def placed(
    profile: Profile, placement: Placement, device: GPU | None, sharing: str = MIG
) -> PlacedPod:
    # as GPUKubeSpawner._apply_placement computes it, with the job's own priority
    return placed_pod(
        profile,
        placement,
        sharing=sharing,
        priority=placement.request.priority,
        device=device,
        gpu_memory_mib=A100_MIB,
    )


def manifest(
    profile: Profile,
    device: GPU | None,
    gpus: tuple[GpuShare, ...],
    *,
    sharing: str = MIG,
    priority: str = "on-demand",
    timeout_seconds: int | None = 3600,
    settings: KubeJobSettings = SETTINGS,
    spec: JobSpec | None = None,
) -> dict[str, Any]:
    placement = placement_of(profile, gpus, priority)
    return job_run_manifest(
        spec or job_spec(),
        run_id=12,
        attempt=2,
        profile=profile,
        placement=placement,
        pod=placed(profile, placement, device, sharing),
        home_pvc="gpulab-home-alice",
        timeout_seconds=timeout_seconds,
        settings=settings,
    )


def whole_gpu_job(**kw: Any) -> dict[str, Any]:
    device = GPU("GPU-aaaa", A100, A100_MIB)
    return manifest(WHOLE, device, (GpuShare("GPU-aaaa", 1000),), **kw)


def pod_spec(job: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = job["spec"]["template"]["spec"]
    return spec


def container(job: dict[str, Any]) -> dict[str, Any]:
    c: dict[str, Any] = pod_spec(job)["containers"][0]
    return c


def env_values(job: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container(job)["env"]}


# -- the whole manifests ----------------------------------------------------------------------------


def test_an_on_demand_whole_gpu_attempt_is_one_pinned_hardened_pod_running_the_wrapper():
    job = whole_gpu_job()
    placement = placement_from_pod({"metadata": job["metadata"]})
    assert placement is not None
    labels = {
        "component": "gpulab-job",
        "hub.jupyter.org/username": "alice",
        "gpulab.io/job-run": "12",
        "gpulab.io/job-attempt": "2",
        "gpulab.io/priority": "on-demand",
    }
    annotations = {
        "hub.jupyter.org/username": "alice",
        "gpulab.io/placement": json.dumps(
            {
                "created_at": CREATED,
                "gpus": [["GPU-aaaa", 1000]],
                "node": "gpu-node-1",
                "request": {
                    "affinity_group": None,
                    "cpu_milli": 0,
                    "gpu_milli": 0,
                    "gpu_models": [A100],
                    "groups": [],
                    "id": "job/12",
                    "memory_mib": 0,
                    "num_gpu": 1,
                    "nvlink": False,
                    "owner": "alice",
                    "priority": "on-demand",
                },
            },
            sort_keys=True,
        ),
    }
    resources = {"cpu": "8000m", "memory": "65536Mi", "nvidia.com/gpu": "1"}
    out = "/home/jovyan/gpulab-jobs/train/run-12"
    assert job == {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {
            "name": "gpulab-job-alice-12-2",
            "namespace": "gpulab",
            "labels": labels,
            "annotations": annotations,
        },
        "spec": {
            "backoffLimit": 0,
            "completions": 1,
            "parallelism": 1,
            "activeDeadlineSeconds": 3600,
            "ttlSecondsAfterFinished": 3600,
            "template": {
                "metadata": {"labels": labels, "annotations": annotations},
                "spec": {
                    "restartPolicy": "Never",
                    "automountServiceAccountToken": False,
                    "enableServiceLinks": False,
                    "terminationGracePeriodSeconds": 60,
                    "securityContext": {
                        "fsGroup": 100,
                        "seccompProfile": {"type": "RuntimeDefault"},
                        "runAsNonRoot": True,
                    },
                    "containers": [
                        {
                            "name": "job",
                            "image": "quay.io/jupyter/pytorch-notebook:cuda12-2025-12-01",
                            "command": [
                                "python3",
                                "-I",
                                "-m",
                                "gpulab.spawner.singleuser.jobwrapper",
                                "run",
                                "--spec-file",
                                "/etc/gpulab/job/spec.json",
                                "--forward-signals",
                                "--list-outputs",
                            ],
                            "workingDir": "/home/jovyan",
                            "env": [
                                {"name": "HOME", "value": "/home/jovyan"},
                                {"name": "LANG", "value": "C.UTF-8"},
                                {"name": "PYTHONUNBUFFERED", "value": "1"},
                                {
                                    "name": "WANDB_API_KEY",
                                    "valueFrom": {
                                        "secretKeyRef": {
                                            "name": "gpulab-job-alice-12-2-spec",
                                            "key": "env.WANDB_API_KEY",
                                        }
                                    },
                                },
                                {"name": "GPULAB_PROFILE", "value": "a100"},
                                {
                                    "name": "GPULAB_ISOLATION",
                                    "value": "Exclusive: whole GPUs, yours alone while the "
                                    "server runs.",
                                },
                                {"name": "GPULAB_GPU_SHARING", "value": ""},
                                {"name": "GPULAB_GPU_MODEL", "value": A100},
                                {"name": "GPULAB_GPU_DEVICE_MEMORY_MIB", "value": "81920"},
                                {"name": "GPULAB_GPU_ENFORCEMENT", "value": "exclusive"},
                                {"name": "GPULAB_JOB_RUN_ID", "value": "12"},
                                {"name": "GPULAB_JOB_ATTEMPT", "value": "2"},
                                {"name": "GPULAB_CHECKPOINT_DIR", "value": f"{out}/checkpoints"},
                                {"name": "GPULAB_OUTPUT_DIR", "value": out},
                            ],
                            "resources": {"limits": resources, "requests": resources},
                            "securityContext": {
                                "runAsUser": 1000,
                                "runAsGroup": 100,
                                "allowPrivilegeEscalation": False,
                                "seccompProfile": {"type": "RuntimeDefault"},
                                "runAsNonRoot": True,
                                "capabilities": {"drop": ["ALL"]},
                            },
                            "volumeMounts": [
                                {"name": "gpulab-home", "mountPath": "/home/jovyan"},
                                {
                                    "name": "gpulab-job-spec",
                                    "mountPath": "/etc/gpulab/job",
                                    "readOnly": True,
                                },
                            ],
                        }
                    ],
                    "volumes": [
                        {
                            "name": "gpulab-home",
                            "persistentVolumeClaim": {"claimName": "gpulab-home-alice"},
                        },
                        {
                            "name": "gpulab-job-spec",
                            "secret": {
                                "secretName": "gpulab-job-alice-12-2-spec",
                                "items": [{"key": "spec.json", "path": "spec.json"}],
                                "defaultMode": 0o440,
                            },
                        },
                    ],
                    "affinity": {
                        "nodeAffinity": {
                            "requiredDuringSchedulingIgnoredDuringExecution": {
                                "nodeSelectorTerms": [
                                    {
                                        "matchExpressions": [
                                            {
                                                "key": "nvidia.com/gpu.product",
                                                "operator": "In",
                                                "values": [f"NVIDIA-{A100}"],
                                            },
                                            {
                                                "key": "kubernetes.io/hostname",
                                                "operator": "In",
                                                "values": ["gpu-node-1"],
                                            },
                                        ]
                                    }
                                ]
                            }
                        }
                    },
                    "priorityClassName": "gpulab-on-demand",
                },
            },
        },
    }


def test_the_attempts_secret_holds_the_wrappers_spec_and_the_users_variables():
    secret = job_run_secret_manifest(
        job_spec(), run_id=12, attempt=2, priority="on-demand", settings=SETTINGS
    )
    spec = {
        "argv": ["python3", "/home/jovyan/work/train.py", "--epochs", "3"],
        "cwd": "/home/jovyan/work",
        "make_dirs": [
            "/home/jovyan/gpulab-jobs/train/run-12",
            "/home/jovyan/gpulab-jobs/train/run-12/checkpoints",
        ],
    }
    assert secret == {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "immutable": True,
        "metadata": {
            "name": "gpulab-job-alice-12-2-spec",
            "namespace": "gpulab",
            "labels": {
                "component": "gpulab-job",
                "hub.jupyter.org/username": "alice",
                "gpulab.io/job-run": "12",
                "gpulab.io/job-attempt": "2",
                "gpulab.io/priority": "on-demand",
            },
            "annotations": {"hub.jupyter.org/username": "alice"},
        },
        "data": {
            "spec.json": base64.b64encode(json.dumps(spec, sort_keys=True).encode()).decode(),
            "env.WANDB_API_KEY": base64.b64encode(b"wandb-secret-7f3a").decode(),
        },
    }


def test_a_notebook_attempt_gets_the_same_wrapper_spec_as_the_local_runner_would_give_it():
    spec = job_spec(kind="notebook", path="nb/train.ipynb", args=(), parameters={"lr": 1e-3})
    secret = job_run_secret_manifest(
        spec, run_id=12, attempt=1, priority="on-demand", settings=SETTINGS
    )
    got = json.loads(base64.b64decode(secret["data"]["spec.json"]))
    assert got == wrapper_spec(
        kind="notebook",
        path="nb/train.ipynb",
        home="/home/jovyan",
        output_dir="gpulab-jobs/train",
        run_id=12,
        python="python3",
        parameters={"lr": 1e-3},
    )
    assert got["argv"][1:4] == ["-m", "gpulab.spawner.singleuser.jobwrapper", "notebook"]


def test_the_wrapper_reads_its_spec_where_the_secret_volume_puts_it():
    job = whole_gpu_job()
    command = container(job)["command"]
    spec_file = command[command.index("--spec-file") + 1]
    (mount,) = [m for m in container(job)["volumeMounts"] if m["name"] == "gpulab-job-spec"]
    (volume,) = [v for v in pod_spec(job)["volumes"] if v["name"] == "gpulab-job-spec"]
    (item,) = volume["secret"]["items"]
    assert spec_file == f"{mount['mountPath']}/{item['path']}"
    assert volume["secret"]["secretName"] == job_run_secret_name("alice", 12, 2)
    assert "--status-fd" not in command  # the container's exit code is the record


# -- the sharing backends -------------------------------------------------------------------------


def test_a_mig_share_asks_for_the_instance_the_allocator_placed_it_on():
    device = GPU("MIG-bbbb", A100, 20480, capacity_milli=250, mig_profile="2g.20gb")
    job = manifest(QUARTER, device, (GpuShare("MIG-bbbb", 250),), sharing=MIG)
    assert container(job)["resources"] == {
        "limits": {"nvidia.com/mig-2g.20gb": "1"},
        "requests": {"nvidia.com/mig-2g.20gb": "1"},
    }
    env = env_values(job)
    assert {k: v for k, v in env.items() if k.startswith("GPULAB_GPU")} == {
        "GPULAB_GPU_SHARING": "mig",
        "GPULAB_GPU_MODEL": f"{A100} MIG 2g.20gb",
        "GPULAB_GPU_DEVICE_MEMORY_MIB": "81920",
        "GPULAB_GPU_ENFORCEMENT": "mig",
        "GPULAB_GPU_FRACTION": "0.250",
        "GPULAB_GPU_MEMORY_LIMIT_MIB": "81920",
    }


def test_a_time_sliced_share_asks_for_one_replica_on_a_shared_product_node():
    device = GPU("GPU-cccc/replica-1", A100, A100_MIB, capacity_milli=250, share_step_milli=250)
    job = manifest(QUARTER, device, (GpuShare("GPU-cccc/replica-1", 250),), sharing=TIME_SLICING)
    assert container(job)["resources"] == {
        "limits": {"nvidia.com/gpu.shared": "1"},
        "requests": {"nvidia.com/gpu.shared": "1"},
    }
    terms = pod_spec(job)["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]["nodeSelectorTerms"]
    assert terms == [
        {
            "matchExpressions": [
                {
                    "key": "nvidia.com/gpu.product",
                    "operator": "In",
                    "values": [f"NVIDIA-{A100}", f"NVIDIA-{A100}-SHARED"],
                },
                {"key": "kubernetes.io/hostname", "operator": "In", "values": ["gpu-node-1"]},
            ]
        }
    ]
    assert env_values(job)["GPULAB_GPU_ENFORCEMENT"] == "time-slicing"


def test_a_hami_share_is_granted_what_it_took_on_its_gpu_rounded_to_the_split_step():
    device = GPU("GPU-dddd", A100, A100_MIB, share_step_milli=100)
    job = manifest(QUARTER, device, (GpuShare("GPU-dddd", 300),), sharing=HAMI)
    limits = {"nvidia.com/gpu": "1", "nvidia.com/gpumem": "24576", "nvidia.com/gpucores": "30"}
    assert container(job)["resources"] == {"limits": limits, "requests": limits}
    assert env_values(job)["GPULAB_GPU_ENFORCEMENT"] == "hami"


def test_a_cpu_only_attempt_sees_no_gpu_and_is_pinned_to_its_node_alone():
    cpu = Profile("cpu", "CPU only", cpu_limit=0.5, mem_limit_mib=2048)
    job = manifest(cpu, None, ())
    assert container(job)["resources"]["limits"] == {"cpu": "500m", "memory": "2048Mi"}
    env = env_values(job)
    assert (env["NVIDIA_VISIBLE_DEVICES"], env["CUDA_VISIBLE_DEVICES"]) == ("void", "")
    assert pod_spec(job)["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]["nodeSelectorTerms"] == [
        {
            "matchExpressions": [
                {"key": "kubernetes.io/hostname", "operator": "In", "values": ["gpu-node-1"]}
            ]
        }
    ]


# -- priority, timeout, lifetime ---------------------------------------------------------------------


def test_a_preemptible_attempt_tolerates_spot_nodes_and_gets_the_preemptible_class():
    job = whole_gpu_job(priority="preemptible")
    spec = pod_spec(job)
    assert spec["tolerations"] == [
        {"key": "gpulab.io/spot", "operator": "Exists", "effect": "NoSchedule"}
    ]
    assert spec["priorityClassName"] == "gpulab-preemptible"
    assert job["spec"]["template"]["metadata"]["labels"]["gpulab.io/priority"] == "preemptible"


def test_an_on_demand_attempt_does_not_tolerate_spot_nodes():
    assert "tolerations" not in pod_spec(whole_gpu_job(priority="on-demand"))


def test_a_run_without_timeout_has_no_deadline_and_a_ttl_of_none_keeps_the_job():
    job = whole_gpu_job(
        timeout_seconds=None,
        settings=KubeJobSettings(namespace="gpulab", image="img", ttl_seconds_after_finished=None),
    )
    assert {k: v for k, v in job["spec"].items() if k != "template"} == {
        "backoffLimit": 0,
        "completions": 1,
        "parallelism": 1,
    }


# -- what the cluster and the hub rely on ------------------------------------------------------------


def test_the_placement_round_trips_through_the_parser_the_hub_rebuilds_its_state_with():
    device = GPU("MIG-bbbb", A100, 20480, capacity_milli=250, mig_profile="2g.20gb")
    placement = placement_of(QUARTER, (GpuShare("MIG-bbbb", 250),), "preemptible")
    job = job_run_manifest(
        job_spec(),
        run_id=12,
        attempt=2,
        profile=QUARTER,
        placement=placement,
        pod=placed(QUARTER, placement, device),
        home_pvc="gpulab-home-alice",
        timeout_seconds=None,
        settings=SETTINGS,
    )
    # the Job controller copies the template's metadata onto the pod the hub's watch sees
    pod = {"metadata": job["spec"]["template"]["metadata"], "spec": {"nodeName": "gpu-node-1"}}
    assert placement_from_pod(pod) == placement
    assert placement_from_pod(job) == placement


@pytest.mark.parametrize(
    "owner",
    [
        "Ada.Lovelace_" * 20 + "@example.org",
        "ådä@example.org",
        "x" * 300,
        "--..--",
    ],
)
def test_names_and_labels_are_valid_for_any_username(owner: str):
    job = whole_gpu_job(spec=job_spec(owner=owner))
    name = job["metadata"]["name"]
    assert DNS_LABEL.fullmatch(name) and len(name) <= 63
    assert name.endswith("-12-2")
    secret = job_run_secret_name(owner, 12, 2)
    assert DNS_LABEL.fullmatch(secret) and len(secret) <= 253
    for value in job["metadata"]["labels"].values():
        assert LABEL_VALUE.fullmatch(value) and len(value) <= 63
    assert job["metadata"]["annotations"]["hub.jupyter.org/username"] == owner


def test_two_long_usernames_with_the_same_start_get_different_job_names():
    start = "a" * 80
    assert job_run_name(start + "-bob", 12, 2) != job_run_name(start + "-eve", 12, 2)


def test_no_hub_variable_and_no_value_of_the_users_secrets_is_in_the_job():
    job = whole_gpu_job()
    names = [e["name"] for e in container(job)["env"]]
    assert not [n for n in names if n.startswith(("JUPYTERHUB_", "JPY_"))]
    assert len(names) == len(set(names))
    text = json.dumps(job)
    assert "wandb-secret-7f3a" not in text  # by secretKeyRef only: pod readers never see it
    assert "JUPYTERHUB" not in text


def test_the_jobs_hardening_defaults_are_the_servers():
    from gpulab.spawner.kube.isolation import KubeIsolationMixin
    from gpulab.spawner.workspaces.kube import KubeWorkspaceMixin

    traits = KubeIsolationMixin.class_traits()
    server = {
        "uid": traits["uid"].default(),
        "gid": traits["gid"].default(),
        "fs_gid": traits["fs_gid"].default(),
        "run_as_non_root": traits["run_as_non_root"].default(),
        "seccomp": traits["seccomp_profile"].default(),
        "drop_capabilities": tuple(traits["drop_capabilities"].default()),
        "home": KubeWorkspaceMixin.class_traits()["workspace_home"].default(),
    }
    job = {key: getattr(SETTINGS, key) for key in server}
    assert job == server


def test_the_secrets_owner_is_the_created_job():
    created = {"metadata": {"name": "gpulab-job-alice-12-2", "uid": "0b1c-42"}}
    assert secret_owner_patch(created) == {
        "metadata": {
            "ownerReferences": [
                {
                    "apiVersion": "batch/v1",
                    "kind": "Job",
                    "name": "gpulab-job-alice-12-2",
                    "uid": "0b1c-42",
                }
            ]
        }
    }


def test_a_job_not_created_yet_cannot_own_its_secret():
    with pytest.raises(ValueError, match="no uid"):
        secret_owner_patch({"metadata": {"name": "gpulab-job-alice-12-2"}})
