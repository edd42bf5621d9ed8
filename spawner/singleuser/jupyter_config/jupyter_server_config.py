"""gpulab's Jupyter Server configuration directory (gpulab.spawner.singleuser.lab_start): run
before any extension is imported, it keeps JupyterLab's yarn lookup off the server's start."""

from gpulab.spawner.singleuser.lab_start import pin_npm_registry

pin_npm_registry()
