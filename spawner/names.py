"""Names shared across processes: Kubernetes labels, annotations, resources and environment variables.

Each name is defined here once and imported on both sides of the boundary it crosses: the hub and
its spawners write them, and a user's server, kernel, pod, the JupyterLab extension, the node agent
of the dev cluster or the metrics service read them. A typo on one side would fail silently (an
unset variable, an unmatched label), so neither side spells the string itself.

This module imports nothing, not even the standard library: code that runs as the user
(`gpulab.spawner.singleuser`, the extension) and the pure allocator may import it at no cost.
Every value is part of a deployed contract (pod labels outlive a hub upgrade; images read the
variables), so never change a string here, only add names.
"""

from __future__ import annotations

# --- Kubernetes node labels and taints ------------------------------------------------------------
# Written on Nodes by the cluster (the dev cluster's devcluster/spec.py simulates it); read by the
# kube spawner (affinity, Node -> inventory) and the allocator (rack locality).

#: A node's rack; requests sharing an affinity group prefer one rack. The pure allocator
#: (gpulab.hub.allocator.model) keeps its own copy of this and ZONE_LABEL so that it imports no
#: gpulab package (it is checked with mypy --strict on its own); tests/spawner/test_names.py
#: checks the copies are equal.
RACK_LABEL = "gpulab.io/rack"
#: Kubernetes' standard zone label (informational; a fallback locality key).
ZONE_LABEL = "topology.kubernetes.io/zone"
#: Kubernetes' standard hostname label (pod anti-affinity per node).
HOSTNAME_LABEL = "kubernetes.io/hostname"
#: The NoSchedule taint on spot/preemptible nodes; preemptible profiles tolerate it.
SPOT_TAINT_KEY = "gpulab.io/spot"
#: Label `=spot` on the same nodes (capacity type, for selectors and dashboards).
SPOT_LABEL = "gpulab.io/capacity-type"
#: The GPUs of a node joined by NVLink (one group per node when set).
NVLINK_GROUP_LABEL = "gpulab.io/nvlink-group"
#: GPU model label of NVIDIA's GPU feature discovery (node affinity for a profile's model).
PRODUCT_LABEL = "nvidia.com/gpu.product"
#: GFD's suffix on PRODUCT_LABEL of a node whose GPUs are time-sliced with renameByDefault.
SHARED_PRODUCT_SUFFIX = "-SHARED"
#: GFD: the node's physical GPUs, MIG-enabled ones included.
GPU_COUNT_LABEL = "nvidia.com/gpu.count"
#: GFD: memory of one of the node's GPUs, MiB.
GPU_MEMORY_LABEL = "nvidia.com/gpu.memory"
#: GFD: time-slicing replicas per GPU.
GPU_REPLICAS_LABEL = "nvidia.com/gpu.replicas"
#: GFD: "single" or "mixed" MIG strategy (gpulab reads mixed: one resource per MIG profile).
MIG_STRATEGY_LABEL = "nvidia.com/mig.strategy"
#: HAMi's device plugin: the node's GPUs as "uuid,split count,memory MiB,cores,type,numa,healthy"
#: entries joined by ":" (HAMi's registration protocol).
HAMI_REGISTER_ANNOTATION = "hami.io/node-nvidia-register"

# --- Labels on inventory nodes the hub builds itself (declared or NVML), read by the admin API -----
INVENTORY_LABEL = "gpulab.io/inventory"
#: On a dev-cluster Node (devcluster/spec.py): its GPUs are simulated.
SIMULATED_NODE_ANNOTATION = "gpulab.io/simulated"
MIG_ENABLED_LABEL = "gpulab.io/mig-enabled"

# --- NVIDIA extended resources --------------------------------------------------------------------
# Advertised on Nodes by the device plugin / HAMi (simulated by the dev cluster's node agent),
# requested in pods by the kube spawner (spawner/kube/gpu_resources.py).

#: Whole GPUs (NVIDIA device plugin).
GPU_RESOURCE = "nvidia.com/gpu"
#: Time-slicing replicas (device plugin with renameByDefault).
SHARED_GPU_RESOURCE = "nvidia.com/gpu.shared"
#: MIG slices: the prefix of `nvidia.com/mig-<g>g.<mem>gb` (mixed strategy).
MIG_RESOURCE_PREFIX = "nvidia.com/mig-"
#: HAMi's memory (MiB) and compute (% of one GPU) limits.
HAMI_MEMORY_RESOURCE = "nvidia.com/gpumem"
HAMI_CORES_RESOURCE = "nvidia.com/gpucores"

# --- Pod labels and annotations written by the kube spawner ---------------------------------------

#: Placements of a server's GPUs (JSON); the hub rebuilds its ledger from these after a restart.
PLACEMENT_ANNOTATION = "gpulab.io/placement"
#: The profile's priority class ("on-demand" / "preemptible") on the pod.
PRIORITY_LABEL = "gpulab.io/priority"
#: Pods of one affinity group (preferred together on a rack / zone).
AFFINITY_LABEL = "gpulab.io/affinity-group"
#: GPU placeholder pods (the Helm chart's, per profile, at the lowest priority): their GPUs are
#: there for a server to take by preemption, so gpulab's allocator does not count them as held.
PLACEHOLDER_LABEL = "gpulab.io/placeholder"
#: Warm pool member pods (`"true"`): placeholders the hub made, each holding a pool member's
#: reservation (its placement annotation, owner gpulab:warm-pool) until a user's start takes it;
#: a restarted hub deletes those it does not know (GPUWarmPool.sweep).
WARM_MEMBER_LABEL = "gpulab.io/warm-member"
#: KubeSpawner's label of a user's objects (its escaped name); gpulab's jobs carry it too, with
#: the name as a safe label value (the exact name is in the annotation of the same key).
USERNAME_LABEL = "hub.jupyter.org/username"

# --- Kubernetes objects of a job run (issue 16): the Job, its pod, its spec Secret ---------------
# Written by the job manifests (spawner/kube/job_objects.py); read by the hub's Kubernetes job
# executor to find a run's objects again after a restart.

#: The `component` label value of a job run's objects (servers: KubeSpawner's singleuser-server).
JOB_COMPONENT = "gpulab-job"
#: The run id of the hub's job store.
JOB_RUN_LABEL = "gpulab.io/job-run"
#: The attempt of the run, from 1.
JOB_ATTEMPT_LABEL = "gpulab.io/job-attempt"

# --- Kubernetes objects of a Dask cluster (issue 17): DaskCluster, DaskWorkerGroups, their pods ---
# Written by spawner/kube/dask_objects.py; read by the hub's Kubernetes Dask executor.

#: The `component` label value of a Dask cluster's objects.
DASK_COMPONENT = "gpulab-dask"
#: The cluster id of the hub's cluster store.
DASK_CLUSTER_LABEL = "gpulab.io/dask-cluster"
#: The worker's number within its cluster (worker groups and their pods).
DASK_WORKER_LABEL = "gpulab.io/dask-worker"

# --- Workspace volumes and snapshots (kube spawner writes; dev cluster snapshotter reads) ---------

#: The workspace (user/server) a PVC or VolumeSnapshot belongs to.
WORKSPACE_LABEL = "gpulab.io/workspace"
#: The user's label for a snapshot.
SNAPSHOT_KIND_LABEL = "gpulab.io/snapshot-label"
#: File count/size of a snapshot, written by the snapshotter, shown in the workspaces page.
SNAPSHOT_FILES_ANNOTATION = "snapshot.gpulab.io/files"

# --- Environment of a user's workloads: the prefix of every variable gpulab sets -----------------
#: Every variable gpulab writes into a server's, job's or worker's environment starts with this;
#: a job's submitter may set none of them (gpulab.hub.jobs.model), so none can be forged.
ENV_PREFIX = "GPULAB_"

#: A Dask pod's own address (the downward API's status.podIP), which its scheduler's listeners
#: bind to (spawner/kube/dask_objects.py), expanded by Kubernetes as `$(GPULAB_POD_IP)`.
POD_IP_ENV = "GPULAB_POD_IP"

# --- Environment of a user's server: GPUs -----------------------------------------------------------
# Written by the spawners (spawner/environment.py, spawner/local, spawner/kube); read by the GPU
# caps hook (spawner/singleuser/gpu_caps) and the extension's GPU panel (jupyterlab_gpulab/share.py).

#: Comma-separated UUIDs of the server's GPUs.
GPU_UUIDS_ENV = "GPULAB_GPU_UUIDS"
#: How the GPU share is enforced ("exclusive", "mig", "hami", "caps", ...).
GPU_ENFORCEMENT_ENV = "GPULAB_GPU_ENFORCEMENT"
#: The fraction of one GPU (e.g. "0.250") of a fractional share.
GPU_FRACTION_ENV = "GPULAB_GPU_FRACTION"
#: The memory cap in MiB of a fractional share.
GPU_MEMORY_LIMIT_MIB_ENV = "GPULAB_GPU_MEMORY_LIMIT_MIB"
#: The GPU model the hub placed the server on, as NVML names it ("A100-SXM4-80GB", or
#: "A100-SXM4-80GB MIG 2g.20gb" for a MIG instance); the simulated monitor source takes its shape.
GPU_MODEL_ENV = "GPULAB_GPU_MODEL"
#: Memory of one device of the share, MiB (a MIG instance's own).
GPU_DEVICE_MEMORY_MIB_ENV = "GPULAB_GPU_DEVICE_MEMORY_MIB"
#: Where the share's devices come from when nothing can measure them: "declared" (an admin's
#: declared inventory) or "simulated" (a dev-cluster node); the monitor then simulates them.
GPU_INVENTORY_ENV = "GPULAB_GPU_INVENTORY"
#: Values of GPU_INVENTORY_ENV (and of INVENTORY_LABEL on the hub's nodes).
DECLARED_INVENTORY = "declared"
SIMULATED_INVENTORY = "simulated"
#: The kube cluster's sharing backend of a fractional share ("" for whole GPUs).
GPU_SHARING_ENV = "GPULAB_GPU_SHARING"
#: "1": the spawner installed the sitecustomize hook that caps memory per process.
CAPS_HOOK_ENV = "GPULAB_CAPS_HOOK"
#: The isolation sentence shown to the user.
ISOLATION_ENV = "GPULAB_ISOLATION"
#: The slug of the server's profile.
PROFILE_ENV = "GPULAB_PROFILE"
#: The code-server executable VS Code in the browser runs (jupyterlab_gpulab.vscode); unset: the
#: one beside the server's Python, else code-server on PATH.
CODE_SERVER_ENV = "GPULAB_CODE_SERVER"

# --- Environment of a user's server: kernel checkpoints ---------------------------------------------
# Written by the spawner (spawner/singleuser/checkpoint/environment.py, run in the hub); read by
# the IPython extension and the store in the kernel (spawner/singleuser/checkpoint/).

#: The server's checkpoint root (default ~/.gpulab/checkpoints/<server or 'default'>).
CHECKPOINT_DIR_ENV = "GPULAB_CHECKPOINT_DIR"
#: The slot of one kernel (default: its notebook path).
CHECKPOINT_SLOT_ENV = "GPULAB_CHECKPOINT_SLOT"
#: The file holding the user's signing key (a mounted Secret on Kubernetes).
CHECKPOINT_KEY_FILE_ENV = "GPULAB_CHECKPOINT_KEY_FILE"
#: The user whose key signs the checkpoints.
CHECKPOINT_USER_ENV = "GPULAB_CHECKPOINT_USER"
#: "1": restore the latest checkpoint once without asking (after a preemption respawn).
AUTO_RESTORE_ENV = "GPULAB_AUTO_RESTORE"
#: MB of changed variables above which a cell's save is left to shutdown/SIGTERM (0: no saves after
#: cells at all; the exit save always runs).
CHECKPOINT_INCREMENTAL_MB_ENV = "GPULAB_CHECKPOINT_INCREMENTAL_MB"
#: Seconds to wait after a cell before saving.
CHECKPOINT_IDLE_SECONDS_ENV = "GPULAB_CHECKPOINT_IDLE_SECONDS"
#: "0": checkpoints off.
CHECKPOINT_ENABLED_ENV = "GPULAB_CHECKPOINT"

# --- Environment of a job run (issue 16) ------------------------------------------------------------
# Written by the local job runner (spawner/local/jobs.py) for every attempt of a run, besides the
# placement's GPU variables above and CHECKPOINT_DIR_ENV (for a job: the run's checkpoint
# directory, the same for every attempt, so that a retried or preempted run resumes from it); read
# by the job's own code.

#: The run's id in the hub's job store.
JOB_RUN_ID_ENV = "GPULAB_JOB_RUN_ID"
#: The attempt's number, from 1 (a retry or a preempted run's next attempt counts up).
JOB_ATTEMPT_ENV = "GPULAB_JOB_ATTEMPT"
#: The run's output directory (absolute; <home>/<output_dir>/run-<id>), the same for every attempt.
JOB_OUTPUT_DIR_ENV = "GPULAB_OUTPUT_DIR"

# --- Environment of a user's server: the GPU monitor (extension) ---------------------------------
# Set by the dev cluster / test harness for servers without NVML; read by jupyterlab_gpulab.

#: The monitor's figures source ("auto", "nvml", "simulated", "none").
MONITOR_SOURCE_ENV = "GPULAB_MONITOR_SOURCE"
#: A JSON file of simulated figures, re-read when it changes.
SIMULATED_GPU_FILE_ENV = "GPULAB_SIMULATED_GPU_FILE"

# --- Metrics push: servers -> the gpulab-metrics service -----------------------------------------
# gpulab.hub.config.apply sets these for every spawner; the server extension
# (jupyterlab_gpulab/push.py) pushes; the service (hub/services/metrics/service.py) receives.

#: Where a server POSTs its Prometheus exposition: the service's own address (never the proxy, so
#: a push is no activity of the server and idle culling still applies) + its prefix + PUSH_PATH.
#: Not a secret: it names an endpoint that checks every push's token with the hub.
PUSH_URL_ENV = "GPULAB_METRICS_PUSH_URL"
#: Seconds between two pushes, so the hub's config sets the cadence the service expects.
PUSH_INTERVAL_ENV = "GPULAB_METRICS_PUSH_INTERVAL_SECONDS"
#: The push endpoint under the service's prefix: POST api/push/<user>[/<server name>].
PUSH_PATH = "api/push"
DEFAULT_PUSH_INTERVAL_SECONDS = 15.0
#: The config file the hub gives the gpulab-metrics service (GPULab.metrics_config_file).
METRICS_CONFIG_ENV = "GPULAB_METRICS_CONFIG"
#: the GPU-hour ledger's database URL, for the gpulab-metrics service (a hub-side process; never
#: in a server's environment: it may hold the database's password)
LEDGER_DB_URL_ENV = "GPULAB_LEDGER_DB_URL"

# --- GPU reports: job runs and Dask workers -> the gpulab-metrics service --------------------------
# A job run or a Dask worker holds a GPU share but runs no JupyterLab, so no GPU monitor pushes for
# it. The hub gives each one a report of its own (these variables and PUSH_INTERVAL_ENV, as a
# mapping): where to
# push, a token of the owner's worth only reporting for that one workload, the workload's name,
# and how often. The job wrapper (its spec's REPORT_SPEC_KEY) and the Dask worker preload
# (its environment) start `jupyterlab_gpulab.reporter` with it; the service accepts pushes for
# <user>/<workload name> while the hub's allocator holds that allocation.

#: The service's push URL, as PUSH_URL_ENV gives a server.
REPORT_URL_ENV = "GPULAB_REPORT_URL"
#: The workload's own token: `custom:gpulab:report-gpu!server=<owner>/<workload name>` only, revoked
#: when the workload's share is given back. Never a server's token, and nothing more of the owner's.
REPORT_TOKEN_ENV = "GPULAB_REPORT_TOKEN"
#: The workload's name, the part of its allocation id after "<owner>/": "job-17", "dask-3-w2".
REPORT_NAME_ENV = "GPULAB_REPORT_NAME"
#: The workload's owner, the hub user it reports for (a pod's uid may have no name).
REPORT_USER_ENV = "GPULAB_REPORT_USER"
#: Where a job attempt's wrapper spec holds the report (a spec the hub hands over privately: a
#: descriptor locally, the attempt's Secret on Kubernetes; never the job's environment).
REPORT_SPEC_KEY = "gpu_report"
#: The custom scope a report token holds (filtered to one workload): report GPU figures for it.
REPORT_GPU_SCOPE = "custom:gpulab:report-gpu"


def is_workload_name(name: str) -> bool:
    """Whether `name` is a job run's ("job-<run id>") or a Dask worker's ("dask-<cluster>-w<n>")
    part of an allocation id, the names gpulab-metrics takes reports for besides servers'. Named
    servers may not take these names (their allocation ids would collide)."""
    if name.startswith("job-"):
        return name[4:].isdigit() and name[4:].isascii()
    if not name.startswith("dask-"):
        return False
    cluster, sep, worker = name[5:].partition("-w")
    return (
        bool(sep)
        and cluster.isascii()
        and cluster.isdigit()
        and worker.isascii()
        and worker.isdigit()
    )


# --- Culling: a server's activity report -> the hub's GPUCuller ------------------------------------
# The server extension (jupyterlab_gpulab/culling.py) reports its users' real input and its kernels'
# execution states; the hub (gpulab.hub.apihandlers.culling) answers with the warning to show.

#: POST <JUPYTERHUB_API_URL>/gpulab/users/<user>/servers/<server>/<ACTIVITY_REPORT_PATH>: the
#: report, with the server's own $JUPYTERHUB_API_TOKEN (users:activity on its owner).
ACTIVITY_REPORT_PATH = "activity"
#: POST .../servers/<server>/<SWITCH_TO_CPU_PATH>: restart the server on the CPU-only profile now.
SWITCH_TO_CPU_PATH = "switch-to-cpu"
#: Seconds between two reports until the hub's first answer names its own cadence.
DEFAULT_ACTIVITY_REPORT_INTERVAL_SECONDS = 15.0
