"""Starting and supervising a pod's containers: volumes, network, init containers, restarts
with back-off, and readiness probes (httpGet, tcpSocket, exec).

Each run of a container is one `runtime.ContainerProcess` (a launcher); the environment comes
from `podenv`, the identity from `podsecurity`, the volumes from `podvolumes`.
"""

from __future__ import annotations

import asyncio
import os
import ssl
import time
from pathlib import Path
from typing import Any

import aiohttp

from . import clusterdns, pause, podenv, podsecurity, podvolumes
from .kube import log, now, raw, status_of
from .podstate import ContainerState, PodState
from .runtime import ContainerProcess, StartError

#: where a pod's resolver reads its name servers (bind-mounted over the host's in the pod)
RESOLV_CONF = Path("/etc/resolv.conf")
ETC_HOSTS = Path("/etc/hosts")
MAX_BACKOFF_SECONDS = 300


def _restart(policy: str, code: int) -> bool:
    return policy == "Always" or (policy == "OnFailure" and code != 0)


class ContainerRunner(PodState):
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
        cs.ready = False
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
        probe = cs.spec.get("readinessProbe")
        if cs.init:
            pass
        elif probe and any(k in probe for k in ("httpGet", "tcpSocket", "exec")):
            self.tasks.append(asyncio.create_task(self._probe_loop(cs, probe)))
        else:
            cs.ready = True
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
        cs.ready = False
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

    async def _supervise(self, cs: ContainerState, volumes: dict[str, tuple[Path, bool]]) -> None:
        delay = 10.0
        while True:
            started = await self._start(cs, volumes)
            if not started and cs.terminated is None:  # config error: retry like a kubelet
                await asyncio.sleep(delay)
                continue
            code = await self._exited(cs) if started else 128
            if self.deleting or not _restart(self.policy, code):
                return
            if cs.proc is not None and time.monotonic() - cs.proc.started_mono > 600:
                delay = 10.0
            await self._backoff(cs, delay)
            delay = min(delay * 2, MAX_BACKOFF_SECONDS)

    # -- readiness --------------------------------------------------------------------------

    async def _probe_loop(self, cs: ContainerState, probe: dict[str, Any]) -> None:
        await asyncio.sleep(float(probe.get("initialDelaySeconds") or 0))
        period = float(probe.get("periodSeconds") or 10)
        timeout = float(probe.get("timeoutSeconds") or 1)
        need_ok, need_fail = (
            int(probe.get("successThreshold") or 1),
            int(probe.get("failureThreshold") or 3),
        )
        ok_run = fail_run = 0
        while cs.running:
            ok = await self._probe_once(cs, probe, timeout)
            ok_run, fail_run = (ok_run + 1, 0) if ok else (0, fail_run + 1)
            if ok and ok_run >= need_ok and not cs.ready:
                cs.ready = True
                self.dirty.set()
            elif not ok and fail_run >= need_fail and cs.ready:
                cs.ready = False
                self.dirty.set()
                await self.node.events.emit(
                    self.pod,
                    "Unhealthy",
                    "Readiness probe failed",
                    type_="Warning",
                    host=self.node.name,
                )
            await asyncio.sleep(period)

    def _port(self, cs: ContainerState, port: Any) -> int:
        if isinstance(port, int) or str(port).isdigit():
            return int(port)
        for p in cs.spec.get("ports") or []:
            if p.get("name") == port:
                return int(p["containerPort"])
        raise ValueError(f"named port {port!r} not in container {cs.name}")

    async def _probe_once(self, cs: ContainerState, probe: dict[str, Any], timeout: float) -> bool:
        try:
            if "httpGet" in probe:
                g = probe["httpGet"]
                scheme = (g.get("scheme") or "HTTP").lower()
                host = g.get("host") or self.ip
                url = f"{scheme}://{host}:{self._port(cs, g['port'])}{g.get('path') or '/'}"
                headers = {h["name"]: h["value"] for h in g.get("httpHeaders") or []}
                ctx = ssl.create_default_context()
                ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
                async with (
                    aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as s,
                    s.get(
                        url,
                        headers=headers,
                        ssl=ctx if scheme == "https" else None,
                        allow_redirects=False,
                    ) as r,
                ):
                    return 200 <= r.status < 400
            if "tcpSocket" in probe:
                t = probe["tcpSocket"]
                _, w = await asyncio.wait_for(
                    asyncio.open_connection(t.get("host") or self.ip, self._port(cs, t["port"])),
                    timeout,
                )
                w.close()
                return True
            if "exec" in probe and cs.proc is not None:
                rc = await cs.proc.exec(
                    probe["exec"]["command"],
                    cs.env,
                    cs.working_dir,
                    timeout,
                    identity=cs.identity,
                )
                return rc == 0
        except (OSError, asyncio.TimeoutError, aiohttp.ClientError, ValueError):
            return False
        return False
