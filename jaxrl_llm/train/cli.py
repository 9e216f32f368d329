"""``jaxrl-llm train [CONFIG.yaml] [dotted.key=value ...]`` and ``jaxrl-llm export RUN_DIR``.

The config's top-level ``job`` (or a ``job=...`` override; default ``rl``) picks the wing:
``rl`` runs the RL trainer (``train.rl``), ``preference`` and ``reward_model`` run offline
preference training (``train.preference``). A user error — an unknown key, a missing file, a
bad record, a batch that does not divide the mesh — prints one ``error:`` line and exits 2,
leaving no run directory behind that the run created. A reward function that fails (raises,
returns NaN) is a user error too: its ``error:`` line shows the completion it failed on, and
its traceback goes to ``RUN_DIR/error.log`` (``--debug``: every error raises, with its
traceback). Ctrl-C (SIGINT) or SIGTERM stops the run at the end of its step with a checkpoint
(``train.core``): one line says how to resume, and the exit status is 128 + the signal (130
for Ctrl-C).

Faults end with one ``error:`` line too, which says from which checkpoint ``resume=true``
continues (the last complete one: a checkpoint being written when the run failed commits
first where it can, and one that never completed is discarded on resume):

* a step whose loss or gradient norm is NaN or infinite (``core.Diverged``): nothing of that
  step is saved; exit 2;
* a full disk (or an exhausted quota), with the path whose write found it full: exit 2;
* another process of a multi-process job gone (killed, crashed; a collective's peer closed its
  connection): exit 75 (``EX_TEMPFAIL``: relaunching every process with ``resume=true`` as is
  continues the run) at once, without JAX's shutdown barrier, which would wait for the dead
  process. A process that learns of it from JAX's coordination service instead (a host gone
  silent: no heartbeat for ``JAXRL_HEARTBEAT_TIMEOUT_S`` seconds, default 100) is stopped by JAX
  itself, with its own message.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import pathlib
import re
import shlex
import shutil
import sys
import traceback
from collections.abc import Sequence
from typing import Any

import yaml

from jaxrl_llm.console import (  # noqa: F401 (USER_ERRORS, quiet_start re-exported)
    USER_ERRORS,
    log_to_stderr,
    quiet_start,
)
from jaxrl_llm.train.config_io import load_config, parse_yaml

JOBS = ("rl", "preference", "reward_model")

#: Exit status when another process of the job is gone: relaunching as is continues the run
#: (``sysexits.h``'s ``EX_TEMPFAIL``; a scheduler may requeue on it).
LOST_PROCESS_EXIT = 75


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jaxrl-llm train",
        description=(
            "Run a training job. With no CONFIG, the built-in tiny CPU task: a tiny Llama-shaped "
            "model learns arithmetic (SFT warm-up, then GRPO). The config's top-level `job` "
            "picks the trainer: rl (default), preference (DPO / KTO / ORPO / SimPO / CPO) or "
            "reward_model (Bradley-Terry)."
        ),
        epilog="Overrides: run_dir=PATH seed=N trainer.max_steps=N checkpoint.every_steps=N "
        "resume=true mesh.data=2 mesh.fsdp=2 mesh.tensor=2 objective.name=dapo job=preference "
        "loss.name=kto ... Ctrl-C (or SIGTERM) stops at the end of the current step with a "
        "checkpoint, and resume=true continues from it.",
    )
    parser.add_argument("config", nargs="?", help="YAML config (default: the built-in task)")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value overrides")
    parser.add_argument(
        "--debug",
        action="store_true",
        help="errors raise with their traceback (default: one error: line; a failing reward's "
        "traceback goes to RUN_DIR/error.log)",
    )
    return parser


def resume_command(argv: Sequence[str]) -> str:
    """The command line that resumes the run ``jaxrl-llm train ARGV`` started."""
    kept = [a for a in argv if a.partition("=")[0].strip() != "resume"]
    return shlex.join(["jaxrl-llm", "train", *kept, "resume=true"])


def _interrupted_line(stop, argv: Sequence[str]) -> str:
    if stop.step is None:
        return (
            f"interrupted {stop.where}, before the first checkpoint: nothing to resume (the "
            "same command starts over)"
        )
    return f"interrupted {stop.where}; resume with {resume_command(argv)}"


def _last_checkpoint(run_dir: pathlib.Path) -> int | None:
    """The last complete checkpoint of a run that failed (what ``resume=true`` starts from)."""
    from jaxrl_llm.train.checkpoint import committed_steps  # noqa: PLC0415

    steps = committed_steps(run_dir / "checkpoints")
    return steps[-1] if steps else None


def _resume_from(run_dir: pathlib.Path, argv: Sequence[str], prefix: str) -> str:
    """``PREFIX COMMAND (it continues from checkpoint step N)``, or that nothing was saved."""
    step = _last_checkpoint(run_dir)
    if step is None:
        return "no checkpoint was saved: the same command starts over"
    return f"{prefix} {resume_command(argv)} (it continues from checkpoint step {step})"


def _diverged_line(err, run_dir: pathlib.Path, argv: Sequence[str]) -> str:
    values = ", ".join(f"{k} is {v}" for k, v in err.values.items())
    head = f"step {err.step} diverged ({values}); nothing of it was saved"
    fix = "change what made it diverge (e.g. a lower trainer.learning_rate)"
    if _last_checkpoint(run_dir) is None:
        return f"{head} and no checkpoint before it: {fix} and start again"
    # The fix changes the config: resuming with it needs resume_force (train.core).
    forced = [a for a in argv if a.partition("=")[0].strip() != "resume_force"]
    return f"{head}; resumed as it is, the run repeats it: {fix}, " + _resume_from(
        run_dir, [*forced, "resume_force=true"], "then resume with"
    )


def _written_path(err: BaseException, run_dir: pathlib.Path) -> str:
    """The file a failed write named (an ``OSError``'s, or the first absolute path another
    library quoted), else the run directory."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OSError) and err.filename:
            return os.fspath(err.filename)
        quoted = re.search(r'"(/[^"]+)"', str(err))
        if quoted:
            return quoted.group(1)
        err = err.__cause__ or err.__context__
    return os.fspath(run_dir)


def _disk_full_line(err, run_dir: pathlib.Path, argv: Sequence[str]) -> str:
    where = _written_path(err, run_dir)
    return (
        f"the disk is full (no space left on the device of {where}): free space there, "
        + _resume_from(run_dir, argv, "then resume with")
    )


def _lost_process_exit(err, run_dir: pathlib.Path, argv: Sequence[str], debug: bool):
    """Reports a lost process and ends this one at once (exit ``LOST_PROCESS_EXIT``): Python's
    exit would run JAX's shutdown barrier, which waits for the dead process until the heartbeat
    timeout and then aborts."""
    import jax  # noqa: PLC0415

    if debug:
        traceback.print_exception(err)
    cause = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    print(
        f"error: another process of this {jax.process_count()}-process job is gone ({cause}); "
        + _resume_from(run_dir, argv, "relaunch every process with"),
        file=sys.stderr,
    )
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(LOST_PROCESS_EXIT)


def _log_traceback(run_dir: pathlib.Path, err: BaseException) -> str | None:
    """Writes ``err``'s traceback to ``RUN_DIR/error.log``; its path (None: no run dir)."""
    if not run_dir.is_dir():
        return None
    path = run_dir / "error.log"
    path.write_text("".join(traceback.format_exception(err)), encoding="utf-8")
    return os.fspath(path)


def resolve_job(config_path: str | os.PathLike | None, overrides: Sequence[str]) -> str:
    """The job a config runs: the last ``job=...`` override, else its top-level ``job``.

    A missing or unreadable file is left to ``load_config`` to report.

    Raises:
      ValueError: a job that is not one of ``JOBS``.
    """
    job: Any = "rl"
    if config_path is not None and os.path.isfile(config_path):
        with open(config_path, encoding="utf-8") as f:
            try:
                data = parse_yaml(f.read())
            except yaml.YAMLError:
                data = None
        if isinstance(data, dict) and "job" in data:
            job = data["job"]
    for override in overrides:
        key, sep, value = override.partition("=")
        if sep and key.strip() == "job":
            job = parse_yaml(value)
    if job not in JOBS:
        raise ValueError(f"unknown job {job!r}: config key 'job' must be one of {JOBS}")
    return job


def config_class(job: str) -> type:
    """The config dataclass of a job (imported lazily: JAX starts only when a job runs)."""
    if job == "rl":
        from jaxrl_llm.train.rl.config import TrainConfig  # noqa: PLC0415

        return TrainConfig
    from jaxrl_llm.train.preference.config import PreferenceConfig  # noqa: PLC0415

    return PreferenceConfig


def _load(config_path, overrides):
    job = resolve_job(config_path, overrides)
    return job, load_config(config_class(job), config_path, overrides)


def train_main(argv: Sequence[str] | None = None) -> int:
    """Parses the command line, resolves the config and runs the job (exit 2: user error, a
    diverged step, a full disk; 128 + the signal: stopped by SIGINT / SIGTERM, with a checkpoint
    to resume from; ``LOST_PROCESS_EXIT``: another process of the job is gone)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    # Options may come anywhere among the overrides (``train CONFIG --debug seed=1``).
    args = _parser().parse_intermixed_args(argv)
    config_path, overrides = args.config, list(args.overrides)
    if config_path is not None and "=" in config_path:
        config_path, overrides = None, [config_path, *overrides]
    quiet_start()
    from jaxrl_llm.parallel.distributed import lost_process  # noqa: PLC0415
    from jaxrl_llm.rewards import RewardError  # noqa: PLC0415
    from jaxrl_llm.train.core import Diverged, Interrupted, disk_full  # noqa: PLC0415
    from jaxrl_llm.train.rl.watch import NoLearningSignal  # noqa: PLC0415

    try:
        job, cfg = _load(config_path, overrides)
    except USER_ERRORS as err:
        if args.debug:
            raise
        print(f"error: {err}", file=sys.stderr)
        return 2
    run_dir = pathlib.Path(cfg.run_dir)
    existed = run_dir.exists()
    if job == "rl":
        from jaxrl_llm.train.rl.run import run  # noqa: PLC0415
    else:
        from jaxrl_llm.train.preference.run import run  # noqa: PLC0415
    try:
        summary = run(cfg)
    except Interrupted as stop:
        print(_interrupted_line(stop, argv), file=sys.stderr)
        return 128 + stop.signum
    except KeyboardInterrupt:  # a second Ctrl-C: stopped at once, mid-step
        saved = (run_dir / "checkpoints").is_dir()
        where = f"resume=true continues from the latest checkpoint: {resume_command(argv)}"
        print(
            f"interrupted mid-step; {where if saved else 'no checkpoint to resume from'}",
            file=sys.stderr,
        )
        return 130
    except Diverged as err:
        if args.debug:
            raise
        print(f"error: {_diverged_line(err, run_dir, argv)}", file=sys.stderr)
        return 2
    except NoLearningSignal as err:  # the run dir stays: its samples show what the reward saw
        if args.debug:
            raise
        print(f"error: {err}", file=sys.stderr)
        return 2
    except RewardError as err:
        # The run started: what it wrote (samples, metrics) shows what the reward saw.
        if args.debug:
            raise
        logged = _log_traceback(run_dir, err)
        print(f"error: {err}", file=sys.stderr)
        print(f"  {_resume_from(run_dir, argv, 'once it is fixed, resume with')}", file=sys.stderr)
        if logged is not None:
            print(f"  traceback: {logged} (--debug prints it here)", file=sys.stderr)
        return 2
    except Exception as err:
        if lost_process(err):
            _lost_process_exit(err, run_dir, argv, args.debug)
        if args.debug or not (disk_full(err) or isinstance(err, USER_ERRORS)):
            raise
        if disk_full(err):
            print(f"error: {_disk_full_line(err, run_dir, argv)}", file=sys.stderr)
            return 2
        # A run refused before its first checkpoint leaves nothing it created behind.
        if not existed and not (run_dir / "checkpoints").exists():
            shutil.rmtree(run_dir, ignore_errors=True)
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(json.dumps(summary, indent=2))
    return 0


# -- jaxrl-llm export ------------------------------------------------------------------------


def _export_parser() -> argparse.ArgumentParser:
    from jaxrl_llm.train.export import EXPORT_DTYPES  # noqa: PLC0415

    parser = argparse.ArgumentParser(
        prog="jaxrl-llm export",
        description="Write a Hugging Face checkpoint of a run's policy (a reward-model run: "
        "its sequence classifier) from one of its kept checkpoints.",
    )
    parser.add_argument("run_dir", help="a run directory (holds config.yaml and checkpoints/)")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: last)")
    parser.add_argument("--dtype", choices=EXPORT_DTYPES, default=None, help="weights' dtype")
    parser.add_argument("--out", default=None, help="output directory (default RUN_DIR/hf-STEP)")
    parser.add_argument(
        "--merge",
        action="store_true",
        help="a LoRA run (model.lora): write the merged full weights instead of the PEFT adapter",
    )
    return parser


def _policy_params(job: str, state: dict) -> Any:
    """The policy's (or reward model's) parameters inside a raw checkpointed state."""
    if "params" in state:  # a TrainState
        params = state["params"]
        return params["policy"] if job == "rl" and "policy" in params else params
    return state["policy"]["params"]  # PPO with a separate critic, PRIME


def export_run(
    run_dir, *, step: int | None = None, dtype: str | None = None, out=None, merge: bool = False
) -> str:
    """Writes a Hugging Face checkpoint of ``run_dir``'s policy at ``step`` (default: latest),
    with the prompt format the run trained it with (``prompt_format.json``); a LoRA run's is a
    PEFT adapter (``merge``: the merged full weights).

    Raises:
      FileNotFoundError: not a run directory, or no such checkpoint.
      ValueError: ``merge`` for a run without adapters.
    """
    from jaxrl_llm import data, models  # noqa: PLC0415
    from jaxrl_llm.data.encoding import PromptFormat, write_prompt_format  # noqa: PLC0415
    from jaxrl_llm.train import setup  # noqa: PLC0415
    from jaxrl_llm.train.checkpoint import Checkpointer  # noqa: PLC0415

    run_dir = pathlib.Path(run_dir)
    config_path = run_dir / "config.yaml"
    if not config_path.is_file():
        raise FileNotFoundError(f"{run_dir} is not a run directory: it has no config.yaml")
    job, cfg = _load(config_path, [])
    checkpointer = Checkpointer(run_dir / "checkpoints", async_save=False)
    try:
        step = checkpointer.latest_step() if step is None else step
        state, _ = checkpointer.restore_raw(step)
    finally:
        checkpointer.close()
    params = _policy_params(job, state)
    if cfg.model.path is not None:
        tokenizer = models.load_tokenizer(cfg.model.path)
    else:
        tokenizer = data.build_char_tokenizer(setup.tiny_alphabet(cfg))
    out = run_dir / f"hf-{step}" if out is None else pathlib.Path(out)
    written = _export(job, cfg, run_dir, params, tokenizer, out, dtype=dtype, merge=merge)
    write_prompt_format(written, PromptFormat(cfg.data.chat_template, cfg.data.system_prompt))
    return written


def _export(job, cfg, run_dir, params, tokenizer, out, *, dtype, merge) -> str:
    """Writes the checkpoint ``export_run`` describes; returns its directory."""
    import jax.numpy as jnp  # noqa: PLC0415

    from jaxrl_llm import data, models  # noqa: PLC0415
    from jaxrl_llm.train import adapters, export, setup  # noqa: PLC0415

    if cfg.model.lora is not None and job == "reward_model":
        return _export_lora_reward_model(cfg, run_dir, params, tokenizer, out, dtype)
    if cfg.model.lora is not None:  # the checkpoint holds the adapters; the base is on disk
        base_path = adapters.base_model_path(cfg, run_dir)
        if merge:
            config, base = models.load_pretrained(base_path, dtype=jnp.float32)
            params = models.lora.combine(base, params)
        else:  # the adapter alone: the base's config is all it needs
            config = models.load_config(base_path)
        config = dataclasses.replace(config, lora=setup.lora_spec(cfg.model))
        stop = data.stop_token_ids(tokenizer, config, cfg.model.path)
        return adapters.export_adapter(
            out,
            config,
            params,
            tokenizer,
            base_model=base_path,
            stop_ids=stop,
            merge=merge,
            dtype=dtype,
        )
    if merge:
        raise ValueError(f"--merge: {run_dir} is not a LoRA run (its config has no model.lora)")
    if cfg.model.path is not None:
        config = models.load_config(cfg.model.path)
    else:
        config = setup.tiny_model_config(cfg.model, tokenizer, None)
    # The built-in model's vocabulary was padded to the run's mesh: read it off the weights.
    embed = params["backbone"]["embed"] if "backbone" in params else params["embed"]
    config = dataclasses.replace(config, vocab_size=int(embed.shape[0]))
    if job == "reward_model":
        return export.export_scalar_model(out, config, params, tokenizer, dtype=dtype)
    stop = data.stop_token_ids(tokenizer, config, cfg.model.path)
    return export.export_policy(
        out, config, params, tokenizer, stop_ids=stop, dtype=dtype, source=cfg.model.path
    )


def _export_lora_reward_model(cfg, run_dir, params, tokenizer, out, dtype) -> str:
    """A LoRA reward model's checkpoint (adapters and head) over its frozen backbone, written
    merged as a sequence classifier (what the run's ``hf/`` is)."""
    import jax.numpy as jnp  # noqa: PLC0415

    from jaxrl_llm import models  # noqa: PLC0415
    from jaxrl_llm.models import heads  # noqa: PLC0415
    from jaxrl_llm.train import adapters, export, setup  # noqa: PLC0415
    from jaxrl_llm.train.preference.data import is_scalar_model  # noqa: PLC0415
    from jaxrl_llm.train.step import merge_trees  # noqa: PLC0415

    base_path = adapters.base_model_path(cfg, run_dir)
    if is_scalar_model(base_path):
        config, loaded = heads.load_scalar_model(base_path, dtype=jnp.float32)
        backbone = loaded["backbone"]
    else:
        config, backbone = models.load_pretrained(base_path, dtype=jnp.float32)
    config = dataclasses.replace(config, lora=setup.lora_spec(cfg.model))
    frozen = adapters.backbone_view(backbone)
    merged = adapters.merged_scalar(config, merge_trees(frozen, params))
    return export.export_scalar_model(
        out, models.lora.base_config(config), merged, tokenizer, dtype=dtype
    )


def export_main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``jaxrl-llm export`` (exit 2: user error)."""
    args = _export_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    quiet_start()
    try:
        out = export_run(
            args.run_dir, step=args.step, dtype=args.dtype, out=args.out, merge=args.merge
        )
    except USER_ERRORS as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(out)
    return 0
