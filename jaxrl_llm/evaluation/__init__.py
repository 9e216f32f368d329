"""Evaluation metrics of sampled completions: pass@k, maj@k, mean@k and their bootstrap
confidence intervals (``jaxrl_llm.evaluation.estimators``)."""

from jaxrl_llm.evaluation.estimators import (
    bootstrap_interval,
    majority_at_k,
    mean_at_k,
    pass_at_k,
    summarize,
)

__all__ = ["bootstrap_interval", "majority_at_k", "mean_at_k", "pass_at_k", "summarize"]
