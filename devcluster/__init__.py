"""A real Kubernetes control plane with simulated GPU nodes, for tests and local demos.

    from gpulab.devcluster import DevCluster, NodeSpec
    cluster = DevCluster(state_dir=tmp).up(nodes=[NodeSpec("gpu-0", gpus=8)])
    cluster.kubeconfig        # a kubeconfig file for any Kubernetes client
    cluster.stop_node("gpu-0")  # simulated node failure; start_node() brings it back
    cluster.down()

Command line: ``gpulab dev-cluster up|down|status`` (or ``python -m gpulab.devcluster``).
See README.md in this folder for ports, directories and how the node agent differs from a kubelet.
"""

from .build import BuildError, ensure_binaries
from .cluster import DevCluster
from .spec import NodeSpec, default_nodes
from .state import DevClusterError, Timing, default_state_dir

__all__ = [
    "BuildError",
    "DevCluster",
    "DevClusterError",
    "NodeSpec",
    "Timing",
    "default_nodes",
    "default_state_dir",
    "ensure_binaries",
]
