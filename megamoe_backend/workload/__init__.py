"""Synthetic MoE workloads (seeded problems, per-rank EP runs) for demo, tests and GPU checks."""

from .ep_run import EPCase, run_ep_cases, run_ep_rank
from .problem import Problem, ProblemConfig, local_weights, make_problem

__all__ = ["EPCase", "Problem", "ProblemConfig", "local_weights", "make_problem", "run_ep_cases", "run_ep_rank"]
