"""GPU jobs as Kubernetes Jobs: a real hub with GPUKubeSpawner against the real dev cluster, users'
own tokens on the job REST API. A script on a GPU share runs as a batch/v1 Job whose pod holds the
share like a server's and succeeds, with its log and outputs; another tenant's pod cannot connect
to it; cancel deletes the Job and frees the share before it answers; a running job outlives a hub
restart; a run whose node is lost runs again on another node from its checkpoint."""

from __future__ import annotations

import base64
import json
import os
import socket
import sys
import time
import urllib.error
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from traitlets.config import Config

from gpulab.devcluster import DevCluster, NodeSpec
from gpulab.spawner.kube.job_objects import job_run_secret_name
from tests.harness.hub import Hub, merged
from tests.harness.jobs import until, user_client
from tests.harness.kube import CONNECT_SCRIPT, KUBE_HUB_OVERLAY, kube_hub_overlay, pod_manifest
from tests.harness.wait import wait_for

# gj-mig: a MIG-partitioned A100 (the quarter profile's 2g.20gb slices); gj-x, gj-y: one whole
# A100 each, so that a run whose node is lost has another one to go to
NODES = [
    NodeSpec("gj-mig", gpus=1, zone="zone-a", rack="rack-1", mig={"2g.20gb": 3, "1g.10gb": 1}),
    NodeSpec("gj-x", gpus=1, zone="zone-a", rack="rack-1"),
    NodeSpec("gj-y", gpus=1, zone="zone-a", rack="rack-1"),
]

# the job wrapper runs with the Python of the servers' home preparation (python3: the node agent
# finds this checkout's, which has gpulab, first on its PATH)
JOBS_OVERLAY = Config({"GPUJobs": {"admission_interval_seconds": 0.5}})

#: the namespace label Pod Security admission enforces
ENFORCE_LABEL = "pod-security.kubernetes.io/enforce"

#: the uid and gid the servers (and so the jobs) run as (GPUKubeSpawner's defaults)
UID, GID = 1000, 100


@pytest.fixture(scope="module")
def cluster(make_dev_cluster: Any) -> DevCluster:
    return make_dev_cluster(NODES, "gj-cluster")


@pytest.fixture
def hub_overlay() -> Config:
    """More hub config for one test (a test parametrizes it)."""
    return Config()


@pytest.fixture
def hub(make_hub: Any, cluster: DevCluster, shared_dir: Path, hub_overlay: Config) -> Iterator[Hub]:
    # the job pods' GPU reports measure simulated devices (labelled so in their pushes), 60 %
    # busy, every second
    figures = shared_dir / "gpus.json"
    figures.write_text(json.dumps({"*": {"utilization_pct": 60}}))
    monitor = Config()
    monitor.Spawner.environment = {
        "GPULAB_MONITOR_SOURCE": "simulated",
        "GPULAB_SIMULATED_GPU_FILE": str(figures),
    }
    overlay = kube_hub_overlay(
        cluster, merged(KUBE_HUB_OVERLAY, JOBS_OVERLAY, monitor, hub_overlay)
    )
    yield make_hub(
        overlay,
        env={"KUBECONFIG": str(cluster.kubeconfig), "GPULAB_METRICS_PUSH_INTERVAL_SECONDS": "1"},
    )
    # the cluster is the module's: what a test left (a failed one's Jobs) must not hold the next
    # test's GPUs
    cluster.api(
        "DELETE",
        "/apis/batch/v1/namespaces/default/jobs",
        {"propagationPolicy": "Background", "gracePeriodSeconds": 0},
    )
    # one collection delete: a pod the Jobs' cascade removes between a list and its own delete
    # would answer 404 (CI saw that) where a delete of the collection cannot
    cluster.api("DELETE", "/api/v1/namespaces/default/pods", {"gracePeriodSeconds": 0})
    wait_for(
        "no pod left in namespace default",
        lambda: not cluster.api("GET", "/api/v1/namespaces/default/pods")["items"],
        60,
    )


def make_home(cluster: DevCluster, user: str) -> Path:
    """The user's home claim (the name her server's would have), bound; its folder here."""
    name = f"gpulab-home-{user}"
    body = {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": name},
        "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}},
    }
    cluster.api("POST", "/api/v1/namespaces/default/persistentvolumeclaims", body)

    def bound() -> dict[str, Any] | None:
        pvc = cluster.api("GET", f"/api/v1/namespaces/default/persistentvolumeclaims/{name}")
        return pvc if pvc.get("status", {}).get("phase") == "Bound" else None

    pvc = wait_for(f"{name} to be bound", bound, 60)
    pv = cluster.api("GET", f"/api/v1/persistentvolumes/{pvc['spec']['volumeName']}")
    return Path(pv["spec"]["hostPath"]["path"])


def put(home: Path, relative: str, text: str) -> None:
    """A file in the home, the server's uid's (as if she had written it in her lab)."""
    path = home / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    os.chown(path, UID, GID)


def job_pods(cluster: DevCluster, run_id: int) -> list[dict[str, Any]]:
    selector = urllib.parse.quote(f"gpulab.io/job-run={run_id}")
    path = f"/api/v1/namespaces/default/pods?labelSelector={selector}"
    return list(cluster.api("GET", path)["items"])


def running_pod(cluster: DevCluster, run_id: int, attempt: int = 1) -> dict[str, Any]:
    def check() -> dict[str, Any] | None:
        for pod in job_pods(cluster, run_id):
            labels = pod["metadata"]["labels"]
            if (
                labels.get("gpulab.io/job-attempt") == str(attempt)
                and pod["status"].get("phase") == "Running"
                and not pod["metadata"].get("deletionTimestamp")
            ):
                return pod
        return None

    return wait_for(f"the pod of run {run_id} attempt {attempt} to run", check, 90)


def job_exists(cluster: DevCluster, name: str) -> bool:
    try:
        cluster.api("GET", f"/apis/batch/v1/namespaces/default/jobs/{name}")
    except urllib.error.HTTPError as e:
        if e.code == 404:
            return False
        raise
    return True


def connect_from_pod(cluster: DevCluster, name: str, labels: dict[str, str], target: str) -> str:
    """What a pod with `labels` and no NetworkPolicy of its own gets connecting to `target`."""
    manifest = pod_manifest(name, [sys.executable, "-c", CONNECT_SCRIPT, target])
    manifest["metadata"]["labels"] = labels
    cluster.api("POST", "/api/v1/namespaces/default/pods", manifest)
    try:
        wait_for(
            f"{name} to end",
            lambda: (
                cluster.api("GET", f"/api/v1/namespaces/default/pods/{name}")["status"].get("phase")
                in ("Succeeded", "Failed")
            ),
            60,
        )
        out = cluster.logs(name)
        return str(json.loads(out.strip().splitlines()[-1])[target])
    finally:
        cluster.api("DELETE", f"/api/v1/namespaces/default/pods/{name}", {"gracePeriodSeconds": 0})


# listens on the servers' port (the one port the policy opens, to the hub only) until `go` exists
TRAIN = """
import os, socket, sys, time
print('epochs', sys.argv[1], 'on', os.environ['NVIDIA_VISIBLE_DEVICES'], flush=True)
open(os.path.join(os.environ['GPULAB_OUTPUT_DIR'], 'model.bin'), 'w').write('w' * 10)
listener = socket.create_server(('0.0.0.0', 8888))
while not os.path.exists(os.path.join(os.environ['HOME'], 'go')):
    time.sleep(0.2)
print('done', flush=True)
"""


def test_a_script_job_on_a_gpu_share_runs_as_a_job_unreachable_by_another_tenant(
    hub: Hub, cluster: DevCluster
) -> None:
    hub.create_user("alice")
    home = make_home(cluster, "alice")
    put(home, "projects/train.py", TRAIN)
    alice = user_client(hub, "alice")
    body = {
        "name": "train",
        "kind": "script",
        "path": "projects/train.py",
        "args": ["3"],
        "profile": "a100-quarter",
    }
    r = alice.post("/users/alice/jobs", json=body)
    assert r.status_code == 201, r.text
    run_id = r.json()["id"]
    until(alice, f"/users/alice/jobs/{run_id}", "running", timeout=90)
    pod = running_pod(cluster, run_id)
    meta, spec = pod["metadata"], pod["spec"]
    (container,) = spec["containers"]
    # the share's device, on the node the allocator chose, held like a server's
    assert container["resources"]["limits"] == {"nvidia.com/mig-2g.20gb": "1"}
    assert spec["nodeName"] == "gj-mig"
    placement = json.loads(meta["annotations"]["gpulab.io/placement"])
    assert placement["request"]["id"] == f"alice/job-{run_id}"
    assert f"alice/job-{run_id}" in hub.allocations()
    assert hub.capacity()["a100-quarter"]["free"] == 2  # of 3 slices
    # her servers' identity and home
    assert container["securityContext"]["runAsUser"] == UID
    assert spec["securityContext"]["fsGroup"] == GID
    claims = [
        v["persistentVolumeClaim"]["claimName"]
        for v in spec["volumes"]
        if "persistentVolumeClaim" in v
    ]
    assert claims == ["gpulab-home-alice"]
    assert spec["automountServiceAccountToken"] is False
    # the run's GPU report token is in its attempt's Secret (the wrapper's spec), never in the
    # pod's spec or environment, where anyone who may read pods would see it
    secret_name = job_run_secret_name("alice", run_id, 1)
    secret = cluster.api("GET", f"/api/v1/namespaces/default/secrets/{secret_name}")
    wrapper_spec = json.loads(base64.b64decode(secret["data"]["spec.json"]))
    report = wrapper_spec["gpu_report"]
    assert report["GPULAB_REPORT_NAME"] == f"job-{run_id}"
    assert report["GPULAB_REPORT_TOKEN"] not in json.dumps(pod)

    # another tenant's pod (no egress policy of its own) cannot connect to the job: the job
    # pods' NetworkPolicy resets it; the hub's address may (the listener is there)
    ip = pod["status"]["podIP"]
    probe = connect_from_pod(
        cluster, "bob-probe", {"hub.jupyter.org/username": "bob"}, f"{ip}:8888"
    )
    assert probe == "refused", probe
    socket.create_connection((ip, 8888), timeout=5).close()

    # the run's live GPU figures in the admin overview: the pod's monitor names the MIG
    # instance the device plugin gave it, the allocator the slot; they are paired
    def live_job() -> dict[str, Any] | None:
        r = hub.api("GET", "/gpulab/admin/overview", params={"kind": "job"})
        rows = [w for w in r.json()["workloads"] if w["id"] == f"alice/job-{run_id}"]
        return rows[0] if rows and rows[0]["utilization"] is not None else None

    job = wait_for("the run's live GPU figures", live_job, 30, 0.5)
    assert job["utilization"] == 60.0
    assert job["live"]["slices"][0]["device"].startswith("MIG-gj-mig-")

    put(home, "go", "")
    done = until(alice, f"/users/alice/jobs/{run_id}", "succeeded", "failed", timeout=90)
    assert done["state"] == "succeeded", (done, hub.log()[-3000:])
    assert done["outputs"] == [{"path": "model.bin", "size_bytes": 10}]
    assert (home / "gpulab-jobs" / "train" / f"run-{run_id}" / "model.bin").read_text() == "w" * 10
    logs = alice.get(f"/users/alice/jobs/{run_id}/logs").json()
    assert logs["data"].startswith("epochs 3 on MIG-gj-mig-"), logs
    assert "\ndone\n" in logs["data"] and logs["ended"] is True
    assert f"alice/job-{run_id}" not in hub.allocations()
    assert hub.capacity()["a100-quarter"]["free"] == 3

    # the pod's wrapper reported its share's figures from the pod network: its hours are
    # measured (used and idle), not unmonitored
    def job_row() -> dict[str, Any] | None:
        r = hub.api("GET", "/gpulab/usage", params={"by": "workload", "bucket": "day"})
        rows = [x for x in r.json()["rows"] if x["workload"] == "job" and x["used_gpu_hours"] > 0]
        return rows[0] if rows else None

    row = wait_for("the run's used GPU-hours from its pod's reports", job_row, 30, 0.5)
    assert row["unmonitored_gpu_hours"] == 0.0
    assert 0 < row["used_gpu_hours"] <= row["allocated_gpu_hours"]
    wait_for(
        "the finished Job to be deleted",
        lambda: not job_exists(cluster, meta["labels"]["job-name"]),
        30,
    )


def test_cancel_and_timeout_end_the_job_and_free_the_share_and_a_job_outlives_a_hub_restart(
    hub: Hub, cluster: DevCluster
) -> None:
    hub.create_user("carl")
    home = make_home(cluster, "carl")
    put(
        home,
        "wait.py",
        "import os, time\nprint('waiting', flush=True)\n"
        "while not os.path.exists(os.path.join(os.environ['HOME'], 'go')):\n    time.sleep(0.2)\n",
    )
    put(home, "sleep.py", "import time\nprint('sleeping', flush=True)\ntime.sleep(600)\n")
    carl = user_client(hub, "carl")
    runs = {}
    for name in ("wait", "sleep"):
        body = {"name": name, "kind": "script", "path": f"{name}.py", "profile": "a100-quarter"}
        r = carl.post("/users/carl/jobs", json=body)
        assert r.status_code == 201, r.text
        runs[name] = r.json()["id"]
    for run_id in runs.values():
        until(carl, f"/users/carl/jobs/{run_id}", "running", timeout=90)
    kept = running_pod(cluster, runs["wait"])
    canceled = running_pod(cluster, runs["sleep"])

    hub.stop_hub()
    hub.start()
    carl = user_client(hub, "carl")
    assert {f"carl/job-{i}" for i in runs.values()} <= set(hub.allocations())
    assert carl.get(f"/users/carl/jobs/{runs['wait']}").json()["state"] == "running"
    assert running_pod(cluster, runs["wait"])["metadata"]["uid"] == kept["metadata"]["uid"]

    r = carl.delete(f"/users/carl/jobs/{runs['sleep']}")
    assert r.status_code == 200, r.text
    assert r.json()["state"] == "canceled" and r.json()["reason"] == "canceled by carl"
    # when the answer comes: the share is free and no pod of the Job runs
    assert f"carl/job-{runs['sleep']}" not in hub.allocations()
    assert not [
        p for p in job_pods(cluster, runs["sleep"]) if p["status"].get("phase") == "Running"
    ]
    job = canceled["metadata"]["labels"]["job-name"]
    wait_for(f"Job {job} to be deleted", lambda: not job_exists(cluster, job), 30)
    logs = carl.get(f"/users/carl/jobs/{runs['sleep']}/logs").json()
    assert logs["data"].startswith("sleeping"), logs

    # the run's timeout is the Job's activeDeadlineSeconds
    body = {"name": "slow", "kind": "script", "path": "sleep.py", "profile": "a100-quarter"}
    r = carl.post("/users/carl/jobs", json={**body, "timeout_seconds": 3})
    assert r.status_code == 201, r.text
    slow = until(
        carl, f"/users/carl/jobs/{r.json()['id']}", "timed_out", "failed", "succeeded", timeout=90
    )
    assert slow["state"] == "timed_out", slow
    assert f"carl/job-{slow['id']}" not in hub.allocations()

    put(home, "go", "")
    done = until(carl, f"/users/carl/jobs/{runs['wait']}", "succeeded", "failed", timeout=90)
    assert done["state"] == "succeeded", (done, hub.log()[-3000:])
    assert [a["state"] for a in done["attempts"]] == ["succeeded"]
    assert not [a for a in hub.allocations() if a.startswith("carl/job-")]


# counts on from its checkpoint (written atomically) every half second until `stop` exists
COUNTER = """
import os, time
checkpoint = os.path.join(os.environ['GPULAB_CHECKPOINT_DIR'], 'counter')
n = int(open(checkpoint).read()) if os.path.exists(checkpoint) else 0
print('attempt', os.environ['GPULAB_JOB_ATTEMPT'], 'resumes at', n, flush=True)
while not os.path.exists(os.path.join(os.environ['HOME'], 'stop')):
    n += 1
    with open(checkpoint + '.tmp', 'w') as f:
        f.write(str(n))
    os.replace(checkpoint + '.tmp', checkpoint)
    print('count', n, flush=True)
    time.sleep(0.5)
"""


def test_a_run_whose_node_is_lost_resumes_on_another_node_from_its_checkpoint(
    hub: Hub, cluster: DevCluster
) -> None:
    hub.create_user("dana")
    home = make_home(cluster, "dana")
    put(home, "count.py", COUNTER)
    dana = user_client(hub, "dana")
    body = {"name": "count", "kind": "script", "path": "count.py", "profile": "a100-1"}
    r = dana.post("/users/dana/jobs", json=body)
    assert r.status_code == 201, r.text
    run_id = r.json()["id"]
    path = f"/users/dana/jobs/{run_id}"
    until(dana, path, "running", timeout=90)
    lost = running_pod(cluster, run_id)["spec"]["nodeName"]
    checkpoint = home / "gpulab-jobs" / "count" / f"run-{run_id}" / "checkpoints" / "counter"
    wait_for("3 counts", lambda: checkpoint.exists() and int(checkpoint.read_text() or 0) >= 3, 30)
    cluster.stop_node(lost)
    stopped = time.monotonic()
    try:
        not_ready = wait_for(
            f"{lost} to be NotReady",
            lambda: _node_ready(cluster, lost) != "True" and time.monotonic(),
            60,
        )
        at_stop = int(checkpoint.read_text())  # its processes were killed with the node
        pod = running_pod(cluster, run_id, attempt=2)
        resumed_after = time.monotonic() - not_ready
        print(
            f"\nnode-loss resume: {resumed_after:.1f} s from NotReady to running again "
            f"({not_ready - stopped:.1f} s from the stop to NotReady)"
        )
        assert pod["spec"]["nodeName"] not in (lost, "gj-mig")
        run = dana.get(path).json()
        first = run["attempts"][0]
        assert first["state"] == "preempted" and first["reason"] == f"node {lost} was lost", run
        wait_for("attempt 2 to count", lambda: "count" in _log(dana, path, 2), 30)
        text = _log(dana, path, 2)
        assert text.startswith(f"attempt 2 resumes at {at_stop}\n"), text
        assert f"count {at_stop + 1}\n" in text  # continued, not restarted
        assert f"dana/job-{run_id}" in hub.allocations()
        put(home, "stop", "")
        done = until(dana, path, "succeeded", "failed", timeout=90)
        assert done["state"] == "succeeded", done
        assert [a["state"] for a in done["attempts"]] == ["preempted", "succeeded"]
    finally:
        cluster.start_node(lost)


def _node_ready(cluster: DevCluster, name: str) -> str:
    conditions = cluster.api("GET", f"/api/v1/nodes/{name}").get("status", {}).get("conditions", [])
    return next((c["status"] for c in conditions if c["type"] == "Ready"), "missing")


def _log(client: httpx.Client, path: str, attempt: int) -> str:
    return str(client.get(f"{path}/logs", params={"attempt": attempt}).json()["data"])


def test_a_job_is_refused_a_node_other_than_the_one_her_readwriteonce_home_is_mounted_on(
    hub: Hub, cluster: DevCluster
) -> None:
    hub.create_user("eve")
    hub.start_server("eve", profile="a100-1")  # her home claim (ReadWriteOnce) on gj-x or gj-y
    home = make_home_of_server(cluster, "eve")
    put(home, "job.py", "print('ran')\n")
    eve = user_client(hub, "eve")
    body = {"name": "j", "kind": "script", "path": "job.py", "profile": "a100-quarter"}
    r = eve.post("/users/eve/jobs", json=body)  # a slice of gj-mig: another node
    assert r.status_code == 201, r.text
    run = until(eve, f"/users/eve/jobs/{r.json()['id']}", "failed", "succeeded", timeout=90)
    assert run["state"] == "failed", run
    assert "ReadWriteOnce" in run["reason"] and "mounted on node gj-" in run["reason"], run
    assert not job_pods(cluster, run["id"])  # nothing was created
    assert f"eve/job-{run['id']}" not in hub.allocations()
    hub.stop_server("eve")
    # with her server stopped, the job mounts the home where it runs
    r = eve.post("/users/eve/jobs", json=body)
    run = until(eve, f"/users/eve/jobs/{r.json()['id']}", "failed", "succeeded", timeout=90)
    assert run["state"] == "succeeded", run


def make_home_of_server(cluster: DevCluster, user: str) -> Path:
    """The folder of the home claim her server made."""
    claim = cluster.api(
        "GET", f"/api/v1/namespaces/default/persistentvolumeclaims/gpulab-home-{user}"
    )
    pv = cluster.api("GET", f"/api/v1/persistentvolumes/{claim['spec']['volumeName']}")
    return Path(pv["spec"]["hostPath"]["path"])


def test_an_on_demand_server_preempts_a_preemptible_job_pod_which_resumes_from_its_checkpoint(
    hub: Hub, cluster: DevCluster
) -> None:
    hub.create_user("fran")
    hub.create_user("gus")
    hub.create_user("hal")
    home = make_home(cluster, "fran")
    put(home, "count.py", COUNTER)
    fran = user_client(hub, "fran")
    body = {
        "name": "spot",
        "kind": "script",
        "path": "count.py",
        "profile": "a100-1",
        "preemptible": True,
    }
    r = fran.post("/users/fran/jobs", json=body)
    assert r.status_code == 201, r.text
    run_id = r.json()["id"]
    path = f"/users/fran/jobs/{run_id}"
    until(fran, path, "running", timeout=90)
    running_pod(cluster, run_id)
    checkpoint = home / "gpulab-jobs" / "spot" / f"run-{run_id}" / "checkpoints" / "counter"
    wait_for("2 counts", lambda: checkpoint.exists() and int(checkpoint.read_text() or 0) >= 2, 30)
    hub.start_server("gus", profile="a100-1")  # the other whole A100
    # hal's on-demand whole GPU: none is free, the job's gives way
    hub.start_server("hal", profile="a100-1")
    run = fran.get(path).json()
    first = run["attempts"][0]
    assert first["state"] == "preempted", run
    assert "preempted for on-demand work hal/" in first["reason"], run
    assert run["state"] == "queued"
    assert f"fran/job-{run_id}" not in hub.allocations()
    assert not [p for p in job_pods(cluster, run_id) if p["status"].get("phase") == "Running"]
    at_stop = int(checkpoint.read_text())
    hub.stop_server("hal")
    running_pod(cluster, run_id, attempt=2)
    wait_for("attempt 2 to count", lambda: "count" in _log(fran, path, 2), 30)
    text = _log(fran, path, 2)
    assert text.startswith(f"attempt 2 resumes at {at_stop}\n"), text
    put(home, "stop", "")
    done = until(fran, path, "succeeded", "failed", timeout=90)
    assert [a["state"] for a in done["attempts"]] == ["preempted", "succeeded"], done
    hub.stop_server("gus")


@pytest.mark.parametrize(
    "hub_overlay", [Config({"GPUKubeSpawner": {"run_as_non_root": False}})], ids=["unhardened"]
)
def test_a_job_whose_pod_pod_security_refuses_fails_at_once_saying_why(
    hub: Hub, cluster: DevCluster
) -> None:
    """With the servers' hardening turned off in a namespace that enforces `restricted`, the
    Job controller's every pod is refused (FailedCreate events, no pod): the run fails within
    seconds with the API server's reason and the settings to look at, its share given back,
    rather than waiting out start_timeout (120 s here) and retrying as the platform's failure."""
    set_enforce(cluster, "restricted")
    try:
        hub.create_user("rita")
        home = make_home(cluster, "rita")
        put(home, "projects/hello.py", "print('never runs')\n")
        rita = user_client(hub, "rita")
        body = {
            "name": "hello",
            "kind": "script",
            "path": "projects/hello.py",
            "profile": "a100-quarter",
        }
        r = rita.post("/users/rita/jobs", json=body)
        assert r.status_code == 201, r.text
        run_id = r.json()["id"]
        run = until(rita, f"/users/rita/jobs/{run_id}", "failed", "succeeded", timeout=60)
        assert run["state"] == "failed", run
        assert 'violates PodSecurity "restricted:latest"' in run["reason"], run
        assert "runAsNonRoot != true" in run["reason"], run
        assert "GPUKubeSpawner.run_as_non_root" in run["reason"], run
        assert [a["state"] for a in run["attempts"]] == ["failed"], run  # no platform retry
        assert not job_pods(cluster, run_id)
        assert f"rita/job-{run_id}" not in hub.allocations()
        assert hub.capacity()["a100-quarter"]["free"] == 3
    finally:
        set_enforce(cluster, None)


def set_enforce(cluster: DevCluster, level: str | None) -> None:
    """Namespace default's Pod Security enforce level (None: the label removed)."""
    namespace = cluster.api("GET", "/api/v1/namespaces/default")
    labels = namespace["metadata"].setdefault("labels", {})
    labels.pop(ENFORCE_LABEL, None)
    if level is not None:
        labels[ENFORCE_LABEL] = level
    cluster.api("PUT", "/api/v1/namespaces/default", namespace)
