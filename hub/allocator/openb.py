"""Loaders for the openb trace (Alibaba cluster-trace-gpu-v2023, as used by the FGD paper).

Each loader reads a csv file or its gzip copy (a name ending in ``.gz``, as the repository carries
the trace in bench/data/openb/).
"""

from __future__ import annotations

import csv
import gzip
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from .model import GPU, MILLI, Node, Request


def open_trace_csv(path: object) -> IO[str]:
    """A csv file of the trace for reading as text; gzip-decompressed when its name ends in .gz."""
    p = Path(str(path))
    if p.suffix == ".gz":
        return gzip.open(p, "rt", newline="")
    return open(p, newline="")


def load_openb_nodes(path: object) -> list[Node]:
    """Nodes from ``openb_node_list_gpu_node.csv`` (``sn,cpu_milli,memory_mib,gpu,model``).

    GPU uuids are ``<node>-gpu<i>``; openb has no NVLink information, so no groups are set.
    """
    nodes = []
    with open_trace_csv(path) as f:
        for row in csv.DictReader(f):
            name = row["sn"]
            model = row.get("model") or ""
            gpus = tuple(
                GPU(uuid=f"{name}-gpu{i}", model=model, index=i)
                for i in range(int(row["gpu"] or 0))
            )
            nodes.append(Node(name, int(row["cpu_milli"]), int(row["memory_mib"]), gpus))
    return nodes


@dataclass(frozen=True)
class TracePod:
    """One task of an openb pod list."""

    name: str
    cpu_milli: int
    memory_mib: int
    num_gpu: int
    gpu_milli: int
    gpu_spec: frozenset[str]

    @property
    def total_gpu_milli(self) -> int:
        """Requested GPU in milli (``num_gpu * gpu_milli`` for whole GPUs)."""
        return (
            self.gpu_milli if self.num_gpu == 1 and self.gpu_milli < MILLI else self.num_gpu * MILLI
        )

    def to_request(self, request_id: str | None = None) -> Request:
        """The allocator request for this pod (a fraction when num_gpu is 1 and milli < 1000)."""
        fractional = self.num_gpu == 1 and 0 < self.gpu_milli < MILLI
        return Request(
            id=request_id or self.name,
            cpu_milli=self.cpu_milli,
            memory_mib=self.memory_mib,
            num_gpu=0 if fractional else self.num_gpu,
            gpu_milli=self.gpu_milli if fractional else 0,
            gpu_models=self.gpu_spec if self.num_gpu else frozenset(),
        )


def load_openb_pods(path: object) -> list[TracePod]:
    """Pods from an ``openb_pod_list_*.csv`` file."""
    pods = []
    with open_trace_csv(path) as f:
        for row in csv.DictReader(f):
            spec = row.get("gpu_spec") or ""
            pods.append(
                TracePod(
                    name=row["name"],
                    cpu_milli=int(row["cpu_milli"]),
                    memory_mib=int(row["memory_mib"]),
                    num_gpu=int(row["num_gpu"]),
                    gpu_milli=int(row["gpu_milli"]),
                    gpu_spec=frozenset(s for s in spec.split("|") if s),
                )
            )
    return pods
