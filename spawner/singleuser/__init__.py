"""Everything that runs as the user: in her server, pod or kernel, or as her account.

A user image needs exactly this package (plus `gpulab.spawner.names`): the home preparation a
server runs before it starts (`checkpoint.prepare`), the kernels' checkpoint extension
(`checkpoint.kernel`), the pod's preStop hook (`prestop`), the GPU caps import hook
(`gpu_caps/sitecustomize.py`), the workspace worker the local hub runs as the user
(`checkpoint.worker`) and the wrapper a job attempt runs under (`jobwrapper`). Nothing here imports JupyterHub, tornado, Kubernetes clients or the hub's
code (an import-linter contract enforces it).
"""
