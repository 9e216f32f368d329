"""Every preference loss trains from its config: each DPO loss type, ORPO and CPO for a few
optimizer steps on a tiny model, and SimPO as a whole run of the reference-free path (DPO and
KTO run end to end in test_trainer.py). Each compiles its own programs, so these are
marked slow."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import data, models
from jaxrl_llm.preference import LOSS_TYPES
from jaxrl_llm.train.config_io import load_config
from jaxrl_llm.train.metrics import read_metrics
from jaxrl_llm.train.optim import make_optimizer
from jaxrl_llm.train.preference.config import PreferenceConfig, check_config
from jaxrl_llm.train.preference.losses import make_loss_fn, make_reference_fn
from jaxrl_llm.train.preference.run import run
from jaxrl_llm.train.setup import build_policy
from jaxrl_llm.train.state import TrainState
from jaxrl_llm.train.step import make_step
from jaxrl_llm.types import PreferenceBatch
from tests.train import helpers
from tests.train.preference.preference_helpers import SMALL_MODEL

CONFIGS = helpers.CONFIGS
TINY_RUN = (
    "sft_warmup.steps=0",
    "data.num_train=16",
    "data.eval_size=8",
    "trainer.batch_size=8",
    "trainer.max_steps=2",
    "logging.progress=false",
    "logging.plots=false",
    "logging.tensorboard=false",
    "mesh.fsdp=1",
    *SMALL_MODEL,
)
# Loss types that need a setting to be valid at all.
EXTRA = {"exo_pair": ["loss.label_smoothing=1e-3"]}


@pytest.fixture(scope="module", autouse=True)
def _compilation_cache(tmp_path_factory):
    with helpers.persistent_compilation_cache(tmp_path_factory.getbasetemp() / "jax_cache"):
        yield


@pytest.fixture(scope="module")
def setup():
    """A small policy, its reference log-probs and one batch of 8 synthetic pairs."""
    cfg = load_config(PreferenceConfig, CONFIGS / "dpo.yaml", list(SMALL_MODEL))
    tokenizer, model_config, _ = build_policy(cfg, None)
    params = models.init_params(model_config, jax.random.key(0))
    pairs = data.arithmetic_preference_pairs(8, seed=0)
    arrays, _ = data.encode_pairs(
        tokenizer,
        [p.prompt for p in pairs],
        [p.chosen for p in pairs],
        [p.rejected for p in pairs],
        max_prompt_tokens=16,
        max_completion_tokens=16,
    )
    batch = PreferenceBatch(*(jnp.asarray(x) for x in arrays[:6]))
    ref_chosen, ref_rejected = make_reference_fn(model_config, unpaired=False)(params, batch)
    batch = batch._replace(ref_chosen_logps=ref_chosen, ref_rejected_logps=ref_rejected)
    return model_config, params, batch


@pytest.mark.slow
@pytest.mark.parametrize("loss_type", [*LOSS_TYPES, "orpo", "cpo"])
def test_every_loss_trains_from_config(setup, loss_type):
    model_config, params, batch = setup
    if loss_type in ("orpo", "cpo"):
        cfg = load_config(PreferenceConfig, CONFIGS / f"{loss_type}.yaml", [*SMALL_MODEL])
        batch = batch._replace(ref_chosen_logps=None, ref_rejected_logps=None)
    else:
        overrides = [f"loss.loss_type={loss_type}", *EXTRA.get(loss_type, [])]
        cfg = load_config(PreferenceConfig, CONFIGS / "dpo.yaml", [*SMALL_MODEL, *overrides])
    check_config(cfg)
    optimizer = make_optimizer(1e-2)
    step = jax.jit(make_step(make_loss_fn(cfg, model_config), optimizer, accumulate="mean"))
    state = TrainState(jnp.zeros((), jnp.int32), params, optimizer.init(params), jax.random.key(0))
    history = []
    for _ in range(3):
        state, metrics = step(state, batch)
        history.append({k: float(v) for k, v in metrics.items()})
    for metrics in history:
        assert all(math.isfinite(v) for v in metrics.values()), metrics
    if cfg.loss.name == "dpo":
        assert history[0]["rewards/margins"] == 0.0  # policy = reference before the update
    assert history[0]["grad_norm"] > 0.0
    # The same batch twice more: the loss goes down, and the policy moves towards the chosen
    # answers -- except under DiscoPOP, whose loss at Δ = 0 decreases with a *smaller* margin
    # (dL/dz = 0.78 at z = 0 with τ = 0.05), so it first pushes the margin below 0.
    assert history[-1]["loss"] < history[0]["loss"]
    if loss_type != "discopop":
        assert history[-1]["rewards/margins"] > 0.0
    moved = jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))), state.params, params)
    assert max(jax.tree.leaves(moved)) > 0.0


@pytest.mark.slow
def test_a_reference_free_config_runs(tmp_path):
    name = "simpo"
    cfg = load_config(
        PreferenceConfig, CONFIGS / f"{name}.yaml", [*TINY_RUN, f"run_dir={tmp_path}"]
    )
    summary = run(cfg)
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2]
    keys = ("loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "nll_loss", "nll")
    for row in rows:
        for key in keys:
            assert math.isfinite(row[key]), (key, row)
    # No reference model: nothing but the state is checkpointed, and rewards are β·lp̄.
    assert (tmp_path / "checkpoints").is_dir()
    assert not (tmp_path / "checkpoints" / "reference").exists() or not any(
        (tmp_path / "checkpoints" / "reference").iterdir()
    )
    np.testing.assert_allclose(
        rows[0]["rewards/chosen"], cfg.loss.beta * rows[0]["logps/chosen"], rtol=1e-5
    )
    assert summary["loss"] == name
    assert summary["hf"] == str(tmp_path / "hf")
