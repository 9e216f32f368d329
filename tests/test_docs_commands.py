"""Every command README.md and docs/ show is run (issue 46, item 4), as a user would type it
in a fresh directory, with small overrides appended so it takes seconds.

The commands are read from the pages themselves: every line of a ``bash`` block (``\\``
continuations joined, comments dropped, ``&&`` chains split) and every inline code span that
starts with ``jaxrl-llm`` or ``python examples/``. Each must be listed here, so a command added
to the docs fails this test until it is run:

- ``RUNS``: run in a scratch directory that holds what the docs assume (``configs/``,
  ``examples/``, a user's ``my_pkg/rewards.py``, GSM8K and MATH files, a local Hugging Face
  checkpoint standing in for ``/models/Qwen2.5-0.5B-Instruct``); a run a later command reads
  (``runs/default``, ``runs/reward_model/hf``, ``data/gsm8k``) is made by the documented
  command that makes it. Each must exit 0 with no traceback and no ``error:`` line.
- ``SYNOPSES``: usage lines with placeholders (``RUN_DIR``, ``[--step N]``), each run as the
  concrete command listed beside it.
- ``ELSEWHERE``: what cannot run here, with the reason (installs, other machines' launchers,
  the two-process launch that ``tests/train/rl/test_multihost.py`` runs from the README's own
  block).

Train commands get ``SMALL_RL`` / ``SMALL_PREFERENCE`` appended, minus any key the command
sets itself (its own settings are what is being shown), except ``FORCED``: every run is one
step, whatever step count it shows.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import io
import json
import os
import pathlib
import re
import shlex
import sys
from unittest import mock

import pytest

from jaxrl_llm import cli
from tests.models import hf_utils
from tests.train import helpers

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PROGRAMS = ("jaxrl-llm ", "python examples/")
# A bare subcommand named in prose ("`jaxrl-llm plan` compiles ...") is a name, not a command.
MENTION = re.compile(r"^jaxrl-llm (plan|generate|eval)$")
MODEL_PATH = "/models/Qwen2.5-0.5B-Instruct"

pytestmark = pytest.mark.slow


def _commands(text: str) -> list[str]:
    found = []
    for block in re.findall(r"^```(?:bash|sh|shell)\n(.*?)^```", text, re.M | re.S):
        block = re.sub(r"\\\n\s*", " ", block)
        if re.search(r"^for .*; do$", block, re.M):  # a shell loop is one command
            found.append(" ".join(block.split()))
            continue
        for line in block.splitlines():
            line = re.sub(r"(^|\s)#.*$", "", line).strip()
            parts = [line] if '"' in line else line.split("&&")  # not inside a quoted command
            found.extend(" ".join(part.split()) for part in parts if part.strip())
    prose = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    for span in re.findall(r"`([^`]+)`", prose):
        span = " ".join(span.split())
        runs_ours = span.startswith(PROGRAMS) or " jaxrl-llm " in span
        if runs_ours and not MENTION.match(span):
            found.append(span)
    return found


def documented() -> dict[str, list[str]]:
    """Command -> the pages that show it, in order of first appearance."""
    shown: dict[str, list[str]] = {}
    for page in PAGES:
        for command in _commands(page.read_text(encoding="utf-8")):
            shown.setdefault(command, []).append(page.name)
    return shown


@dataclasses.dataclass(frozen=True)
class Run:
    """A documented command run here: ``extra`` appended where the command does not set the
    key, ``force`` appended whatever it sets; ``needs``: commands run first."""

    extra: tuple[str, ...] = ()
    needs: tuple[str, ...] = ()
    force: tuple[str, ...] = ()


FORCED = ("trainer.max_steps=1",)
SMALL_RL = (
    "sft_warmup.steps=2",
    "data.num_train=64",
    "data.eval_size=8",
    "rollout.prompts_per_step=4",
    "rollout.group_size=2",
    "trainer.minibatches=1",
    "trainer.micro_batches=1",
    "trainer.eval_every=1",
    "trainer.eval_k=1",
    "checkpoint.every_steps=1",
    "logging.progress=false",
    "mesh.fsdp=1",
)
SMALL_PREFERENCE = (
    "sft_warmup.steps=0",
    "data.num_train=16",
    "data.eval_size=8",
    "trainer.batch_size=8",
    "trainer.eval_every=1",
    "logging.progress=false",
    "mesh.fsdp=1",
)
# The recipe for a real model, on the local stand-in: short prompts and completions.
SMALL_REAL = (
    "data.max_prompt_tokens=96",
    "rollout.max_new_tokens=8",
    "model.compute_dtype=float32",
)

DEFAULT = "jaxrl-llm train"
PLAN = (
    "jaxrl-llm plan configs/grpo.yaml --topology v5litepod-16 model.architecture=qwen2.5-7b "
    "rollout.prompts_per_step=32 data.max_prompt_tokens=512 rollout.max_new_tokens=1024 "
    "model.remat=layer mesh.fsdp=8 mesh.tensor=2 trainer.micro_batches=8 "
    "trainer.optimizer_state_dtype=bfloat16 --json plan.json"
)
PLAN_SMALL = (
    f"model.architecture={MODEL_PATH}",  # the local stand-in's config.json: 2 layers, 4 heads
    "rollout.prompts_per_step=8",
    "rollout.max_new_tokens=16",
    "data.max_prompt_tokens=16",
    "trainer.micro_batches=1",
)
REWARD_MODEL = "jaxrl-llm train configs/reward_model.yaml"
GSM8K_HF = (
    "python examples/gsm8k_to_hf.py --train gsm8k/train.jsonl --test gsm8k/test.jsonl "
    "--out data/gsm8k"
)
LORA = "jaxrl-llm train model.lora.rank=16 trainer.learning_rate=5e-4"
OFF_POLICY = "'objective.overrides={rollout_correction: {is_level: token}}'"

# A sweep shown with its variants and seeds runs one variant, one seed, one small step, with
# no warm-up (the shared warm-up is tests/train/test_sweep.py's tiny sweep's).
SMALL_SWEEP = (
    "--seeds",
    "0",
    *(x for x in SMALL_RL if not x.startswith("sft_warmup.steps=")),
    "sft_warmup.steps=0",
    *FORCED,
)

RUNS: dict[str, Run] = {
    DEFAULT: Run(),
    "jaxrl-llm train --debug": Run(("run_dir=runs/debug",)),
    "jaxrl-llm train seed=1": Run(("run_dir=runs/seed1",)),
    "jaxrl-llm train rollout.engine=continuous": Run(("run_dir=runs/continuous",)),
    LORA: Run(("run_dir=runs/lora",)),
    "jaxrl-llm train model.compute_dtype=bfloat16": Run(("run_dir=runs/bf16",)),
    "jaxrl-llm train model.tiny.experts=8 model.tiny.experts_per_token=2": Run(
        ("run_dir=runs/moe",)
    ),
    # Both pages' DAPO commands write runs/dapo: a second run there would need resume=true.
    "jaxrl-llm train configs/dapo.yaml trainer.max_steps=50 seed=1": Run(("run_dir=runs/dapo1",)),
    "jaxrl-llm train configs/dapo.yaml trainer.max_steps=50 run_dir=runs/dapo seed=1": Run(),
    "jaxrl-llm train configs/ppo.yaml": Run(),
    "jaxrl-llm train configs/prime.yaml": Run(),
    "jaxrl-llm train configs/dpo.yaml loss.loss_type=ipo": Run(),
    REWARD_MODEL: Run(),
    "jaxrl-llm train configs/grpo.yaml reward_model.path=runs/reward_model/hf": Run(
        ("run_dir=runs/grpo_rm",), needs=(REWARD_MODEL,)
    ),
    "jaxrl-llm train configs/grpo.yaml 'rewards=[{name: my_pkg.rewards:score}]'": Run(
        ("run_dir=runs/grpo_mine",)
    ),
    GSM8K_HF: Run(),
    "python examples/math_to_hf.py --train MATH/train --test MATH/test --out data/math": Run(),
    f"jaxrl-llm train configs/qwen2.5-0.5b-gsm8k-grpo.yaml model.path={MODEL_PATH} "
    "data.task=hf data.path=data/gsm8k data.eval_split=test data.train_path=null "
    "data.eval_path=null": Run((*SMALL_REAL, "run_dir=runs/gsm8k_hf"), needs=(GSM8K_HF,)),
    f"jaxrl-llm train configs/qwen2.5-0.5b-gsm8k-grpo.yaml model.path={MODEL_PATH} "
    "data.train_path=gsm8k.jsonl data.eval_path=null": Run((*SMALL_REAL, "run_dir=runs/own")),
    f"jaxrl-llm train configs/qwen2.5-0.5b-gsm8k-grpo.yaml model.path={MODEL_PATH} mesh.fsdp=8": (
        Run((*SMALL_REAL, "data.train_path=gsm8k.jsonl", "data.eval_path=null"))
    ),
    "jaxrl-llm train configs/carry_slips.yaml": Run(),
    "jaxrl-llm train configs/tool_calculator.yaml": Run(),
    "jaxrl-llm train configs/tool_calculator.yaml env.name=null run_dir=runs/no_tool": Run(),
    f"jaxrl-llm train rollout.max_staleness=1 mesh.rollout_devices=4 {OFF_POLICY}": Run(
        ("run_dir=runs/async",)
    ),
    "jaxrl-llm train rollout.max_staleness=1 rollout.partial=true rollout.engine=continuous "
    f"{OFF_POLICY}": Run(("run_dir=runs/partial",)),
    "XLA_FLAGS=--xla_force_host_platform_device_count=8 jaxrl-llm train mesh.data=2 mesh.fsdp=2 "
    "mesh.tensor=2": Run(("run_dir=runs/mesh",)),
    "jaxrl-llm eval runs/default --k 8": Run(needs=(DEFAULT,)),
    "jaxrl-llm generate runs/default/hf --prompts prompts.jsonl --num-samples 8 "
    "--max-new-tokens 256 --out completions.jsonl --slots 64 --engine continuous": Run(
        needs=(DEFAULT,)
    ),
    "jaxrl-llm generate --help": Run(),
    # The README's plan, its layout and flags as shown, on the local stand-in's architecture
    # with short sequences: a plan compiles every program of the job for the TPU (minutes for
    # the 7B; its figures are measured in benchmarks/RESULTS.md, "Pod plans"; tests/plan/
    # checks a real architecture's plan).
    PLAN: Run(force=PLAN_SMALL),
    "jaxrl-llm sweep configs/carry_slips.yaml --presets grpo,dapo,grpo+kl_cov,dapo+m2po "
    "--seeds 0,1,2 --out runs/sweep": Run(force=("--presets", "grpo+kl_cov", *SMALL_SWEEP)),
    "jaxrl-llm sweep --out runs/bakeoff": Run(force=("--presets", "dapo+m2po", *SMALL_SWEEP)),
    "jaxrl-llm sweep --list": Run(),
    "jaxrl-llm bench losses": Run(
        ("--presets", "grpo", "--shapes", "4x16", "--repeats", "5", "--results", "", "--quiet")
    ),
}

SYNOPSES: dict[str, str] = {
    "jaxrl-llm train CONFIG": "jaxrl-llm train configs/ppo.yaml",  # as shown beside it
    "jaxrl-llm plan CONFIG --topology NAME [--json FILE] [overrides]": PLAN,
    "jaxrl-llm export RUN_DIR --merge": "jaxrl-llm export runs/lora --merge",
    "jaxrl-llm export RUN_DIR [--step N] [--out DIR]": (
        "jaxrl-llm export runs/lora --step 1 --out exported_adapter"
    ),
    "jaxrl-llm export RUN_DIR [--step N] [--dtype bfloat16] [--out DIR]": (
        "jaxrl-llm export runs/default --step 1 --dtype bfloat16 --out exported_bf16"
    ),
    "jaxrl-llm eval RUN_DIR": "jaxrl-llm eval runs/lora",
    "jaxrl-llm eval runs/default --k 8 [--samples 16] [--temperature 1.0] [--json eval.json]": (
        "jaxrl-llm eval runs/default --k 8 --samples 16 --temperature 1.0 --json eval.json"
    ),
    'jaxrl-llm generate MODEL_DIR "prompt"': 'jaxrl-llm generate runs/default/hf "12+34="',
}
SYNOPSIS_NEEDS = {"runs/lora": LORA, "runs/default": DEFAULT}

ELSEWHERE: dict[str, str] = {
    "pip install -e .": "the install CI itself runs first",
    'pip install torch==2.13.0 && pip install -e ".[test,tpu]" && pip install --no-deps -r '
    "tests/conformance/requirements-verl.txt && JAXRL_REQUIRE_VERL=1 python -m pytest -q -n 2 "
    "--dist loadfile": "the test command: .ci/run runs exactly it (tests/test_readme.py checks)",
    'gcloud compute tpus tpu-vm ssh my-pod --worker=all --command "cd jaxrl_llm && jaxrl-llm '
    'train configs/qwen2.5-0.5b-gsm8k-grpo.yaml mesh.data=4 mesh.fsdp=8"': "a TPU pod's launcher",
    "srun --ntasks-per-node=1 jaxrl-llm train CONFIG.yaml mesh.data=2 mesh.fsdp=-1": (
        "a SLURM cluster's launcher"
    ),
    "srun --nodes=2 --ntasks-per-node=1 jaxrl-llm train CONFIG.yaml mesh.rollout_devices=8 "
    "rollout.max_staleness=1": "a SLURM cluster's launcher",
    "for i in 0 1; do JAX_COORDINATOR_ADDRESS=127.0.0.1:12355 JAX_NUM_PROCESSES=2 "
    "JAX_PROCESS_ID=$i JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=4 "
    "jaxrl-llm train run_dir=runs/two_hosts mesh.data=2 mesh.fsdp=4 & done; wait": (
        "two processes: tests/train/rl/test_multihost.py runs this block, read from README.md"
    ),
    "JAX_CROSS_HOST_TRANSFER_SOCKET_ADDRESS=$HOST_IP:29700 jaxrl-llm train "
    f"rollout.max_staleness=1 mesh.rollout_devices=4 {OFF_POLICY}": (
        "the sampler on another host: tests/train/rl/test_multihost.py's remote-sampler runs"
    ),
    "tensorboard --logdir runs/grpo/tensorboard": "TensorBoard's own command",
    "wandb login": "W&B's own command",
    "wandb sync runs/grpo/wandb/offline-run-*": "W&B's own command",
}


def test_every_documented_command_is_listed_once():
    shown = documented()
    listed = [*RUNS, *SYNOPSES, *ELSEWHERE]
    assert len(listed) == len(set(listed))
    assert sorted(set(shown) - set(listed)) == [], "documented but not run by this test"
    assert sorted(set(listed) - set(shown)) == [], "listed here but no longer documented"


def test_the_extraction_reads_blocks_spans_and_chains():
    text = (
        "Run `jaxrl-llm train seed=1\nmodel.x=2` or `jaxrl-llm plan`.\n"
        "```bash\n# a comment\npip install -e . && jaxrl-llm train   # trailing\n"
        "jaxrl-llm train a=1 \\\n  b=2\n```\n"
    )
    assert _commands(text) == [
        "pip install -e .",
        "jaxrl-llm train",
        "jaxrl-llm train a=1 b=2",
        "jaxrl-llm train seed=1 model.x=2",
    ]


# -- the scratch directory -----------------------------------------------------------------

GSM8K_ROWS = [
    {"question": f"{a}+{b}?", "answer": f"{a}+{b} = <<{a}+{b}={a + b}>>{a + b}\n#### {a + b}"}
    for a, b in [(1, 2), (3, 4), (5, 6), (7, 1), (2, 2), (9, 3), (4, 4), (6, 1)] * 3
]
MATH_PROBLEM = {
    "problem": "What is $1+1$?",
    "solution": "It is $\\boxed{2}$.",
    "level": "Level 1",
    "type": "Prealgebra",
}


def _jsonl(path: pathlib.Path, rows) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """A user's directory: the repository's configs and examples, their own files."""
    root = tmp_path_factory.mktemp("user")
    (root / "configs").symlink_to(ROOT / "configs")
    (root / "examples").symlink_to(ROOT / "examples")
    (root / "my_pkg").mkdir()
    (root / "my_pkg" / "__init__.py").write_text("")
    (root / "my_pkg" / "rewards.py").write_text(
        "def score(prompt, completion, example):\n"
        "    return float(completion.strip() == example.answer)\n"
    )
    _jsonl(root / "gsm8k" / "train.jsonl", GSM8K_ROWS)
    _jsonl(root / "gsm8k" / "test.jsonl", GSM8K_ROWS[:8])
    _jsonl(
        root / "gsm8k.jsonl",
        [{"prompt": f"{a} + {b} =", "answer": str(a + b)} for a in range(6) for b in range(5)],
    )
    for split in ("train", "test"):
        folder = root / "MATH" / split / "prealgebra"
        folder.mkdir(parents=True)
        (folder / "0.json").write_text(json.dumps(MATH_PROBLEM))
    _jsonl(root / "prompts.jsonl", [{"prompt": "12+34="}, {"prompt": "7-5="}])
    hf_utils.build_char_checkpoint("qwen2", root / "local_model", hf_utils.PRINTABLE_ALPHABET)
    with helpers.persistent_compilation_cache(root / "jax_cache"):
        yield root


def _argv(command: str, extra: tuple[str, ...], workspace: pathlib.Path) -> list[str]:
    words = shlex.split(command.replace(MODEL_PATH, str(workspace / "local_model")))
    while words and re.match(r"^[A-Z_]+=", words[0]):  # an environment prefix
        assert words.pop(0) == "XLA_FLAGS=--xla_force_host_platform_device_count=8"
    set_here = {w.split("=", 1)[0] for w in words if "=" in w and not w.startswith("-")}
    return [*words, *(x for x in extra if x.split("=", 1)[0] not in set_here)]


def _small(argv: list[str]) -> tuple[str, ...]:
    """The small overrides for a ``jaxrl-llm train`` argv (by the config's ``job``)."""
    config = next((a for a in argv[2:3] if a.endswith(".yaml")), None)
    job = "rl"
    if config is not None:
        text = pathlib.Path(config).read_text(encoding="utf-8")
        found = re.search(r"^job:\s*(\w+)", text, re.M)
        job = found.group(1) if found else "rl"
    return SMALL_RL if job == "rl" else SMALL_PREFERENCE


_done: dict[str, tuple[int, str, str]] = {}


def _run(command: str, workspace: pathlib.Path, spec: Run) -> tuple[int, str, str]:
    if command in _done:
        return _done[command]
    for need in spec.needs:
        code, _, err = _run(need, workspace, RUNS[need])
        assert code == 0, f"{need!r} (needed first) failed:\n{err[-3000:]}"
    argv = _argv(command, spec.extra, workspace)
    argv += [word.replace(MODEL_PATH, str(workspace / "local_model")) for word in spec.force]
    if argv[:2] == ["jaxrl-llm", "train"]:
        argv += [
            x for x in _small(argv) if x.split("=", 1)[0] not in {a.split("=")[0] for a in argv}
        ]
        argv += FORCED
    out, err = io.StringIO(), io.StringIO()
    saved_path = list(sys.path)
    with (
        contextlib.chdir(workspace),
        contextlib.redirect_stdout(out),
        contextlib.redirect_stderr(err),
        _children_share_the_cache(argv, workspace),
    ):
        try:
            if argv[0] == "python":
                name = pathlib.Path(argv[1]).stem
                loaded = importlib.util.spec_from_file_location(name, argv[1])
                module = importlib.util.module_from_spec(loaded)
                loaded.loader.exec_module(module)
                code = module.main(argv[2:])
            else:
                code = cli.main(argv[1:])
        except SystemExit as stop:  # --help
            code = stop.code or 0
        finally:
            sys.path[:] = saved_path
    _done[command] = (code, out.getvalue(), err.getvalue())
    return _done[command]


@contextlib.contextmanager
def _children_share_the_cache(argv: list[str], workspace: pathlib.Path):
    """A sweep trains each cell in a ``jaxrl-llm train`` subprocess: give those the session's
    compilation cache (the in-process runs' programs: the sampler, evaluation, warm-up), as
    ``workspace`` gives this process."""
    if argv[:2] != ["jaxrl-llm", "sweep"]:
        yield
        return
    directory = os.environ.get(helpers.SHARED_CACHE_ENV) or workspace / "jax_cache"
    with mock.patch.dict(os.environ, helpers.cache_env(directory)):
        yield


def _check(command: str, code: int, out: str, err: str) -> None:
    assert code == 0, f"{command!r} exited {code}:\n{err[-3000:]}"
    assert "Traceback" not in err, err[-3000:]
    assert not [line for line in err.splitlines() if line.startswith("error:")], err[-3000:]


@pytest.mark.parametrize("command", list(RUNS))
def test_documented_command_runs(command, workspace, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_CACHE", str(workspace / "hf-cache"))
    _check(command, *_run(command, workspace, RUNS[command]))


@pytest.mark.parametrize("synopsis", list(SYNOPSES))
def test_documented_synopsis_runs(synopsis, workspace):
    command = SYNOPSES[synopsis]
    if command in RUNS:  # the documented example of this usage
        _check(command, *_run(command, workspace, RUNS[command]))
        return
    needs = tuple(need for run_dir, need in SYNOPSIS_NEEDS.items() if f" {run_dir}" in command)
    _check(command, *_run(command, workspace, Run(needs=needs)))


def test_ci_runs_the_readme_test_command():
    (install_and_test,) = [c for c in ELSEWHERE if c.startswith("pip install torch")]
    assert install_and_test in (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
