"""Host-side reward functions: verifiers and shaping terms over ``RewardInput``.

Every reward is a plain callable ``fn(inp: RewardInput) -> float``; ``combine_rewards`` makes a
weighted sum, ``compute_rewards`` scores a batch into a float32 ``[B]`` array plus one array
per component, and ``make_reward`` builds a registered reward from its config name.
"""

from jaxrl_llm.rewards.base import RewardError, RewardFn, RewardInput, reference_answer
from jaxrl_llm.rewards.combine import (
    CombinedReward,
    WeightedReward,
    call_reward,
    combine_rewards,
    compute_rewards,
    reward_name,
    summarize_rewards,
)
from jaxrl_llm.rewards.format import FormatReward, matches_format
from jaxrl_llm.rewards.length import OverlongPenalty, overlong_penalty
from jaxrl_llm.rewards.math import (
    MathMatch,
    answer_value,
    answers_match,
    extract_answer,
    is_correct,
    parse_number,
)
from jaxrl_llm.rewards.registry import REWARDS, make_reward

__all__ = [
    "REWARDS",
    "CombinedReward",
    "FormatReward",
    "MathMatch",
    "OverlongPenalty",
    "RewardError",
    "RewardFn",
    "RewardInput",
    "WeightedReward",
    "answer_value",
    "answers_match",
    "call_reward",
    "combine_rewards",
    "compute_rewards",
    "extract_answer",
    "is_correct",
    "make_reward",
    "matches_format",
    "overlong_penalty",
    "parse_number",
    "reference_answer",
    "reward_name",
    "summarize_rewards",
]
