"""`gpulab job submit|list|show|logs|cancel`: GPU jobs from a shell, a script or CI.

A client of the hub's REST API (`/hub/api/gpulab/users/{user}/jobs`, docs/rest-api.yaml) with a
user's own token; it imports nothing of the hub and runs wherever the hub is reachable (a laptop,
a CI runner, a terminal in the user's server). The hub decides everything (scopes, quotas, the
spec's checks); this prints its answers.

    gpulab job submit projects/train.ipynb --profile gpu-quarter -p lr=0.001 --follow
    gpulab job list
    gpulab job logs 12 --follow
    gpulab job cancel 12

Hub and token: `--hub-url` / `$GPULAB_HUB_URL` (e.g. https://hub.example.org; inside a user's
server `$JUPYTERHUB_API_URL` is used), `--token` / `$GPULAB_TOKEN` (a token made at
/hub/token; a server's own `$JUPYTERHUB_API_TOKEN` may not start jobs, by design: it is worth that
server only).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import PurePosixPath
from typing import Any

#: seconds between two polls of a run or its log while following it
FOLLOW_INTERVAL_SECONDS = 1.0
TERMINAL = ("succeeded", "failed", "canceled", "timed_out", "preempted")


class CLIError(Exception):
    """Something to tell the user on one line; exit status 1."""


class HubClient:
    def __init__(self, api_url: str, token: str) -> None:
        self.api_url, self.token = api_url.rstrip("/"), token

    def call(self, method: str, path: str, body: Any = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(f"{self.api_url}{path}", data=data, method=method)
        request.add_header("Authorization", f"token {self.token}")
        if data is not None:
            request.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                return json.loads(response.read() or b"null")
        except urllib.error.HTTPError as e:
            try:
                message = json.loads(e.read()).get("message") or e.reason
            except (ValueError, AttributeError):
                message = e.reason
            hint = ""
            if e.code == 403 and "scope" in str(message):
                hint = " (a token made at <hub>/hub/token may; a server's own token may not)"
            raise CLIError(f"{e.code}: {message}{hint}") from None
        except urllib.error.URLError as e:
            raise CLIError(f"cannot reach the hub at {self.api_url}: {e.reason}") from None


def _api_url(args: argparse.Namespace) -> str:
    if args.hub_url:
        return f"{args.hub_url.rstrip('/')}/hub/api"
    inside = os.environ.get("JUPYTERHUB_API_URL")
    if inside:
        return inside
    raise CLIError("no hub: give --hub-url or set GPULAB_HUB_URL")


def _client(args: argparse.Namespace) -> tuple[HubClient, str]:
    token = args.token or os.environ.get("JUPYTERHUB_API_TOKEN")
    if not token:
        raise CLIError("no token: give --token or set GPULAB_TOKEN (make one at <hub>/hub/token)")
    client = HubClient(_api_url(args), token)
    user = args.user or client.call("GET", "/user")["name"]
    return client, f"/gpulab/users/{urllib.parse.quote(user, safe='')}/jobs"


def _pair(text: str, what: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise CLIError(f"{what}: expected NAME=VALUE, got {text!r}")
    return key, value


def _parameter(text: str) -> tuple[str, Any]:
    """name=value, the value read as JSON when it is JSON (0.001, true, [1, 2]), else a string."""
    key, value = _pair(text, "--param")
    try:
        return key, json.loads(value)
    except ValueError:
        return key, value


def submit(args: argparse.Namespace) -> int:
    client, jobs = _client(args)
    path = PurePosixPath(args.path)
    body: dict[str, Any] = {
        "name": args.name or path.stem,
        "kind": "notebook" if path.suffix == ".ipynb" else "script",
        "path": args.path,
        "profile": args.profile,
    }
    if args.param:
        body["parameters"] = dict(_parameter(p) for p in args.param)
    if args.arg:
        body["args"] = list(args.arg)
    if args.env:
        body["environment"] = dict(_pair(e, "--env") for e in args.env)
    for key in ("timeout_seconds", "max_retries", "priority", "output_dir"):
        if getattr(args, key) is not None:
            body[key] = getattr(args, key)
    if args.preemptible:
        body["preemptible"] = True
    run = client.call("POST", jobs, body)
    print(f"run {run['id']}: {run['state']} ({run['spec']['profile']})", flush=True)
    if args.follow:
        return _follow(client, jobs, run["id"], "stdout")
    return 0


def _describe(run: dict[str, Any]) -> str:
    spec = run["spec"]
    where = f" position {run['queue_position']}" if run.get("queue_position") else ""
    why = f" - {run['waiting_reason']}" if run.get("waiting_reason") else ""
    if run["state"] != "queued" and run.get("reason"):
        why = f" - {run['reason']}"
    attempts = len(run.get("attempts") or [])
    return (
        f"{run['id']:>5}  {run['state']:<10} {spec['name']:<20.20} {spec['profile']:<14.14} "
        f"attempts {attempts}{where}{why}"
    )


def list_runs(args: argparse.Namespace) -> int:
    client, jobs = _client(args)
    for run in client.call("GET", jobs)["runs"]:
        print(_describe(run))
    return 0


def show(args: argparse.Namespace) -> int:
    client, jobs = _client(args)
    print(json.dumps(client.call("GET", f"{jobs}/{args.run}"), indent=2))
    return 0


def _follow(client: HubClient, jobs: str, run_id: int, stream: str) -> int:
    """Print the latest attempt's log as it grows until the run ends; exit 0 when it
    succeeded."""
    offset, attempt = 0, 0
    while True:
        run = client.call("GET", f"{jobs}/{run_id}")
        latest = len(run["attempts"])
        if latest and latest != attempt:
            if attempt:
                print(f"--- attempt {latest} ---", flush=True)
            attempt, offset = latest, 0
        if attempt:
            query = urllib.parse.urlencode({"stream": stream, "offset": offset, "attempt": attempt})
            log = client.call("GET", f"{jobs}/{run_id}/logs?{query}")
            sys.stdout.write(log["data"])
            sys.stdout.flush()
            offset = log["next_offset"]
            more = log["data"] != ""
        else:
            more = False
        if run["state"] in TERMINAL and not more and (run["state"] != "failed" or _over(run)):
            print(
                f"run {run_id}: {run['state']}" + (f" - {run['reason']}" if run["reason"] else "")
            )
            return 0 if run["state"] == "succeeded" else 1
        if not more:
            time.sleep(FOLLOW_INTERVAL_SECONDS)


def _over(run: dict[str, Any]) -> bool:
    """A failed run with retries left is queued again shortly: keep following."""
    retries = run["spec"].get("max_retries", 0)
    counted = [a for a in run["attempts"] if a["state"] != "preempted"]
    return len(counted) > retries


def logs(args: argparse.Namespace) -> int:
    client, jobs = _client(args)
    if args.follow:
        return _follow(client, jobs, args.run, args.stream)
    query: dict[str, Any] = {"stream": args.stream}
    if args.attempt:
        query["attempt"] = args.attempt
    log = client.call("GET", f"{jobs}/{args.run}/logs?{urllib.parse.urlencode(query)}")
    sys.stdout.write(log["data"])
    return 0


def cancel(args: argparse.Namespace) -> int:
    client, jobs = _client(args)
    run = client.call("DELETE", f"{jobs}/{args.run}")
    print(f"run {run['id']}: {run['state']}")
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--hub-url", default=os.environ.get("GPULAB_HUB_URL"), help="the hub's address"
    )
    parser.add_argument(
        "--token", default=os.environ.get("GPULAB_TOKEN"), help="your token (from /hub/token)"
    )
    parser.add_argument("--user", help="whose jobs (default: the token's user)")
    parser.set_defaults(func=run)
    sub = parser.add_subparsers(dest="job_command", required=True)
    p = sub.add_parser("submit", help="queue a run of a notebook (.ipynb) or a script")
    p.add_argument("path", help="relative to your home (the folder JupyterLab shows)")
    p.add_argument("--profile", required=True, help="a GPU profile, e.g. gpu-quarter")
    p.add_argument("--name", help="the job's name (default: the file's)")
    p.add_argument("-p", "--param", action="append", help="a notebook parameter NAME=JSON")
    p.add_argument("-a", "--arg", action="append", help="a script argument (repeat)")
    p.add_argument("-e", "--env", action="append", help="an environment variable NAME=VALUE")
    p.add_argument("--timeout", dest="timeout_seconds", type=int, help="seconds per attempt")
    p.add_argument("--retries", dest="max_retries", type=int, help="retries after a failure")
    p.add_argument("--priority", type=int, help="within your queue, higher first")
    p.add_argument("--output-dir", help="relative to your home")
    p.add_argument("--preemptible", action="store_true", help="may be evicted and retried")
    p.add_argument("--follow", action="store_true", help="print its log until it ends")
    p.set_defaults(job_func=submit)
    sub.add_parser("list", help="your runs, newest first").set_defaults(job_func=list_runs)
    p = sub.add_parser("show", help="one run as JSON")
    p.add_argument("run", type=int)
    p.set_defaults(job_func=show)
    p = sub.add_parser("logs", help="a run's log")
    p.add_argument("run", type=int)
    p.add_argument("--stream", choices=("stdout", "stderr"), default="stdout")
    p.add_argument("--attempt", type=int, help="default: the latest")
    p.add_argument("--follow", action="store_true", help="until the run ends")
    p.set_defaults(job_func=logs)
    p = sub.add_parser("cancel", help="cancel a run (its GPU share is free when this returns)")
    p.add_argument("run", type=int)
    p.set_defaults(job_func=cancel)


def run(args: argparse.Namespace) -> int:
    try:
        return int(args.job_func(args))
    except CLIError as e:
        print(f"gpulab job: {e}", file=sys.stderr)
        return 1
