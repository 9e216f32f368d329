"""Built-in task with headroom for RL: arithmetic taught by a teacher who forgets carries.

The prompts and reference answers are the built-in arithmetic task's (``"56+78="`` →
``"134"``, ``data.arithmetic``). Only the SFT warm-up's demonstrations differ: where the
problem carries out of the units column (``a + b``) or borrows into it (``a - b``), the
teacher's worked answer drops that carry or borrow with probability ``slip_rate``
(``"56+78="`` → ``"124"``, ``"52-7="`` → ``"55"``), a fresh draw each time the warm-up draws
the problem (``draw_demonstration``): the teacher is unreliable, not wrong about a fixed set of
problems the student could memorise. Supervised learning imitates the teacher, slips included:
on carrying problems the warm-up's greedy answer is the slip, while the right answer stays among
its samples (with probability about ``1 - slip_rate``). A reward that checks
the answer (``math_match`` against the reference) is what teaches the carry back, so the
warm-up ends far below the ceiling and RL has that gap to close: the regime of post-training
on imperfect demonstrations, small enough for the tiny CPU model (``configs/carry_slips.yaml``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jaxrl_llm.data.arithmetic import arithmetic_examples
from jaxrl_llm.data.datasets import Example

#: Operators whose carry or borrow the teacher drops.
SLIP_OPS = ("+", "-")
#: The share of carrying problems whose demonstration drops the carry (``data.task:
#: carry_slips``).
SLIP_RATE = 0.7


def slipped_answer(a: int, op: str, b: int) -> int | None:
    """The answer of ``a op b`` with the carry out of (``+``) or the borrow into (``-``) the
    units column dropped, or None when there is none to drop.

    ``7+5`` → 2 (not 12), ``56+78`` → 124 (not 134), ``52-7`` → 55 (not 45), ``12+3`` → None.
    Operands are non-negative.

    Raises:
      ValueError: an operator other than ``+`` / ``-``, or a negative operand.
    """
    if op not in SLIP_OPS:
        raise ValueError(f"the teacher slips on {SLIP_OPS} only, got {op!r}")
    if a < 0 or b < 0:
        raise ValueError(f"operands must be non-negative, got {a} and {b}")
    if op == "+":
        return a + b - 10 if a % 10 + b % 10 >= 10 else None
    return a - b + 10 if a % 10 < b % 10 else None


def check_slip_rate(slip_rate: float) -> float:
    """``slip_rate`` as a float in [0, 1].

    Raises:
      ValueError: anything else.
    """
    if isinstance(slip_rate, bool) or not isinstance(slip_rate, int | float | np.floating):
        raise ValueError(f"slip_rate must be a number in [0, 1], got {slip_rate!r}")
    if not 0.0 <= slip_rate <= 1.0:
        raise ValueError(f"slip_rate must be a number in [0, 1], got {slip_rate!r}")
    return float(slip_rate)


def carry_slip_examples(
    n: int,
    *,
    seed: int,
    digits: int | Sequence[int] = (1, 2),
    ops: Sequence[str] = SLIP_OPS,
    slip_rate: float = SLIP_RATE,
) -> list[Example]:
    """``n`` distinct problems of ``data.arithmetic_examples`` (same prompts, answers and order
    for the same arguments), each with the teacher's demonstration.

    ``extra["demonstration"]`` (``data.demonstration``'s one fixed demonstration) is the
    reference answer, or, for a problem with a carry or borrow in the units column, with
    probability ``slip_rate`` (a draw of its own, seeded by ``seed``) the answer with it
    dropped (``slipped_answer``); ``extra["slipped"]`` says which. A carrying problem also
    holds both, ``extra["demonstrations"] = (answer, slip)`` with ``extra[
    "demonstration_weights"] = (1 - slip_rate, slip_rate)``: the SFT warm-up draws one of them
    afresh at every draw of the problem (``draw_demonstration``).

    Raises:
      ValueError: bad settings (``arithmetic_examples``'s), an operator other than ``+`` /
        ``-`` or a ``slip_rate`` outside [0, 1].
    """
    ops = (ops,) if isinstance(ops, str) and len(ops) == 1 else tuple(ops)
    bad = [op for op in ops if op not in SLIP_OPS]
    if bad:
        raise ValueError(f"the carry_slips task takes ops from {SLIP_OPS}, got {ops!r}")
    slip_rate = check_slip_rate(slip_rate)
    examples = arithmetic_examples(n, seed=seed, digits=digits, ops=ops)
    rng = np.random.default_rng([seed, 47])
    out = []
    for ex, u in zip(examples, rng.random(len(examples)), strict=True):
        a, b = ex.extra["operands"]
        slipped = slipped_answer(a, ex.extra["op"], b)
        slips = slipped is not None and bool(u < slip_rate)
        demo = str(slipped) if slips else ex.answer
        extra = {**ex.extra, "task": "carry_slips", "demonstration": demo, "slipped": slips}
        if slipped is not None:
            extra["demonstrations"] = (ex.answer, str(slipped))
            extra["demonstration_weights"] = (1.0 - slip_rate, slip_rate)
        out.append(Example(prompt=ex.prompt, answer=ex.answer, extra=extra))
    return out
