"""The real-model recipe (configs/qwen2.5-0.5b-gsm8k-grpo.yaml) on a tiny local Qwen2 checkpoint.

The config is used as written -- a Hugging Face checkpoint directory, JSONL train / eval files,
the chat template with its system prompt, KL to a frozen reference, minibatches and
micro-batches -- with paths pointed at files built here (a random transformers Qwen2 model and
a character tokenizer saved beside it) and sizes shrunk so that it runs on a CPU.
"""

from __future__ import annotations

import json
import pathlib

import pytest

from jaxrl_llm import data
from jaxrl_llm.train.metrics import read_metrics
from jaxrl_llm.train.rl.trainer import RLTrainer
from tests.models import hf_utils
from tests.train.rl import rl_helpers

CONFIG = rl_helpers.CONFIGS / "qwen2.5-0.5b-gsm8k-grpo.yaml"
# Printable ASCII without tabs and line breaks: covers the system prompt and the questions.
ALPHABET = hf_utils.PRINTABLE_ALPHABET

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", autouse=True)
def _compilation_cache(tmp_path_factory):
    with rl_helpers.persistent_compilation_cache(tmp_path_factory.getbasetemp() / "jax_cache"):
        yield


def _write_jsonl(path: pathlib.Path, pairs) -> str:
    with open(path, "w", encoding="utf-8") as f:
        for a, b in pairs:
            f.write(json.dumps({"prompt": f"What is {a} + {b}?", "answer": str(a + b)}) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory) -> pathlib.Path:
    """A random Qwen2 checkpoint whose token ids agree with the saved character tokenizer."""
    path = tmp_path_factory.mktemp("tiny-qwen2")
    hf_utils.build_char_checkpoint("qwen2", path, ALPHABET)
    return path


def test_real_model_recipe_runs_on_a_tiny_local_checkpoint(tmp_path, checkpoint_dir):
    train = _write_jsonl(tmp_path / "train.jsonl", [(a, 2 * a + 1) for a in range(24)])
    test = _write_jsonl(tmp_path / "test.jsonl", [(a, 3) for a in range(6)])
    run_dir = tmp_path / "run"
    cfg = rl_helpers.tiny_config(
        CONFIG,
        run_dir,
        f"model.path={checkpoint_dir}",
        "model.compute_dtype=float32",
        f"data.train_path={train}",
        f"data.eval_path={test}",
        "data.eval_size=4",
        "rollout.prompts_per_step=4",
        "rollout.group_size=2",
        "rollout.max_new_tokens=8",
        "trainer.max_steps=2",
        "trainer.minibatches=2",
        "trainer.micro_batches=2",
        "trainer.eval_every=2",
        "checkpoint.every_steps=1",
    )
    # What the test relies on from the YAML itself.
    assert cfg.data.task == "jsonl" and cfg.data.chat_template and cfg.data.system_prompt
    assert cfg.objective.name == "grpo" and cfg.objective.overrides == {"kl_coef": 0.001}
    assert cfg.sft_warmup.steps == 0

    trainer = RLTrainer(cfg)
    summary = trainer.fit()

    assert trainer.run.model_config.vocab_size == len(ALPHABET) + len(data.SPECIAL_TOKENS)
    assert len(trainer.run.train_examples) == 24 and len(trainer.run.eval_examples) == 4
    (prompt,) = trainer.run.prompts(trainer.run.eval_examples[:1])
    assert prompt.startswith("<|system|>" + cfg.data.system_prompt)
    assert prompt.endswith("<|user|>What is 0 + 3?<|assistant|>")

    rl_helpers.check_run_dir(run_dir, cfg, summary)
    rows = read_metrics(run_dir)
    rl_helpers.check_rows(rows, cfg, vocab_size=trainer.run.model_config.vocab_size)
    assert "kl" in rows[0] and abs(rows[0]["kl"]) < 1e-5
    assert "eval/accuracy" in rows[1]
