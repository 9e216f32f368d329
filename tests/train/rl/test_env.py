"""The RL trainer on a multi-turn environment (``env.name``), through the whole step.

A scripted environment (importable as ``tests.train.rl.test_env:scripted_env``) answers the
first two 3-token turns with a tool message and scores the third. Checked against quantities
computed here, not by the code under test: the step trains on the sampled tokens only
(``num_tokens`` = what the loss mask counts, 3 per turn), the trainer's forward attends the
environment's tokens exactly as the sampler did (sampler vs trainer log-probs agree to 1e-4 in
f32; scoring with the environment's tokens hidden would not), and the ``env/*`` metrics.
"""

from __future__ import annotations

import os

import pytest

from jaxrl_llm.data import Example
from jaxrl_llm.envs import StepResult, ToolEnv
from jaxrl_llm.train.config_io import load_config
from jaxrl_llm.train.metrics import read_metrics
from jaxrl_llm.train.rl.config import TrainConfig, check_config
from jaxrl_llm.train.rl.episodes import demonstrations, make_run_env
from jaxrl_llm.train.rl.trainer import RLTrainer
from tests.train.rl import rl_helpers

TURNS, TURN_TOKENS = 3, 3


class Scripted:
    def __init__(self, reward_fn):
        self.reward_fn = reward_fn

    def reset(self, example):
        return [{"role": "user", "content": example.prompt}]

    def step(self, episode, completion):
        if episode.turn < TURNS:
            return StepResult([{"role": "tool", "content": "ok"}], 0.0, False, {"calls": 1})
        return StepResult(None, float(len(set(completion))), True, {"calls": 0})

    def demonstration(self, example):
        raise NotImplementedError


def scripted_env(reward_fn, **kwargs):
    return Scripted(reward_fn, **kwargs)


ENV = (
    "env.name=tests.train.rl.test_env:scripted_env",
    f"env.max_turns={TURNS}",
    f"env.max_turn_tokens={TURN_TOKENS}",
    "rollout.max_new_tokens=96",
    "trainer.max_steps=1",
)


@pytest.mark.slow
def test_a_step_trains_on_sampled_tokens_and_attends_the_environments(tmp_path):
    cfg = rl_helpers.tiny_config(None, tmp_path / "run", *ENV)
    RLTrainer(cfg).fit()
    (row,) = read_metrics(tmp_path / "run")
    rows = cfg.rollout.prompts_per_step * cfg.rollout.group_size
    assert row["env/turns"] == TURNS and row["env/calls"] == TURNS - 1
    # At most 3 sampled ids a turn (fewer where the random policy samples EOS); the attended
    # length adds the environment's two responses to each episode, trained on by none.
    assert rows * TURNS <= row["num_tokens"] <= rows * TURNS * TURN_TOKENS
    response = len("<tool_response>ok</tool_response>")
    attended = row["completion_length_mean"] * rows
    assert attended == pytest.approx(row["num_tokens"] + rows * (TURNS - 1) * response)
    assert row["rollout/logprob_diff_max"] < 1e-4
    assert row["grad_norm"] > 0.0


def test_calculator_demonstrations_train_the_assistant_turns_only(tmp_path):
    cfg = rl_helpers.tiny_config(
        None, tmp_path, "env.name=calculator", "rollout.max_new_tokens=128"
    )
    trainer = RLTrainer(cfg)
    batch = demonstrations(trainer.run, [Example("12*34=", "408")])
    tokenizer = trainer.run.tokenizer
    attended = batch.completion_tokens[0][batch.attention_mask[0]].tolist()
    trained = batch.completion_mask[0][batch.attention_mask[0]].tolist()
    call = '<tool_call>{"name":"calc","arguments":{"expr":"12*34"}}</tool_call>'
    response = "<tool_response>408</tool_response>"
    eos = tokenizer.eos_token_id
    ids = lambda text: [tokenizer.convert_tokens_to_ids(c) for c in text]  # noqa: E731
    assert attended == [*ids(call), eos, *ids(response), *ids("408"), eos]
    assert trained == [True] * (len(call) + 1) + [False] * len(response) + [True] * 4
    assert tokenizer.decode(batch.prompt_tokens[0][batch.prompt_mask[0]].tolist()) == "12*34="


@pytest.mark.parametrize(
    ("override", "match"),
    [
        ("env.name=calculater", "env.name must be one of \\['calculator'\\]"),
        ("env.max_turns=0", "env.max_turns must be >= 1"),
        ("objective.name=ppo", "critic-free objectives.*needs a critic"),
        # The episode loop scores with the environment's reward only: a learned reward
        # model would sit loaded and unused.
        ("reward_model.path=/rm", "needs a learned reward model"),
        ("rollout.engine=continuous", "rollout.engine=static"),
    ],
)
def test_bad_env_settings_name_the_key(override, match):
    cfg = load_config(TrainConfig, None, ["run_dir=x", "env.name=calculator", override])
    with pytest.raises(ValueError, match=match):
        check_config(cfg)


def test_the_run_env_is_built_with_the_task_reward():
    cfg = load_config(TrainConfig, None, ["run_dir=x", "env.name=calculator"])
    env = make_run_env(cfg, reward_fn=lambda inp: 7.0)
    assert isinstance(env, ToolEnv) and env.reward_fn(None) == 7.0
    assert make_run_env(load_config(TrainConfig, None, ["run_dir=x"]), None) is None


def worker_reward(prompt, completion, example) -> float:
    """1 in a scoring worker, 0 in the process that made the test (``TRAINER_PID``)."""
    return float(os.getpid() != int(os.environ["TRAINER_PID"]))


@pytest.mark.slow
def test_reward_workers_score_in_worker_processes(tmp_path, monkeypatch):
    """``rollout.reward_workers=2``: every completion is scored in a worker process (reward
    1), none in the trainer's (it would score 0)."""
    monkeypatch.setenv("TRAINER_PID", str(os.getpid()))
    reward = "rewards=[{name: 'tests.train.rl.test_env:worker_reward'}]"
    cfg = rl_helpers.tiny_config(
        None, tmp_path, reward, "trainer.max_steps=1", "rollout.reward_workers=2"
    )
    trainer = RLTrainer(cfg)
    try:
        trainer.fit()
    finally:
        trainer.run.scorer.close()
    (row,) = read_metrics(tmp_path)
    assert row["reward_mean"] == 1.0
