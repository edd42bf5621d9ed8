"""Names the gpulab-metrics service and the servers' GPU monitors share across processes.

Defined once here; hub/jupyterhub_config.py (which sets them for every spawner), the service
(hub/services/metrics/service.py) and the server extension (jupyterlab_gpulab/push.py) all import them.
This module imports nothing, so a single-user image pays nothing for it.
"""

from __future__ import annotations

# Where a server POSTs its Prometheus exposition: the service's own address (never the proxy, so
# a push is no activity of the server and idle culling still applies) + its prefix + PUSH_PATH.
# Not a secret: it names an endpoint that checks every push's token with the hub.
PUSH_URL_ENV = "GPULAB_METRICS_PUSH_URL"

# Seconds between two pushes, so the hub's config sets the cadence the service expects.
PUSH_INTERVAL_ENV = "GPULAB_METRICS_PUSH_INTERVAL_SECONDS"

# The push endpoint under the service's prefix: POST api/push/<user>[/<server name>].
PUSH_PATH = "api/push"

DEFAULT_PUSH_INTERVAL_SECONDS = 15.0
