"""Expert parallelism (``models.moe.expert_parallel_mlp``): the mixture-of-experts layer on a mesh
with an ``expert`` axis (experts split over it, tokens exchanged by all-to-all) against a float64
NumPy per-token reference and the unsharded layer, forward and gradients; hand-built routings
(idle experts, every token on one expert); the experts' weights and Adam moments sharded over
``expert``; the compiled step's collectives; one RL step through the trainer."""

from __future__ import annotations

import functools
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxrl_llm import cli, models, parallel
from jaxrl_llm.models import moe
from jaxrl_llm.train.optim import make_optimizer
from jaxrl_llm.train.state import create_train_state
from tests.reference import moe as ref

pytestmark = pytest.mark.needs_devices(8)

T_BATCH, T_SEQ, D, E, F = 8, 4, 8, 8, 8  # 32 tokens: 4 per device on every 8-device mesh

# (data, fsdp, tensor, expert) x routing / shared-expert variants: expert 2 and 4, combined with
# data, fsdp and a tensor axis that splits the experts' width.
MESHES = {
    "fsdp2_expert4": ((1, 2, 1, 4), 2, True, False),
    "data2_expert4": ((2, 1, 1, 4), 2, False, True),
    "fsdp2_tensor2_expert2": ((1, 2, 2, 2), 2, True, True),
    "data2_fsdp2_expert2_top3": ((2, 2, 1, 2), 3, False, False),
}


def _weights(rng, shared):
    """``(router, w_gate, w_up, w_down[, shared expert's four])`` f32, ``N(0, 1/fan_in)`` (the
    router's ``N(0, 9/fan_in)``)."""
    out = list(ref.layer_weights(rng, D, E, F, router_scale=3.0))
    if shared:
        w = functools.partial(ref.fan_in_weight, rng)
        out += [w(D, 6), w(D, 6), w(6, D), w(D, 1)]
    return tuple(out)


def _dense_reference(params, h, cotangent, experts, *, normalize):
    """float64 ``<y, c>`` and its gradient in (h, every parameter), with the experts each token
    chose fixed: every expert's SwiGLU on every token, weighted by the routing softmax over the
    chosen ones (zero elsewhere). No sort, ragged matmul, mesh or ``models.moe`` code."""
    chosen = np.zeros((experts.shape[0], E))
    np.put_along_axis(chosen, experts, 1.0, axis=-1)

    def loss(h, router, w_gate, w_up, w_down, *shared):
        x = h.reshape(-1, D)
        probs = jax.nn.softmax(x @ router, axis=-1) * chosen
        if normalize:
            probs = probs / probs.sum(-1, keepdims=True)
        hidden = jax.nn.silu(jnp.einsum("td,edf->tef", x, w_gate))
        hidden = hidden * jnp.einsum("td,edf->tef", x, w_up)
        y = jnp.einsum("te,tef,efd->td", probs, hidden, w_down)
        if shared:
            s_gate, s_up, s_down, s_sigmoid = shared
            dense = (jax.nn.silu(x @ s_gate) * (x @ s_up)) @ s_down
            y = y + jax.nn.sigmoid(x @ s_sigmoid) * dense
        return jnp.sum(y * cotangent.reshape(-1, D))

    with jax.enable_x64(True):
        args = [jnp.asarray(a, jnp.float64) for a in (h, *params)]
        grads = jax.jit(jax.grad(loss, argnums=tuple(range(len(args)))))(*args)
        return [np.asarray(g) for g in grads]


def _layer(top_k, normalize, shared):
    """``(params, h, cotangent) -> (y, grads)`` of ``moe.sparse_mlp``, jitted."""

    def loss(h, router, w_gate, w_up, w_down, *rest, cotangent):
        out, _ = moe.sparse_mlp(
            h,
            router,
            w_gate,
            w_up,
            w_down,
            top_k=top_k,
            normalize=normalize,
            shared=moe.SharedExpert(*rest) if shared else None,
        )
        return jnp.sum(out * cotangent), out

    @jax.jit
    def run(params, h, cotangent):
        n = len(params) + 1
        grad_fn = jax.grad(loss, argnums=tuple(range(n)), has_aux=True)
        grads, out = grad_fn(h, *params, cotangent=cotangent)
        return out, grads

    return run


@pytest.mark.parametrize("name", list(MESHES))
def test_sharded_layer_equals_float64_reference_and_unsharded_layer(rng, name):
    """Forward and gradients w.r.t. the hidden states and every parameter (router, experts,
    shared expert) on an expert mesh, against float64 per-token math and the unsharded layer."""
    (data, fsdp, tensor, expert), top_k, normalize, shared = MESHES[name]
    params = _weights(rng, shared)
    h = rng.standard_normal((T_BATCH, T_SEQ, D)).astype(np.float32)
    cotangent = rng.standard_normal(h.shape).astype(np.float32)
    run = _layer(top_k, normalize, shared)

    mesh = parallel.make_mesh(data, fsdp, tensor, expert=expert)
    assert dict(mesh.shape)["expert"] == expert
    with jax.set_mesh(mesh):
        out, grads = run(params, h, cotangent)
    plain_out, plain_grads = run(params, h, cotangent)  # no mesh: the single-program layer

    x = h.reshape(-1, D)
    weights, experts = ref.route(x @ params[0], top_k, normalize)
    assert len(np.unique(experts)) == E  # every expert (so every shard) takes part
    want = ref.experts_mlp(x, weights, experts, *params[1:4])
    if shared:
        s_gate, s_up, s_down, s_sigmoid = (np.asarray(a, np.float64) for a in params[4:])
        dense = (ref.silu(x @ s_gate) * (x @ s_up)) @ s_down
        want = want + dense / (1.0 + np.exp(-(x @ s_sigmoid)))
    np.testing.assert_allclose(np.asarray(out).reshape(-1, D), want, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(out), np.asarray(plain_out), atol=1e-5, rtol=0)

    want_grads = _dense_reference(params, h, cotangent, experts, normalize=normalize)
    assert len(grads) == len(want_grads) == len(params) + 1
    for g, plain, w in zip(grads, plain_grads, want_grads, strict=True):
        scale = np.abs(w).max()
        assert scale > 1e-3
        np.testing.assert_allclose(np.asarray(g), w, atol=2e-5 * scale, rtol=1e-4)
        np.testing.assert_allclose(np.asarray(g), np.asarray(plain), atol=1e-5 * scale, rtol=0)


def _hand_logits(rng, case):
    """Router logits whose top-k is known: ``(logits [T, E], top_k, what every token picks)``."""
    tokens = T_BATCH * T_SEQ
    logits = rng.standard_normal((tokens, E)).astype(np.float32)
    if case == "idle_experts":  # experts 2 and 5 (on two different shards) never chosen
        logits[:, [2, 5]] = -20.0
        return logits, 2, None
    if case == "one_expert":  # top-1, every token to expert 7: one shard receives everything
        logits[:, 7] = 20.0
        return logits, 1, np.full((tokens, 1), 7)
    # "stay_home": each device's tokens pick the two experts of its own expert shard.
    mesh_rows = np.arange(tokens) // (tokens // 8)  # device row block, (fsdp=2, expert=4)
    home = (mesh_rows % 4)[:, None] * 2 + np.arange(2)
    logits = logits - 20.0
    np.put_along_axis(logits, home, 20.0 + rng.uniform(0, 1, home.shape), axis=-1)
    return logits.astype(np.float32), 2, home


@pytest.mark.parametrize("case", ["idle_experts", "one_expert", "stay_home"])
def test_hand_built_routings(rng, case):
    """Experts that get no token (zero gradient, exactly), every token on one expert (one shard
    receives every row: the exchange's full capacity), and no token leaving its device."""
    _, w_gate, w_up, w_down = _weights(rng, False)
    x = rng.standard_normal((T_BATCH * T_SEQ, D)).astype(np.float32)
    logits, top_k, picks = _hand_logits(rng, case)
    cotangent = rng.standard_normal(x.shape).astype(np.float32)
    weights, experts = ref.route(logits, top_k, True)
    if picks is not None:
        np.testing.assert_array_equal(np.sort(experts, -1), np.sort(picks, -1))
    unused = sorted(set(range(E)) - set(experts.ravel().tolist()))
    assert unused == {"idle_experts": [2, 5], "one_expert": [0, 1, 2, 3, 4, 5, 6]}.get(case, [])

    def loss(x, w_gate, w_up, w_down):
        out = moe.expert_parallel_mlp(
            x, jnp.asarray(logits), w_gate, w_up, w_down, top_k=top_k, normalize=True
        )
        return jnp.sum(out * cotangent), out

    # (One case on a mesh of Explicit axes: the arguments are resharded before the shard_map.)
    axis_types = "explicit" if case == "one_expert" else "auto"
    with jax.set_mesh(parallel.make_mesh(1, 2, 1, expert=4, axis_types=axis_types)):
        grads, out = jax.jit(jax.grad(loss, argnums=(1, 2, 3), has_aux=True))(
            x, w_gate, w_up, w_down
        )
    want = ref.experts_mlp(x, weights, experts, w_gate, w_up, w_down)
    np.testing.assert_allclose(np.asarray(out), want, atol=1e-5, rtol=1e-5)
    for g in grads:
        g = np.asarray(g)
        assert np.all(g[unused] == 0.0)
        used = sorted(set(range(E)) - set(unused))
        assert np.all(np.abs(g[used]).reshape(len(used), -1).max(-1) > 0)


def test_refuses_what_it_cannot_split(rng):
    _, w_gate, w_up, w_down = _weights(rng, False)
    logits = jnp.zeros((30, E))  # 30 tokens over 8 batch shards
    with jax.set_mesh(parallel.make_mesh(1, 2, 1, expert=4)):
        with pytest.raises(ValueError, match="the 30 tokens must divide into the 8 batch shards"):
            moe.expert_parallel_mlp(
                jnp.zeros((30, D)), logits, w_gate, w_up, w_down, top_k=2, normalize=True
            )
    with pytest.raises(ValueError, match="needs a mesh with an 'expert' axis"):
        moe.expert_parallel_mlp(
            jnp.zeros((32, D)), jnp.zeros((32, E)), w_gate, w_up, w_down, top_k=2, normalize=True
        )
    with jax.set_mesh(parallel.make_mesh(1, 2, 1, expert=4)):
        assert moe.expert_parallel_mesh() is not None
    with jax.set_mesh(parallel.make_mesh(1, 8, 1)):
        assert moe.expert_parallel_mesh() is None  # today's single-program layer


# --- the model on an expert mesh: state, compiled step, trainer ------------------------------

CONFIG = models.ModelConfig(
    architecture="MixtralForCausalLM",
    vocab_size=112,
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=160,
    norm_topk_prob=True,
)
EXPERT_WEIGHTS = ("expert_w_gate", "expert_w_up", "expert_w_down")


def test_expert_weights_and_adam_moments_are_sharded_over_expert():
    mesh = parallel.make_mesh(1, 2, 1, expert=4)
    state, _ = create_train_state(CONFIG, make_optimizer(1e-3), key=jax.random.key(0), mesh=mesh)
    want = {
        "expert_w_gate": P(None, "expert", "fsdp", "tensor"),
        "expert_w_up": P(None, "expert", "fsdp", "tensor"),
        "expert_w_down": P(None, "expert", "tensor", "fsdp"),
    }
    seen = {}
    for tree_name, tree in (("params", state.params), ("opt_state", state.opt_state)):
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
            where = jax.tree_util.keystr(path)
            name = next((n for n in EXPERT_WEIGHTS if f"'{n}'" in where), None)
            if name is None or getattr(leaf, "ndim", 0) != 4:
                continue
            assert leaf.sharding.spec == want[name], where
            # Each device holds E / 4 experts and D / 2 of their width.
            assert leaf.addressable_shards[0].data.shape[1] == CONFIG.num_experts // 4
            seen.setdefault(tree_name, []).append(where)
    assert len(seen["params"]) == 3
    assert len(seen["opt_state"]) == 6, seen["opt_state"]  # Adam's mu and nu of each
    # Dense weights are replicated over the expert axis (FSDP-split only).
    assert state.params["layers"]["wq"].sharding.spec == P(None, "fsdp", "tensor", None)


@pytest.fixture
def fresh_compiles():
    """Compiled-HLO checks read a fresh compile's text, never the persistent cache's."""
    previous = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", previous)


_ALL_GATHER = re.compile(r"= ([a-z0-9]+)\[([\d,]*)\][^ ]* all-gather(?:-start)?\(")


def _sft_step_hlo(mesh) -> str:
    from tests.parallel import test_fsdp_sharding  # noqa: PLC0415  (its SFT-step compile)

    return test_fsdp_sharding._compile(mesh, config=CONFIG)


def test_compiled_step_exchanges_tokens_and_never_gathers_the_experts(fresh_compiles):
    """The SFT step (forward + backward + AdamW) on fsdp=2 x expert=4: tokens cross the expert
    axis by all-to-all; the experts' weights are gathered over fsdp only (their E / 4 local
    experts), never to all E experts."""
    hlo = _sft_step_hlo(parallel.make_mesh(1, 2, 1, expert=4))
    assert re.search(r" all-to-all(?:-start)?\(", hlo)
    gathered = {tuple(int(d) for d in m[2].split(",") if d) for m in _ALL_GATHER.finditer(hlo)}
    e, d, f = CONFIG.num_experts, CONFIG.hidden_size, CONFIG.moe_intermediate_size
    full = [s for s in gathered if e in s and d in s and f in s]
    assert not full, f"all E experts gathered: {full}"
    assert {(e // 4, d, f), (e // 4, f, d)} <= gathered, gathered  # FSDP gathers, local experts


TRAIN = (
    "model.tiny.experts=8",
    "model.tiny.experts_per_token=2",
    "sft_warmup.steps=0",
    "trainer.max_steps=1",
    "data.eval_size=8",
    "rollout.prompts_per_step=8",
    "rollout.group_size=2",
    # A length penalty: groups differ, so the update has non-zero advantages and gradients; an
    # entropy bonus: the first (on-policy) step's loss is not ~0 but depends on the model.
    "rewards=[{name: math_match}, {name: overlong, kwargs: {max_tokens: 3, buffer_tokens: 3}}]",
    "objective.overrides={entropy_coef: 0.01}",
    "logging.progress=false",
    "logging.plots=false",
    "logging.tensorboard=false",
)


def _first_step(tmp_path, monkeypatch, *mesh):
    built = []
    make_mesh = parallel.make_mesh

    def spy(*args, **kwargs):
        built.append(make_mesh(*args, **kwargs))
        return built[-1]

    monkeypatch.setattr(parallel, "make_mesh", spy)
    run_dir = tmp_path / "_".join(m.replace("mesh.", "").replace("=", "") for m in mesh)
    assert cli.main(["train", *TRAIN, *mesh, f"run_dir={run_dir}"]) == 0
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return rows[0], built


@pytest.mark.slow  # two trainer runs, ~40 s on 2 CPU cores
def test_rl_step_with_expert_parallelism_equals_the_fsdp_run(tmp_path, monkeypatch):
    """``mesh.expert=4 mesh.fsdp=2`` runs a GRPO step of the tiny MoE through the trainer, and its
    first step (loss, entropy, gradient norm) is the ``mesh.fsdp=8`` run's."""
    ep, built = _first_step(tmp_path, monkeypatch, "mesh.expert=4", "mesh.fsdp=2")
    assert any(dict(m.shape).get("expert") == 4 for m in built), [dict(m.shape) for m in built]
    fsdp, _ = _first_step(tmp_path, monkeypatch, "mesh.expert=1", "mesh.fsdp=8")
    assert ep["step"] == fsdp["step"] == 1
    assert ep["grad_norm"] > 0 and ep["advantage_std"] > 0 and abs(ep["loss"]) > 1e-3
    keys = ("loss", "pg_loss", "entropy", "grad_norm", "num_tokens")
    for key in (*keys, "moe/load_balancing_loss", "moe/router_z_loss"):  # router losses too
        np.testing.assert_allclose(ep[key], fsdp[key], rtol=1e-5, atol=1e-7, err_msg=key)
