"""The offline preference and reward-model jobs (``job: preference`` / ``job: reward_model``)."""

from __future__ import annotations

from typing import Any

from jaxrl_llm.train.preference.config import PreferenceConfig
from jaxrl_llm.train.preference.trainer import PreferenceTrainer


def run(cfg: PreferenceConfig) -> dict[str, Any]:
    """Runs a ``preference`` or ``reward_model`` job; returns the summary in summary.json."""
    return PreferenceTrainer(cfg).fit()
