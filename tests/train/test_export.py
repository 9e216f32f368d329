"""Every job ends with ``run_dir/hf/``; ``jaxrl-llm export`` writes any kept checkpoint.

The reference is transformers itself: the exported directory is loaded with
``AutoModelForCausalLM`` and its logits are compared with the JAX model's on the checkpoint's
own parameters (restored from orbax, not from the export).
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import data, models
from jaxrl_llm.train import cli, setup
from jaxrl_llm.train.checkpoint import Checkpointer
from jaxrl_llm.train.rl.config import TrainConfig

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

RUN = (
    "sft_warmup.steps=5",
    "trainer.max_steps=2",
    "checkpoint.every_steps=1",
    "data.eval_size=8",
    "data.num_train=100",
    "rollout.prompts_per_step=4",
    "rollout.group_size=4",
    "logging.progress=false",
    "logging.tensorboard=false",
    "mesh.fsdp=1",
    # math_match alone gives an untrained policy all-zero advantages: a length term moves it.
    "rewards=[{name: math_match}, {name: overlong, kwargs: {max_tokens: 6, buffer_tokens: 4}}]",
)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("export") / "run"
    assert cli.train_main([*RUN, f"run_dir={path}"]) == 0
    return path


def _checkpoint_params(run_dir, step):
    checkpointer = Checkpointer(run_dir / "checkpoints", async_save=False)
    state, _ = checkpointer.restore_raw(step)
    checkpointer.close()
    return state["params"]


def _tokens():
    tokenizer = data.build_char_tokenizer(data.ARITHMETIC_ALPHABET)
    rows = [tokenizer("12+7=19")["input_ids"], tokenizer("3-1=2")["input_ids"]]
    width = max(map(len, rows))
    tokens = np.array([r + [tokenizer.pad_token_id] * (width - len(r)) for r in rows], np.int32)
    mask = np.array([[1] * len(r) + [0] * (width - len(r)) for r in rows], np.int32)
    return tokens, mask


def _compare_logits(hf_dir, params, *, atol):
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32)
    tokens, mask = _tokens()
    with torch.no_grad():
        want = model(
            input_ids=torch.tensor(tokens, dtype=torch.long),
            attention_mask=torch.tensor(mask, dtype=torch.long),
        ).logits.numpy()
    config = models.load_config(hf_dir)
    got = np.asarray(
        models.logits(
            jax.tree.map(jnp.asarray, params),
            config,
            jnp.asarray(tokens),
            attention_mask=jnp.asarray(mask),
        )
    )
    valid = mask.astype(bool)
    np.testing.assert_allclose(got[valid], want[valid], atol=atol, rtol=0)


def test_run_leaves_hf_checkpoint_with_the_trained_logits(run_dir):
    hf = run_dir / "hf"
    for name in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json"):
        assert (hf / name).is_file(), name
    assert sorted(p.name for p in (run_dir / "plots").glob("*.png"))
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["hf"].endswith("hf")
    # The final checkpoint is the final policy: transformers on hf/ = JAX on the checkpoint.
    _compare_logits(hf, _checkpoint_params(run_dir, 2), atol=1e-4)
    generation = json.loads((hf / "generation_config.json").read_text())
    tokenizer = data.build_char_tokenizer(data.ARITHMETIC_ALPHABET)
    assert generation["eos_token_id"] == tokenizer.eos_token_id


def test_export_cli_writes_an_older_step_and_bf16(run_dir, tmp_path, capsys):
    out = tmp_path / "step1"
    assert cli.export_main([str(run_dir), "--step", "1", "--out", str(out)]) == 0
    params = _checkpoint_params(run_dir, 1)
    _compare_logits(out, params, atol=1e-4)
    # Step 1 is not the final policy: the export really read the older checkpoint.
    final = _checkpoint_params(run_dir, 2)
    leaves = zip(jax.tree.leaves(params), jax.tree.leaves(final))
    assert any(not np.array_equal(np.asarray(a), np.asarray(b)) for a, b in leaves)
    bf16 = tmp_path / "bf16"
    assert cli.export_main([str(run_dir), "--dtype", "bfloat16", "--out", str(bf16)]) == 0
    config = json.loads((bf16 / "config.json").read_text())
    assert config["torch_dtype"] == "bfloat16"


def test_the_policy_carries_the_prompt_format_it_was_trained_with(run_dir, tmp_path, capsys):
    """``hf/`` (and an export of any step) records that the run prompted raw text, so
    ``jaxrl-llm generate`` does not apply the char tokenizer's chat template (issue 46)."""
    from jaxrl_llm.data.encoding import PromptFormat, read_prompt_format

    assert read_prompt_format(run_dir / "hf") == PromptFormat(chat_template=False)
    out = tmp_path / "step1"
    assert cli.export_main([str(run_dir), "--step", "1", "--out", str(out)]) == 0
    assert read_prompt_format(out) == PromptFormat(chat_template=False)


def test_export_cli_user_errors_exit_2(tmp_path, capsys):
    assert cli.export_main([str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and "config.yaml" in err[0]


def test_tiny_model_config_matches_build_policy():
    cfg = TrainConfig()
    tokenizer, config, _ = setup.build_policy(cfg, None)
    tiny = setup.tiny_model_config(cfg.model, tokenizer, None)
    assert setup.job_model(tiny, setup.resolve_precision(cfg.model)) == config


def test_export_policy_writes_a_multimodal_source_back_whole(tmp_path):
    """A policy trained from a ``Gemma3ForConditionalGeneration`` exports as that wrapper: the
    language model's tensors updated, the vision tower and projector copied through, so
    transformers loads the trained model as the model it was."""
    from safetensors.numpy import load_file  # noqa: PLC0415

    from jaxrl_llm.train import export  # noqa: PLC0415
    from tests.models import hf_utils  # noqa: PLC0415

    source = str(tmp_path / "gemma3_mm")
    hf_utils.build_gemma3_multimodal(source, seed=3)
    config, params = models.load_pretrained(source, dtype=jnp.float32)
    trained = jax.tree.map(lambda x: x + 0.01, params)
    out = export.export_policy(str(tmp_path / "out"), config, trained, None, source=source)
    theirs, ours = (load_file(f"{d}/model.safetensors") for d in (source, out))
    assert set(ours) == set(theirs)
    towers = [k for k in theirs if k.startswith(("vision_tower.", "multi_modal_projector."))]
    assert towers and all(np.array_equal(ours[k], theirs[k]) for k in towers)
    assert not any(np.array_equal(ours[k], theirs[k]) for k in set(theirs) - set(towers))
    with open(f"{out}/config.json") as f:
        assert json.load(f)["architectures"] == ["Gemma3ForConditionalGeneration"]
    # A source that is not a local checkpoint (a hub id, a missing path) changes nothing.
    plain = export.export_policy(str(tmp_path / "plain"), config, trained, None, source="a/b")
    with open(f"{plain}/config.json") as f:
        assert json.load(f)["architectures"] == ["Gemma3ForCausalLM"]
