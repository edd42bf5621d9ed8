"""gpulab's embedded default: one machine, local processes, NativeAuthenticator.

Started by `gpulab run` from a state directory (the hub's working directory: its database,
cookie secret, allocations and users' homes live there). Environment knobs, all optional:
GPULAB_IP / GPULAB_PORT (127.0.0.1:8000), GPULAB_DECLARED_INVENTORY (used when no NVIDIA driver
answers; default '8 x A100-SXM4-80GB'), GPULAB_CULL_IDLE_SECONDS (3600; 0: no culling),
GPULAB_METRICS_SERVICE (1; 0: no gpulab-metrics service), GPULAB_MONITOR_SOURCE (every
server's GPU monitor: auto, nvml, simulated or none), GPULAB_CONFIG (an extra config file loaded last, for an
admin's own profiles, quotas and settings).
"""

import os
import shutil
import sys

from gpulab.hub.config import apply
from gpulab.spawner.names import (
    METRICS_CONFIG_ENV,
    MONITOR_SOURCE_ENV,
    PUSH_INTERVAL_ENV,
    PUSH_URL_ENV,
)

c = get_config()  # noqa: F821 - provided by JupyterHub when it loads this file

# JupyterHub starts its services before it installs its own signal handlers, and stops them with
# SIGINT (then SIGTERM after 30 s each). A hub started from a background job (nohup, a CI script, a
# service manager's `&`) has SIGINT *ignored*, which its services would inherit and keep: the hub
# would then take a minute to stop. Restore the default now, in the hub, before any service starts.
import signal  # noqa: E402

if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# The hub's database, secrets and the admin's first password live in its working directory, beside
# the users' homes: the directory is 0711 and the hub's files in it 0600 (gpulab.hub.state_dir).
from gpulab.hub.state_dir import secure_state_dir  # noqa: E402

for _tightened in secure_state_dir(os.getcwd()):
    print(f"gpulab: tightened permissions: {_tightened}", file=sys.stderr)

bin_dir = os.path.dirname(sys.executable)

c.JupyterHub.ip = os.environ.get("GPULAB_IP", "127.0.0.1")
c.JupyterHub.port = int(os.environ.get("GPULAB_PORT", "8000"))
c.JupyterHub.hub_ip = "127.0.0.1"
c.JupyterHub.hub_port = int(os.environ.get("GPULAB_HUB_PORT", "8081"))
c.ConfigurableHTTPProxy.api_url = os.environ.get("GPULAB_PROXY_API_URL", "http://127.0.0.1:8001")
c.ConfigurableHTTPProxy.command = [
    shutil.which("configurable-http-proxy", path=f"{bin_dir}:{os.environ.get('PATH', '')}")
    or "configurable-http-proxy"
]
c.JupyterHub.allow_named_servers = True
c.JupyterHub.named_server_limit_per_user = 5
# Servers and their GPU allocations outlive a hub restart (upgrade, config change).
c.JupyterHub.cleanup_servers = False
c.ConfigurableHTTPProxy.should_start = True

c.JupyterHub.authenticator_class = "gpulab.hub.auth.GPULabAuthenticator"
c.Authenticator.allow_all = True  # NativeAuthenticator: only users an admin approved can log in
c.NativeAuthenticator.open_signup = False
# Login hardening with NativeAuthenticator's own options: at least 10 characters, none of its list
# of common passwords, and 5 failed logins lock the account for 5 minutes.
c.NativeAuthenticator.minimum_password_length = 10
c.NativeAuthenticator.check_common_password = True
c.NativeAuthenticator.allowed_failed_logins = 5
c.NativeAuthenticator.seconds_before_next_try = 300
# Cookies only go with requests from the hub's own site (SameSite), so another site cannot use an
# admin's session behind their back; the XSRF cookie takes the same options.
c.JupyterHub.tornado_settings.update({"cookie_options": {"samesite": "Lax"}})

c.JupyterHub.spawner_class = "gpulab-simple"
c.Spawner.cmd = [os.path.join(bin_dir, "jupyterhub-singleuser")]
c.Spawner.default_url = "/lab"
c.Spawner.http_timeout = 60
c.Spawner.start_timeout = 120
c.Spawner.poll_interval = 10

# Hub services (gpulab.hub.config.GPULab: the idle culler, gpulab-metrics) are added by apply(c)
# at the end; admins' and tests' configs may append services of their own to these lists.
c.JupyterHub.services = []
c.JupyterHub.load_roles = []

# `gpulab run` conveniences: environment variables that become GPULab's options (an admin's own
# config, loaded after this, can still set c.GPULab.* directly).
_ENV_KNOBS = {
    "GPULAB_CULL_IDLE_SECONDS": ("cull_idle_seconds", int),
    MONITOR_SOURCE_ENV: ("monitor_source", str),
    "GPULAB_METRICS_SERVICE": (
        "metrics_service",
        lambda v: v.strip().lower() not in ("0", "false", "no", "off"),
    ),
    "GPULAB_METRICS_SERVICE_URL": ("metrics_service_url", str),
    "GPULAB_METRICS_SERVICE_PORT": ("metrics_service_url", lambda v: f"http://127.0.0.1:{int(v)}"),
    PUSH_URL_ENV: ("metrics_push_url", str),
    PUSH_INTERVAL_ENV: ("metrics_push_interval_seconds", float),
    METRICS_CONFIG_ENV: ("metrics_config_file", str),
}
for _env, (_trait, _parse) in _ENV_KNOBS.items():
    if os.environ.get(_env):
        setattr(c.GPULab, _trait, _parse(os.environ[_env]))

c.GPUCapacity.declared_inventory = os.environ.get("GPULAB_DECLARED_INVENTORY", "8 x A100-SXM4-80GB")
c.GPUCapacity.db_url = "sqlite:///gpulab-allocations.sqlite"
# A finite budget per user (one whole GPU, in any fractions), so one person cannot take the
# machine; raise it per user or group with user_quota_gpus / group_quota_gpus.
c.GPUCapacity.default_user_quota_gpus = 1

extra = os.environ.get("GPULAB_CONFIG")
if extra:
    load_subconfig(extra)  # noqa: F821 - provided by JupyterHub

# Where users' servers share one OS account (a hub that is not root, or allow_root_servers), every
# page says so: nobody should mistake such an install for one that keeps users apart.
if c.JupyterHub.spawner_class in (
    "gpulab-simple",
    "gpulab.spawner.local.GPUSimpleLocalSpawner",
    "gpulab.spawner.local.spawner.GPUSimpleLocalSpawner",
):
    from gpulab.spawner.local.spawner import shared_account_warning

    _warning = shared_account_warning(c)
    if _warning:
        print(f"gpulab: WARNING: {_warning}", file=sys.stderr)
        _vars = dict(c.JupyterHub.get("template_vars") or {})
        _vars["announcement"] = " ".join(filter(None, [_warning, _vars.get("announcement")]))
        c.JupyterHub.template_vars = _vars

# `gpulab stop` stops the hub with every server (a signal stops the hub alone: see cleanup_servers
# above): its token, worth the `shutdown` scope alone, in a 0600 file of the state directory
from gpulab.hub.stop import add_stop_service  # noqa: E402

add_stop_service(c, os.getcwd())

# Last: gpulab's REST endpoints, pages and server checks, for whichever authenticator the admin's
# config chose (the same call a cluster deployment's config ends with; see gpulab.hub.config)
apply(c)
