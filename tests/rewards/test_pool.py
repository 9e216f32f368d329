"""Scoring in worker processes: hand-checked totals and components, in input order; futures;
reward errors and dead workers reported like in-process scoring; unpicklable rewards refused."""

import concurrent.futures
import os
import pickle

import numpy as np
import pytest

from jaxrl_llm.rewards import (
    CodeExec,
    FormatReward,
    MathMatch,
    OverlongPenalty,
    RewardError,
    RewardInput,
    ScoringPool,
    combine_rewards,
    compute_rewards,
    make_reward,
)


class Die:
    """Kills its worker process on the completion ``"die"`` (a crash in native code)."""

    name = "die"

    def __call__(self, inp):
        if inp.completion == "die":
            os._exit(3)
        return 0.0


REWARD = combine_rewards(
    [
        (MathMatch(backend="builtin"), 1.0),
        (FormatReward(tags=["answer"]), 0.5),
        (OverlongPenalty(max_tokens=5, buffer_tokens=2), 1.0),  # 0 up to 3 tokens, -1 from 5
        (Die(), 0.0),
    ]
)
ROWS = [  # completion, reference, completion tokens
    ("19", "19", 3),
    ("<answer>19</answer>", "19", 4),
    ("20", "19", 5),
    ("<answer>7</answer>", "7", 6),
    ("", "0", 2),
    ("\\boxed{0.5}", "1/2", 1),
    ("x", "1", 4),
]
INPUTS = [RewardInput("q", c, {"answer": a}, n) for c, a, n in ROWS]
MATH = [1, 1, 0, 1, 0, 1, 0]
FORMAT = [0, 1, 0, 1, 0, 0, 0]
OVERLONG = [0, -0.5, -1, -1, 0, 0, -0.5]
TOTALS = [1.0, 1.0, -1.0, 0.5, 0.0, 1.0, -0.5]  # math + 0.5 format + overlong


@pytest.fixture(scope="module")
def pool():
    with ScoringPool(REWARD, workers=2, chunk_size=2) as p:  # 7 rows: 4 chunks
        yield p


def _check_scores(rewards, components):
    assert rewards.dtype == np.float32 and rewards.shape == (7,)
    np.testing.assert_array_equal(rewards, TOTALS)
    assert list(components) == ["math_match", "format", "overlong", "die"]
    for name, want in [("math_match", MATH), ("format", FORMAT), ("overlong", OVERLONG)]:
        assert components[name].dtype == np.float32
        np.testing.assert_array_equal(components[name], want, err_msg=name)
    np.testing.assert_array_equal(components["die"], np.zeros(7))


def test_pool_scores_match_hand_values_in_order(pool):
    _check_scores(*pool.score(INPUTS))
    np.testing.assert_array_equal(pool.map(INPUTS), TOTALS)
    np.testing.assert_array_equal(pool.map(INPUTS[::-1]), TOTALS[::-1])
    # In the calling process (workers=0) and through compute_rewards: the same arrays.
    _check_scores(*ScoringPool(REWARD, workers=0).score(INPUTS))
    _check_scores(*compute_rewards(REWARD, INPUTS))


def test_submit_returns_futures(pool):
    first, second = pool.submit(INPUTS), pool.submit(INPUTS[2:5])
    assert isinstance(first, concurrent.futures.Future)
    np.testing.assert_array_equal(second.result(timeout=60), TOTALS[2:5])
    np.testing.assert_array_equal(first.result(timeout=60), TOTALS)
    _check_scores(*pool.submit_score(INPUTS).result(timeout=60))
    assert pool.map([]).shape == (0,)
    done = ScoringPool(REWARD, workers=0).submit(INPUTS[:1])
    assert done.done() and done.result().tolist() == [1.0]


def test_a_failing_reward_is_a_reward_error_naming_the_row(pool):
    inputs = list(INPUTS)
    inputs[5] = RewardInput("q", "\\boxed{3}", {"question": "no answer"}, 1)
    for scorer in (pool, ScoringPool(REWARD, workers=0)):
        with pytest.raises(RewardError) as info:
            scorer.map(inputs)
        message = str(info.value)
        assert "'math_match' on row 5 raised ValueError" in message
        assert "reference answer" in message and "completion: '\\\\boxed{3}'" in message
    np.testing.assert_array_equal(pool.map(INPUTS), TOTALS)  # the pool still works


def test_unpicklable_rewards_are_refused_by_name():
    def local_reward(inp):
        return 1.0

    with pytest.raises(ValueError, match="reward 'local_reward' cannot be sent to scoring"):
        ScoringPool(local_reward, workers=1)
    combined = combine_rewards([(MathMatch(), 1.0), ("shaping", lambda inp: 0.0, 1.0)])
    with pytest.raises(ValueError, match="reward 'shaping' cannot be sent"):
        ScoringPool(combined, workers=2)
    assert ScoringPool(combined, workers=0).map(INPUTS[:1]).tolist() == [1.0]  # in-process: fine
    for reward in (MathMatch(strict=True), CodeExec(timeout_s=1.0), make_reward("format")):
        assert pickle.loads(pickle.dumps(reward)) == reward


@pytest.mark.parametrize(
    "kwargs, message",
    [({"workers": -1}, "workers must be an int >= 0"), ({"workers": 1, "chunk_size": 0}, "chunk")],
)
def test_bad_settings(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ScoringPool(REWARD, **kwargs)


def test_inputs_must_be_reward_inputs_and_closed_pools_refuse():
    scorer = ScoringPool(REWARD, workers=0)
    with pytest.raises(ValueError, match=r"inputs\[0\] must be a RewardInput"):
        scorer.map([("q", "19", {"answer": "19"}, 3)])
    scorer.close()
    with pytest.raises(RuntimeError, match="closed"):
        scorer.map(INPUTS)


def test_a_dead_worker_is_a_reward_error_and_the_pool_recovers(pool):
    # Last in this module: the pool restarts its workers afterwards.
    inputs = list(INPUTS)
    inputs[4] = RewardInput("q", "die", {"answer": "0"}, 2)
    with pytest.raises(RewardError, match="worker process died"):
        pool.map(inputs)
    np.testing.assert_array_equal(pool.map(INPUTS), TOTALS)
