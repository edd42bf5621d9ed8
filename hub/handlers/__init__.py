"""gpulab's hub pages (HTML) and its checks in front of JupyterHub's own server handlers."""
