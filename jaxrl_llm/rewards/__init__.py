"""Host-side reward functions: verifiers and shaping terms over ``RewardInput``.

Every reward is a plain callable ``fn(inp: RewardInput) -> float``; ``combine_rewards`` makes a
weighted sum, ``compute_rewards`` scores a batch into a float32 ``[B]`` array plus one array
per component, ``ScoringPool`` does the same in worker processes, and ``make_reward`` builds a
registered reward from its config name. Verifiers: ``MathMatch`` (``math_match``: final-answer
equivalence, builtin or math-verify) and ``CodeExec`` (``code_exec``: the completion's program
run against the example's tests, in the OS sandbox of ``rewards.sandbox`` or a SandboxFusion
service, the verdict made here by ``rewards.verdict``); see docs/rewards.md.
"""

from jaxrl_llm.rewards.base import RewardError, RewardFn, RewardInput, reference_answer
from jaxrl_llm.rewards.code import (
    CodeExec,
    RunResult,
    example_tests,
    extract_code,
    run_assert_tests,
    run_python,
)
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
    has_boxed_answer,
    is_correct,
    parse_number,
)
from jaxrl_llm.rewards.pool import ScoringPool, score_rows
from jaxrl_llm.rewards.registry import REWARDS, make_reward

__all__ = [
    "REWARDS",
    "CodeExec",
    "CombinedReward",
    "FormatReward",
    "MathMatch",
    "OverlongPenalty",
    "RewardError",
    "RewardFn",
    "RewardInput",
    "RunResult",
    "ScoringPool",
    "WeightedReward",
    "answer_value",
    "answers_match",
    "call_reward",
    "combine_rewards",
    "compute_rewards",
    "example_tests",
    "extract_answer",
    "extract_code",
    "has_boxed_answer",
    "is_correct",
    "make_reward",
    "matches_format",
    "overlong_penalty",
    "parse_number",
    "reference_answer",
    "reward_name",
    "run_assert_tests",
    "run_python",
    "score_rows",
    "summarize_rewards",
]
