"""gpulab's alert rule language: parse, evaluate over GPU samples, export to Prometheus.

    IF gpu_utilization > 90% FOR 5m AND gpu_memory_used > 95% THEN alert("HIGH_LOAD")

Pure domain code: imports neither JupyterHub, tornado nor Kubernetes.
"""

from .engine import AlertEvent, RuleEngine, Sample
from .errors import RuleError
from .model import Action, And, Condition, Expr, Not, Or, Rule
from .parser import parse_rule, parse_rules
from .prometheus import to_prometheus_rules

__all__ = [
    "Action",
    "AlertEvent",
    "And",
    "Condition",
    "Expr",
    "Not",
    "Or",
    "Rule",
    "RuleEngine",
    "RuleError",
    "Sample",
    "parse_rule",
    "parse_rules",
    "to_prometheus_rules",
]
