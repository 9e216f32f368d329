"""Routing replay in the RL trainer (``model.routing_replay``; R3, Ma et al. 2025).

The sampler records each token's experts (``Samples.routing`` ``[B, P + T, L, k]``); with
``rollout`` every training-side forward of the step (behaviour, reference, update) routes each
token to them, padded or packed, micro-batched or not; ``moe/routing_mismatch`` is the share of
completion tokens whose top-k set under the trainer's own router differs from the recorded one.

Unit checks run on ``tests.train.moe_problem``'s 4-expert model: the mismatch count against a
NumPy reference, the replayed log-prob forward against ``models.forward(routing=...)`` and the
update's loss with replayed ids (packed = padded = micro-batched). The trainer runs use the
built-in tiny model as a 4-expert mixture, with a spy on the forward behind every log-prob
function (``jaxrl_llm.logprobs.forward``) that records the ids each replayed forward used.
"""

from __future__ import annotations

import collections
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxrl_llm import logprobs as logprobs_lib
from jaxrl_llm import models, objectives
from jaxrl_llm.logprobs import completion_logprobs
from jaxrl_llm.packing import plan_sequences
from jaxrl_llm.train.forward import make_logprob_fn
from jaxrl_llm.train.packing import plan_micro_batches
from jaxrl_llm.train.rl.policy import (
    make_policy_loss_fn,
    make_policy_step,
    routing_mismatch,
    with_totals,
)
from jaxrl_llm.train.state import TrainState
from jaxrl_llm.train.step import totals_of
from jaxrl_llm.types import RolloutBatch, Sequences, sequences_of
from tests.train import moe_problem, step_problem
from tests.train.rl import rl_helpers

MOE = moe_problem.MOE
E, K = MOE.num_experts, MOE.num_experts_per_tok


@functools.lru_cache(maxsize=1)
def _params():
    """Random weights, the router's scaled up so routing is far from uniform."""
    params = jax.jit(lambda key: models.init_params(MOE, key))(jax.random.key(0))
    layers = dict(params["layers"], router=params["layers"]["router"] * 20.0)
    return {**params, "layers": layers}


def _joined(batch: RolloutBatch):
    tokens = np.concatenate([batch.prompt_tokens, batch.completion_tokens], axis=1)
    mask = np.concatenate([batch.prompt_mask, batch.completion_mask], axis=1).astype(bool)
    return tokens, mask


@jax.jit
def _free_forward(params, tokens, mask):
    return models.forward(params, MOE, tokens, attention_mask=mask, outputs=("routing",))[-1]


def _free_routing(batch: RolloutBatch) -> np.ndarray:
    """``[B, P + T, L, k]``: an independent padded forward's own top-k, -1 on padding."""
    tokens, mask = _joined(batch)
    out = _free_forward(_params(), jnp.asarray(tokens), jnp.asarray(mask))
    ids = np.moveaxis(np.asarray(out), 0, 2)
    return np.where(mask[:, :, None, None], ids, -1).astype(np.int32)


def _other_routing(batch: RolloutBatch) -> np.ndarray:
    """Recorded ids another router would choose: every id moved to the next expert."""
    ids = _free_routing(batch)
    return np.where(ids >= 0, (ids + 1) % E, -1).astype(np.int32)


def _batch(seed: int = 0) -> RolloutBatch:
    return step_problem.host_batch(seed)


def _device(batch: RolloutBatch) -> RolloutBatch:
    return jax.tree.map(jnp.asarray, batch)


# -- the mismatch count --------------------------------------------------------------------------


def _mismatch_reference(logits, recorded, scored) -> float:
    """float64 NumPy: tokens where some layer with recorded ids chose another top-k set."""
    logits = np.asarray(logits, np.float64)
    count = 0
    layers, rows, cols, _ = logits.shape
    k = recorded.shape[-1]
    for n in range(rows):
        for s in range(cols):
            if not scored[n, s]:
                continue
            for layer in range(layers):
                ids = recorded[layer, n, s]
                if np.any(ids < 0):
                    continue
                free = set(np.argsort(-logits[layer, n, s], kind="stable")[:k].tolist())
                if free != set(ids.tolist()):
                    count += 1
                    break
    return float(count)


def test_routing_mismatch_counts_tokens_whose_top_k_set_differs():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((2, 3, 5, E)).astype(np.float32)
    top = np.argsort(-logits, axis=-1)[..., :K]
    recorded = top[..., ::-1].copy()  # the same sets in another order: no mismatch
    moved = (top + 1) % E  # another set (E = 4, k = 2: a shifted set never equals itself)
    recorded[0, 0, 1] = moved[0, 0, 1]  # token (0, 1): layer 0 differs
    recorded[:, 2, 0] = moved[:, 2, 0]  # token (2, 0): both layers differ, counted once
    recorded[1, 2, 3] = moved[1, 2, 3]  # token (2, 3) differs but is not scored
    recorded[1, 1, 4] = [-1, moved[1, 1, 4, 1]]  # nothing recorded there: not counted
    scored = np.ones((3, 5), bool)
    scored[2, 3] = False  # a prompt or padding token
    got = float(routing_mismatch(jnp.asarray(logits), jnp.asarray(recorded), jnp.asarray(scored)))
    assert got == _mismatch_reference(logits, recorded, scored) == 2.0
    assert float(routing_mismatch(jnp.asarray(logits), jnp.asarray(top), jnp.asarray(scored))) == 0


# -- the log-prob forwards --------------------------------------------------------------------


def test_logprob_programs_replay_the_recorded_ids_padded_packed_and_micro_batched():
    batch = _batch(3)
    seqs = Sequences(*(jnp.asarray(x) for x in sequences_of(batch)))
    ids = _other_routing(batch)
    tokens, mask = _joined(batch)
    # Reference: the model's forward told the ids directly, then log-softmax in float64.
    # (Jitted: run eagerly, every primitive of the forward would compile on its own.)
    logits = jax.jit(
        lambda p, t, m, r: models.unembed(
            p, MOE, models.forward(p, MOE, t, attention_mask=m, routing=r)[0]
        )
    )(_params(), jnp.asarray(tokens), jnp.asarray(mask), jnp.moveaxis(jnp.asarray(ids), 2, 0))
    logits = np.asarray(logits, np.float64)
    prompt = batch.prompt_tokens.shape[1]
    logits = logits[:, prompt - 1 : -1]
    logz = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    picked = np.take_along_axis(logits, batch.completion_tokens[..., None], -1)[..., 0]
    want = np.where(batch.completion_mask, picked - logz, 0.0)
    free = np.asarray(jax.jit(lambda p, s: completion_logprobs(p, MOE, *s))(_params(), seqs))
    assert np.abs(free - want).max() > 1e-3  # the other experts change the log-probs
    for k in (1, 2):
        fn = make_logprob_fn(MOE, micro_batches=k)
        np.testing.assert_allclose(
            np.asarray(fn(_params(), seqs, None, jnp.asarray(ids))), want, atol=1e-5
        )
        plan = plan_micro_batches(
            batch.prompt_mask, batch.completion_mask, micro_batches=k, shards=1
        )
        packed = fn(_params(), seqs, plan, routing=jnp.asarray(ids))
        np.testing.assert_allclose(np.asarray(packed), want, atol=1e-5)
    # The old call form (no routing) still routes freely.
    np.testing.assert_allclose(np.asarray(make_logprob_fn(MOE)(_params(), seqs)), free, atol=1e-6)


def test_replayed_routing_checks_its_shape():
    with pytest.raises(ValueError, match=r"routing .* must be \[B, P \+ T, L, k\]"):
        logprobs_lib.replayed_routing(jnp.zeros((2, 5, 2, K), jnp.int32), (2, 6))


# -- the update -------------------------------------------------------------------------------


@functools.lru_cache(maxsize=2)
def _loss_fn(replay: bool):
    """GRPO's policy loss of ``MOE``, jitted (eagerly every primitive would compile alone)."""
    return jax.jit(make_policy_loss_fn(MOE, objectives.make("grpo"), replay_routing=replay))


def _loss(batch: RolloutBatch, *, replay: bool, packed: bool = False):
    fn = _loss_fn(replay)
    if packed:
        plan = plan_sequences(np.asarray(batch.prompt_mask), np.asarray(batch.completion_mask))
        batch = batch._replace(packing=plan)
    batch = _device(batch)
    return fn(_params(), batch, totals_of(batch.completion_mask))


def test_the_update_replays_the_ids_and_reports_the_mismatch():
    batch = _batch(4)
    free_ids, other = _free_routing(batch), _other_routing(batch)
    free_loss, free_metrics = _loss(batch, replay=False)
    assert "moe/routing_mismatch" not in free_metrics  # nothing recorded: nothing reported
    # The trainer's own routing recorded: replaying it is the free update (f32).
    same_loss, same = _loss(batch._replace(routing=free_ids), replay=True)
    np.testing.assert_allclose(float(same_loss), float(free_loss), rtol=1e-6)
    assert float(same["moe/routing_mismatch"]) == 0.0
    # Other ids: every completion token differs (each id moved), replayed or not; replayed,
    # the loss is GRPO's of the log-probs of the forward routed by them.
    mask = batch.completion_mask.astype(bool)
    objective = objectives.make("grpo")
    for replay in (False, True):
        loss, metrics = _loss(batch._replace(routing=other), replay=replay)
        assert float(metrics["moe/routing_mismatch"]) == pytest.approx(1.0)
        if replay:
            assert abs(float(loss) - float(free_loss)) > 1e-6

            @jax.jit
            def reference(params, device, routing):
                lp, entropy = completion_logprobs(
                    params, MOE, *sequences_of(device), routing=routing, return_entropy=True
                )
                totals = totals_of(device.completion_mask)
                return objectives.policy_loss(
                    objective, lp, with_totals(device, totals), entropy=entropy
                ).loss

            want = reference(_params(), _device(batch), jnp.asarray(other))
            np.testing.assert_allclose(float(loss), float(want), rtol=1e-6)
    # Half the rows recorded as the trainer's own choice: the share of their tokens.
    half = np.where(np.arange(len(other))[:, None, None, None] % 2 == 0, other, free_ids)
    _, metrics = _loss(batch._replace(routing=half), replay=True)
    want = mask[::2].sum() / mask.sum()
    assert float(metrics["moe/routing_mismatch"]) == pytest.approx(want, rel=1e-6)


def test_the_replayed_update_packed_and_micro_batched_equals_padded():
    batch = _batch(5)._replace(routing=_other_routing(_batch(5)))
    loss, metrics = _loss(batch, replay=True)
    packed_loss, packed = _loss(batch, replay=True, packed=True)
    np.testing.assert_allclose(float(packed_loss), float(loss), rtol=1e-5, atol=1e-6)
    assert float(packed["moe/routing_mismatch"]) == pytest.approx(
        float(metrics["moe/routing_mismatch"])
    )
    # Two micro-batches (strided rows), padded and packed: the routing splits with the rows.
    state = TrainState(
        jnp.zeros((), jnp.int32), _params(), optax.sgd(0.0).init(_params()), jax.random.key(1)
    )
    step = jax.jit(
        make_policy_step(
            MOE, objectives.make("grpo"), optax.sgd(0.0), micro_batches=2, replay_routing=True
        )
    )
    plan = plan_micro_batches(batch.prompt_mask, batch.completion_mask, micro_batches=2, shards=1)
    for run in (batch, batch._replace(packing=plan)):
        _, got = step(state, _device(run))
        np.testing.assert_allclose(float(got["pg_loss"]), float(metrics["pg_loss"]), atol=1e-6)
        assert float(got["moe/routing_mismatch"]) == pytest.approx(
            float(metrics["moe/routing_mismatch"]), rel=1e-6
        )


def test_replay_without_recorded_ids_is_refused():
    with pytest.raises(ValueError, match="carries no routing"):
        _loss(_batch(0), replay=True)


# -- the trainer --------------------------------------------------------------------------------

REPLAY = ("model.tiny.experts=4", "model.tiny.experts_per_token=2", "model.param_dtype=float32")


class _Spy:
    """Records, for every forward of a log-prob function given ids to replay, its tokens, its
    real tokens, the ids it was given and the ids its layers used (``outputs=("routing",)``)."""

    def __init__(self, monkeypatch):
        self.calls = []
        real = logprobs_lib.forward

        def forward(params, config, tokens, **kwargs):
            if kwargs.get("routing") is None:
                return real(params, config, tokens, **kwargs)
            outputs = (*kwargs.get("outputs", ()), "routing")  # routing comes last
            out = real(params, config, tokens, **{**kwargs, "outputs": outputs})
            segments = kwargs.get("segment_ids")
            real_tokens = kwargs["attention_mask"] if segments is None else segments > 0
            jax.debug.callback(self.record, tokens, real_tokens, kwargs["routing"], out[-1])
            return out[:-1]

        monkeypatch.setattr(logprobs_lib, "forward", forward)

    def record(self, tokens, real, given, used):
        self.calls.append(tuple(np.asarray(x) for x in (tokens, real, given, used)))


def _run(tmp_path, name, *overrides, monkeypatch=None, spy=False, tokens_hook=None):
    """One GRPO step (two minibatches: the behaviour forward runs) of the tiny MoE; returns
    ``(its metrics row, the first update's metrics, the step's Samples, the spy's calls)``.
    (The second minibatch's update runs on moved weights: its own routing may differ.)"""
    from jaxrl_llm.train.metrics import read_metrics  # noqa: PLC0415
    from jaxrl_llm.train.rl import rollout as rollout_lib  # noqa: PLC0415
    from jaxrl_llm.train.rl.run import run  # noqa: PLC0415
    from jaxrl_llm.train.rl.trainer import RLTrainer  # noqa: PLC0415

    drawn, updates = [], []
    real_rollout, real_update = RLTrainer.rollout, RLTrainer.update

    def rollout(self, step, timer):
        samples, info = real_rollout(self, step, timer)
        drawn.append(samples)
        return samples, info

    def update(self, step, minibatch):
        metrics = real_update(self, step, minibatch)
        updates.append(jax.device_get(metrics))
        return metrics

    monkeypatch.setattr(RLTrainer, "rollout", rollout)
    monkeypatch.setattr(RLTrainer, "update", update)
    if tokens_hook is not None:
        for cls in (rollout_lib.StaticDrawer, rollout_lib.ContinuousDrawer):
            monkeypatch.setattr(cls, "tokens", tokens_hook(cls.tokens))
    recorder = _Spy(monkeypatch) if spy else None
    cfg = rl_helpers.tiny_config(
        rl_helpers.CONFIGS / "grpo.yaml",
        tmp_path / name,
        rl_helpers.SHAPED_REWARDS,
        *REPLAY,
        "trainer.max_steps=1",
        "trainer.minibatches=2",
        *overrides,
    )
    run(cfg)
    rows = [r for r in read_metrics(tmp_path / name) if "loss" in r]
    assert len(rows) == 1 and len(updates) == 2
    return rows[0], updates[0], drawn[0], (recorder.calls if spy else None)


def _check_replayed(calls, samples):
    """Every replayed forward used, on every real token, the ids the sampler recorded for that
    row (rows matched by their tokens; the trainer buckets the prompts wider)."""
    recorded = {}
    for row in range(len(samples.prompts)):
        mask = np.concatenate([samples.prompt_mask[row], samples.completion_mask[row]])
        tokens = np.concatenate([samples.prompt_tokens[row], samples.completion_tokens[row]])
        key = tuple(tokens[mask].tolist())
        recorded.setdefault(key, []).append(samples.routing[row][mask])
    rows_seen = collections.Counter()
    for tokens, real, given, used in calls:
        real = real.astype(bool)
        for n in range(tokens.shape[0]):
            ids = np.moveaxis(given[:, n], 0, 1)[real[n]]  # [S_real, L, k]
            np.testing.assert_array_equal(np.moveaxis(used[:, n], 0, 1)[real[n]], ids)
            assert np.all(ids >= 0)  # every real token replayed
            want = recorded[tuple(tokens[n][real[n]].tolist())]
            assert any(np.array_equal(ids, w) for w in want), n
        rows_seen[tokens.shape[0]] += 1
    return dict(rows_seen)


@pytest.mark.slow
def test_a_replayed_run_routes_every_forward_as_the_sampler(tmp_path, monkeypatch):
    """f32: the behaviour, reference and update forwards (batch 16, minibatches of 8) each
    replay the sampler's ids on every real token; the first step's loss is the free run's (the
    same experts are chosen in f32), packed or padded, and the mismatch is 0."""
    row, first, samples, calls = _run(
        tmp_path, "replay", "model.routing_replay=rollout", monkeypatch=monkeypatch, spy=True
    )
    assert samples.routing is not None and samples.routing.dtype == np.int32
    assert samples.routing.shape[:2] == (
        len(samples.prompts),
        samples.prompt_tokens.shape[1] + samples.completion_tokens.shape[1],
    )
    # The behaviour and reference forwards (16 rows), the update's two minibatches (8 rows).
    assert _check_replayed(calls, samples) == {16: 2, 8: 2}
    assert first["moe/routing_mismatch"] == 0.0  # the sampler's weights: its own experts
    assert 0.0 <= row["moe/routing_mismatch"] <= 1.0
    monkeypatch.undo()
    free, free_first, _, _ = _run(tmp_path, "free", monkeypatch=monkeypatch)
    assert "moe/routing_mismatch" not in free  # off: nothing recorded, nothing reported
    assert first["loss"] == pytest.approx(free_first["loss"], rel=1e-5, abs=1e-7)
    monkeypatch.undo()
    _, packed, _, _ = _run(
        tmp_path, "packed", "model.routing_replay=rollout", "trainer.packing=on",
        monkeypatch=monkeypatch,
    )  # fmt: skip
    assert packed["loss"] == pytest.approx(first["loss"], rel=1e-5, abs=1e-7)


def _moved(tokens):
    """A drawer whose recorded routing is another router's: each id moved to the next expert."""

    @functools.wraps(tokens)
    def hook(self, *args, **kwargs):
        *out, routing = tokens(self, *args, **kwargs)
        return (*out, np.where(routing >= 0, (routing + 1) % 4, -1).astype(np.int32))

    return hook


@pytest.mark.slow
def test_the_forwards_use_the_recorded_ids_not_their_own(tmp_path, monkeypatch):
    """bf16 compute, with a sampler whose routing differs from the trainer's (on CPU the bf16
    sampler and trainer choose the same experts, so the recorded ids are moved to other
    experts): ``measure`` (static engine) reports the mismatch (every completion token) and
    replays nothing; ``rollout`` (continuous engine) replays the recorded ids in every forward.
    (The static engine's ``rollout`` run is ``test_a_replayed_run_routes_every_forward_as_the_
    sampler``'s: the trainer's forwards replay alike whichever engine recorded the ids.)"""
    common = ("model.compute_dtype=bfloat16",)
    row, _, _, calls = _run(
        tmp_path, "measure", "model.routing_replay=measure", "rollout.engine=static", *common,
        monkeypatch=monkeypatch, spy=True, tokens_hook=_moved,
    )  # fmt: skip
    assert row["moe/routing_mismatch"] == pytest.approx(1.0)
    assert calls == []
    monkeypatch.undo()
    row, _, samples, calls = _run(
        tmp_path, "rollout", "model.routing_replay=rollout", "rollout.engine=continuous",
        *common, monkeypatch=monkeypatch, spy=True, tokens_hook=_moved,
    )  # fmt: skip
    assert row["moe/routing_mismatch"] == pytest.approx(1.0)
    assert _check_replayed(calls, samples) == {16: 2, 8: 2}


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (("model.routing_replay=rollout",), "mixture-of-experts models.*dense"),
        (("model.routing_replay=on",), "model.routing_replay must be one of"),
        ((*REPLAY, "model.routing_replay=rollout", "env.name=calculator"), "multi-turn"),
    ],
)
def test_unsupported_replays_are_refused(tmp_path, overrides, match):
    from jaxrl_llm.train.rl.trainer import RLTrainer  # noqa: PLC0415

    with pytest.raises(ValueError, match=match):
        cfg = rl_helpers.tiny_config(None, tmp_path / "run", *overrides)
        trainer = RLTrainer(cfg)
        try:
            with jax.set_mesh(trainer.mesh):
                trainer.setup()
                trainer.compile()
        finally:
            trainer.checkpointer.close()
            trainer.metrics_writer.close()


def _watched_run(monkeypatch, cfg):
    """Runs ``cfg`` with the spy; returns ``(its metrics rows, the rollouts' Samples, the spy's
    calls)``."""
    from jaxrl_llm.train.metrics import read_metrics  # noqa: PLC0415
    from jaxrl_llm.train.rl.run import run  # noqa: PLC0415
    from jaxrl_llm.train.rl.trainer import RLTrainer  # noqa: PLC0415

    drawn, real_rollout = [], RLTrainer.rollout

    def rollout(self, step, timer):
        samples, info = real_rollout(self, step, timer)
        drawn.append(samples)
        return samples, info

    monkeypatch.setattr(RLTrainer, "rollout", rollout)
    spy = _Spy(monkeypatch)
    run(cfg)
    rows = [r for r in read_metrics(cfg.run_dir) if "loss" in r]
    return rows, drawn, spy.calls


@pytest.mark.slow
def test_ppo_replays_in_the_policys_forwards(tmp_path, monkeypatch):
    """PPO's joint step (policy and critic under one optimizer) replays the sampler's ids on
    every real token of both minibatches, as the policy trainer does; the critic, a model of
    its own, routes by its own router. (PRIME's policy update: the resume test below.)"""
    cfg = rl_helpers.tiny_config(
        rl_helpers.CONFIGS / "grpo.yaml",
        tmp_path / "run",
        rl_helpers.SHAPED_REWARDS,
        *REPLAY,
        "model.routing_replay=rollout",
        "trainer.max_steps=1",
        "trainer.minibatches=2",
        "objective.name=ppo",
        "critic.optimizer=joint",
        "critic.warmup_steps=0",
    )
    rows, drawn, calls = _watched_run(monkeypatch, cfg)
    assert _check_replayed(calls, drawn[0]).get(8) == 2  # the update's two minibatches
    assert 0.0 <= rows[0]["moe/routing_mismatch"] <= 1.0


@pytest.mark.slow
def test_prime_replays_and_a_replayed_run_resumes_with_its_rollout_in_flight(tmp_path, monkeypatch):
    """PRIME, two minibatches, one step off-policy (``rollout.max_staleness=1``): the first
    run's policy update replays the sampler's ids on every real token of both minibatches, as
    the policy trainer does (the PRM, a model of its own, routes by its own router); the
    checkpoint keeps the rollout in flight, routing included (per-step data, not state); the
    resumed run replays it. (Replay in the trainer's forwards and the in-flight rollout's
    checkpoint are independent: one job checks both.)"""
    from jaxrl_llm.train.metrics import read_metrics  # noqa: PLC0415
    from jaxrl_llm.train.rl.pipeline import IN_FLIGHT_DIR  # noqa: PLC0415
    from jaxrl_llm.train.rl.run import run  # noqa: PLC0415

    def config(steps, *extra):
        return rl_helpers.tiny_config(
            rl_helpers.CONFIGS / "grpo.yaml",
            tmp_path / "run",
            rl_helpers.SHAPED_REWARDS,
            *REPLAY,
            "model.routing_replay=rollout",
            "objective.name=prime",
            "trainer.minibatches=2",
            "rollout.max_staleness=1",
            f"trainer.max_steps={steps}",
            *extra,
        )

    rows, drawn, calls = _watched_run(monkeypatch, config(1))
    assert _check_replayed(calls, drawn[0]).get(8) == 2  # the update's two minibatches
    assert 0.0 <= rows[0]["moe/routing_mismatch"] <= 1.0
    monkeypatch.undo()
    assert list((tmp_path / "run" / IN_FLIGHT_DIR).glob("1-*.pkl"))
    run(config(2, "resume=true"))
    rows = [r for r in read_metrics(tmp_path / "run") if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(0.0 <= r["moe/routing_mismatch"] <= 1.0 for r in rows)


def test_dynamic_sampling_keeps_each_rows_routing_aligned():
    """``concat_samples`` left-pads the prompt columns of narrower draws' routing with -1
    (as their prompts), ``select_groups`` takes the groups' rows."""
    from jaxrl_llm.train.rl import rollout as rollout_lib  # noqa: PLC0415

    def draw(rows, width, fill):
        routing = np.full((rows, width + 3, 2, K), fill, np.int32)
        routing[:, 0] = -1  # the first prompt column is padding
        return rollout_lib.Samples(
            prompt_tokens=np.ones((rows, width), np.int32),
            prompt_mask=np.ones((rows, width), bool),
            completion_tokens=np.ones((rows, 3), np.int32),
            completion_mask=np.ones((rows, 3), bool),
            completions=["a"] * rows,
            prompts=["p"] * rows,
            rewards=np.zeros(rows, np.float32),
            correct=np.zeros(rows, bool),
            components={"r": np.zeros(rows, np.float32)},
            finished=np.ones(rows, bool),
            logprobs=np.zeros((rows, 3), np.float32),
            routing=routing,
        )

    both = rollout_lib.concat_samples([draw(2, 4, 1), draw(2, 6, 2)])
    assert both.routing.shape == (4, 9, 2, K)
    np.testing.assert_array_equal(both.routing[:2, :3], -1)  # 2 new columns and the old pad
    np.testing.assert_array_equal(both.routing[:2, 3:], 1)
    np.testing.assert_array_equal(both.routing[2:, 1:], 2)
    picked = rollout_lib.select_groups(both, np.array([1]), 2)
    np.testing.assert_array_equal(picked.routing, both.routing[2:])
    # A draw without routing: none for the whole batch.
    assert rollout_lib.concat_samples([draw(2, 4, 1)._replace(routing=None)]).routing is None
