"""The Kubernetes job executor: one attempt of a GPU job run as one `batch/v1` Job of its owner's.

`GPUKubeSpawner.job_executor` hands the hub's job service a `KubeJobExecutor` (the contract:
`gpulab.hub.jobservice.JobExecutor`). The manifests are the pure builders of `job_objects`; this
module talks to the API server and decides when an attempt has ended (reading the Job and pod
with `job_outcomes`, calling the API through `job_api`, keeping records with `job_records`).

start     once the allocator admitted the run (never before: no Pending pod waits for GPUs),
          creates the attempt's Secret, then its Job, then makes the Job the Secret's owner.
          The pod has the same GPU resources, node pin, priority class and placement annotation
          as a server on the same placement (`gpu_resources.placed_pod`), so the hub's cluster
          view (`state.KubeGPUState`) counts it and a restarted hub rebuilds the allocation from
          it; it runs with the owner's servers' uid/gid/fsGroup and hardening and mounts her home
          claim at her servers' home, so the input, the outputs and GPULAB_CHECKPOINT_DIR are the
          folders her lab shows, kept across attempts. Job pods get a NetworkPolicy of their own
          (`<network_policy_name>-jobs`) with the servers' rules: nothing but the hub, the proxy
          and the metrics scraper may connect to them (another tenant's pod cannot).
wait      polls the hub's pod cache and the Job until nothing of the attempt runs, then keeps
          the outcome and the log in the hub's runs folder and deletes the Job and its Secret:
          Complete -> Succeed; Failed with DeadlineExceeded (`activeDeadlineSeconds` = the run's
          `timeout_seconds`) -> TimeOut; Failed otherwise -> Fail with the container's exit code;
          the Job deleted by `cancel` -> Cancel; a pod that does not start within the spawner's
          `start_timeout` -> Fail (the kubelet's reason, e.g. CreateContainerConfigError).
node loss a pod whose node has been NotReady (or gone) for `GPUKubeSpawner.node_failure_seconds`
          is lost: the Job is deleted and its pods force-deleted (no kubelet will confirm), and
          the outcome is `Preempt(reason="node X was lost")`, so the service frees the share and
          queues the run again (preemptions do not count against `max_retries`); the cluster
          view leaves NotReady nodes out of the inventory (`nodes.inventory_from_nodes`), so the
          next attempt lands on another node and resumes from GPULAB_CHECKPOINT_DIR. With the
          default 30 s a run ran again 30.8 s after its node went NotReady on the dev cluster
          (2.6 s with the tests' 2 s); the issue's bar is 90 s.
cancel    deletes the Job (propagation Foreground: the pods get SIGTERM, which the wrapper passes
          to the job, SIGKILL after the grace) and returns when no pod of it runs (pods of a lost
          node are force-deleted).
reattach  after a hub restart: the Job and its pods are found again by name and labels.
tail      the pod's log through the API server (the kubelet's containerLogs), from a byte
          offset. The API merges stdout and stderr into one log, so on Kubernetes the whole log
          is the "stdout" stream and "stderr" is empty. Once the attempt ended the hub's copy is
          read (the Job, and with it the pod's log, is deleted); while it runs the copy is
          refreshed every `LOG_COPY_SECONDS`, so the log of an attempt lost with its node keeps
          what was read before.
outputs   the hub cannot read a pod's volume (it is the node's, not the hub's), so the job
          wrapper ends the log with the run's file listing (`jobwrapper --list-outputs`); the
          executor takes the last such line. The job could print a forged one: that lies only
          about its own run's listing, of files she controls anyway.

Files in the hub's runs folder (root's, 0700, nothing the user reaches):
`<runs_dir>/run-<id>/attempt-<n>/kube/` holds `log` (the final copy, or `log.partial` while it
runs), `ended-by` ("canceled": the hub's own word, never taken from the pod) and `result.json`
(the outcome, written before the Job is deleted, so a restart between the two still knows it).

The home claim, ReadWriteOnce or ReadWriteMany. A job mounts its owner's home claim wherever the
allocator placed it; it does not follow her server's node. The allocator places by GPUs, so
pinning jobs to the server's node would make a job wait for GPUs on that one node, for a server
that has nothing to do with it, and a run whose node is lost has to move anyway. So:

- ReadWriteMany homes (NFS, CephFS, Filestore...) are what jobs want: any node mounts them, a
  run resumes on another node within seconds, and a server and a job use the home at once;
- a ReadWriteOnce home is mounted by the pods of one node at a time. `start` refuses (before it
  creates anything, with a message that says what to do) a placement on another node than a
  live pod of the owner that mounts the claim (her server); with no server running, the job
  mounts it where it runs. After a node loss a ReadWriteOnce volume stays attached to the lost
  node until the attach-detach controller gives up (6 min) or the node gets the
  `node.kubernetes.io/out-of-service` taint, so the 90 s resume needs ReadWriteMany homes (the
  dev cluster's `gpulab-local` volumes are host folders, which behave as such).

A lost node may still run the pod behind a network partition (as with servers): until it is
fenced, both attempts may write the checkpoint folder. Jobs should write checkpoints atomically
(write a temporary file, then rename), which the documented GPULAB_CHECKPOINT_DIR pattern does.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import asdict
from typing import Any, cast

from kubernetes_asyncio.client import BatchV1Api
from kubernetes_asyncio.client.exceptions import ApiException

from gpulab.hub.allocator import Placement
from gpulab.hub.jobs import JobSpec, Run
from gpulab.spawner.kube.job_api import (
    delete_job,
    delete_leftovers,
    delete_pod,
    delete_secret,
    job_events,
    pods_of,
    read_job,
)
from gpulab.spawner.kube.job_objects import (
    CONTAINER_NAME,
    KubeJobSettings,
    job_run_manifest,
    job_run_name,
    job_run_secret_manifest,
    job_run_secret_name,
    secret_owner_patch,
)
from gpulab.spawner.kube.job_outcomes import (
    KubeOutcome,
    container_end,
    creation_failure,
    finished_outcome,
    job_finished,
    outputs_from_log,
    pod_is_live,
    refused_by_pod_security,
    waiting_reason,
)
from gpulab.spawner.kube.job_records import (
    MAX_LOG_BYTES,
    KubeHandle,
    mark_ended_by,
    read_log_copy,
    read_result,
    read_small,
    read_small_bytes,
    write_file,
)
from gpulab.spawner.kube.pod_security import pod_security_advice
from gpulab.spawner.singleuser.jobwrapper import (
    BEFORE_USER_CODE,
    DEFAULT_KERNEL_START_TIMEOUT_SECONDS,
)

log = logging.getLogger("gpulab.jobs.kube")

#: the stream the pod log is served as (the API server merges stdout and stderr)
LOG_STREAM = "stdout"
#: how often a running attempt's log is copied to the hub's runs folder
LOG_COPY_SECONDS = 10.0
#: the end of a pod's log read for the wrapper's cause of a failure before the job's code
CAUSE_BYTES = 64 * 1024
READ_WRITE_MANY = "ReadWriteMany"
#: how long an attempt's Job may be without a pod before its events are read for why (the Job
#: controller makes the pod within a second when it can)
NO_POD_CHECK_SECONDS = 3.0


class KubeJobError(Exception):
    """An attempt could not be started or stopped; the message says why and what to change."""


class KubeJobExecutor:
    """Attempts of job runs as Kubernetes Jobs (see the module docstring). `spawner_for(owner)`:
    the owner's default server's GPUKubeSpawner (her namespace, image, uid, home claim, the
    cluster client, the hub's cluster view and the GPUs behind a placement, as for her
    servers); `runs_dir`: the hub's folder for attempts' records."""

    def __init__(
        self,
        *,
        runs_dir: str,
        spawner_for: Callable[[str], Awaitable[Any]],
        poll_seconds: float = 1.0,
        kernel_start_timeout_seconds: int = DEFAULT_KERNEL_START_TIMEOUT_SECONDS,
    ) -> None:
        self.runs_dir, self.spawner_for = runs_dir, spawner_for
        self.poll_seconds = poll_seconds
        self.kernel_start_timeout_seconds = kernel_start_timeout_seconds
        self._log_cache: dict[str, tuple[float, bytes]] = {}

    # -- start -------------------------------------------------------------------------------

    async def start(
        self,
        run: Run,
        spec: JobSpec,
        placement: Placement,
        report: Mapping[str, str] | None = None,
    ) -> dict[str, Any]:
        spawner = await self.spawner_for(spec.owner)
        await spawner.gpu_state()  # the cluster view, and the priority classes the pod names
        profile = spawner.gpu_capacity.profile(spec.profile)
        if profile is None:
            raise KubeJobError(f"profile {spec.profile!r} no longer exists")
        attempt = len(run.attempts)
        settings = await self._settings(spawner)
        claim = await self._home_claim(spawner, spec.owner, placement.node)
        await spawner.ensure_job_network_policy()  # before the pod: never up unprotected
        pod = spawner.placed_job_pod(profile, placement)
        priority = placement.request.priority
        secret = job_run_secret_manifest(
            spec,
            run_id=run.id,
            attempt=attempt,
            priority=priority,
            settings=settings,
            report=report,
        )
        job = job_run_manifest(
            spec,
            run_id=run.id,
            attempt=attempt,
            profile=profile,
            placement=placement,
            pod=pod,
            home_pvc=claim,
            timeout_seconds=spec.timeout_seconds,
            settings=settings,
        )
        handle = KubeHandle(
            owner=spec.owner,
            run_id=run.id,
            attempt=attempt,
            namespace=settings.namespace,
            job=job_run_name(spec.owner, run.id, attempt),
            secret=job_run_secret_name(spec.owner, run.id, attempt),
            node=placement.node,
            started_at=time.time(),
            attempt_dir=await asyncio.to_thread(self._attempt_dir, run.id, attempt),
        )
        core, batch = spawner.api, BatchV1Api(spawner.api.api_client)
        ns = settings.namespace
        try:
            await delete_leftovers(core, batch, handle)  # of a start the hub did not finish
            await core.create_namespaced_secret(ns, secret)
            created = await batch.create_namespaced_job(ns, cast(Any, job))  # a dict is a body
            body = core.api_client.sanitize_for_serialization(created)
            await core.patch_namespaced_secret(handle.secret, ns, secret_owner_patch(body))
        except BaseException as e:
            with contextlib.suppress(Exception):
                await delete_job(batch, handle, grace=0, propagation="Background")
                await delete_secret(core, handle)
            if isinstance(e, ApiException):
                detail = e.body.decode(errors="replace") if isinstance(e.body, bytes) else e.body
                raise KubeJobError(
                    f"the cluster refused the Job of run {run.id} ({e.status} {e.reason}): "
                    f"{str(detail or '')[:300]}"
                ) from None
            raise
        log.info(
            "job run %d attempt %d: Job %s/%s on %s", run.id, attempt, ns, handle.job, handle.node
        )
        return handle.to_dict()

    async def _settings(self, spawner: Any) -> KubeJobSettings:
        async def resolved(value: Any) -> Any:
            if callable(value):
                value = value(spawner)
                if asyncio.iscoroutine(value):
                    value = await value
            return value

        return KubeJobSettings(
            namespace=spawner.namespace,
            image=spawner.image,
            home=spawner.workspace_home,
            python=spawner.job_python,
            uid=await resolved(spawner.uid),
            gid=await resolved(spawner.gid),
            fs_gid=await resolved(spawner.fs_gid),
            run_as_non_root=spawner.run_as_non_root,
            seccomp=spawner.seccomp_profile,
            drop_capabilities=tuple(spawner.drop_capabilities),
            # the hub deletes each Job once it has its outcome and log; the TTL (where the
            # cluster's TTL controller runs) only cleans up after a hub that never came back
            ttl_seconds_after_finished=24 * 3600,
            termination_grace_seconds=int(spawner.delete_grace_period),
            image_pull_policy=spawner.image_pull_policy or None,
            labels=dict(spawner.common_labels),
            kernel_start_timeout_seconds=self.kernel_start_timeout_seconds,
        )

    async def _home_claim(self, spawner: Any, owner: str, node: str) -> str:
        """The owner's home claim (made as her server would make it, when she never had one),
        after the ReadWriteOnce check of the module docstring."""
        core, ns, name = spawner.api, spawner.namespace, spawner.pvc_name
        try:
            claim = await core.read_namespaced_persistent_volume_claim(name, ns)
        except ApiException as e:
            if e.status != 404:
                raise
            spawner.apply_workspace_to_pod()  # the claim's labels, as her server's first start
            try:
                await core.create_namespaced_persistent_volume_claim(ns, spawner.get_pvc_manifest())
            except ApiException as e2:
                if e2.status != 409:
                    raise
            return str(name)
        modes = set(core.api_client.sanitize_for_serialization(claim.spec).get("accessModes") or [])
        if READ_WRITE_MANY in modes:
            return str(name)
        state = await spawner.gpu_state()
        for pod in list(state.pods.objects.values()):
            meta, pod_spec = pod["metadata"], pod.get("spec") or {}
            other = pod_spec.get("nodeName")
            if meta.get("namespace") != ns or not pod_is_live(pod) or not other or other == node:
                continue
            claims = {
                (v.get("persistentVolumeClaim") or {}).get("claimName")
                for v in pod_spec.get("volumes") or []
            }
            if name in claims:
                raise KubeJobError(
                    f"{owner}'s home {name} is ReadWriteOnce and mounted on node {other} (pod "
                    f"{meta['name']}); the job was placed on {node}. Stop the server there, or "
                    "give homes ReadWriteMany storage (GPUKubeSpawner.storage_access_modes)"
                )
        return str(name)

    def _attempt_dir(self, run_id: int, attempt: int) -> str:
        path = os.path.join(self.runs_dir, f"run-{run_id}", f"attempt-{attempt}", "kube")
        os.makedirs(path, mode=0o700, exist_ok=True)
        return path

    # -- wait, cancel, reattach ----------------------------------------------------------------

    async def wait(self, handle: Mapping[str, Any]) -> KubeOutcome:
        h = KubeHandle.from_dict(handle)
        recorded = await asyncio.to_thread(read_result, h)
        if recorded is not None:
            return recorded
        spawner = await self.spawner_for(h.owner)
        state = await spawner.gpu_state()
        core, batch = spawner.api, BatchV1Api(spawner.api.api_client)
        copied_at = 0.0
        while True:
            try:
                outcome = await self._ended(spawner, state, batch, h)
            except (ApiException, OSError, asyncio.TimeoutError) as e:
                # the API server may be away for a while (an upgrade): the attempt still runs,
                # and its watcher must outlive that
                log.warning("job run %d: cannot read Job %s (%s); retrying", h.run_id, h.job, e)
                await asyncio.sleep(5 * self.poll_seconds)
                continue
            if outcome is not None:
                break
            if time.monotonic() - copied_at > LOG_COPY_SECONDS:
                copied_at = time.monotonic()
                await self._copy_log(core, state, h, "log.partial")
            await asyncio.sleep(self.poll_seconds)
        if outcome.kind != "lost":  # a lost node's kubelet answers nothing
            await self._copy_log(core, state, h, "log")
        await asyncio.to_thread(write_file, h.path("result.json"), json.dumps(asdict(outcome)))
        with contextlib.suppress(ApiException):
            await delete_job(batch, h, grace=0, propagation="Background")
            await delete_secret(core, h)
        self._log_cache.pop(h.job, None)
        return outcome

    async def _ended(
        self, spawner: Any, state: Any, batch: BatchV1Api, h: KubeHandle
    ) -> KubeOutcome | None:
        """The attempt's outcome once nothing of it runs; None while it runs."""
        pods = pods_of(state, h)
        live = [p for p in pods if pod_is_live(p)]
        for pod in live:
            node = (pod.get("spec") or {}).get("nodeName")
            if node and state.node_failed_for(node) > spawner.node_failure_seconds:
                await self._remove_lost(spawner, batch, h, node)
                return KubeOutcome("lost", f"node {node} was lost")
        job = await read_job(batch, h)
        canceled = await asyncio.to_thread(read_small, h.path("ended-by")) == "canceled"
        if job is None or job["metadata"].get("deletionTimestamp"):
            if live:
                return None  # a cancel in progress: its pods are stopping
            if canceled:
                return KubeOutcome("canceled")
            return KubeOutcome("failed", "its Job was deleted (not by the hub)")
        if job_finished(job) is not None:
            if live:
                return None  # e.g. past its deadline: the controller stops the pod
            last = pods[-1] if pods else None
            log_end = b""
            if container_end(last)[0] == BEFORE_USER_CODE:  # its log says whether it was ours
                log_end = (await self._pod_log(spawner.api, state, h) or b"")[-CAUSE_BYTES:]
            return finished_outcome(job, last, log_end)
        running = any((p.get("status") or {}).get("phase") == "Running" for p in live)
        waited = time.time() - h.started_at
        refused = ""
        if not pods and waited > NO_POD_CHECK_SECONDS:
            # why the Job controller made no pod: its FailedCreate events say
            refused = creation_failure(await job_events(spawner.api, h))
            if refused_by_pod_security(refused):
                await delete_job(batch, h, grace=0, propagation="Background")
                return KubeOutcome("failed", pod_security_advice(refused, h.namespace))
        if not running and waited > float(spawner.start_timeout):
            why = waiting_reason(live[-1] if live else None) or refused or "no pod was scheduled"
            await delete_job(batch, h, grace=0, propagation="Background")
            for pod in live:
                await delete_pod(spawner.api, pod, grace=0)
            # nothing of the job ran: the platform's failure (an image that does not pull, a
            # node that does not start the container), retried without counting
            reason = f"did not start within {waited:.0f} s: {why}"
            return KubeOutcome("failed", reason, platform_failure=True)
        return None

    async def _remove_lost(self, spawner: Any, batch: BatchV1Api, h: KubeHandle, node: str) -> None:
        log.warning(
            "job run %d attempt %d: node %s is lost; deleting its Job %s",
            h.run_id,
            h.attempt,
            node,
            h.job,
        )
        spawner.gpu_capacity.record_notice(
            h.owner, f"Your job run {h.run_id} was lost with node {node}; it runs again"
        )
        # the Job first (its controller must not make a new pod), then its pods at once: no
        # kubelet will confirm their end, and the share is given to the next attempt
        with contextlib.suppress(ApiException):
            await delete_job(batch, h, grace=0, propagation="Background")
        state = await spawner.gpu_state()
        for pod in pods_of(state, h):
            await delete_pod(spawner.api, pod, grace=0)

    async def cancel(self, handle: Mapping[str, Any]) -> None:
        h = KubeHandle.from_dict(handle)
        await asyncio.to_thread(mark_ended_by, h, "canceled")
        spawner = await self.spawner_for(h.owner)
        state = await spawner.gpu_state()
        core, batch = spawner.api, BatchV1Api(spawner.api.api_client)
        await self._copy_log(core, state, h, "log.partial")  # the log goes with the pod
        grace = int(spawner.delete_grace_period)
        await delete_job(batch, h, grace=grace, propagation="Foreground")
        give_up = time.monotonic() + grace + 60
        while live := [p for p in pods_of(state, h) if pod_is_live(p)]:
            for pod in live:
                node = (pod.get("spec") or {}).get("nodeName")
                if node and state.node_failed_for(node) > 0:
                    await delete_pod(core, pod, grace=0)  # no kubelet will stop it
            if time.monotonic() > give_up:
                names = ", ".join(p["metadata"]["name"] for p in live)
                raise KubeJobError(f"pods {names} of run {h.run_id} did not stop after {grace} s")
            await asyncio.sleep(min(self.poll_seconds, 0.25))
        await delete_secret(core, h)

    async def reattach(self, handle: Mapping[str, Any]) -> bool:
        h = KubeHandle.from_dict(handle)
        if await asyncio.to_thread(read_result, h) is not None:
            return False
        spawner = await self.spawner_for(h.owner)
        state = await spawner.gpu_state()
        job = await read_job(BatchV1Api(spawner.api.api_client), h)
        if job is None or job_finished(job) is not None:
            return any(pod_is_live(p) for p in pods_of(state, h))
        return True

    # -- logs and outputs ----------------------------------------------------------------------

    async def _pod_log(self, core: Any, state: Any, h: KubeHandle) -> bytes | None:
        """The pod's whole log through the API server (None: no pod, or no log to read)."""
        pods = pods_of(state, h)
        if not pods:
            return None
        name = pods[-1]["metadata"]["name"]
        try:
            response = await core.read_namespaced_pod_log(
                name,
                h.namespace,
                container=CONTAINER_NAME,
                limit_bytes=MAX_LOG_BYTES,
                _preload_content=False,
            )
        except ApiException:
            return None  # not started yet, or its node is gone
        except (OSError, asyncio.TimeoutError):
            return None
        try:
            data: bytes = await response.read()
        finally:
            response.release()
        return data

    async def _copy_log(self, core: Any, state: Any, h: KubeHandle, name: str) -> None:
        data = await self._pod_log(core, state, h)
        if data is not None:
            await asyncio.to_thread(write_file, h.path(name), data)

    async def tail(
        self, handle: Mapping[str, Any], stream: str, offset: int = 0
    ) -> tuple[bytes, int]:
        if stream not in ("stdout", "stderr"):
            raise ValueError(f"stream must be 'stdout' or 'stderr', got {stream!r:.40}")
        if offset < 0:
            raise ValueError(f"offset must be at least 0, got {offset}")
        h = KubeHandle.from_dict(handle)
        if stream != LOG_STREAM:
            return b"", offset  # merged into the one pod log (module docstring)
        data = await self._log_of(h)
        if offset >= len(data):
            return b"", offset
        return data[offset:], len(data)

    async def _log_of(self, h: KubeHandle) -> bytes:
        saved = await asyncio.to_thread(read_log_copy, h)
        if saved is not None:
            return saved
        # a running attempt: live viewers poll several times a second, the API is asked at most
        # twice a second per attempt
        cached = self._log_cache.get(h.job)
        if cached is not None and time.monotonic() - cached[0] < 0.5:
            return cached[1]
        spawner = await self.spawner_for(h.owner)
        data = await self._pod_log(spawner.api, await spawner.gpu_state(), h)
        if data is None:
            partial = await asyncio.to_thread(read_small_bytes, h.path("log.partial"))
            data = partial or b""
        self._log_cache[h.job] = (time.monotonic(), data)
        return data

    async def outputs(self, handle: Mapping[str, Any]) -> list[tuple[str, int]]:
        h = KubeHandle.from_dict(handle)
        data = await asyncio.to_thread(read_log_copy, h)
        return outputs_from_log(data or b"")


__all__ = ["KubeJobError", "KubeJobExecutor"]
