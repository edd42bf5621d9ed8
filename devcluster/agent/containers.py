"""Starting and supervising a pod's containers: volumes, network, init containers, sidecars,
restarts with back-off; their probes are `probes`'.

Each run of a container is one `runtime.ContainerProcess` (a launcher); the environment comes
from `podenv`, the identity from `podsecurity`, the volumes from `podvolumes`.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

from . import clusterdns, pause, podenv, podsecurity, podvolumes, sidecars
from .kube import log, now, raw, status_of
from .podstate import ContainerState
from .probes import Prober
from .runtime import ContainerProcess, StartError

#: where a pod's resolver reads its name servers (bind-mounted over the host's in the pod)
RESOLV_CONF = Path("/etc/resolv.conf")
ETC_HOSTS = Path("/etc/hosts")
MAX_BACKOFF_SECONDS = 300


class ContainerRunner(Prober):
    """A pod's containers from volumes to exit: the part of a pod worker a runtime would do."""

    # -- volumes and containers -------------------------------------------------------------

    def _jupyter_allow_root(self) -> None:
        """Containers without runAsUser run as the agent's account (root) here, where an image
        would run as its USER (jovyan): let a Jupyter server start as root instead of refusing
        (found via JUPYTER_CONFIG_PATH, set for root containers only)."""
        d = self.dir / "jupyter-config"
        d.mkdir(exist_ok=True)
        (d / "jupyter_server_config.json").write_text('{"ServerApp": {"allow_root": true}}\n')

    async def _join_network(self) -> bool:
        """The NetworkPolicy table that covers the pod, then the pod's network namespace, before
        any of its processes start (a pod is never up unprotected); retried while nft or ip
        refuse."""
        reported = False
        while not self.deleting:
            try:
                if self.node.netpol is not None and not self.in_policy:
                    await self.node.netpol.join(self.pod, self.ip or "")
                    self.in_policy = True
                if self.node.network is not None and self.netns is None:
                    self.network_made = True  # _cleanup removes it, also when half made
                    self.netns = await self.node.network.attach(self.ip or "", self.node.host_ip)
                return True
            except (RuntimeError, OSError) as e:
                log.error("pod %s: %s", self.key, e)
                if not reported:
                    reported = True
                    await self.node.events.emit(
                        self.pod,
                        "FailedCreatePodSandBox",
                        f"the pod's network could not be set up: {str(e)[:500]}",
                        type_="Warning",
                        host=self.node.name,
                    )
            await self._wait_change(2.0)
        return False

    async def _prepare_volumes(self) -> dict[str, tuple[Path, bool]] | None:
        while not self.deleting:
            try:
                volumes = await podvolumes.prepare(
                    self.node.core, self.pod, self.dir, fs_group=podsecurity.fs_group(self.pod)
                )
                self.mount_message = None
                return volumes
            except podvolumes.MountError as e:
                msg = f"MountVolume.SetUp failed: {e}"
                if msg != self.mount_message:
                    self.mount_message = msg
                    await self.node.events.emit(
                        self.pod, "FailedMount", msg, type_="Warning", host=self.node.name
                    )
            except Exception as e:
                log.warning("pod %s: preparing volumes: %s", self.key, e)
            await self._wait_change(2.0)
        return None

    def _launch_spec(
        self, cs: ContainerState, volumes: dict[str, tuple[Path, bool]]
    ) -> dict[str, Any]:
        pod = {
            **self.pod,
            "status": {
                **(self.pod.get("status") or {}),
                "podIP": self.ip,
                "hostIP": self.node.host_ip,
            },
        }
        secrets = getattr(self, "_secrets", {})
        configmaps = getattr(self, "_configmaps", {})
        ident = podsecurity.identity(self.pod, cs.spec, image_uid=os.getuid())
        cs.identity = ident
        # the pod folders are the agent's alone (0700): a process of another uid finds its
        # HOME where a runtime would put it, and reaches its volumes only at their mount paths
        as_agent = ident.uid == os.getuid()
        services = self.node.services
        base = {
            # underneath everything of the pod's own, as the kubelet's Service variables
            **(
                services.environment(
                    self.pod["metadata"]["namespace"],
                    enable_service_links=(self.pod.get("spec") or {}).get(
                        "enableServiceLinks", True
                    )
                    is not False,
                )
                if services is not None
                else {}
            ),
            **self.node.base_env,
            "HOME": podsecurity.default_home(ident.uid, str(self.dir / "home")),
            "HOSTNAME": clusterdns.pod_hostname(self.pod),
        }
        if as_agent:
            base["JUPYTER_CONFIG_PATH"] = str(self.dir / "jupyter-config")
        cs.env = podenv.container_env(
            pod,
            cs.spec,
            base=base,
            configmaps=configmaps,
            secrets=secrets,
            node_capacity=self.node.capacity,
        )
        cs.env.update(self.node.devices.allocate(f"{self.uid}/{cs.name}", cs.spec))
        argv = podenv.container_argv(cs.spec, cs.env)
        if not argv and pause.is_pause_image(cs.spec.get("image") or ""):
            # the one image whose entrypoint the agent knows: a pause image only waits to be
            # stopped (GPU placeholders hold their resources with it)
            argv = pause.argv()
        if not argv:
            raise StartError(
                "no command: the gpulab node agent runs the container's command + args on the host "
                "(an image's entrypoint is not available, except a pause image's); set command or "
                "args"
            )
        mounts = []
        for vm in cs.spec.get("volumeMounts") or []:
            if vm["name"] not in volumes:
                raise StartError(f'volumeMount "{vm["name"]}": no volume of that name in the pod')
            src, ro = volumes[vm["name"]]
            if vm.get("subPath"):
                src = src / vm["subPath"]
                if not src.exists():
                    src.mkdir(parents=True)
            mounts.append(
                {
                    "source": str(src),
                    "target": vm["mountPath"],
                    "readOnly": bool(vm.get("readOnly") or ro),
                    "file": src.is_file(),
                }
            )
        for managed, target in ((self._resolv_conf(), RESOLV_CONF), (self._etc_hosts(), ETC_HOSTS)):
            if managed is not None and not any(Path(m["target"]) == target for m in mounts):
                mounts.append(
                    {"source": str(managed), "target": str(target), "readOnly": True, "file": True}
                )
        targets = [Path(m["target"]) for m in mounts]

        def covered(p: Path) -> bool:
            return any(t in p.parents for t in targets)

        for m in mounts:
            t = Path(m["target"])
            if not covered(t):
                self.held += self.node.host_paths.acquire(t, is_file=m["file"])
        wd = cs.spec.get("workingDir") or (str(self.dir / "home") if as_agent else "/")
        cs.working_dir = wd
        if not covered(Path(wd)) and Path(wd) not in targets and not Path(wd).exists():
            self.held += self.node.host_paths.acquire(Path(wd))
        return {
            "argv": argv,
            "env": cs.env,
            "workingDir": wd,
            "mounts": mounts,
            "identity": ident.as_spec(),
            "netns": str(self.netns) if self.netns else None,
            # a UTS namespace with the pod's hostname, only with a network of its own (the
            # hostname names the pod's address in its /etc/hosts)
            "hostname": clusterdns.pod_hostname(self.pod) if self.netns else None,
        }

    def _resolv_conf(self) -> Path | None:
        """The pod's resolv.conf (the cluster's DNS, per its dnsPolicy), written once per pod as
        the kubelet does; None: the host's stays (no cluster DNS, or dnsPolicy Default)."""
        if self.node.dns_server is None:
            return None
        text = clusterdns.resolv_conf(self.pod, self.node.dns_server)
        if text is None:
            return None
        return self._pod_file("resolv.conf", text)

    def _etc_hosts(self) -> Path | None:
        """The pod's /etc/hosts (its hostname at its address), as the kubelet manages it; None
        without a pod network (the pod would have no address of its own to name)."""
        if self.netns is None or not self.ip:
            return None
        return self._pod_file("hosts", clusterdns.etc_hosts(self.pod, self.ip))

    def _pod_file(self, name: str, text: str) -> Path:
        path = self.dir / name
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
            path.chmod(0o644)  # read by the pod's processes, whatever their uid
        return path

    async def _load_env_objects(self) -> None:
        cms, secs = podenv.referenced_objects(self.pod)
        core = self.node.core
        self._configmaps = await self._read_optional(core.read_namespaced_config_map, cms)
        self._secrets = await self._read_optional(core.read_namespaced_secret, secs)

    async def _read_optional(self, read: Any, names: Any) -> dict[str, dict[str, Any] | None]:
        """name -> object, or None where it does not exist (the pod's env decides if that is fatal)."""
        found: dict[str, dict[str, Any] | None] = {}
        for name in names:
            try:
                found[name] = await raw(read(name, self.ns, _preload_content=False))
            except Exception as e:
                if status_of(e) != 404:
                    raise
                found[name] = None
        return found

    async def _start(self, cs: ContainerState, volumes: dict[str, tuple[Path, bool]]) -> bool:
        """Start one run of the container; False (and a terminated StartError state) if it failed."""
        cs.terminated = None
        cs.ready = cs.started = False
        try:
            await self._load_env_objects()
            launch = self._launch_spec(cs, volumes)
        except (podenv.EnvError, podsecurity.SecurityConfigError) as e:
            cs.waiting = {"reason": "CreateContainerConfigError", "message": str(e)}
            self.dirty.set()
            await self.node.events.emit(
                self.pod, "Failed", f"Error: {e}", type_="Warning", host=self.node.name
            )
            return False
        except (StartError, ValueError) as e:
            return await self._start_failed(cs, str(e))
        log_file = self.dir / f"{cs.name}.log"
        if log_file.exists():
            # the last run's output stays readable (kubectl logs --previous), one run back as
            # with a kubelet
            log_file.replace(log_file.with_name(f"{cs.name}.log.previous"))
        cs.proc = ContainerProcess(cs.name, self.dir / f"{cs.name}.json", log_file)
        try:
            await cs.proc.start(launch)
        except StartError as e:
            return await self._start_failed(cs, str(e))
        cs.waiting = {}
        await self.node.events.emit(
            self.pod,
            "Started",
            f"Started container {cs.name}",
            host=self.node.name,
            field_path=f"spec.{'initContainers' if cs.init else 'containers'}{{{cs.name}}}",
        )
        if cs.init and not cs.sidecar:
            cs.started = True  # no probes on a regular init container: started while it runs
        else:
            self._begin_probes(cs)
        self.phase = "Running" if not cs.init else self.phase
        self.dirty.set()
        return True

    async def _start_failed(self, cs: ContainerState, message: str) -> bool:
        ts = now()
        cs.terminated = {
            "exitCode": 128,
            "reason": "StartError",
            "message": message,
            "startedAt": "1970-01-01T00:00:00Z",
            "finishedAt": ts,
            "containerID": cs.container_id(),
        }
        self.dirty.set()
        await self.node.events.emit(
            self.pod,
            "Failed",
            f'Error: failed to start container "{cs.name}": {message}',
            type_="Warning",
            host=self.node.name,
            field_path=f"spec.{'initContainers' if cs.init else 'containers'}{{{cs.name}}}",
        )
        return False

    async def _exited(self, cs: ContainerState) -> int:
        assert cs.proc is not None
        code = await cs.proc.wait()
        cs.ready = cs.started = False
        cs.terminated = {
            "exitCode": code,
            "reason": "Completed" if code == 0 else "Error",
            "startedAt": cs.proc.started_at,
            "finishedAt": cs.proc.finished_at or now(),
            "containerID": cs.container_id(),
        }
        self.dirty.set()
        return code

    async def _backoff(self, cs: ContainerState, delay: float) -> None:
        cs.last_state = {"terminated": cs.terminated} if cs.terminated else {}
        cs.terminated = None
        cs.restart_count += 1
        cs.waiting = {
            "reason": "CrashLoopBackOff",
            "message": f"back-off {delay:.0f}s restarting failed container={cs.name} pod={self.name}_{self.ns}({self.uid})",
        }
        self.dirty.set()
        await self.node.events.emit(
            self.pod,
            "BackOff",
            "Back-off restarting failed container",
            type_="Warning",
            host=self.node.name,
        )
        await asyncio.sleep(delay)

    async def _run_init(
        self, cs: ContainerState, volumes: dict[str, tuple[Path, bool]]
    ) -> bool | None:
        delay = 10.0
        while not self.deleting:
            code = await self._exited(cs) if await self._start(cs, volumes) else 128
            if self.deleting:
                return None
            if code == 0:
                return True
            if self.policy == "Never":
                return False
            await self._backoff(cs, delay)
            delay = min(delay * 2, MAX_BACKOFF_SECONDS)
        return None

    async def _start_sidecar(
        self, cs: ContainerState, volumes: dict[str, tuple[Path, bool]]
    ) -> bool | None:
        """Start a sidecar's supervisor (it runs, and restarts, until the pod stops) and wait
        until the sidecar has started, as the kubelet does before the next init container: its
        startupProbe passed, or its process runs. Never waits for its exit. None: deleted
        meanwhile; False: its supervisor failed."""
        task = asyncio.create_task(self._supervise(cs, volumes))
        self.tasks.append(task)
        while not self.deleting and not (cs.running and cs.started):
            if task.done():
                return False
            await self._wait_change(5.0)  # _on_started and deletion set `changed`
        return None if self.deleting else True

    async def _supervise(self, cs: ContainerState, volumes: dict[str, tuple[Path, bool]]) -> None:
        """A main container's or a sidecar's runs: restarted with back-off as
        `sidecars.restarts` says, until the pod is deleted or the container is done."""
        delay = 10.0
        while True:
            started = await self._start(cs, volumes)
            if not started and cs.terminated is None:  # config error: retry like a kubelet
                await asyncio.sleep(delay)
                continue
            code = await self._exited(cs) if started else 128
            if self.deleting or not sidecars.restarts(self.policy, code, sidecar=cs.sidecar):
                return
            if cs.proc is not None and time.monotonic() - cs.proc.started_mono > 600:
                delay = 10.0
            await self._backoff(cs, delay)
            delay = min(delay * 2, MAX_BACKOFF_SECONDS)
