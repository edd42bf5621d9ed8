"""Kubernetes manifests of a job run's attempt, as pure builders (dicts in, dicts out; no client).

One attempt of a run is one `batch/v1` Job with one pod, created only once the hub's allocator
admitted the run, plus a Secret with what the attempt runs. The pod is a server's pod in all that
matters to the cluster and the hub:

- GPUs: the same resources, node pin, spot toleration and priority class as a server on the same
  placement (`gpu_resources.placed_pod`, which GPUKubeSpawner uses too), and the same placement
  annotation, so a restarted hub rebuilds its allocator from the job's pod as from a server's
  (`objects.placement_from_pod`; the Job carries it too);
- hardening: the servers' security contexts (`objects.pod_security_context`,
  `container_security_context`; non-root uid/gid, seccomp, no privilege escalation, no
  capabilities), no service account token, no service links;
- the owner's home PVC mounted where her server has it (`objects.home_volume`, `home_mount`), so
  the input notebook or script and the run's output directory are those of her server.

What runs is the job wrapper, exactly as the local runner starts it (`gpulab.spawner.job_attempt`:
the same spec, directories and GPULAB_JOB_* variables), with three differences:

- instructions: no hub-opened descriptor exists in a pod, so the wrapper reads its spec from a
  file of the attempt's Secret (`--spec-file`), mounted read-only; the user's environment
  variables (her secrets, perhaps) come from the same Secret by `secretKeyRef`, so neither is in
  the pod spec, which anyone who may read pods sees;
- exit status: the container's exit code (the job's, 128 + the signal for a signalled job), in the
  pod's status, is the record (no `--status-fd`); a timeout is the Job's `activeDeadlineSeconds`
  (condition Failed, reason DeadlineExceeded), a cancel the hub's deletion of the Job;
- signals: the kubelet signals only the container's first process, the wrapper, which passes
  them on to the job (`--forward-signals`), so a job checkpoints on SIGTERM as locally;
- outputs: the hub cannot read the pod's volume, so the wrapper ends the pod's log with the list
  of the run's output files (`--list-outputs`), which the executor reads.

Retries are the hub's (`backoffLimit: 0`): a retried or preempted run is a new attempt, with a new
placement, resuming from GPULAB_CHECKPOINT_DIR.

Order of creation: the Secret (`job_run_secret_manifest`), then the Job (`job_run_manifest`), then
the Secret's owner reference to the created Job (`secret_owner_patch`, which needs the Job's uid),
so the Secret goes with the Job (its `ttlSecondsAfterFinished`, or a cancel). A hub that stops
between the last two leaves a Secret without owner: it carries the run's labels, and the executor
deletes such Secrets of runs that are over.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from gpulab.hub.allocator import Placement
from gpulab.hub.jobs.model import JobSpec
from gpulab.hub.profiles import Profile
from gpulab.spawner.job_attempt import WRAPPER_MODULE, attempt_environment, wrapper_spec
from gpulab.spawner.kube.gpu_resources import PlacedPod
from gpulab.spawner.kube.objects import (
    container_security_context,
    dns_name,
    home_mount,
    home_volume,
    placement_annotation,
    pod_security_context,
    safe_label_value,
)
from gpulab.spawner.names import (
    JOB_ATTEMPT_LABEL,
    JOB_COMPONENT,
    JOB_RUN_LABEL,
    PLACEMENT_ANNOTATION,
    PRIORITY_LABEL,
    USERNAME_LABEL,
)
from gpulab.spawner.singleuser.jobwrapper import DEFAULT_KERNEL_START_TIMEOUT_SECONDS

#: a Job's name is the value of its pods' job-name label: a DNS label
MAX_JOB_NAME = 63
#: where the attempt's Secret is mounted in the job's container, and the spec's file there
SPEC_DIR = "/etc/gpulab/job"
SPEC_KEY = "spec.json"
SPEC_VOLUME = "gpulab-job-spec"
#: the Secret's key of the user's variable NAME (Secret keys may hold '.', variable names not)
ENV_KEY_PREFIX = "env."
CONTAINER_NAME = "job"


@dataclass(frozen=True)
class KubeJobSettings:
    """How the cluster runs jobs: the image (with gpulab installed, as server images), where the
    home is mounted (GPUKubeSpawner.workspace_home) and the servers' hardening (the defaults are
    GPUKubeSpawner's: uid 1000, gid 100, fsGroup 100, runAsNonRoot, RuntimeDefault, drop ALL).

    `ttl_seconds_after_finished`: how long a finished Job (and its Secret) stays for the hub to
    read its result (None: until the hub deletes it). `labels`: common labels of gpulab's
    objects (e.g. `app`)."""

    namespace: str
    image: str
    home: str = "/home/jovyan"
    python: str = "python3"
    kernel_name: str = "python3"
    #: how long a notebook's kernel may take to start (GPUJobs.kernel_start_timeout_seconds)
    kernel_start_timeout_seconds: int = DEFAULT_KERNEL_START_TIMEOUT_SECONDS
    uid: int | None = 1000
    gid: int | None = 100
    fs_gid: int | None = 100
    run_as_non_root: bool = True
    seccomp: str = "RuntimeDefault"
    drop_capabilities: tuple[str, ...] = ("ALL",)
    ttl_seconds_after_finished: int | None = 3600
    termination_grace_seconds: int = 60
    image_pull_policy: str | None = None
    labels: Mapping[str, str] = field(default_factory=dict)


def job_run_name(owner: str, run_id: int, attempt: int) -> str:
    """`gpulab-job-<owner>-<run>-<attempt>`: a DNS label (the owner's part cut, with a hash of
    it, to fit 63 characters), unique by the run id and attempt."""
    suffix = f"-{run_id}-{attempt}"
    prefix = dns_name(f"gpulab-job-{owner}".replace(".", "-"), MAX_JOB_NAME - len(suffix))
    return prefix + suffix


def job_run_secret_name(owner: str, run_id: int, attempt: int) -> str:
    """The attempt's Secret: the Job's name and `-spec`."""
    return f"{job_run_name(owner, run_id, attempt)}-spec"


def job_run_labels(
    owner: str, run_id: int, attempt: int, priority: str, common: Mapping[str, str]
) -> dict[str, str]:
    """Labels of an attempt's Job, pod and Secret: what the hub's executor selects them by."""
    return {
        **common,
        "component": JOB_COMPONENT,
        USERNAME_LABEL: safe_label_value(owner),
        JOB_RUN_LABEL: str(run_id),
        JOB_ATTEMPT_LABEL: str(attempt),
        PRIORITY_LABEL: priority,
    }


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def job_run_secret_manifest(
    spec: JobSpec,
    *,
    run_id: int,
    attempt: int,
    priority: str,
    settings: KubeJobSettings,
    report: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """The attempt's Secret (core/v1, immutable): the wrapper's spec under `spec.json` (argv,
    folders, notebook parameters, the GPU report with its token) and each of the user's
    variables under `env.<NAME>`. Create it before the Job; give it the Job as owner with
    `secret_owner_patch` once the Job exists."""
    instructions = wrapper_spec(
        kind=spec.kind,
        path=spec.path,
        home=settings.home,
        output_dir=spec.output_dir,
        run_id=run_id,
        python=settings.python,
        parameters=spec.parameters,
        args=spec.args,
        kernel_name=settings.kernel_name,
        report=report,
        kernel_start_timeout_seconds=settings.kernel_start_timeout_seconds,
    )
    data = {SPEC_KEY: _b64(json.dumps(instructions, sort_keys=True))}
    data.update({ENV_KEY_PREFIX + k: _b64(v) for k, v in sorted(spec.environment.items())})
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "immutable": True,
        "metadata": {
            "name": job_run_secret_name(spec.owner, run_id, attempt),
            "namespace": settings.namespace,
            "labels": job_run_labels(spec.owner, run_id, attempt, priority, settings.labels),
            "annotations": {USERNAME_LABEL: spec.owner},
        },
        "data": data,
    }


def secret_owner_patch(job: Mapping[str, Any]) -> dict[str, Any]:
    """A merge patch that makes the created `job` (with its uid) the owner of its Secret, so the
    garbage collector deletes the Secret with the Job."""
    meta = job["metadata"]
    if not meta.get("uid"):
        raise ValueError(f"Job {meta.get('name')!r} has no uid: patch its Secret once it exists")
    reference = {"apiVersion": "batch/v1", "kind": "Job", "name": meta["name"], "uid": meta["uid"]}
    return {"metadata": {"ownerReferences": [reference]}}


def _cpu_quantity(cores: float) -> str:
    return f"{round(cores * 1000)}m"


def _environment(
    spec: JobSpec,
    *,
    run_id: int,
    attempt: int,
    pod: PlacedPod,
    secret_name: str,
    home: str,
) -> list[dict[str, Any]]:
    """The container's env: the basics, the user's variables (from the Secret, by name only),
    the placement's, then the attempt's GPULAB_JOB_* ones; never anything of the hub's."""
    entries: dict[str, dict[str, Any]] = {}

    def put(name: str, value: str) -> None:
        entries[name] = {"name": name, "value": value}

    put("HOME", home)
    put("LANG", "C.UTF-8")
    put("PYTHONUNBUFFERED", "1")  # print() reaches the log at once, not at exit
    for name in sorted(spec.environment):
        entries[name] = {
            "name": name,
            "valueFrom": {"secretKeyRef": {"name": secret_name, "key": ENV_KEY_PREFIX + name}},
        }
    for name, value in pod.environment.items():
        put(name, value)
    job_env = attempt_environment(
        run_id=run_id, attempt=attempt, home=home, output_dir=spec.output_dir
    )
    for name, value in job_env.items():
        put(name, value)
    return list(entries.values())


def job_run_manifest(
    spec: JobSpec,
    *,
    run_id: int,
    attempt: int,
    profile: Profile,
    placement: Placement,
    pod: PlacedPod,
    home_pvc: str,
    timeout_seconds: int | None,
    settings: KubeJobSettings,
) -> dict[str, Any]:
    """The `batch/v1` Job of one attempt of run `run_id` of `spec`.

    `placement`: the allocator's, for this attempt; `pod`: its pod side, as the spawner computes
    it (`placed_pod(profile, placement, priority=placement.request.priority, ...)`); `profile`:
    the CPU and memory limits; `home_pvc`: the owner's home claim (her server's, e.g.
    `gpulab-home-<user>`: a ReadWriteOnce claim binds the job to the node of a running server
    that mounts it); `timeout_seconds`: the run's limit (`activeDeadlineSeconds`, None: none).
    """
    name = job_run_name(spec.owner, run_id, attempt)
    secret_name = job_run_secret_name(spec.owner, run_id, attempt)
    priority = placement.request.priority
    labels = job_run_labels(spec.owner, run_id, attempt, priority, settings.labels)
    annotations = {
        USERNAME_LABEL: spec.owner,
        PLACEMENT_ANNOTATION: placement_annotation(placement),
    }

    resources: dict[str, str] = {}
    if profile.cpu_limit:
        resources["cpu"] = _cpu_quantity(profile.cpu_limit)
    if profile.mem_limit_mib:
        resources["memory"] = f"{profile.mem_limit_mib}Mi"
    resources.update(pod.gpu.limits)

    # as KubeSpawner's make_pod: fsGroup at the pod, runAsUser/runAsGroup and no privilege
    # escalation at the container, then gpulab's hardening on both
    psc: dict[str, Any] = {} if settings.fs_gid is None else {"fsGroup": settings.fs_gid}
    psc.update(
        pod_security_context(run_as_non_root=settings.run_as_non_root, seccomp=settings.seccomp)
    )
    csc: dict[str, Any] = {}
    if settings.uid is not None:
        csc["runAsUser"] = settings.uid
    if settings.gid is not None:
        csc["runAsGroup"] = settings.gid
    csc["allowPrivilegeEscalation"] = False
    csc.update(
        container_security_context(
            run_as_non_root=settings.run_as_non_root,
            seccomp=settings.seccomp,
            drop_capabilities=settings.drop_capabilities,
        )
    )

    container: dict[str, Any] = {
        "name": CONTAINER_NAME,
        "image": settings.image,
        "command": [
            settings.python,
            "-I",  # the job's PYTHONPATH and friends do not reach the wrapper
            "-m",
            WRAPPER_MODULE,
            "run",
            "--spec-file",
            f"{SPEC_DIR}/{SPEC_KEY}",
            "--forward-signals",
            "--list-outputs",  # the hub cannot read the volume: the log ends with the outputs
        ],
        "workingDir": settings.home,
        "env": _environment(
            spec,
            run_id=run_id,
            attempt=attempt,
            pod=pod,
            secret_name=secret_name,
            home=settings.home,
        ),
        "resources": {"limits": dict(resources), "requests": dict(resources)},
        "securityContext": csc,
        "volumeMounts": [
            home_mount(settings.home),
            {"name": SPEC_VOLUME, "mountPath": SPEC_DIR, "readOnly": True},
        ],
    }
    if settings.image_pull_policy:
        container["imagePullPolicy"] = settings.image_pull_policy

    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "automountServiceAccountToken": False,
        # no variables of the namespace's services (the hub's among them) in the job's env
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": settings.termination_grace_seconds,
        "securityContext": psc,
        "containers": [container],
        "volumes": [
            home_volume(home_pvc),
            {
                "name": SPEC_VOLUME,
                "secret": {
                    "secretName": secret_name,
                    "items": [{"key": SPEC_KEY, "path": SPEC_KEY}],
                    # group-owned by fsGroup (the kubelet's rule for Secret volumes): the
                    # non-root job reads it; without an fsGroup nobody else is in the pod
                    "defaultMode": 0o440 if settings.fs_gid is not None else 0o444,
                },
            },
        ],
    }
    if pod.gpu.node_affinity_required:
        pod_spec["affinity"] = {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": list(pod.gpu.node_affinity_required)
                }
            }
        }
    if pod.gpu.tolerations:
        pod_spec["tolerations"] = list(pod.gpu.tolerations)
    if pod.gpu.priority_class_name:
        pod_spec["priorityClassName"] = pod.gpu.priority_class_name

    job_spec: dict[str, Any] = {
        "backoffLimit": 0,  # retries are the hub's, with a new placement and the checkpoints
        "completions": 1,
        "parallelism": 1,
    }
    if timeout_seconds is not None:
        job_spec["activeDeadlineSeconds"] = int(timeout_seconds)
    if settings.ttl_seconds_after_finished is not None:
        job_spec["ttlSecondsAfterFinished"] = settings.ttl_seconds_after_finished
    job_spec["template"] = {
        "metadata": {"labels": dict(labels), "annotations": dict(annotations)},
        "spec": pod_spec,
    }
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {
            "name": name,
            "namespace": settings.namespace,
            "labels": labels,
            "annotations": annotations,
        },
        "spec": job_spec,
    }
