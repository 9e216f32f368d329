"""Multi-turn rollouts, token in, token out (``envs.rollout``), on a tiny random model.

A scripted environment answers every turn but the last with a tool message. The checks: the
episode's completion is exactly [sampled ids] + [the environment's rendered ids] + ... (the
sampled ids never re-tokenised; the environment's tokenised once, as ``Renderer`` renders
them by hand here); the loss mask is 1 exactly on sampled ids; rewards are summed over turns;
budgets end episodes; and the sampler's log-probs equal a teacher-forced forward over the whole
episode (prompt, own tokens, environment tokens) at the sampled positions, to 1e-5 in f32:
the sampler saw the same sequence the trainer scores.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxrl_llm import logprobs as logprobs_lib
from jaxrl_llm.data import Example
from jaxrl_llm.data.char_tokenizer import TOOL_ALPHABET, build_char_tokenizer
from jaxrl_llm.envs import EpisodeLimits, Renderer, StepResult, run_episodes
from jaxrl_llm.models import ModelConfig
from tests.sampling import random_params

TOKENIZER = build_char_tokenizer(TOOL_ALPHABET)
VOCAB = -(-len(TOKENIZER) // 8) * 8
CONFIG = ModelConfig(
    architecture="LlamaForCausalLM",
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=256,
)
PARAMS = random_params(CONFIG, seed=1)
EOS = TOKENIZER.eos_token_id
PAD = TOKENIZER.pad_token_id
RESPONSE = "<tool_response>ok</tool_response>"


class Scripted:
    """Answers turns 1 .. ``turns - 1`` with a tool message (reward 0.25 each); the last
    turn ends the episode with reward 1. Records the completions it was given."""

    def __init__(self, turns: int):
        self.turns, self.seen = turns, []

    def reset(self, example):
        return [{"role": "user", "content": example.prompt}]

    def step(self, episode, completion):
        self.seen.append(completion)
        if episode.turn >= self.turns:
            return StepResult(None, 1.0, True, {"calls": 0})
        return StepResult([{"role": "tool", "content": "ok"}], 0.25, False, {"calls": 1})

    def demonstration(self, example):
        raise NotImplementedError


def _run(env, *, max_turns=3, max_tokens=96, max_turn_tokens=3, stop_ids=(EOS,), temp=1.0):
    return run_episodes(
        PARAMS,
        CONFIG,
        Renderer(TOKENIZER, chat_template=False, eos_id=EOS),
        env,
        [Example("12*34=", "408"), Example("5*6=", "30")],
        key=jax.random.key(0),
        group_size=2,
        limits=EpisodeLimits(max_turns, max_tokens, max_turn_tokens),
        stop_ids=stop_ids,
        pad_id=PAD,
        temperature=temp,
    )


def _ids(text):
    return [TOKENIZER.convert_tokens_to_ids(c) for c in text]


def test_episode_is_sampled_ids_then_environment_ids_with_loss_mask_on_sampled_only():
    env = Scripted(turns=3)
    out = _run(env)
    response = _ids(RESPONSE)  # rendered by hand: one id per character
    assert out["tokens"].shape == (4, 96)
    for i in range(4):
        n = int(out["mask"][i].sum())
        row, trained = out["tokens"][i, :n].tolist(), out["loss_mask"][i, :n].tolist()
        # turn 1 (3 ids) | response | turn 2 (3 ids) | response | turn 3 (3 ids)
        assert n == 3 + len(response) + 3 + len(response) + 3
        assert row[3 : 3 + len(response)] == response
        assert row[6 + len(response) : 6 + 2 * len(response)] == response
        want = [True] * 3 + [False] * len(response)
        assert trained == want + want + [True] * 3
        assert not out["loss_mask"][i, n:].any() and not out["mask"][i, n:].any()
        assert np.all(out["logprobs"][i, :n][~np.array(trained)] == 0.0)
        assert np.all(out["logprobs"][i, :n][np.array(trained)] < 0.0)
    assert out["rewards"].tolist() == [1.5] * 4  # 0.25 + 0.25 + 1
    assert out["turns"].tolist() == [3] * 4
    assert out["info"]["calls"].tolist() == [2.0] * 4
    # The environment saw each turn's own ids decoded (no EOS in a 3-id turn here).
    first_turns = [TOKENIZER.decode(out["tokens"][i, :3].tolist()) for i in range(4)]
    assert env.seen[:4] == first_turns
    assert out["prompts"] == ["12*34=", "12*34=", "5*6=", "5*6="]


def test_sampler_logprobs_equal_a_forward_over_the_whole_episode():
    out = _run(Scripted(turns=3))
    prompt = [_ids(p) for p in out["prompts"]]
    width = max(map(len, prompt))
    prompt_tokens = np.array([[PAD] * (width - len(p)) + p for p in prompt], np.int32)
    prompt_mask = prompt_tokens != PAD
    forward = np.asarray(
        logprobs_lib.completion_logprobs(
            PARAMS, CONFIG, prompt_tokens, prompt_mask, out["tokens"], out["mask"]
        )
    )
    trained = out["loss_mask"]
    np.testing.assert_allclose(forward[trained], out["logprobs"][trained], atol=1e-5)
    # Scoring the episode without the environment's tokens (attention = loss mask) differs.
    blind = np.asarray(
        logprobs_lib.completion_logprobs(
            PARAMS, CONFIG, prompt_tokens, prompt_mask, out["tokens"], trained
        )
    )
    assert np.abs(blind[trained] - out["logprobs"][trained]).max() > 1e-3


def test_done_ends_the_episode_and_eos_makes_it_finished():
    every_token_stops = tuple(range(VOCAB))  # each turn is one sampled id, ending "with EOS"
    out = _run(Scripted(turns=1), stop_ids=every_token_stops)
    assert out["mask"].sum(axis=1).tolist() == [1] * 4
    assert out["finished"].all() and out["rewards"].tolist() == [1.0] * 4
    cut = _run(Scripted(turns=1))  # 3 ids, no stop among them: done but not finished
    assert not cut["finished"].any()


@pytest.mark.parametrize(
    ("max_turns", "max_tokens", "turns", "length"),
    [
        (1, 96, 1, 3),  # out of turns: the environment's answer is not appended
        (3, 3 + len(RESPONSE), 1, 3),  # its answer would leave no room for a turn
        (3, 3 + len(RESPONSE) + 2, 2, 3 + len(RESPONSE) + 2),  # the last turn is cut at 2
    ],
)
def test_budgets_end_episodes(max_turns, max_tokens, turns, length):
    out = _run(Scripted(turns=3), max_turns=max_turns, max_tokens=max_tokens)
    assert out["turns"].tolist() == [turns] * 4
    assert out["mask"].sum(axis=1).tolist() == [length] * 4
    assert out["tokens"].shape[1] == max_tokens


def test_malformed_environment_output_is_refused():
    class Silent(Scripted):
        def step(self, episode, completion):
            return StepResult(None, 0.0, False, {})

    with pytest.raises(ValueError, match="done=False with no messages"):
        _run(Silent(turns=2))

    class BadReset(Scripted):
        def reset(self, example):
            return "12*34="

    with pytest.raises(ValueError, match="Environment.reset must return a list of messages"):
        _run(BadReset(turns=1))
