# gpulab's hub config in a Helm install (the chart mounts it at /etc/gpulab/jupyterhub_config.py).
#
# The chart's values become traits, class by class, in gpulab-traits.yaml beside this file; the
# secrets come from the hub Secret through the environment; the admin's hub.extraConfig snippets
# run next; and gpulab.hub.config.apply(c) comes last, as in the embedded default
# (hub/jupyterhub_config.py), so both deployments are configured by the same function.
import glob
import os

import yaml

from gpulab.hub.config import apply

c = get_config()  # noqa: F821 - provided by JupyterHub when it loads this file

CONFIG_DIR = os.path.dirname(os.path.abspath(__file__))

with open(os.path.join(CONFIG_DIR, "gpulab-traits.yaml")) as f:
    for class_name, traits in (yaml.safe_load(f) or {}).items():
        for trait, value in traits.items():
            setattr(c[class_name], trait, value)

# JPY_COOKIE_SECRET and CONFIGPROXY_AUTH_TOKEN are read by JupyterHub itself.
db_url = os.environ.get("GPULAB_DB_URL", "")
if db_url:
    # one PostgreSQL database for the hub and gpulab's stores (their tables are prefixed). A bare
    # postgresql:// means psycopg 3 to gpulab's stores; SQLAlchemy would pick psycopg2 for the hub
    if db_url.startswith("postgresql://"):
        c.JupyterHub.db_url = "postgresql+psycopg://" + db_url[len("postgresql://") :]
    else:
        c.JupyterHub.db_url = db_url
    c.GPUJobs.db_url = db_url
    c.GPUDask.db_url = db_url
    c.GPULedger.db_url = db_url

# gpulab-metrics runs in this pod and listens where the proxy can route to it: the pod's own
# address (a Service's name cannot be bound); servers push to it through the hub Service
pod_ip = os.environ.get("POD_IP", "")
metrics_port = os.environ.get("GPULAB_METRICS_PORT", "")
if pod_ip and metrics_port:
    host = f"[{pod_ip}]" if ":" in pod_ip else pod_ip
    c.GPULab.metrics_service_url = f"http://{host}:{metrics_port}"

for snippet in sorted(glob.glob(os.path.join(CONFIG_DIR, "extra-config-*.py"))):
    load_subconfig(snippet)  # noqa: F821 - provided by JupyterHub

# Last: gpulab's REST endpoints, pages, services and checks (gpulab.hub.config)
apply(c)
