"""What a pause image's entrypoint does (kubernetes' build/pause/linux/pause.c), for containers
the node agent runs from a pause image with no command of their own (GPU placeholder pods): sleep
until told to stop, then exit 0; as PID 1 of its namespace it would also reap orphans, which the
agent's launcher already does for the pod."""

from __future__ import annotations

import signal
import sys
from types import FrameType

#: repository names (the last path part, without tag or digest) of the pause images the node
#: agent runs this for: registry.k8s.io/pause, k8s.gcr.io/pause, gcr.io/google_containers/pause-amd64
PAUSE_REPOSITORIES = ("pause",)


def is_pause_image(image: str) -> bool:
    """True for a pause image reference (any registry, tag or digest)."""
    repository = image.split("@", 1)[0].rsplit("/", 1)[-1].split(":", 1)[0]
    return any(
        repository == name or repository.startswith(f"{name}-") for name in PAUSE_REPOSITORIES
    )


def argv() -> list[str]:
    """The command the agent runs for a pause image's container."""
    return [sys.executable, "-m", __name__]


def _stop(signum: int, frame: FrameType | None) -> None:
    sys.exit(0)


def main() -> None:
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, _stop)
    while True:
        signal.pause()


if __name__ == "__main__":
    main()
