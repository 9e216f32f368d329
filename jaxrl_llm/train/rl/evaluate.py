"""``jaxrl-llm eval CONFIG|RUN_DIR [--k K] [overrides]``: pass@k, maj@k and mean@k on a task's
held-out prompts, with bootstrap confidence intervals.

``RUN_DIR`` (a directory with ``config.yaml``, e.g. ``runs/default``) evaluates the policy the
run left in ``RUN_DIR/hf`` on the run's own task and eval set; ``CONFIG`` (a YAML file)
evaluates ``model.path``. Every held-out prompt is sampled ``--samples`` times (default ``K``)
at ``--temperature`` (default the config's ``rollout.temperature``), through the same sampler,
prompt formatting, stop tokens and correctness check as training (``train.rl.context``), a
rollout batch's rows at a time (``context.eval_batch_prompts``) under a progress bar. The
report gives, for ``k`` in ``1`` and ``K``, the unbiased pass@k, mean@k and maj@k (the majority
final answer, ``rewards.math.extract_answer``) with their percentile-bootstrap intervals over
the prompts (``jaxrl_llm.evaluation.estimators``); ``--json FILE`` writes them with the
per-prompt counts and answers.

The policy is prompted as it was trained: a ``model.path`` written by a run records its prompt
format (``prompt_format.json``, ``data.encoding.PromptFormat``), which replaces the config's
``data.chat_template`` and ``data.system_prompt``; ``--chat-template`` / ``--no-chat-template``
(or a ``data.chat_template=`` override) choose instead, and a choice that differs from the
training is said in one ``note:`` line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import sys

from jaxrl_llm.console import USER_ERRORS, quiet_start
from jaxrl_llm.evaluation.sampled import sampled_report
from jaxrl_llm.sampling.prompt_format import (
    add_chat_template_flags,
    asked_chat_template,
    resolve_prompt_format,
)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jaxrl-llm eval",
        description="pass@k, maj@k and mean@k of a run's policy (or model.path) on the task's "
        "held-out prompts, with bootstrap intervals",
    )
    parser.add_argument("target", help="a run directory (with config.yaml) or a YAML config")
    parser.add_argument("--k", type=int, default=8, help="the largest k reported (default 8)")
    parser.add_argument("--samples", type=int, default=None, help="completions a prompt (>= k)")
    parser.add_argument("--temperature", type=float, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--resamples", type=int, default=1000, help="bootstrap resamples")
    parser.add_argument("--json", default=None, metavar="FILE")
    add_chat_template_flags(parser, unrecorded="the config's data.chat_template")
    parser.add_argument("overrides", nargs="*", help="config overrides, key=value")
    return parser


def as_trained(cfg, *, asked: bool | None):
    """``(cfg, note)``: ``cfg`` prompting ``model.path`` with the format it was trained with
    (its ``prompt_format.json``) unless ``asked`` for the chat template (True) or raw text
    (False); ``note``: one line when that differs from the config or from the training."""
    from jaxrl_llm.data.encoding import PromptFormat, read_prompt_format  # noqa: PLC0415

    path = cfg.model.path
    trained = read_prompt_format(path) if path is not None and os.path.isdir(path) else None
    data = cfg.data
    if asked is None and trained is None:
        return cfg, None
    configured = PromptFormat(data.chat_template, data.system_prompt)
    chosen, note = resolve_prompt_format(
        trained,
        asked=asked,
        unrecorded=configured,
        system_prompt=data.system_prompt,
        model_dir=path,
    )
    if asked is None and chosen != configured:
        system = "" if chosen.system_prompt is None else " and its system prompt"
        note = (
            f"note: {path} was trained {chosen.describe()}{system}; evaluating it so, not "
            f"as the config's data.chat_template={str(data.chat_template).lower()} says "
            "(--chat-template / --no-chat-template to choose)"
        )
    data = dataclasses.replace(
        data, chat_template=chosen.chat_template, system_prompt=chosen.system_prompt
    )
    return dataclasses.replace(cfg, data=data), note


def load_eval_config(target: str, overrides: list[str]):
    """The ``TrainConfig`` to evaluate: a run directory's own (its ``hf/`` policy as
    ``model.path``: a Hugging Face checkpoint, or a LoRA run's PEFT adapter over its saved base)
    or a YAML config's.

    Raises:
      FileNotFoundError: no such file or directory, or a run directory without ``config.yaml``
        or a policy in ``hf/``.
    """
    from jaxrl_llm.models import lora  # noqa: PLC0415
    from jaxrl_llm.train.config_io import load_config  # noqa: PLC0415
    from jaxrl_llm.train.rl.config import TrainConfig  # noqa: PLC0415

    path = pathlib.Path(target)
    if path.is_dir():
        config, hf = path / "config.yaml", path / "hf"
        if not config.is_file():
            raise FileNotFoundError(f"{path} is a directory without config.yaml (not a run dir)")
        # A LoRA run leaves its adapters (PEFT, over the base it saved in ``RUN_DIR/base``),
        # which ``model.path`` loads as one model (``setup.build_policy``).
        if not (hf / "config.json").is_file() and not lora.is_adapter_dir(hf):
            raise FileNotFoundError(
                f"{hf} holds no Hugging Face checkpoint or LoRA adapter: the run has not "
                f"finished (or `jaxrl-llm export {path}` writes one)"
            )
        return load_config(TrainConfig, str(config), [*overrides, f"model.path={hf}"])
    if not path.is_file():
        raise FileNotFoundError(f"no run directory or config file at {path}")
    return load_config(TrainConfig, str(path), overrides)


def evaluate(cfg, *, k: int, samples: int, temperature: float, seed: int, resamples: int):
    """``(summary, per_prompt)`` of ``cfg``'s policy on its held-out prompts (see module)."""
    from jaxrl_llm import data  # noqa: PLC0415
    from jaxrl_llm.train import setup  # noqa: PLC0415
    from jaxrl_llm.train.rl.context import (  # noqa: PLC0415
        RunContext,
        eval_batch_prompts,
        load_examples,
        task_reward,
    )
    from jaxrl_llm.train.rl.episodes import make_run_env  # noqa: PLC0415
    from jaxrl_llm.train.rl.spec import resolve  # noqa: PLC0415

    if samples < k:
        raise ValueError(f"--samples {samples} must be at least --k {k}")
    if cfg.model.path is None:
        raise ValueError(
            "eval needs trained weights: give a run directory or a config with model.path (the "
            "built-in tiny model would be evaluated at its random initialisation)"
        )
    spec = resolve(cfg, training=False)
    objective = spec.objective
    # A run's sampler-only devices (mesh.rollout_devices) are the evaluation's too.
    mesh = setup.make_run_mesh(dataclasses.replace(cfg.mesh, rollout_devices=0))
    tokenizer, model_config, params = setup.build_policy(cfg, mesh, spec.precision)
    _, examples = load_examples(cfg, tokenizer)
    reward_fn = task_reward(cfg)
    context = RunContext(
        cfg,
        mesh,
        tokenizer,
        model_config,
        objective,
        reward_fn,
        [],
        examples,
        stop_ids=data.stop_token_ids(tokenizer, model_config, cfg.model.path),
        env=make_run_env(cfg, reward_fn),
    )
    return sampled_report(
        context,
        params,
        examples,
        k=k,
        samples=samples,
        temperature=temperature,
        seed=seed,
        resamples=resamples,
        batch_prompts=eval_batch_prompts(cfg.rollout, samples),
        progress=True,
    )


def eval_main(argv: list[str] | None = None) -> int:
    """Entry point of ``jaxrl-llm eval`` (exit 0; 2 on bad input, with the reason)."""
    # Overrides may follow the options (``RUN --k 4 data.eval_size=512``), as in ``plan``.
    args = _parser().parse_intermixed_args(argv)
    quiet_start()
    from jaxrl_llm.rewards import RewardError  # noqa: PLC0415

    try:
        cfg = load_eval_config(args.target, args.overrides)
        asked = asked_chat_template(args)
        if asked is None and any(
            o.split("=")[0].strip() == "data.chat_template" for o in args.overrides
        ):
            asked = cfg.data.chat_template
        cfg, note = as_trained(cfg, asked=asked)
        if note is not None:
            print(note, file=sys.stderr)
        temperature = cfg.rollout.temperature if args.temperature is None else args.temperature
        summary, per_prompt = evaluate(
            cfg,
            k=args.k,
            samples=args.k if args.samples is None else args.samples,
            temperature=temperature,
            seed=args.seed,
            resamples=args.resamples,
        )
    except (*USER_ERRORS, RewardError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(
        f"{summary['problems']} prompts x {summary['samples']} samples at temperature "
        f"{temperature:g} ({cfg.model.path}); 95% bootstrap intervals over the prompts"
    )
    for key in (k for k in summary if "@" in k and not k.endswith(("_low", "_high"))):
        low, high = summary[f"{key}_low"], summary[f"{key}_high"]
        print(f"  {key:8s} {summary[key]:.4f}  [{low:.4f}, {high:.4f}]")
    if args.json:
        pathlib.Path(args.json).write_text(
            json.dumps({"summary": summary, "per_prompt": per_prompt}, indent=2), encoding="utf-8"
        )
    return 0


__all__ = ["as_trained", "eval_main", "evaluate", "load_eval_config"]
