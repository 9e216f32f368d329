"""``jaxrl-llm plan CONFIG --topology NAME [--json FILE] [dotted.key=value ...]``.

Compiles, without a TPU (deviceless, ``libtpu`` only), the programs ``jaxrl-llm train CONFIG``
runs for an RL job on a Cloud TPU slice, and prints a per-chip report: HBM by part against the
chip's capacity, per-program compute / HBM / ICI times, the estimated RL step (roofline and
expected), the update step's MFU (the roofline's upper bound and the expected one), goodput
over real tokens and decode tokens/s (``jaxrl_llm.plan.programs``, ``jaxrl_llm.plan.goodput``;
docs/plan.md).

Exit status: 0 when every program fits, 1 when one does not (the report says what to change),
2 on bad input (unknown topology, config key or architecture, a job that is not RL, no
libtpu) with one ``error:`` line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

EXIT_FITS, EXIT_DOES_NOT_FIT, EXIT_BAD_INPUT = 0, 1, 2
GIB = 1024**3

_PARTS = (
    ("parameters", "params"),
    ("optimizer_state", "optim"),
    ("reference", "ref"),
    ("frozen_base", "base"),
    ("aux_model", "critic/PRM"),
    ("reward_model", "RM"),
    ("teacher", "teacher"),
    ("sampler_weights", "bf16 w"),
    ("kv_cache", "KV"),
    ("inputs", "inputs"),
    ("temporaries", "temps"),
)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jaxrl-llm plan",
        description=(
            "Compile an RL job's programs (policy update, log-prob forwards, rollout prefill "
            "and decode step) for a Cloud TPU topology without one attached, and report per "
            "chip: HBM by part against capacity, compute / HBM / ICI time per program, the "
            "estimated RL step, MFU (roofline bound and expected), goodput and decode "
            "tokens/s. Exit 0: fits, 1: does not fit, "
            "2: bad input."
        ),
        epilog="Example: jaxrl-llm plan configs/grpo.yaml --topology v5litepod-16 "
        "model.architecture=qwen2.5-7b model.remat=layer trainer.micro_batches=4",
    )
    parser.add_argument("config", help="YAML config of an RL job (job: rl)")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value overrides")
    parser.add_argument(
        "--topology",
        required=True,
        help="Cloud TPU type or JAX topology: v5litepod-16, v5e-4, v6e-8, v4-32, v5p-128, "
        "v5e:4x4, v5p:2x2x4, ...",
    )
    parser.add_argument("--json", dest="json_file", help="also write the full report here")
    parser.add_argument(
        "--compile-anyway",
        action="store_true",
        help="compile even when the resident state alone exceeds the chip's HBM",
    )
    parser.add_argument(
        "--lengths-from",
        metavar="RUN_DIR",
        help="an earlier RL run's directory: its metrics.jsonl's completion_length_mean (the "
        "last 10 steps) sets the expected completion length (instead of "
        "rollout.expected_length_fraction)",
    )
    return parser


def _deviceless() -> None:
    """CPU as JAX's platform (the TPU devices come from ``get_topology_desc``), unless the user
    chose one with ``JAX_PLATFORMS``."""
    if "JAX_PLATFORMS" not in os.environ:
        os.environ["JAX_PLATFORMS"] = "cpu"
        import jax  # noqa: PLC0415

        jax.config.update("jax_platforms", "cpu")


def _load(config_path: str | None, overrides: list[str]):
    from jaxrl_llm.train.cli import resolve_job  # noqa: PLC0415
    from jaxrl_llm.train.config_io import load_config  # noqa: PLC0415
    from jaxrl_llm.train.rl.config import TrainConfig  # noqa: PLC0415

    job = resolve_job(config_path, overrides)
    if job != "rl":
        raise ValueError(f"plan supports RL jobs (job: rl); this config runs job {job!r}")
    return load_config(TrainConfig, config_path, overrides)


def plan_main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``jaxrl-llm plan``: 0 fits, 1 does not fit, 2 bad input."""
    try:
        args = _parser().parse_intermixed_args(list(sys.argv[1:] if argv is None else argv))
    except SystemExit as exit_:  # --help (0) or a usage error (2)
        return int(exit_.code or 0)
    config_path, overrides = args.config, list(args.overrides)
    if "=" in config_path and not os.path.isfile(config_path):
        config_path, overrides = None, [config_path, *overrides]
    _deviceless()
    from jaxrl_llm.console import USER_ERRORS, quiet_start  # noqa: PLC0415

    quiet_start()
    from jaxrl_llm.plan.programs import plan_job  # noqa: PLC0415
    from jaxrl_llm.plan.topology import resolve_topology  # noqa: PLC0415

    try:
        spec = resolve_topology(args.topology)
        cfg = _load(config_path, overrides)
        cfg, source = _with_lengths(cfg, args.lengths_from)
        report = plan_job(cfg, spec, compile_anyway=args.compile_anyway, length_source=source)
    except USER_ERRORS as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except RuntimeError as err:
        if "libtpu" not in str(err):  # a compiler failure is a bug to see, not bad input
            raise
        print(f"error: {err}", file=sys.stderr)  # get_devices says how to install it
        return EXIT_BAD_INPUT
    print(format_report(report))
    if args.json_file:
        directory = os.path.dirname(os.path.abspath(args.json_file))
        os.makedirs(directory, exist_ok=True)
        with open(args.json_file, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2, default=_json_default)
            f.write("\n")
    return EXIT_FITS if report["fits"] else EXIT_DOES_NOT_FIT


def _with_lengths(cfg, run_dir: str | None):
    """``(cfg, length_source)``: with ``run_dir``, ``rollout.expected_length_fraction`` from its
    metrics (``goodput.lengths_from_run``); else the config as it is."""
    if run_dir is None:
        return cfg, None
    import dataclasses  # noqa: PLC0415

    from jaxrl_llm.plan.goodput import lengths_from_run  # noqa: PLC0415

    fraction, source = lengths_from_run(run_dir, cfg.rollout.max_new_tokens)
    rollout = dataclasses.replace(cfg.rollout, expected_length_fraction=fraction)
    return dataclasses.replace(cfg, rollout=rollout), source


def _json_default(value: Any) -> Any:
    if hasattr(value, "item"):  # NumPy scalars
        return value.item()
    if isinstance(value, tuple | set | frozenset):
        return list(value)
    return str(value)


def _gib(nbytes: float | None) -> str:
    return "-" if not nbytes else f"{nbytes / GIB:.2f}"


def _ms(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds * 1e3:.2f}" if seconds < 10 else f"{seconds:.1f} s"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(str(c)) for c in column) for column in zip(header, *rows)]
    line = lambda cells: "  ".join(  # noqa: E731
        str(c).ljust(w) if i == 0 else str(c).rjust(w)
        for i, (c, w) in enumerate(zip(cells, widths))
    )
    return [line(header), line(["-" * w for w in widths]), *(line(r) for r in rows)]


def _split_lines(layout: Mapping[str, Any], split: Mapping[str, Any]) -> list[str]:
    mesh = " x ".join(f"{k} {v}" for k, v in layout["mesh"].items())
    where = "processes of its own" if split["sampler_on_hosts_of_its_own"] else "one process"
    sync = split["weight_sync"]
    links = "" if sync["cut_links"] is None else f", {sync['cut_links']} ICI links between them"
    sides = f"rollout {split['rollout_s']:.3g} s, sync {split['weight_sync_s']:.3g} s, trainer "
    sides += f"{split['trainer_s']:.3g} s"
    return [
        f"sampler: {split['sampler_chips']} chips of its own ({where}; the trainer has "
        f"{split['trainer_chips']}), mesh {mesh} (tensor-parallel {layout['tensor']}); after "
        f"each update the trainer casts its weights ({_ms(layout['reshard_s'])} ms) and copies "
        f"{sync['bytes'] / 2**30:.2f} GiB across ({sync['received_bytes_per_chip'] / 2**30:.2f}"
        f" GiB into each sampler chip{links}): {_ms(split['weight_sync_s'])} ms",
        f"RL step with rollout.max_staleness={split['max_staleness']}: {split['step_model']} "
        f"= {split['step_s']:.3g} s ({sides}); the sampler idles {_pct(split['sampler_idle'])}, "
        f"the trainer {_pct(split['trainer_idle'])}",
    ]


def _sampler_line(layout: Mapping[str, Any]) -> str:
    mesh = " x ".join(f"{k} {v}" for k, v in layout["mesh"].items())
    if layout["is_trainer_layout"]:
        return f"sampler: on the trainer's layout (mesh {mesh}), no reshard"
    moved = sum((layout["reshard_collective_bytes"] or {}).values())
    what = "the LoRA adapters" if layout.get("reshard_moves") == "adapters" else "the weights"
    base = (
        f" (the frozen base once per run, {_ms(layout['base_reshard_once_s'])} ms, its copy kept)"
        if layout.get("base_reshard_once_s") is not None
        else ""
    )
    layers = " per layer" if layout.get("decode_layers") == "per_layer" else ""
    return (
        f"sampler: serving layout, mesh {mesh} (tensor-parallel {layout['tensor']}, weights "
        f"in the compute dtype{layers}); reshard of {what} from the trainer's layout once per "
        f"step: {moved / 2**30:.2f} GiB of collectives a chip, {_ms(layout['reshard_s'])} ms{base}"
    )


def _lora_line(model: Mapping[str, Any], layout: Mapping[str, Any]) -> list[str]:
    lora = model.get("lora")
    if not lora:
        return []
    if layout.get("lora_weights") == "merged":
        sampler = f"the sampler decodes merged weights (merge {_ms(layout['merge_s'])} ms a step)"
    else:
        sampler = "the sampler applies the adapters on the fly"
    return [
        f"LoRA: rank {lora['rank']}, alpha {lora['alpha']:g}"
        f"{' (rsLoRA)' if lora.get('rslora') else ''} on {', '.join(lora['targets'])}: "
        f"{lora['adapter_params'] / 1e6:.1f} M adapter parameters trained (the params and "
        f"optim columns); the base frozen in {model['compute_dtype']} (base), also the "
        f"reference; {sampler} (model.lora.sampler)"
    ]


def _moe_lines(moe: Mapping[str, Any] | None) -> list[str]:
    """A mixture-of-experts job's lines (``plan._moe.moe_lines``); none for a dense model."""
    if not moe:
        return []
    from jaxrl_llm.plan._moe import moe_lines  # noqa: PLC0415

    return moe_lines(moe)


def _aux_lines(report: Mapping[str, Any]) -> list[str]:
    lines = []
    critic = report.get("critic")
    if critic:
        start = {
            "policy": "from the policy's backbone",
            "random": "at random",
            "reward_model": f"from the reward model {critic['path']}",
        }.get(critic["init"], critic["init"])
        optimizer = (
            "one optimizer with the policy (trainer.*; the update trains both)"
            if critic["optimizer"] == "joint"
            else "its own optimizer (critic.*)"
        )
        if critic.get("lora"):
            start = (
                "LoRA: its adapters and head trained over "
                + ("the policy's frozen base" if critic["init"] == "policy" else "a frozen ")
                + ("" if critic["init"] == "policy" else f"backbone {start}")
            )
        else:
            start = f"initialised {start}"
        lines.append(
            f"critic: {critic['architecture']}, {critic['params'] / 1e6:.2f} M parameters with "
            f"a scalar head, {start}; {optimizer} (critic/PRM)"
        )
    rm = report.get("reward_model")
    if rm:
        when = (
            "scores each rollout batch inside the rollout (rm_scores)"
            if rm["scores_in_rollout"]
            else "scores each rollout batch once the log-prob forwards are dispatched (rm_scores)"
        )
        lines.append(
            f"reward model: {rm['path']} ({rm['architecture']}, {rm['params'] / 1e6:.2f} M "
            f"parameters in {rm['dtype']}, {_gib(rm['bytes_per_chip'])} GiB a chip: RM), "
            f"kept all run; {when}"
        )
    teacher = report.get("teacher")
    if teacher:
        devices = teacher.get("devices")
        where = (
            f"on {devices} chip(s) of its own (teacher.devices)"
            if devices
            else "on the trainer's chips"
        )
        k = teacher.get("top_k")
        use = (
            "give the distillation advantages"
            if k is None
            else f"and its top-{k} log-probs and ids ([B, T, {k}]) feed the JSD loss"
        )
        lines.append(
            f"teacher: {teacher['path']} ({teacher['architecture']}, "
            f"{teacher['params'] / 1e6:.2f} M parameters in {teacher['dtype']}, "
            f"{_gib(teacher['bytes_per_chip'])} GiB a chip: teacher), kept all run {where}; "
            f"its log-probs of each rollout batch (teacher_logprobs) {use}"
        )
    routing = report.get("routing_replay")
    if routing:
        b, s, layers, k = routing["shape"]
        replayed = ", ".join(routing["replayed_by"]) or "none (the update measures the mismatch)"
        lines.append(
            f"routing replay ({routing['mode']}): the sampler records [B, P + T, L, k] = "
            f"[{b}, {s}, {layers}, {k}] experts ({routing['sampler_dtype']}, "
            f"{_gib(routing['sampler_bytes_per_chip'])} GiB a chip in its state), the trainer "
            f"keeps them as int32 ({_gib(routing['bytes_per_chip'])} GiB a chip, in inputs); "
            f"replayed by: {replayed}"
        )
    return lines


def _expected_lines(report: Mapping[str, Any]) -> list[str]:
    """The roofline's MFU (an upper bound), the expected step and MFU, the length model and
    goodput (``plan.goodput``)."""
    eff, tokens = report["matmul_efficiency"], report["tokens"]
    if eff["value"] is None:
        expected = f"expected RL step: - (matmul efficiency {eff['source']})"
    else:
        expected = (
            f"expected RL step: {_s(report['expected_step_s'])} s at {_pct(eff['value'])} "
            f"matmul efficiency on {eff['generation']} (measured MFU: {eff['source']})"
        )
    f = tokens["expected_length_fraction"]
    return [
        expected,
        f"update step MFU: {_pct(report['roofline_mfu_bound'])} roofline upper bound "
        f"({_pct(report['roofline_mfu_bound_conservative'])} with no overlap), "
        f"{_pct(report['expected_mfu'])} expected; whole RL step: "
        f"{_pct(report['roofline_step_mfu_bound'])} upper bound, "
        f"{_pct(report['expected_step_mfu'])} expected",
        f"tokens a step: {tokens['padded_positions']:,} padded positions, "
        f"{tokens['real_tokens']:,.0f} real ({tokens['prompt_tokens']} a prompt, prompts taken "
        f"as full; completions {f:.2f} x {report['job']['completion_len']}, "
        f"{tokens['length_source']}), {tokens['packed_positions']:,} packed (whole rows)",
        _packing_line(report.get("packing")),
        f"goodput: {_rate(report['goodput_tokens_per_s'])} real tokens/s expected "
        f"({_rate(report['goodput_tokens_per_s_roofline_bound'])} at the roofline, an upper "
        f"bound); MFU over real tokens: {_pct(report['mfu_real_tokens'])} expected "
        f"({_pct(report['mfu_real_tokens_roofline_bound'])} upper bound)",
    ]


def _packing_line(packing: Mapping[str, Any] | None) -> str:
    """Whether the training-side forwards were lowered packed (``trainer.packing``), with
    their packed rows per shard, or why not."""
    if not packing or not packing["packed"]:
        reason = "trainer.packing=off" if not packing else packing["reason"]
        return f"packing: padded programs ({reason})"
    sizes = ", ".join(
        f"{name} {p['packed_rows']} rows ({p['micro_batches']} x {p['shards']} shards x "
        f"{p['rows_per_shard']}) for {p['padded_rows']} padded"
        for name in ("update", "forwards", "prm_update")
        if (p := packing.get(name)) and p["packed"]
    )
    mode = packing["mode"]
    return f"packing: {mode}, packed programs lowered: {sizes} (first-fit at the ceiling)"


def _s(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.3g}"


def _host_lines(programs: Mapping[str, Any]) -> list[str]:
    """The pinned host memory of the programs that keep some there (``model.remat=offload``),
    which the HBM table leaves out."""
    held = {n: p["host_bytes"] for n, p in programs.items() if p.get("host_bytes")}
    if not held:
        return []
    each = ", ".join(f"{name} {_gib(nbytes)}" for name, nbytes in held.items())
    return [
        f"host memory a chip (GiB; model.remat=offload: layer inputs kept on the host between "
        f"forward and backward, not in the HBM totals, their copies not in the times): {each}"
    ]


def format_report(report: Mapping[str, Any]) -> str:
    """The readable per-chip report of ``plan_job``'s dict."""
    model, job, mesh = report["model"], report["job"], report["mesh"]
    programs = report["programs"]
    lines = [
        f"jaxrl-llm plan: {model['name']} ({model['architecture']}, "
        f"{model['params'] / 1e9:.2f} B parameters), {report['objective']} on "
        f"{report['topology']} ({report['jax_topology']}, {report['chips']} chips), mesh "
        + " x ".join(f"{k} {v}" for k, v in mesh.items()),
        f"rollout: {job['prompts']} prompts x {job['group_size']} = {job['rows']} rows, "
        f"{job['prompt_len']} prompt + {job['completion_len']} completion tokens; update: "
        f"{job['epochs']} epoch(s) x {job['minibatches']} minibatch(es) of "
        f"{job['minibatch_rows']} rows, {job['micro_batches']} micro-batch(es), remat "
        f"{job['remat']}; weights {model['param_dtype']}, compute {model['compute_dtype']}, "
        f"AdamW moments {model['optimizer_state_dtype']}",
        *_lora_line(model, report["sampler_layout"]),
        *_moe_lines(report.get("moe")),
        *_aux_lines(report),
        "",
        f"HBM per chip (GiB; the compiler lets a program use {report['hbm_usable_gib']:.2f}, "
        f"Google lists {report['hbm_capacity_gib']:.2f}): everything alive during each program",
    ]
    rows = []
    for name, p in programs.items():
        parts = p["memory_bytes"]
        fits = "yes" if p["fits"] else ("NO" if p["compiled"] else "NO (compile OOM)")
        if report["compile_skipped"]:
            fits = "NO (not compiled)"
        rows.append([name, *(_gib(parts[key]) for key, _ in _PARTS), f"{p['total_gib']:.2f}", fits])
    lines += _table(["program", *(label for _, label in _PARTS), "total", "fits"], rows)
    lines += _host_lines(programs)
    lines += ["", "time per call (ms unless marked s; roofline per chip)"]
    rows = []
    for name, p in programs.items():
        t = p["times"]
        compile_s = p["compile_s"]
        shared = p["shares_compile_of"]
        rows.append(
            [
                name,
                str(p["calls_per_step"]),
                _ms(t["compute_s"]),
                _ms(t["hbm_s"]),
                _ms(t["ici_s"]),
                _ms(t["step_s"]),
                _ms(t["step_conservative_s"]),
                _ms(t["expected_s"]),
                t["bound"] or "-",
                _pct(t["roofline_mfu_bound"]),
                _pct(t["expected_mfu"]),
                f"= {shared}" if shared else ("-" if compile_s is None else f"{compile_s:.1f}"),
            ]
        )
    lines += _table(
        [
            "program",
            "calls",
            "compute",
            "HBM",
            "ICI",
            "step",
            "no overlap",
            "expected",
            "bound",
            "MFU bound",
            "exp. MFU",
            "compile s",
        ],
        rows,
    )
    dominant = report["dominant_program"]
    bound = " at least (compute only: not every program compiled)" * bool(
        report["est_step_is_lower_bound"]
    )
    lines += [
        "",
        f"estimated RL step: {report['est_step_s']:.3g} s{bound} (collectives hidden; "
        f"{report['est_step_conservative_s']:.3g} s with none hidden), "
        f"{dominant} {report['step_breakdown_s'][dominant]:.3g} s of it",
        *_expected_lines(report),
        f"decode: {_rate(report['est_decode_tokens_per_s'])} tokens/s on the slice "
        f"({_rate(report['est_decode_tokens_per_s_conservative'])} with no overlap), every "
        f"row decoding {job['completion_len']} tokens; "
        f"{_pct(report['est_decode_fraction_of_roofline'])} of the HBM roofline "
        f"({_rate(report['est_decode_roofline_tokens_per_s'])} tokens/s: weights and KV cache "
        "read once per step on the serving layout)",
        *(
            _split_lines(report["sampler_layout"], report["split"])
            if report.get("split")
            else [_sampler_line(report["sampler_layout"])]
        ),
        "",
    ]
    if report["fits"]:
        lines.append(
            f"fits: largest program {report['largest_program']} at "
            f"{report['hbm_per_chip_gib']:.2f} GiB a chip, {report['headroom_gib']:.2f} GiB "
            "headroom"
        )
        if report.get("hints"):
            lines.append("faster:")
            lines += [f"  - {h}" for h in report["hints"]]
    else:
        over = [n for n, p in programs.items() if not p["fits"]]
        what = (
            "the resident state alone exceeds the chip (nothing compiled)"
            if report["compile_skipped"]
            else f"{', '.join(over)} over {report['hbm_usable_gib']:.2f} GiB a chip"
        )
        lines.append(f"DOES NOT FIT: {what}. To change:")
        lines += [f"  - {s}" for s in report["suggestions"]]
    return "\n".join(lines)


__all__ = ["format_report", "plan_main"]
