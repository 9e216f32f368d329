"""``trainer.packing`` in the preference jobs (issue 44, item 1): the update's forward (chosen
and rejected rows packed together; KTO's completions and mismatched ones) and the reference's
run over packed rows and train what the padded run trains.

The reference is the padded run of the same config (whose forward is checked against
transformers elsewhere): two steps of two micro-batches each, float32; every metric of every
step and the weights after the last one agree to float rounding. Each loss reads log-probs
(or, for the reward model, scores) of its own forward, so a plan that put a token in the
wrong place, let attention cross two sequences or scored another row shows in the loss.

One run per packed forward: the pair losses' (DPO with a precomputed reference; IPO with an
on-the-fly reference over eight batch shards), ORPO's with the prompts' log-probs, KTO's
unpaired rows with an on-the-fly reference, the reward model's scores. SimPO and CPO read the
same padded-layout per-token log-probs (``pair_token_logps``, no prompt) as DPO and IPO and
differ only in the loss applied to them, which packing does not touch: they have no run here.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxrl_llm.train import packing as packing_lib
from jaxrl_llm.train.config_io import load_config
from jaxrl_llm.train.metrics import read_metrics
from jaxrl_llm.train.preference import packing as pref_packing
from jaxrl_llm.train.preference.config import PreferenceConfig
from jaxrl_llm.train.preference.trainer import PreferenceTrainer
from tests.train import helpers
from tests.train.preference.preference_helpers import SMALL_MODEL, TINY

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", autouse=True)
def _compilation_cache(tmp_path_factory):
    with helpers.persistent_compilation_cache(tmp_path_factory.getbasetemp() / "jax_cache"):
        yield


class Recording(PreferenceTrainer):
    """A preference run recording ``(micro-batches, shards)`` of every plan it makes (None:
    padded)."""

    def _packed(self, host, batch, micro_batches):
        out = super()._packed(host, batch, micro_batches)
        plan = getattr(out, "packing", None)
        self.__dict__.setdefault("plans", []).append(
            None if plan is None else plan.source.shape[:2]
        )
        return out


def _run(path, packing, name, *extra):
    cfg = load_config(
        PreferenceConfig,
        helpers.CONFIGS / name,
        [
            *TINY,
            *SMALL_MODEL,
            f"run_dir={path}",
            "trainer.max_steps=2",
            "trainer.micro_batches=2",
            "checkpoint.every_steps=1000",
            "model.compute_dtype=float32",
            # Adam moves a weight whose gradient is ~0 by up to lr on rounding noise alone: a
            # small rate keeps the weights' 1e-5 bound meaningful.
            "trainer.learning_rate=1e-3",
            f"trainer.packing={packing}",
            *extra,
        ],
    )
    trainer = Recording(cfg)
    trainer.fit()
    params = jax.device_get(trainer.state.params)
    return trainer, read_metrics(path), params


@pytest.mark.parametrize(
    ("name", "extra"),
    [
        ("dpo.yaml", ()),  # precomputed reference
        ("kto.yaml", ("loss.reference=on_the_fly",)),
        ("orpo.yaml", ("loss.orpo_nll=prompt_and_completion",)),
        ("reward_model.yaml", ()),
        # Eight batch shards (fsdp 4 x data 2): each packs its own block of forward rows.
        (
            "dpo.yaml",
            (
                "loss.reference=on_the_fly",
                "loss.loss_type=ipo",
                "mesh.data=2",
                "mesh.fsdp=4",
                "trainer.batch_size=16",
            ),
        ),
    ],
    ids=["dpo", "kto_on_the_fly", "orpo_prompt_nll", "rm", "ipo_on_the_fly_eight_devices"],
)
def test_packed_preference_run_trains_what_the_padded_run_trains(tmp_path, name, extra):
    shards = 8 if "mesh.fsdp=4" in extra else 1
    if jax.device_count() < shards:
        pytest.skip("needs 8 devices")
    padded, padded_rows, padded_params = _run(tmp_path / "padded", "off", name, *extra)
    packed, packed_rows, packed_params = _run(tmp_path / "packed", "on", name, *extra)
    assert set(padded.plans) == {None}
    # The update's plans (two micro-batches) and the reference's (one), per batch shard.
    assert packed.plans and all(p is not None and p[1] == shards for p in packed.plans)
    assert {p[0] for p in packed.plans} <= {1, 2} and (2, shards) in packed.plans
    assert len(packed_rows) == len(padded_rows) == 2
    # With a reference, the first step's policy is the reference: every implicit reward is 0
    # up to rounding, so its accuracy (a comparison of two of them) is a coin toss.
    first_step_skips = ("rewards/accuracies",) if name in ("dpo.yaml", "kto.yaml") else ()
    for step, (want, got) in enumerate(zip(padded_rows, packed_rows, strict=True)):
        for key, value in want.items():
            if key.startswith("time/") or key.endswith("_per_s") or key.endswith("seconds"):
                continue
            if step == 0 and key in first_step_skips:
                continue
            assert got[key] == pytest.approx(value, rel=1e-4, abs=1e-5), key
    for want, got in zip(jax.tree.leaves(padded_params), jax.tree.leaves(packed_params)):
        np.testing.assert_allclose(got, want, atol=1e-5)


def _pairs(rng, rows=8, prompt=5, length=7):
    prompt_mask = np.arange(prompt)[None] >= rng.integers(0, prompt, rows)[:, None]
    chosen = np.arange(length)[None] < rng.integers(0, length + 1, rows)[:, None]
    rejected = np.arange(length)[None] < rng.integers(0, length + 1, rows)[:, None]
    return prompt_mask, chosen, rejected


def test_plan_batch_packs_each_micro_batchs_chosen_and_rejected_rows():
    """Micro-batch ``k``'s plan covers exactly ``[chosen[k::K] ; rejected[k::K]]``: each of
    its ``2N / K`` forward rows' tokens lands once, at its own row and columns."""
    rng = np.random.default_rng(0)
    prompt_mask, chosen, rejected = _pairs(rng)
    host = type("Pairs", (), {})()
    host.prompt_mask, host.chosen_mask, host.rejected_mask = prompt_mask, chosen, rejected
    k = 2
    plan = pref_packing.plan_batch(host, micro_batches=k, shards=2, mode="on")
    assert plan.source.shape[:2] == (k, 2)
    width = prompt_mask.shape[1] + chosen.shape[1]
    for m in range(k):
        rows = np.concatenate(
            [
                np.concatenate([prompt_mask[m::k], chosen[m::k]], 1),
                np.concatenate([prompt_mask[m::k], rejected[m::k]], 1),
            ]
        )
        source = plan.source[m][plan.segment_ids[m] > 0]
        assert sorted(source) == sorted(np.flatnonzero(rows.reshape(-1)))
        # Shard d holds rows [d 2N/(K S), (d+1) 2N/(K S)) of the micro-batch's forward rows.
        per_shard = len(rows) // 2
        for d in range(2):
            mine = plan.source[m, d][plan.segment_ids[m, d] > 0] // width
            assert np.all((mine >= d * per_shard) & (mine < (d + 1) * per_shard))
    assert pref_packing.plan_batch(host, micro_batches=k, shards=2, mode="off") is None
    with pytest.raises(ValueError, match="micro_batches=3"):
        pref_packing.plan_batch(host, micro_batches=3, shards=1, mode="on")


def test_packing_key_is_validated(tmp_path):
    from jaxrl_llm.train.preference.config import check_config  # noqa: PLC0415

    base = [*TINY, f"run_dir={tmp_path}"]
    for value, mode in (("true", "on"), ("false", "off"), ("auto", "auto")):
        cfg = load_config(
            PreferenceConfig, helpers.CONFIGS / "dpo.yaml", [*base, f"trainer.packing={value}"]
        )
        check_config(cfg)
        assert packing_lib.packing_mode(cfg.trainer.packing) == mode
    cfg = load_config(
        PreferenceConfig, helpers.CONFIGS / "dpo.yaml", [*base, "trainer.packing=sometimes"]
    )
    with pytest.raises(ValueError, match="trainer.packing"):
        check_config(cfg)
