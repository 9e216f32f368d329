"""The RL run's side of multi-turn environments (``env.name``): episodes as ``Samples`` and
demonstrations for the SFT warm-up.

``EpisodeDrawer`` runs ``envs.run_episodes`` with the run's sampler settings and packs the
result as the trainer's ``Samples``: the completion is the episode after its opening prompt,
``loss_mask`` its sampled tokens, ``rewards`` the summed turn rewards, ``correct`` the task's
check on the final assistant message, ``info`` the per-episode turn count and the
environment's numeric info (tool calls, tool errors) for the ``env/*`` metrics.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import jax
import numpy as np

from jaxrl_llm import data, envs
from jaxrl_llm.data.demonstrations import draw_demonstration
from jaxrl_llm.data.encoding import pad_id
from jaxrl_llm.rewards import is_correct
from jaxrl_llm.train.rl.rollout import Drawer, DrawRequest, Samples
from jaxrl_llm.types import MaskedSequences, Sequences


def renderer(context) -> envs.Renderer:
    """The run's ``envs.Renderer`` (chat template as ``data.chat_template``; EOS = first stop)."""
    return envs.Renderer(
        context.tokenizer, chat_template=context.cfg.data.chat_template, eos_id=context.stop_ids[0]
    )


def make_run_env(cfg, reward_fn) -> envs.Environment | None:
    """The environment of ``env.name`` with the run's reward, or None (single-turn)."""
    if cfg.env.name is None:
        return None
    return envs.make_env(cfg.env.name, reward_fn, **dict(cfg.env.kwargs))


def _correct(episode: envs.Episode) -> bool:
    try:
        return is_correct(episode.final_text, episode.example)
    except ValueError:  # an environment whose examples carry no reference answer
        return False


class EpisodeDrawer(Drawer):
    """``env.name``: ``group_size`` episodes of the run's environment for each example
    (``envs.run_episodes`` with the run's sampler settings), scored by the environment."""

    def draw(self, params, examples: Sequence[Any], key: jax.Array, request: DrawRequest):
        context, settings = self.context, self.context.settings
        with request.phase("rollout"):
            out = envs.run_episodes(
                params,
                context.sampling_config,
                renderer(context),
                context.env,
                examples,
                key=key,
                group_size=request.group_size,
                limits=envs.EpisodeLimits(
                    max_turns=context.cfg.env.max_turns,
                    max_tokens=settings.max_new_tokens,
                    max_turn_tokens=context.cfg.env.max_turn_tokens,
                ),
                stop_ids=context.stop_ids,
                pad_id=pad_id(context.tokenizer),
                mesh=request.mesh,
                **settings.sampling(request.temperature),
            )
        prompt_tokens, prompt_mask = envs.left_pad(out["prompt_ids"], pad_id(context.tokenizer))
        tokens, mask = out["tokens"], out["mask"]
        texts = [
            context.tokenizer.decode(row[m].tolist(), skip_special_tokens=True)
            for row, m in zip(tokens, mask)
        ]
        info = {"turns": out["turns"].astype(np.float64), **out["info"]}
        return Samples(
            prompt_tokens=prompt_tokens,
            prompt_mask=prompt_mask,
            completion_tokens=tokens,
            completion_mask=mask,
            completions=texts,
            prompts=out["prompts"],
            rewards=out["rewards"],
            correct=np.array([_correct(e) for e in out["episodes"]], bool),
            components={"env": out["rewards"]},
            finished=out["finished"],
            logprobs=out["logprobs"],
            loss_mask=out["loss_mask"],
            info=info,
        )


def demonstrations(context, examples: Sequence[Any]) -> MaskedSequences:
    """The environment's demonstrations of ``examples`` (``Environment.demonstration``) as
    token sequences: assistant messages trained, the environment's messages attended only;
    cut at ``rollout.max_new_tokens`` like an episode.

    Raises:
      ValueError: the environment has no demonstrations (set ``sft_warmup.steps=0``).
    """
    render = renderer(context)
    limit = context.cfg.rollout.max_new_tokens
    prompts, completions, trained = [], [], []
    for example in examples:
        opening = envs.check_messages(context.env.reset(example), "Environment.reset")
        try:
            demo = envs.check_messages(
                context.env.demonstration(example), "Environment.demonstration"
            )
        except NotImplementedError as err:
            raise ValueError(
                f"env.name={context.cfg.env.name!r} has no demonstrations for the SFT "
                f"warm-up ({err}): set sft_warmup.steps=0"
            ) from err
        prompts.append(render.opening(opening)[1])
        ids, mask = render.episode(demo)
        completions.append(ids[:limit])
        trained.append(mask[:limit])
    prompt_tokens, prompt_mask = envs.left_pad(prompts, pad_id(context.tokenizer))
    tokens = np.full((len(examples), limit), pad_id(context.tokenizer), np.int32)
    attention = np.zeros((len(examples), limit), bool)
    loss = np.zeros((len(examples), limit), bool)
    for i, (ids, mask) in enumerate(zip(completions, trained)):
        tokens[i, : len(ids)], attention[i, : len(ids)], loss[i, : len(ids)] = ids, True, mask
    return MaskedSequences(prompt_tokens, prompt_mask, tokens, loss, attention)


def demonstration_batches(run, batch_size: int, seed: int, key: int = 1) -> Iterator[Any]:
    """The SFT warm-up's host batches: ``batch_size`` training examples drawn with replacement
    (seeded by ``(seed, key)``), as ``Sequences`` of prompt and demonstration, or the
    environment's own multi-turn demonstrations (``MaskedSequences``).

    An example with alternative demonstrations (``data.demonstrations``, e.g. a teacher's
    slips) has one drawn afresh at each of its draws, from a stream of its own (seeded by
    ``(seed, key, 1)``): the examples drawn are the same whether or not any has alternatives.
    """
    cfg = run.cfg
    rng = np.random.default_rng([seed, key])
    demo_rng = np.random.default_rng([seed, key, 1])
    while True:
        idx = rng.integers(0, len(run.train_examples), batch_size)
        examples = [run.train_examples[j] for j in idx]
        if run.env is not None:  # multi-turn: the environment's own demonstrations
            yield demonstrations(run, examples)
            continue
        prompt_tokens, prompt_mask = data.encode_prompts(
            run.tokenizer,
            run.prompts(examples),
            max_prompt_tokens=cfg.data.max_prompt_tokens,
            add_special_tokens=not cfg.data.chat_template,
        )
        completion_tokens, completion_mask = data.encode_completions(
            run.tokenizer,
            [draw_demonstration(ex, demo_rng) for ex in examples],
            max_tokens=cfg.rollout.max_new_tokens,
            eos_id=run.stop_ids[0],
        )
        yield Sequences(prompt_tokens, prompt_mask, completion_tokens, completion_mask)


def check_env(cfg: Any, objective: Any) -> None:
    """Refuses an ``env`` section the multi-turn loop cannot run (``TrainConfig`` checks).

    Raises:
      ValueError: an unknown environment, bad turn limits, an objective that needs a critic, a
        PRM or a learned reward model, or the continuous engine.
    """
    env = cfg.env
    if env.name is None:
        return
    if ":" not in env.name and env.name not in envs.ENVIRONMENTS:
        raise ValueError(
            f"env.name must be one of {sorted(envs.ENVIRONMENTS)} or 'package.module:factory', got "
            f"{env.name!r}"
        )
    for key, value in (("max_turns", env.max_turns), ("max_turn_tokens", env.max_turn_tokens)):
        if not (value is None and key == "max_turn_tokens") and not (value or 0) >= 1:
            raise ValueError(f"env.{key} must be >= 1, got {value!r}")
    needs = ["a critic"] * objective.needs_critic + ["a PRM"] * objective.needs_process_rewards
    needs += ["a learned reward model (reward_model.path)"] * (cfg.reward_model.path is not None)
    if needs:
        raise ValueError(
            f"env.name={env.name!r}: multi-turn episodes train with critic-free objectives and "
            f"the environment's rewards for now; this config needs {needs[0]}"
        )
    if cfg.rollout.engine != "static":
        raise ValueError(
            "env.name: multi-turn episodes sample each turn as one batch (rollout.engine="
            f"static); got rollout.engine={cfg.rollout.engine!r}"
        )
