"""Prepare a workspace home inside the server's container, then run the server (pure: stdlib).

On Kubernetes the hub cannot write into the server's volume, so the pod's command starts here:

    python3 -m gpulab.spawner.singleuser.checkpoint.prepare --home /home/jovyan -- jupyterhub-singleuser ...

It runs `prepare_home` (directories, the IPython startup file that loads the checkpoint
extension, kernelspecs of the environments in the home), completes the environment with what
depends on the container's own Python (PATH with ``<home>/.local/bin``, and PIP_PREFIX +
PYTHONPATH inside a virtualenv, else PIP_USER=1: see `environment.persistent_env`), keeps every
variable the spawner set, adds gpulab's Jupyter configuration directory (`lab_start`: JupyterLab
starts without running yarn), and replaces itself with the command (exec: signals reach the
server directly). Without a command it only prepares the home.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import pwd
import sys
from pathlib import Path

from gpulab.spawner.singleuser.checkpoint.environment import persistent_env, prepare_home
from gpulab.spawner.singleuser.lab_start import with_config_dir

#: what depends on the interpreter that runs in the container, not on the hub's
CONTAINER_KEYS = ("PATH", "PYTHONPATH", "PIP_PREFIX", "PIP_USER", "PIP_BREAK_SYSTEM_PACKAGES")


def container_env(home: Path, environ: dict[str, str]) -> dict[str, str]:
    """`environ` completed for a server whose workspace is `home`: HOME and the
    interpreter-dependent variables recomputed here, the others only where the spawner set none."""
    computed = persistent_env(home, base_env=environ)
    env = dict(environ)
    env["HOME"] = str(home)
    for key, value in computed.items():
        if key in CONTAINER_KEYS:
            env[key] = value
        else:
            env.setdefault(key, value)
    if "PIP_PREFIX" in computed:
        env.pop("PIP_USER", None)
        env.pop("PIP_BREAK_SYSTEM_PACKAGES", None)
    else:
        env.pop("PIP_PREFIX", None)
    return env


def prepare(home: Path, directory_only: bool, environ: dict[str, str]) -> dict[str, str]:
    """Make and prepare `home`, move into it, and return the server's environment: `environ`,
    completed for the home unless `directory_only` (workspaces off), with gpulab's Jupyter
    configuration directory on JUPYTER_CONFIG_PATH either way. Run as the server's own
    account (the local spawner's cold start switches before running this; a warm member has
    dropped to it), so the home and everything in it are that account's, private to it."""
    home.mkdir(mode=0o700, parents=True, exist_ok=True)
    if not directory_only:
        prepare_home(home)
    os.chdir(home)  # the server's root directory is where it starts
    env = dict(environ) if directory_only else container_env(home, dict(environ))
    return with_config_dir(env)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--home", default=os.environ.get("HOME", ""), help="the workspace home")
    parser.add_argument(
        "--directory-only",
        action="store_true",
        help="only make the home (0700) and start there: workspaces are off for this server",
    )
    parser.add_argument(
        "--report-fd",
        type=int,
        help="""a pipe to the hub: why the start failed is written there (it is closed when the
        command takes over), so the hub can tell the person starting the server""",
    )
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- command to run afterwards")
    args = parser.parse_args(argv)
    if not args.home:
        parser.error("no --home and no HOME in the environment")
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    try:
        env = prepare(Path(args.home), args.directory_only, dict(os.environ))
    except OSError as e:
        account = pwd.getpwuid(os.getuid()).pw_name
        return _fail(args.report_fd, f"cannot prepare the home {args.home} as {account}: {e}", 1)
    if not command:
        print(f"gpulab: prepared workspace {args.home}", file=sys.stderr)
        return 0
    sys.stdout.flush()
    sys.stderr.flush()
    if args.report_fd is not None:
        os.set_inheritable(args.report_fd, False)  # closed by the exec: the hub reads EOF
    try:
        os.execvpe(command[0], command, env)
    except OSError as e:
        return _fail(args.report_fd, f"cannot run {command[0]!r}: {e}", 127)


def _fail(report_fd: int | None, message: str, status: int) -> int:
    """Say why the start failed, in the log and to the hub (`--report-fd`)."""
    print(f"gpulab: {message}", file=sys.stderr)
    if report_fd is not None:
        with contextlib.suppress(OSError):
            os.write(report_fd, message.encode())
            os.close(report_fd)
    return status


if __name__ == "__main__":
    raise SystemExit(main())
