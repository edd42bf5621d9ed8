"""Native sidecar containers (KEP-753, GA in 1.33) and the status rules they change.

An init container with `restartPolicy: Always` is a sidecar: initialization moves past it once it
has *started* (its startupProbe passed, else its process runs), it is restarted whenever it exits
whatever the pod's restartPolicy, it is stopped only after the main containers (and the sidecars
declared after it), and it never decides a finished pod's phase.

Pure: container specs and API-shaped container statuses (what `ContainerState.status()` writes)
in, names and decisions out, as the kubelet derives its conditions from API statuses
(pkg/kubelet/status/generate.go, getPhase in kubelet_pods.go). `containers`, `probes` and `pods`
act on them; tests/devcluster/test_sidecar_rules.py checks them without a cluster.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

#: a container gets at least this long between SIGTERM and SIGKILL when the pod has any grace
#: period left (the kubelet's minimumGracePeriodInSeconds): a sidecar whose turn comes at the end
#: of the grace period is still asked, not killed outright
MIN_STOP_WINDOW_SECONDS = 2.0


def is_sidecar(spec: dict[str, Any]) -> bool:
    """Whether an init container's spec makes it a sidecar (only `Always` is valid there)."""
    return spec.get("restartPolicy") == "Always"


def restarts(pod_policy: str, exit_code: int, *, sidecar: bool = False) -> bool:
    """Whether a container that exited runs again: a sidecar always (even in a Job's pod, whose
    policy is Never or OnFailure), any other container as the pod's restartPolicy says."""
    if sidecar:
        return True
    return pod_policy == "Always" or (pod_policy == "OnFailure" and exit_code != 0)


def _by_name(statuses: Iterable[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {s["name"]: s for s in statuses}


def init_step_done(spec: dict[str, Any], status: dict[str, Any] | None) -> bool:
    """Whether initialization may move past this init container: a sidecar once it has started,
    a regular init container once it exited 0 (isInitContainerInitialized in the kubelet)."""
    if status is None:
        return False
    if is_sidecar(spec):
        return status.get("started") is True
    term = (status.get("state") or {}).get("terminated")
    return term is not None and term.get("exitCode") == 0


def incomplete_init(init_specs: list[dict[str, Any]], statuses: list[dict[str, Any]]) -> list[str]:
    """The init containers that keep the pod's Initialized condition False, in spec order (the
    names of the message `containers with incomplete status: [...]`)."""
    found = _by_name(statuses)
    return [s["name"] for s in init_specs if not init_step_done(s, found.get(s["name"]))]


def unready(
    init_specs: list[dict[str, Any]],
    init_statuses: list[dict[str, Any]],
    statuses: list[dict[str, Any]],
) -> list[str]:
    """The containers that keep ContainersReady (and Ready) False: sidecars first, then the main
    containers, as the kubelet lists them; regular init containers never count (they are done
    before anything is ready)."""
    out = []
    found = _by_name(init_statuses)
    for spec in init_specs:
        if is_sidecar(spec) and not (found.get(spec["name"]) or {}).get("ready"):
            out.append(spec["name"])
    return out + [s["name"] for s in statuses if not s.get("ready")]


def terminal_phase(statuses: list[dict[str, Any]]) -> str:
    """The phase of a pod whose main containers all ended for good: Succeeded when each exited
    0, else Failed. Sidecars' exits do not count: they are stopped (SIGTERM, 143) by the pod's
    completion itself."""
    codes = [((s.get("state") or {}).get("terminated") or {}).get("exitCode") for s in statuses]
    return "Succeeded" if all(c == 0 for c in codes) else "Failed"


def stop_prerequisites(
    init_specs: list[dict[str, Any]], specs: list[dict[str, Any]], running: set[str]
) -> dict[str, list[str]]:
    """For each running container, the running containers that must have exited before it gets
    SIGTERM (the kubelet's terminationOrdering): main and regular init containers wait for none;
    a sidecar waits for every main container and for the next sidecar declared after it, so
    sidecars stop one after another in reverse order of declaration. Containers that do not run
    are left out: nothing waits for them."""
    mains = [s["name"] for s in specs if s["name"] in running]
    out: dict[str, list[str]] = {name: [] for name in mains}
    # the sidecar declared right after this one: the kubelet orders a sidecar after that one
    # only, so one that does not run (in back-off) breaks the chain there, as it does upstream
    later: str | None = None
    for spec in reversed(init_specs):
        name = spec["name"]
        if name in running:
            sidecar_waits = [*mains, *([later] if later is not None and later in running else [])]
            out[name] = sidecar_waits if is_sidecar(spec) else []
        if is_sidecar(spec):
            later = name
    return out


def stop_order(prereqs: dict[str, list[str]]) -> list[list[str]]:
    """The waves in which containers get SIGTERM when each exits at once (for logs and tests):
    wave 0 has no prerequisites, wave n waits for a container of wave n-1."""
    waves: list[list[str]] = []
    placed: set[str] = set()
    left = dict(prereqs)
    while left:
        wave = [n for n, pre in left.items() if all(p in placed for p in pre)]
        if not wave:
            raise ValueError(f"circular stop order among {sorted(left)}")
        waves.append(wave)
        placed.update(wave)
        for n in wave:
            del left[n]
    return waves
