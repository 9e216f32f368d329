"""A tiny mixture-of-experts policy beside ``step_problem``'s dense one (same vocabulary, so
``step_problem.host_batch`` feeds both): the router tests' model."""

from __future__ import annotations

from jaxrl_llm.models import ModelConfig
from tests.train import step_problem

# 2 layers of 4 experts, top-2 with renormalised weights; router_aux_loss_coef 0 (the default).
MOE = ModelConfig(
    architecture="MixtralForCausalLM",
    vocab_size=step_problem.CONFIG.vocab_size,
    hidden_size=32,
    intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    norm_topk_prob=True,
)
