"""The GPU-hour ledger: what the allocator handed out, to whom, for how long (pure logic and its
store; no JupyterHub, web server or Kubernetes imports).

- `model`: one interval per share of one device, and `diff`, the rule that turns "what the
  allocator holds now" into interval writes;
- `rollup`: allocated, used and idle GPU-hours per hour/day/month and user/group/profile/...;
- `quota`: GPU-hour budgets per user and group over a rolling window;
- `store`: SQLite (embedded default) or PostgreSQL (clusters).

The hub side (`gpulab.hub.ledgerservice`) feeds it from the allocator's change listener and
serves the rollups at /hub/api/gpulab/usage.
"""

from .model import (
    BUDGET,
    CULLED,
    END_REASONS,
    GONE,
    MONITORED_WORKLOADS,
    NODE_LOST,
    PREEMPTED,
    RELEASED,
    RESIZED,
    WORKLOADS,
    Change,
    DeviceInfo,
    Holding,
    Interval,
    diff,
    holdings,
    whole_second,
    workload_of,
)
from .quota import Budget, HourQuota, HourQuotaError, budgets, burn_down, tightest
from .rollup import BUCKETS, DIMENSIONS, RollupError, Row, UsageSample, idle_gpu_hours, rollup

__all__ = [
    "BUCKETS",
    "BUDGET",
    "CULLED",
    "DIMENSIONS",
    "END_REASONS",
    "GONE",
    "MONITORED_WORKLOADS",
    "NODE_LOST",
    "PREEMPTED",
    "RELEASED",
    "RESIZED",
    "WORKLOADS",
    "Budget",
    "Change",
    "DeviceInfo",
    "Holding",
    "HourQuota",
    "HourQuotaError",
    "Interval",
    "RollupError",
    "Row",
    "UsageSample",
    "budgets",
    "burn_down",
    "diff",
    "holdings",
    "idle_gpu_hours",
    "rollup",
    "tightest",
    "whole_second",
    "workload_of",
]
