"""Sequence packing for the preference jobs: the plans of their ``2N``-row forwards.

Every preference loss scores two completion sets of the same ``N`` prompts in one forward over
``2N`` rows ``[prompt ; prompt]`` with ``[first ; second]`` (``losses``: chosen and rejected,
KTO's completions and its mismatched ones, a reward model's chosen and rejected). With
``trainer.packing`` those rows run packed (``jaxrl_llm.packing``: several sequences a row,
attention within each), so both sets share packed rows and no FLOPs go to padding; every loss
reads the same log-probs or scores (to rounding).

The step splits a batch into ``K`` strided micro-batches (``train.step``: micro-batch ``k``
holds rows ``k, k + K, ..``) and each scores ``[first[k::K] ; second[k::K]]``. The plans are
made on the host from the batch's masks (``train.packing.plan_micro_batches`` over the ``2N``
forward rows arranged so that its strided micro-batch ``k`` is exactly those rows), one a
micro-batch, stacked: leaves ``[K, shards, rows, P + T]``. A batch travels with its plan as a
:class:`PackedBatch`; the loss and the reference forward unwrap it (``unwrap``).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from jaxrl_llm.train import packing as packing_lib


class PackedBatch(NamedTuple):
    """A preference batch and the packing plan of its forward rows.

    Attributes:
      rows: the batch (``types.PreferenceBatch``, ``losses.UnpairedBatch`` or
        ``losses.RewardBatch``), ``[N, ...]`` leaves.
      packing: the plan of its ``2N`` forward rows: stacked (``[K, shards, rows, W]``, as
        ``plan_batch`` makes it) while the batch is whole, one micro-batch's (``[shards, rows,
        W]``) inside the step's loss; None: padded.
    """

    rows: Any
    packing: Any = None


def unwrap(batch: Any) -> tuple[Any, Any]:
    """``(rows, plan)`` of a :class:`PackedBatch`; ``(batch, None)`` of a padded batch."""
    if isinstance(batch, PackedBatch):
        return batch.rows, batch.packing
    return batch, None


def forward_masks(batch: Any) -> tuple[Any, Any, Any]:
    """``(prompt_mask [N, P], first_mask [N, T], second_mask [N, T])`` of a preference batch:
    the two completion sets its loss scores in one forward."""
    pairs = getattr(batch, "pairs", batch)  # a reward model's RewardBatch holds pairs
    if hasattr(pairs, "chosen_mask"):
        return pairs.prompt_mask, pairs.chosen_mask, pairs.rejected_mask
    return pairs.prompt_mask, pairs.completion_mask, pairs.kl_completion_mask


def plan_batch(host: Any, *, micro_batches: int, shards: int, mode: Any) -> Any:
    """The stacked plan (NumPy, leaves ``[K, shards, rows, P + T]``) of ``host``'s forward
    rows for ``K = micro_batches`` strided micro-batches, or None when ``mode``
    (``trainer.packing``: ``train.packing.worth_packing``) runs the batch padded.

    Micro-batch ``k``'s plan covers ``[first[k::K] ; second[k::K]]`` (the rows the loss
    forwards), split into ``shards`` contiguous blocks as that forward's batch is sharded.

    Raises:
      ValueError: ``K`` or ``shards`` that do not divide the rows, or masks that are not a
        left-padded prompt and a right-padded completion (``train.packing``).
    """
    mode = packing_lib.packing_mode(mode)
    if mode == "off":
        return None
    prompt, first, second = (np.asarray(m) for m in forward_masks(host))
    rows = len(prompt)
    if micro_batches < 1 or rows % micro_batches:
        raise ValueError(
            f"packing needs micro_batches={micro_batches} to divide the batch's {rows} rows"
        )

    def forward_rows(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        # [2N, ...] whose strided micro-batch k is [a[k::K] ; b[k::K]].
        split = lambda x: x.reshape(rows // micro_batches, micro_batches, *x.shape[1:])  # noqa: E731
        return np.concatenate([split(a), split(b)]).reshape(2 * rows, *a.shape[1:])

    plan = packing_lib.plan_micro_batches(
        forward_rows(prompt, prompt),
        forward_rows(first, second),
        micro_batches=micro_batches,
        shards=shards,
    )
    if not packing_lib.worth_packing(plan, 2 * rows, mode):
        return None
    return plan


__all__ = ["PackedBatch", "forward_masks", "plan_batch", "unwrap"]
