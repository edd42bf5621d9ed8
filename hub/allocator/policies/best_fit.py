"""Best-fit: the node left with the least free CPU and GPU after placement."""

from __future__ import annotations

from ..model import MILLI
from ..state import ClusterState, Shape, Sig
from .base import ScoredPolicy


class BestFit(ScoredPolicy):
    """The FGD paper's BestFit baseline, exact (no integer score buckets).

    Cost = ½·free CPU / largest node CPU + ½·free GPU milli / largest node GPU milli, after
    placement; the fullest node that still fits wins. On the node, a fraction
    goes to the GPU with the least free share that fits (best-fit GPU selection). A share on a
    device slice bigger than itself (a MIG instance, a replica) also pays for the slice it wastes.
    """

    name = "best-fit"

    def score(self, state: ClusterState, sig: Sig, shape: Shape, option: tuple[int, ...]) -> float:
        take = state.taken(sig, shape, option)
        cpu_left = sig[1] - shape[0]
        gpu_left = sum(sig[3]) - take * len(option)
        cost = 0.5 * cpu_left / state.max_cpu_milli + 0.5 * gpu_left / state.max_gpu_milli
        if not shape[2] and take > shape[3]:
            # a slice bigger than the share is capacity nobody else gets: worse than leaving it
            cost += (take - shape[3]) / state.max_gpu_milli
        # within a node: the GPU left with the least free share (tiny weight, below any node gap)
        own = (sig[3][option[0]] - take) / MILLI if option else 0.0
        return cost + 1e-9 * own
