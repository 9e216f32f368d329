"""``jaxrl-llm sweep [CONFIG] --presets grpo,dapo,grpo+kl_cov --seeds 0,1,2 [--out DIR]``: a
bake-off of objective variants.

Each variant is an objective preset (``objectives.available()``), optionally followed by
stabilisers from :data:`STABILISERS` joined with ``+`` (``grpo+kl_cov``, ``dapo+m2po+top_entropy``):
the preset with those objective overrides. Every variant × seed trains ``CONFIG`` (default: the
headroom task, ``configs/carry_slips.yaml``) with the command line's overrides in its own run
directory ``OUT/VARIANT/seedN`` — one ``jaxrl-llm train`` subprocess per run, so a crash fails
one cell, and its output goes to ``OUT/VARIANT/seedN.log``. Runs go one at a time (``--jobs N``:
N at once). Then ``train.sweep_report`` reads every run's ``summary.json`` and ``metrics.jsonl``
and writes ``OUT/sweep.md`` (the table), ``OUT/sweep.json`` and ``OUT/sweep_accuracy.png``.

Shared warm-up (``--warmup shared``, the default when the config warms up): each seed's SFT
warm-up trains once, in ``OUT/_warmup/seedN`` (``trainer.max_steps=0``: the warm-up, its
evaluation and its Hugging Face export), and every variant of that seed starts RL from it
(``model.path=OUT/_warmup/seedN/hf sft_warmup.steps=0``): the variants of a seed then differ in
their objective only, and the bake-off pays one warm-up a seed instead of one a run.
``--warmup each`` warms every run up on its own.

Resumable: a run directory whose ``summary.json`` holds the evaluation after RL is reused, not
retrained; an unfinished one continues from its last checkpoint (every run is started with
``resume=true``). A cell's command is kept in ``OUT/VARIANT/seedN.json``: a finished run whose
command differs (other overrides) is refused rather than reported as if it were the new one.

Every variant and override is checked (the full config check of an RL run) before anything
trains: bad input is one ``error:`` line, exit 2. Exit 1 when some run failed (the report is
still written, the failed cells counted; each failure's last ``error:`` line and log named).
Ctrl-C stops the runs under way at the end of their step with a checkpoint (``jaxrl-llm
train``'s own handling), starts no other, and exits 130: the same command resumes the sweep.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import os
import pathlib
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from jaxrl_llm.console import USER_ERRORS, quiet_start
from jaxrl_llm.train.sweep_report import finished_summary


@dataclasses.dataclass(frozen=True)
class Stabiliser:
    """A named set of objective overrides that switches on one stabiliser.

    Attributes:
      overrides: ``objectives.Objective`` fields and values.
      what: the stabiliser in words (``--list``).
    """

    overrides: tuple[tuple[str, Any], ...]
    what: str


#: Stabilisers a variant can add to a preset (``PRESET+NAME``). The values are the papers' or
#: peers' defaults, except the covariance fractions: with ~1000 completion tokens per step on
#: the tiny task, verl's 2e-4 would select no token, so 2e-3 selects about two.
STABILISERS: dict[str, Stabiliser] = {
    "kl_cov": Stabiliser(
        (("surrogate", "kl_cov"), ("cov_fraction", 0.002)),
        "KL-Cov: |log r| penalty on the highest-covariance tokens (Cui et al. 2025)",
    ),
    "clip_cov": Stabiliser(
        (("surrogate", "clip_cov"), ("cov_fraction", 0.002)),
        "Clip-Cov: no gradient for a few high-covariance tokens (Cui et al. 2025)",
    ),
    "dppo_tv": Stabiliser(
        (("surrogate", "dppo_tv"), ("clip_low", 0.15), ("clip_high", 0.15)),
        "DPPO: total-variation trust region instead of the ratio clip",
    ),
    "dppo_kl": Stabiliser(
        (("surrogate", "dppo_kl"), ("clip_low", 0.15), ("clip_high", 0.15)),
        "DPPO: binary-KL trust region instead of the ratio clip",
    ),
    "top_entropy": Stabiliser(
        (("top_entropy_quantile", 0.2),),
        "train only the top 20% highest-entropy tokens (Wang et al. 2025)",
    ),
    "m2po": Stabiliser(
        (("m2_threshold", 0.04),),
        "M2PO second-moment trust region, tau 0.04 (AReaL's default)",
    ),
    "off_policy_mask": Stabiliser(
        (("off_policy_mask_threshold", 0.5),),
        "DeepSeek-V3.2 off-policy sequence mask, delta 0.5 (TRL's example)",
    ),
    "adaptive_entropy": Stabiliser(
        (("entropy_target", 0.2),),
        "adaptive entropy coefficient, target 0.2 nats (Skywork-OR1; TRL's default)",
    ),
    "kl_bias_correction": Stabiliser(
        (("kl_bias_correction", True),),
        "DeepSeek-V3.2 unbiased KL estimate r*KL (needs a preset with a KL term)",
    ),
}

#: The default bake-off: every preset that trains from a plain config (``ppo`` needs a critic,
#: ``prime`` a process reward model, ``distill`` a teacher) and every stabiliser on GRPO.
BAKE_OFF: tuple[str, ...] = (
    "grpo",
    "dapo",
    "dr_grpo",
    "gspo",
    "cispo",
    "gmpo",
    "sapo",
    "rloo",
    "reinforce_pp",
    "gpg",
    *(f"grpo+{name}" for name in STABILISERS),
)
DEFAULT_CONFIG = "configs/carry_slips.yaml"
DEFAULT_SEEDS = (0, 1, 2)
DEFAULT_THRESHOLD = 20.0
#: ``jaxrl-llm train``'s exit status after Ctrl-C (128 + SIGINT): the sweep stops too.
INTERRUPTED_EXIT = 130
#: Keys the sweep sets per run: an override of one would be silently replaced.
SWEEP_KEYS = ("objective.name", "seed", "run_dir", "resume")
#: ``--warmup``: one warm-up a seed shared by its variants, or one a run.
WARMUP_MODES = ("shared", "each")
#: The directory (under the sweep's) of the shared warm-ups: ``OUT/_warmup/seedN``.
WARMUP_DIR = "_warmup"


@dataclasses.dataclass(frozen=True)
class Variant:
    """One column of the bake-off: a preset and the objective overrides of its stabilisers.

    Attributes:
      name: as given (``grpo+kl_cov``); also its directory under the sweep's output.
      preset: the ``objective.name``.
      overrides: ``(field, value)`` pairs, in the order the stabilisers are named.
    """

    name: str
    preset: str
    overrides: tuple[tuple[str, Any], ...] = ()

    def argv(self) -> list[str]:
        """The ``objective.*`` overrides that train this variant."""
        return [f"objective.name={self.preset}"] + [
            f"objective.overrides.{key}={json.dumps(value)}" for key, value in self.overrides
        ]


def parse_variant(name: str) -> Variant:
    """``PRESET[+STABILISER...]`` -> :class:`Variant` (the objective itself is checked later,
    with the config).

    Raises:
      ValueError: an unknown preset or stabiliser, or two stabilisers setting one field.
    """
    from jaxrl_llm import objectives  # noqa: PLC0415  (imports JAX)

    preset, *added = [part.strip() for part in name.split("+")]
    if preset not in objectives.available():
        raise ValueError(
            f"--presets: unknown preset {preset!r} in {name!r}; presets: "
            f"{', '.join(objectives.available())}"
        )
    overrides: dict[str, Any] = {}
    for stabiliser in added:
        if stabiliser not in STABILISERS:
            raise ValueError(
                f"--presets: unknown stabiliser {stabiliser!r} in {name!r}; stabilisers: "
                f"{', '.join(STABILISERS)}"
            )
        for key, value in STABILISERS[stabiliser].overrides:
            if key in overrides and overrides[key] != value:
                raise ValueError(
                    f"--presets: {name!r} sets objective field {key!r} twice "
                    f"({overrides[key]!r} and {value!r})"
                )
            overrides[key] = value
    return Variant(name, preset, tuple(overrides.items()))


def parse_list(text: str, flag: str) -> list[str]:
    """A comma-separated flag value: its items, stripped (ValueError: empty or repeated)."""
    items = [item.strip() for item in text.split(",")]
    if not items or any(not item for item in items):
        raise ValueError(f"{flag}: expected a comma-separated list, got {text!r}")
    repeated = sorted({item for item in items if items.count(item) > 1})
    if repeated:
        raise ValueError(f"{flag}: {', '.join(repeated)} given twice")
    return items


def parse_seeds(text: str) -> tuple[int, ...]:
    """``"0,1,2"`` -> ``(0, 1, 2)`` (ValueError: not non-negative integers)."""
    seeds = []
    for item in parse_list(text, "--seeds"):
        if not item.isdigit():
            raise ValueError(f"--seeds: {item!r} is not a non-negative integer (e.g. 0,1,2)")
        seeds.append(int(item))
    return tuple(seeds)


def run_dir(out: str | os.PathLike, variant: str, seed: int) -> pathlib.Path:
    """Where the run of ``variant`` and ``seed`` trains: ``OUT/VARIANT/seedN``."""
    return pathlib.Path(out) / variant / f"seed{seed}"


def cell_argv(
    config: str | None, variant: Variant, seed: int, out: str | os.PathLike, overrides
) -> list[str]:
    """The ``jaxrl-llm train`` arguments of one run: the config, the user's overrides, then
    the variant's, the seed and the run directory."""
    return [
        *([config] if config is not None else []),
        *overrides,
        *variant.argv(),
        f"seed={seed}",
        f"run_dir={os.fspath(run_dir(out, variant.name, seed))}",
        "resume=true",
        "logging.progress=false",
    ]


def check_variants(config: str | None, variants: Sequence[Variant], overrides) -> None:
    """Every variant's config passes an RL run's checks (``check_config``), before any
    training.

    Raises:
      ValueError / FileNotFoundError: a bad config, override or variant (named).
    """
    from jaxrl_llm.train.cli import resolve_job  # noqa: PLC0415
    from jaxrl_llm.train.config_io import load_config  # noqa: PLC0415
    from jaxrl_llm.train.rl.config import TrainConfig, check_config  # noqa: PLC0415

    for override in overrides:
        key = override.partition("=")[0].strip()
        if key in SWEEP_KEYS:
            raise ValueError(
                f"override {override!r}: the sweep sets {key} for each run "
                "(--presets, --seeds, --out)"
            )
    if resolve_job(config, overrides) != "rl":
        raise ValueError("jaxrl-llm sweep trains RL jobs: the config's job must be rl")
    for variant in variants:
        cfg = load_config(TrainConfig, config, [*overrides, *variant.argv()])
        try:
            check_config(cfg)
        except ValueError as err:
            raise ValueError(f"variant {variant.name!r}: {err}") from None


@dataclasses.dataclass(frozen=True)
class Outcome:
    """How one run of the sweep went.

    Attributes:
      variant, seed: the cell.
      run_dir: its run directory.
      status: ``"reused"`` (finished before), ``"trained"`` or ``"failed"``.
      detail: for a failed run, its exit status, last ``error:`` line and log path.
    """

    variant: str
    seed: int
    run_dir: pathlib.Path
    status: str
    detail: str = ""


def _last_error(log_path: pathlib.Path) -> str:
    lines = log_path.read_text(encoding="utf-8", errors="replace").splitlines()
    errors = [line for line in lines if line.startswith("error:")]
    if errors:
        return errors[-1]
    return next((line for line in reversed(lines) if line.strip()), "(no output)")


def finished(config, variant: Variant, seed: int, out, overrides) -> bool:
    """Whether the cell's run finished (its ``summary.json`` holds the evaluation after RL).

    Raises:
      ValueError: it finished with another command than this cell's (``OUT/VARIANT/seedN.json``).
    """
    where = run_dir(out, variant.name, seed)
    if finished_summary(where) is None:
        return False
    record = where.parent / f"seed{seed}.json"
    saved = json.loads(record.read_text(encoding="utf-8")) if record.is_file() else None
    if saved is not None and saved != ["train", *cell_argv(config, variant, seed, out, overrides)]:
        raise ValueError(
            f"{where} finished with another command ({record}); choose another --out or "
            "remove the run to retrain it"
        )
    return True


def _train(where: pathlib.Path, argv: list[str]) -> tuple[str, str]:
    """Runs ``jaxrl-llm ARGV`` into ``where`` (its command kept in ``where``'s ``.json``, its
    output in its ``.log``): ``("trained", "")`` or ``("failed", detail)``.

    Raises:
      KeyboardInterrupt: the run stopped on Ctrl-C (exit 130).
    """
    where.parent.mkdir(parents=True, exist_ok=True)
    (where.parent / f"{where.name}.json").write_text(json.dumps(argv) + "\n", encoding="utf-8")
    log_path = where.parent / f"{where.name}.log"
    with open(log_path, "a", encoding="utf-8") as log:
        log.write(f"$ jaxrl-llm {' '.join(argv)}\n")
        log.flush()
        code = subprocess.call(
            [sys.executable, "-m", "jaxrl_llm.cli", *argv], stdout=log, stderr=subprocess.STDOUT
        )
    if code == INTERRUPTED_EXIT:  # the run stopped on Ctrl-C, with a checkpoint
        raise KeyboardInterrupt
    if code != 0 or finished_summary(where) is None:
        return "failed", f"exit {code}: {_last_error(log_path)} (log: {log_path})"
    return "trained", ""


def run_cell(config, variant: Variant, seed: int, out, overrides) -> Outcome:
    """Trains one cell in a subprocess (or reuses its finished run).

    Raises:
      ValueError: the cell's finished run was trained with another command.
      KeyboardInterrupt: the run stopped on Ctrl-C (exit 130).
    """
    where = run_dir(out, variant.name, seed)
    if finished(config, variant, seed, out, overrides):
        return Outcome(variant.name, seed, where, "reused")
    status, detail = _train(where, ["train", *cell_argv(config, variant, seed, out, overrides)])
    return Outcome(variant.name, seed, where, status, detail)


def warmup_dir(out: str | os.PathLike, seed: int) -> pathlib.Path:
    """Where seed ``seed``'s shared warm-up trains: ``OUT/_warmup/seedN``."""
    return pathlib.Path(out) / WARMUP_DIR / f"seed{seed}"


def warmup_argv(config: str | None, seed: int, out, overrides) -> list[str]:
    """The ``jaxrl-llm train`` arguments of a seed's shared warm-up: the config and the user's
    overrides (the config's objective: the warm-up does not use it), the seed, and no RL step
    (``trainer.max_steps=0``: warm up, evaluate, export ``hf/``)."""
    return [
        *([config] if config is not None else []),
        *overrides,
        f"seed={seed}",
        f"run_dir={os.fspath(warmup_dir(out, seed))}",
        "resume=true",
        "logging.progress=false",
        "trainer.max_steps=0",
    ]


def from_warmup(out: str | os.PathLike, seed: int) -> list[str]:
    """The overrides that start a variant's RL from seed ``seed``'s shared warm-up."""
    return [f"model.path={os.fspath(warmup_dir(out, seed) / 'hf')}", "sft_warmup.steps=0"]


def run_warmup(config, seed: int, out, overrides) -> Outcome:
    """Trains seed ``seed``'s shared warm-up (or reuses it: finished with the same command).

    Raises:
      ValueError: it finished with another command.
      KeyboardInterrupt: it stopped on Ctrl-C (exit 130).
    """
    where = warmup_dir(out, seed)
    argv = ["train", *warmup_argv(config, seed, out, overrides)]
    if finished_summary(where) is not None:
        record = where.parent / f"seed{seed}.json"
        saved = json.loads(record.read_text(encoding="utf-8")) if record.is_file() else None
        if saved is not None and saved != argv:
            raise ValueError(
                f"{where} (a shared warm-up) finished with another command ({record}); choose "
                "another --out or remove it to retrain"
            )
        return Outcome(WARMUP_DIR, seed, where, "reused")
    status, detail = _train(where, argv)
    return Outcome(WARMUP_DIR, seed, where, status, detail)


def warms_up(config: str | None, overrides) -> bool:
    """Whether the config's RL runs start with an SFT warm-up (what ``--warmup shared``
    shares).

    Raises:
      ValueError: ``model.lora`` with a warm-up (its export is an adapter, which
        ``model.path`` cannot start from: use ``--warmup each``).
    """
    from jaxrl_llm.train import setup  # noqa: PLC0415  (imports JAX)
    from jaxrl_llm.train.config_io import load_config  # noqa: PLC0415
    from jaxrl_llm.train.rl.config import TrainConfig  # noqa: PLC0415
    from jaxrl_llm.train.rl.warmup import SFT_WARMUP_STEPS_BUILTIN  # noqa: PLC0415

    cfg = load_config(TrainConfig, config, list(overrides))
    if setup.sft_warmup_steps(cfg, SFT_WARMUP_STEPS_BUILTIN) == 0:
        return False
    if cfg.model.lora is not None:
        raise ValueError(
            "--warmup shared: a LoRA run's warm-up exports an adapter, not a model to start "
            "from; use --warmup each"
        )
    return True


def sweep(
    config: str | None,
    variants: Sequence[Variant],
    seeds: Sequence[int],
    out: str | os.PathLike,
    overrides: Sequence[str] = (),
    *,
    jobs: int = 1,
    train: bool = True,
    progress=None,
    share_warmup: bool = False,
) -> list[Outcome]:
    """Trains (or reuses) every variant × seed; returns the outcomes in that order (with
    ``share_warmup``, each seed's warm-up first).

    Args:
      config: the YAML config (None: the built-in task).
      variants: from :func:`parse_variant`.
      seeds: the seeds.
      out: the sweep's directory.
      overrides: ``dotted.key=value`` for every run.
      jobs: runs at once.
      train: False: only read what is there (a missing run counts as failed).
      progress: called with each :class:`Outcome` as it comes.
      share_warmup: train each seed's warm-up once (:func:`run_warmup`) and start every
        variant of the seed from it (:func:`from_warmup`); a seed whose warm-up failed fails
        its cells without training them.
    """
    cells = [(v, s) for v in variants for s in seeds]
    per_seed = {s: list(overrides) + (from_warmup(out, s) if share_warmup else []) for s in seeds}
    if not train:
        outcomes = []
        for v, s in cells:
            where = run_dir(out, v.name, s)
            done = finished_summary(where) is not None
            status, detail = ("reused", "") if done else ("failed", "no finished run")
            outcomes.append(Outcome(v.name, s, where, status, detail))
        return outcomes
    for v, s in cells:  # a stale finished run is refused before anything trains
        finished(config, v, s, out, per_seed[s])
    stopping = threading.Event()
    warmed: dict[int, Outcome] = {}

    def guarded(fn, *args) -> Outcome:
        if stopping.is_set():  # interrupted: no run starts
            raise KeyboardInterrupt
        try:
            return fn(*args)
        except KeyboardInterrupt:
            stopping.set()
            raise

    def cell(variant: Variant, seed: int) -> Outcome:
        warmup = warmed.get(seed)
        if warmup is not None and warmup.status == "failed":
            where = run_dir(out, variant.name, seed)
            return Outcome(variant.name, seed, where, "failed", f"warm-up failed: {warmup.detail}")
        return guarded(run_cell, config, variant, seed, out, per_seed[seed])

    pool = concurrent.futures.ThreadPoolExecutor(max_workers=jobs)
    outcomes = []

    def collect(futures) -> list[Outcome]:
        done = []
        for future in futures:
            done.append(future.result())
            if progress is not None:
                progress(done[-1])
        return done

    try:
        if share_warmup:
            futures = [pool.submit(guarded, run_warmup, config, s, out, overrides) for s in seeds]
            for outcome in collect(futures):
                warmed[outcome.seed] = outcome
                outcomes.append(outcome)
        outcomes += collect([pool.submit(cell, v, s) for v, s in cells])
    except BaseException:  # Ctrl-C: the runs under way stop with a checkpoint, none starts
        stopping.set()
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    pool.shutdown()
    return outcomes


def describe_variants() -> str:
    """The presets and stabilisers a variant can name, and the default bake-off (``--list``)."""
    from jaxrl_llm import objectives  # noqa: PLC0415

    lines = ["presets: " + ", ".join(objectives.available()), "stabilisers (PRESET+NAME):"]
    for name, stabiliser in STABILISERS.items():
        fields = ", ".join(f"{k}={json.dumps(v)}" for k, v in stabiliser.overrides)
        lines.append(f"  {name:20s} {fields}: {stabiliser.what}")
    lines.append("default --presets: " + ",".join(BAKE_OFF))
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jaxrl-llm sweep",
        description="Train every objective variant x seed on one config (one run directory "
        "each, resumable) and write a table and a plot comparing them: held-out accuracy "
        "gain with its 95% t-interval over seeds, steps to a threshold, time per step, "
        "entropy collapse, gradient-norm spikes, clip fractions.",
        epilog="Variants: a preset (grpo) or a preset with stabilisers (grpo+kl_cov, "
        "dapo+m2po+top_entropy); --list shows them. Overrides apply to every run, e.g. "
        "trainer.max_steps=100 sft_warmup.steps=2000.",
    )
    parser.add_argument(
        "config", nargs="?", default=DEFAULT_CONFIG, help=f"YAML config (default {DEFAULT_CONFIG})"
    )
    parser.add_argument("overrides", nargs="*", help="dotted.key=value overrides for every run")
    parser.add_argument(
        "--presets",
        default=",".join(BAKE_OFF),
        help="comma-separated variants (default: every trainable preset and every stabiliser "
        "on grpo)",
    )
    parser.add_argument(
        "--seeds",
        default=",".join(map(str, DEFAULT_SEEDS)),
        help="comma-separated seeds (default 0,1,2)",
    )
    parser.add_argument("--out", default="runs/sweep", help="output directory (default runs/sweep)")
    parser.add_argument(
        "--threshold",
        type=float,
        default=DEFAULT_THRESHOLD,
        help="steps to threshold: the first evaluation at least this many accuracy points "
        "above the warm-up's (default 20)",
    )
    parser.add_argument("--jobs", type=int, default=1, help="runs at once (default 1)")
    parser.add_argument(
        "--warmup",
        choices=WARMUP_MODES,
        default="shared",
        help="shared (default): each seed's SFT warm-up trains once, under OUT/_warmup, and "
        "its variants start RL from it; each: every run warms up on its own",
    )
    parser.add_argument(
        "--report-only",
        action="store_true",
        help="train nothing: write the report from the runs already under --out",
    )
    parser.add_argument("--list", action="store_true", help="list presets and stabilisers")
    return parser


def _config_arg(args) -> tuple[str | None, list[str]]:
    config, overrides = args.config, list(args.overrides)
    if config is not None and "=" in config:  # overrides only: the default config
        config, overrides = DEFAULT_CONFIG, [config, *overrides]
    return config, overrides


def sweep_main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``jaxrl-llm sweep`` (exit 0; 1: some run failed; 2: bad input)."""
    args = _parser().parse_intermixed_args(list(sys.argv[1:] if argv is None else argv))
    quiet_start()
    if args.list:
        print(describe_variants())
        return 0
    from jaxrl_llm.train.sweep_report import (  # noqa: PLC0415
        PLOT_FILE,
        TABLE_FILE,
        markdown_table,
        write_report,
    )

    try:
        config, overrides = _config_arg(args)
        if args.jobs < 1:
            raise ValueError(f"--jobs must be >= 1, got {args.jobs}")
        variants = [parse_variant(name) for name in parse_list(args.presets, "--presets")]
        seeds = parse_seeds(args.seeds)
        share = False
        if not args.report_only:
            check_variants(config, variants, overrides)
            share = args.warmup == "shared" and warms_up(config, overrides)

        def progress(outcome: Outcome) -> None:
            name = "warm-up" if outcome.variant == WARMUP_DIR else outcome.variant
            line = f"{name} seed {outcome.seed}: {outcome.status} ({outcome.run_dir})"
            print(line if not outcome.detail else f"{line}: {outcome.detail}", file=sys.stderr)

        outcomes = sweep(
            config,
            variants,
            seeds,
            args.out,
            overrides,
            jobs=args.jobs,
            train=not args.report_only,
            progress=progress,
            share_warmup=share,
        )
    except USER_ERRORS as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(
            "interrupted; the same command resumes the sweep (finished runs are reused, "
            "unfinished ones continue from their last checkpoint)",
            file=sys.stderr,
        )
        return 130
    cells = [o for o in outcomes if o.variant != WARMUP_DIR]
    report = write_report(args.out, _as_mapping(cells), threshold=args.threshold)
    print(markdown_table(report), end="")
    out = pathlib.Path(args.out)
    print(f"table: {out / TABLE_FILE}; plot: {out / PLOT_FILE}", file=sys.stderr)
    failed = [o for o in outcomes if o.status == "failed"]
    for outcome in failed:
        name = "warm-up" if outcome.variant == WARMUP_DIR else outcome.variant
        print(f"failed: {name} seed {outcome.seed}: {outcome.detail}", file=sys.stderr)
    return 1 if failed else 0


def _as_mapping(outcomes: Sequence[Outcome]) -> Mapping[str, Mapping[int, pathlib.Path]]:
    cells: dict[str, dict[int, pathlib.Path]] = {}
    for outcome in outcomes:
        cells.setdefault(outcome.variant, {})[outcome.seed] = outcome.run_dir
    return cells


__all__ = [
    "BAKE_OFF",
    "STABILISERS",
    "Outcome",
    "Stabiliser",
    "Variant",
    "cell_argv",
    "check_variants",
    "describe_variants",
    "finished",
    "from_warmup",
    "parse_list",
    "parse_seeds",
    "parse_variant",
    "run_cell",
    "run_dir",
    "run_warmup",
    "sweep",
    "sweep_main",
    "warms_up",
    "warmup_argv",
    "warmup_dir",
]
