"""Best-fit: the node left with the least free resources (GPU first, then CPU and memory)."""

from __future__ import annotations

from ..model import MILLI
from ..state import ClusterState, Shape, Sig
from .base import ScoredPolicy


class BestFit(ScoredPolicy):
    """Minimises the weighted share of the node left free after placement.

    Like the FGD paper's BestFit baseline: the score is the sum over resources of the free share
    after placement, GPU weighted highest, so the fullest node that still fits wins.
    """

    name = "best-fit"

    def score(self, state: ClusterState, sig: Sig, shape: Shape, option: tuple[int, ...]) -> float:
        cls = state.node_class(sig)
        _, cpu_free, mem_free, gpus = state.after(sig, shape, option)
        gpu_share = sum(gpus) / (MILLI * len(gpus)) if gpus else 1.0
        cpu_share = cpu_free / cls.cpu_milli if cls.cpu_milli else 0.0
        mem_share = mem_free / cls.memory_mib if cls.memory_mib else 0.0
        # the chosen GPU's remaining share breaks ties between GPUs of one node
        take = MILLI if shape[2] else shape[3]
        gpu_left = (sig[3][option[0]] - take) / MILLI if option else 0.0
        return gpu_share + cpu_share + mem_share + 1e-3 * gpu_left
