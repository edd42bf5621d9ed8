"""The `gpulab` command: run the embedded hub from a state directory (`run`), stop it with
everything it started (`stop`, `gpulab.hub.stop`), GPU jobs on a hub (`job`, `cli_jobs`), the dev
cluster (`dev-cluster`)."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

from gpulab.hub import cli_jobs

DEFAULT_CONFIG = Path(__file__).with_name("jupyterhub_config.py")


def _default_state_dir() -> Path:
    return Path(os.environ.get("GPULAB_STATE_DIR", Path.cwd() / "run"))


def run(args: argparse.Namespace) -> int:
    state = Path(args.state_dir).resolve()
    state.mkdir(parents=True, exist_ok=True)
    os.chmod(state, 0o711)  # users pass through to their homes; see gpulab.hub.state_dir
    env = dict(os.environ)
    env["GPULAB_IP"], env["GPULAB_PORT"] = args.ip, str(args.port)
    if args.config:
        env["GPULAB_CONFIG"] = str(Path(args.config).resolve())
    bin_dir = Path(sys.executable).parent
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    jupyterhub = bin_dir / "jupyterhub"
    print(
        f"gpulab: starting JupyterHub on http://{args.ip}:{args.port} (state in {state})",
        flush=True,
    )
    os.chdir(state)
    # an ignored SIGINT (a background job's) would survive the exec and reach the hub's services
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    os.execve(str(jupyterhub), [str(jupyterhub), "-f", str(DEFAULT_CONFIG), *args.extra], env)
    return 0  # not reached


def stop(args: argparse.Namespace) -> int:
    from gpulab.hub.stop import stop as stop_everything

    return stop_everything(Path(args.state_dir).resolve(), args.timeout_seconds)


def _add_dev_cluster(p: argparse.ArgumentParser) -> None:
    try:
        from gpulab.devcluster import cli as dev_cluster
    except ModuleNotFoundError as e:
        if e.name != "gpulab.devcluster":
            raise  # installed but broken (a dependency missing): say what is missing
        # the dev cluster is a development tool of its own distribution, not in gpulab's wheel
        p.set_defaults(func=_dev_cluster_missing)
        p.add_argument("args", nargs=argparse.REMAINDER)
        return
    dev_cluster.add_arguments(p)
    p.set_defaults(func=dev_cluster.run)


def _dev_cluster_missing(args: argparse.Namespace) -> int:
    print(
        "gpulab dev-cluster is a development tool that is not installed here: from a gpulab "
        "checkout, run `bash .ci/dev setup` (or `pip install -e ./devcluster`)",
        file=sys.stderr,
    )
    return 2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpulab", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("run", help="start the hub on this machine (the embedded default)")
    p.add_argument("--ip", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--state-dir", default=str(_default_state_dir()))
    p.add_argument("--config", help="an extra JupyterHub config file (profiles, quotas...)")
    p.add_argument("extra", nargs=argparse.REMAINDER, help="arguments passed on to jupyterhub")
    p.set_defaults(func=run)
    s = sub.add_parser(
        "stop",
        help="stop the hub and everything it started: every user's server, kernels, "
        "code-server, Dask clusters and jobs (a signal to the hub stops the hub alone)",
    )
    s.add_argument("--state-dir", default=str(_default_state_dir()))
    s.add_argument(
        "--timeout-seconds",
        type=float,
        default=120.0,
        help="how long the hub may take to stop its servers before it is killed",
    )
    s.set_defaults(func=stop)
    j = sub.add_parser("job", help="GPU jobs on a hub: submit, list, show, logs, cancel")
    cli_jobs.add_arguments(j)
    d = sub.add_parser(
        "dev-cluster", help="a local Kubernetes control plane with simulated GPU nodes"
    )
    _add_dev_cluster(d)
    try:
        args = parser.parse_args(argv)
        return int(args.func(args))
    except BrokenPipeError:
        return _reader_gone()


def _reader_gone() -> int:
    """The reader of our output went away (`gpulab job list | head`): stop quietly, as Unix
    tools do (Python ignores SIGPIPE and raises instead). Whatever is still buffered goes to
    /dev/null, so that the flush at exit does not raise it again; the exit status is the one a
    shell reports for a command killed by SIGPIPE."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return 128 + signal.SIGPIPE


if __name__ == "__main__":
    sys.exit(main())
