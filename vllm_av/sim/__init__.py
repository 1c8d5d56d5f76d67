"""Trace-driven simulation of adaptive verification in a batching server.

Engine-agnostic (numpy + torch, the core; never vllm): replays real labelled
drafts (shared/data/traces) through verification policies, including the
shipped `AdaptiveVerifier`, under step-cost tables, at fixed concurrency.
See docs/simulator.md.
"""

from vllm_av.sim.costs import (
    StepCost,
    h200_design,
    h200_eagle,
    large_deployment,
    measure_cpu_mlp,
)
from vllm_av.sim.policies import POLICY_ORDER, make_policy
from vllm_av.sim.simulator import SimResult, simulate
from vllm_av.sim.traces import PromptTape, TraceSet, load_traces

__all__ = [
    "POLICY_ORDER",
    "PromptTape",
    "SimResult",
    "StepCost",
    "TraceSet",
    "h200_design",
    "h200_eagle",
    "large_deployment",
    "load_traces",
    "make_policy",
    "measure_cpu_mlp",
    "simulate",
]
