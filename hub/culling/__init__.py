"""GPU-aware culling: the policy that decides, per server and check, to keep, warn or cull.

    policy = CullPolicy.from_config({"dry_run": False, "profiles": {"gpu-full": {...}}})
    decision = decide(policy, observation, state, now)   # store decision.state for next time

Pure domain code: no I/O, and imports neither JupyterHub, tornado, traitlets nor Kubernetes.
The hub-side service observes servers, calls decide() and carries out ``decision.effect``.
"""

from .dry_run import RoundSummary, summarize_round
from .model import (
    CULL_ACTIONS,
    DEFAULT_CHECK_INTERVAL_SECONDS,
    USER_INPUT_KINDS,
    Activity,
    ActivityKind,
    CullAction,
    CullConfigError,
    CullPolicy,
    CullRule,
    CullState,
    ServerObservation,
    SliceFigures,
    SliceSample,
    SliceSummary,
    last_user_input,
)
from .policy import EXEMPTIONS, VERDICTS, Cause, Decision, Effect, Verdict, decide
from .slices import advance, summarize

__all__ = [
    "CULL_ACTIONS",
    "DEFAULT_CHECK_INTERVAL_SECONDS",
    "EXEMPTIONS",
    "USER_INPUT_KINDS",
    "VERDICTS",
    "Activity",
    "ActivityKind",
    "Cause",
    "CullAction",
    "CullConfigError",
    "CullPolicy",
    "CullRule",
    "CullState",
    "Decision",
    "Effect",
    "RoundSummary",
    "ServerObservation",
    "SliceFigures",
    "SliceSample",
    "SliceSummary",
    "Verdict",
    "advance",
    "decide",
    "last_user_input",
    "summarize",
    "summarize_round",
]
