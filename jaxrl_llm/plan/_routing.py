"""``plan`` with routing replay (``model.routing_replay``, a mixture-of-experts policy): the
sampler records the experts every token was routed to and the trainer's programs carry them,
as ``train`` runs it.

* the sampler's ``prefill`` (``prefill_program(..., record_routing=True)``) and decode loop
  keep a ``[B, P + T, L, k]`` buffer in their state (``generate.routing_dtype``: int8 up to
  128 experts; the continuous engine's ``[S, P + T, L, k]``, ``init_state(...,
  record_routing=True)``);
* ``RLTrainer.batch_routing`` puts it on the trainer's mesh as ``[B, P + T, L, k]`` int32
  (``_job.abstract_routing``), rows split over the batch axes, alive from the log-prob
  forwards to the last update: the update's ``RolloutBatch.routing`` (a minibatch's rows, the
  whole batch's beside it) with ``measure`` and ``rollout``; with ``rollout`` the behaviour and
  reference forwards take it too (``routing=``: they route as the sampler did).

Its bytes are counted in each program's ``inputs`` (``Program.routing_bytes`` says how many).
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from jaxrl_llm.sampling.generate import routing_dtype

ASSUMPTIONS = (
    "model.routing_replay: the sampler records each token's experts ([B, P + T, L, k] in its "
    "state) and the trainer keeps them as int32 from the log-prob forwards to the last update "
    "(counted in inputs); with rollout the policy's forwards replay them",
)


def records_routing(cfg) -> bool:
    """The sampler records each token's experts (``model.routing_replay`` ``measure`` or
    ``rollout``, as ``train.rl.rollout.records_routing``)."""
    return cfg.model.replay_mode != "off"


def replays_routing(cfg) -> bool:
    """The behaviour and reference forwards and the update route as the sampler did
    (``model.routing_replay=rollout``, as ``RLTrainer.replays_routing``)."""
    return cfg.model.replay_mode == "rollout"


def routing_report(job, programs: dict[str, dict]) -> dict[str, Any] | None:
    """The report's ``routing_replay`` entry (None when off): the mode, the trainer's array
    ``[B, P + T, L, k]`` int32 and its bytes a chip, the sampler's buffer dtype and bytes a
    chip, and each program's routing bytes (``Program.routing_bytes``, in its ``inputs``)."""
    if not records_routing(job.cfg):
        return None
    config, shape = job.model_config, job.shape
    dims = [shape.rows, shape.seq_len, config.num_hidden_layers, config.num_experts_per_tok]
    trainer = job.programs["logprobs"].routing_bytes
    decode = job.programs.get("decode_step")
    return {
        "mode": job.cfg.model.replay_mode,
        "shape": dims,
        "dtype": "int32",
        "bytes": 4 * dims[0] * dims[1] * dims[2] * dims[3],
        "bytes_per_chip": trainer,
        "update_bytes_per_chip": job.programs["update"].routing_bytes,
        "sampler_dtype": jnp.dtype(routing_dtype(config.num_experts)).name,
        "sampler_bytes_per_chip": 0 if decode is None else decode.routing_bytes,
        "replayed_by": [
            name
            for name in ("logprobs", "ref_logprobs", "update")
            if name in programs and replays_routing(job.cfg)
        ],
        "programs": {
            name: program.routing_bytes
            for name, program in job.programs.items()
            if program.routing_bytes
        },
    }


__all__ = ["ASSUMPTIONS", "records_routing", "replays_routing", "routing_report"]
