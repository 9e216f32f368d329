"""Host side of an RL rollout: sample G completions per prompt, decode, score, select groups.

Nothing here is traced: tokenising and rewards are Python; sampling calls the jitted sampler.
On several processes every process gathers the whole sampled batch (it is small: tokens and
log-probs), scores it identically, and later feeds only its own rows to the sharded step.
:func:`collect` is the rollout of one RL step, including DAPO's dynamic sampling (groups whose
rewards are all equal are replaced by fresh draws).
"""

from __future__ import annotations

import abc
import concurrent.futures
import contextlib
import dataclasses
import json
import logging
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from jaxrl_llm import sampling
from jaxrl_llm.data.encoding import decode_completions, encode_prompts, pad_id
from jaxrl_llm.parallel import fetch
from jaxrl_llm.rewards import RewardInput, compute_rewards, is_correct
from jaxrl_llm.sampling.engine import Engine, Request, batch_routing

log = logging.getLogger("jaxrl_llm")


class Samples(NamedTuple):
    """One sampled batch on the host; rows ``g*G … g*G+G-1`` answer prompt ``g``."""

    prompt_tokens: np.ndarray  # [N*G, P] int32, left-padded
    prompt_mask: np.ndarray  # [N*G, P] bool
    completion_tokens: np.ndarray  # [N*G, T] int32, right-padded
    completion_mask: np.ndarray  # [N*G, T] bool, includes EOS
    completions: list[str]  # N*G decoded texts
    prompts: list[str]  # N*G prompt texts
    rewards: np.ndarray | None  # [N*G] f32 (None while ``scoring`` is pending)
    correct: np.ndarray  # [N*G] bool
    components: dict[str, np.ndarray] | None  # reward name -> [N*G] (None while pending)
    finished: np.ndarray  # [N*G] bool, ended with EOS within the length limit
    logprobs: np.ndarray | None = None  # [N*G, T] f32, the sampler's log-probs (0 on padding)
    # Multi-turn episodes (``envs``): [N*G, T] bool, the sampled tokens (trained), a subset of
    # completion_mask (attended: the environment's tokens too); None = completion_mask.
    loss_mask: np.ndarray | None = None
    info: dict[str, np.ndarray] | None = None  # per-row episode statistics (turns, tool calls)
    # Deferred scoring (``DrawRequest.defer``): the future of ``(rewards,
    # components)`` from the scoring workers; ``finish_scoring`` waits and fills them in.
    scoring: concurrent.futures.Future | None = None
    # Partial rollouts (``updates``): [N*G, T] int32, the policy version that sampled each
    # token (0 on padding); None = every token from the weights the draw started with.
    versions: np.ndarray | None = None
    # The continuous engine's run (``sampling.engine.EngineStats``): slot utilisation, a paged
    # cache's preemptions and peak blocks; None from the static sampler.
    engine: Any = None
    # Routing replay (``model.routing_replay``): [N*G, P + T, L, k] int32, the experts each
    # mixture-of-experts layer of the sampler chose for each token of ``[prompt ;
    # completion]`` (-1 on padding); None when not recorded.
    routing: np.ndarray | None = None


def records_routing(context: Any) -> bool:
    """Whether a run's draws record the sampler's routing (``model.routing_replay`` set)."""
    return context.cfg.model.replay_mode != "off"


def finish_scoring(samples: Samples) -> Samples:
    """``samples`` with the rewards of a deferred scoring filled in (waits for the workers).

    Raises:
      RewardError: if a reward function failed or a scoring worker died.
    """
    if samples.scoring is None:
        return samples
    rewards, components = samples.scoring.result()
    return samples._replace(
        rewards=np.asarray(rewards, np.float32), components=components, scoring=None
    )


@dataclasses.dataclass(frozen=True)
class DrawRequest:
    """What one draw asks for besides the weights, the examples and the key.

    Attributes:
      temperature: the sampling temperature (0: greedy).
      group_size: samples of each example's prompt, G.
      mesh: the mesh the weights live on (the sampler's serving layout).
      timer: a ``train.core.PhaseTimer`` that gets the ``rollout`` and ``scoring`` phases.
      defer: with scoring workers, return as soon as the rows are sent to them (``rewards``
        None, ``Samples.scoring`` their future; ``finish_scoring`` fills them in), so the
        caller dispatches device work while the verifiers run.
      updates: partial rollouts (the continuous engine): a ``sampling.requests.WeightUpdates``
        whose newer weights the draw decodes with from its next burst on, each token's version
        in ``Samples.versions``; ``version`` is the weights' the draw starts with.
    """

    temperature: float
    group_size: int
    mesh: Any = None
    timer: Any = None
    defer: bool = False
    updates: Any = None
    version: int = 0

    def phase(self, name: str):
        """The ``timer``'s phase ``name`` (nothing without a timer)."""
        return contextlib.nullcontext() if self.timer is None else self.timer.phase(name)


class Drawer(abc.ABC):
    """Draws ``G`` samples of each example's prompt from given weights, scored (or with their
    scoring deferred): the one interface of a run's ways of sampling — the static engine, the
    continuous engine and an environment's multi-turn episodes (``RunContext.drawer`` picks one
    per run). ``context``: the run's ``RunContext`` (tokenizer, reward, stop tokens, settings),
    read at each draw (a LoRA run's merged sampler config is set after it is built)."""

    def __init__(self, context: Any):
        self.context = context

    @abc.abstractmethod
    def draw(self, params: Any, examples: Sequence[Any], key: jax.Array, request: DrawRequest):
        """The draw as ``Samples`` (rewards included unless ``request.defer`` with workers)."""


class TokenDrawer(Drawer):
    """A sampler of token rows (:meth:`tokens`): prompts encoded, completions decoded and
    scored by the run's reward (in this process, or by its scoring workers)."""

    @abc.abstractmethod
    def tokens(self, params, prompt_tokens, prompt_mask, key, request: DrawRequest) -> tuple:
        """``(tokens, mask, logprobs, versions or None, engine stats or None, routing or
        None)``, each ``[N*G, T]`` right-padded on the host; ``routing`` ``[N*G, P + T, L,
        k]`` int32 (``records_routing``) aligned with the given prompts' width ``P``."""

    def draw(self, params, examples, key, request: DrawRequest) -> Samples:
        context = self.context
        prompts = context.prompts(examples)
        with request.phase("rollout"):
            prompt_tokens, prompt_mask = encode_prompts(
                context.tokenizer,
                prompts,
                max_prompt_tokens=context.cfg.data.max_prompt_tokens,
                add_special_tokens=not context.cfg.data.chat_template,
            )
            tokens, mask, logprobs, versions, stats, routing = self.tokens(
                params, prompt_tokens, prompt_mask, key, request
            )
        with request.phase("scoring"):
            g = request.group_size
            texts = decode_completions(context.tokenizer, tokens, mask)
            lengths = mask.sum(axis=1)
            last = tokens[np.arange(len(tokens)), np.maximum(lengths - 1, 0)]
            finished = (lengths > 0) & np.isin(last, context.stop_ids)
            row_examples = [ex for ex in examples for _ in range(g)]
            row_prompts = [p for p in prompts for _ in range(g)]
            inputs = [
                RewardInput(prompt=p, completion=c, example=ex, completion_tokens=int(n))
                for p, c, ex, n in zip(row_prompts, texts, row_examples, lengths)
            ]
            pending, scorer = None, context.scorer
            if scorer is None:
                rewards, components = compute_rewards(context.reward_fn, inputs)
            elif request.defer:
                pending, rewards, components = scorer.submit_score(inputs), None, None
            else:
                rewards, components = scorer.score(inputs)
            correct = np.array([is_correct(c, ex) for c, ex in zip(texts, row_examples)], bool)
        return Samples(
            prompt_tokens=np.repeat(prompt_tokens, g, axis=0),
            prompt_mask=np.repeat(prompt_mask, g, axis=0),
            completion_tokens=tokens,
            completion_mask=mask,
            completions=texts,
            prompts=row_prompts,
            rewards=None if pending else np.asarray(rewards, np.float32),
            correct=correct,
            components=components,
            finished=finished,
            logprobs=np.asarray(logprobs, np.float32),
            scoring=pending,
            versions=versions,
            engine=stats,
            routing=routing,
        )


class StaticDrawer(TokenDrawer):
    """``rollout.engine=static``: ``sampling.generate``, one batch that decodes until its
    longest row finishes."""

    def tokens(self, params, prompt_tokens, prompt_mask, key, request: DrawRequest) -> tuple:
        context, settings = self.context, self.context.settings
        record = records_routing(context)
        out = sampling.generate(
            params,
            context.sampling_config,
            prompt_tokens,
            prompt_mask,
            key=key,
            max_new_tokens=settings.max_new_tokens,
            sampling=sampling.SamplingOptions(
                eos_ids=tuple(context.stop_ids),
                pad_id=pad_id(context.tokenizer),
                **settings.sampling(request.temperature),
            ),
            num_samples=request.group_size,
            mesh=request.mesh,
            decode_layers=settings.decode_layers,
            record_routing=record,
        )
        completion, routing = out if record else (out, None)
        tokens, mask = fetch(completion.tokens), fetch(completion.mask)
        if routing is not None:
            routing = np.asarray(fetch(routing), np.int32)
        return tokens, mask, fetch(completion.logprobs), None, None, routing


class ContinuousDrawer(TokenDrawer):
    """``rollout.engine=continuous``: the continuous-batching ``sampling.engine.Engine`` with
    ``rollout.slots`` slots (default: every row; a multiple of the mesh's batch shards) and
    ``rollout.burst`` decode steps per host round trip (on several processes each runs the
    same host loop over the whole draw), paged with ``rollout.kv_block_size``; with
    ``request.updates`` it takes newer weights in flight (partial rollouts)."""

    def tokens(self, params, prompt_tokens, prompt_mask, key, request: DrawRequest) -> tuple:
        context, settings = self.context, self.context.settings
        mask = np.asarray(prompt_mask, bool)
        requests = [
            Request(np.asarray(prompt_tokens)[i][mask[i]], prompt_key=i)
            for i in range(len(mask))
            for _ in range(request.group_size)
        ]
        pad, t_len = pad_id(context.tokenizer), settings.max_new_tokens
        engine = Engine(
            params,
            context.sampling_config,
            settings=sampling.EngineSettings(
                slots=min(settings.slots or len(requests), len(requests)),
                burst=settings.burst,
                decode_layers=settings.decode_layers,
                kv_block_size=settings.kv_block_size or None,
                kv_blocks=settings.kv_blocks,
            ),
            max_new_tokens=t_len,
            max_prompt_len=int(mask.sum(axis=1).max()),
            sampling=sampling.SamplingOptions(
                eos_ids=tuple(context.stop_ids),
                pad_id=pad,
                **settings.sampling(request.temperature),
            ),
            mesh=request.mesh,
            record_routing=records_routing(context),
        )
        results, stats = engine.run(
            requests, key=key, updates=request.updates, version=request.version
        )
        tokens = np.full((len(results), t_len), pad, np.int32)
        completion_mask = np.zeros((len(results), t_len), bool)
        logprobs = np.zeros((len(results), t_len), np.float32)
        versions = np.zeros((len(results), t_len), np.int32)
        for row, result in enumerate(results):
            n = len(result.tokens)
            tokens[row, :n] = result.tokens
            completion_mask[row, :n] = True
            logprobs[row, :n] = result.logprobs
            versions[row, :n] = result.versions
        versions = versions if request.updates is not None else None
        routing = None
        if records_routing(context):
            routing = batch_routing(results, mask.shape[1], t_len)
        return tokens, completion_mask, logprobs, versions, stats, routing


def concat_samples(parts: Sequence[Samples]) -> Samples:
    """Row-wise concatenation (prompt widths padded on the left to the widest)."""
    width = max(p.prompt_tokens.shape[1] for p in parts)

    def left_pad(x: np.ndarray, fill) -> np.ndarray:
        return np.pad(x, ((0, 0), (width - x.shape[1], 0)), constant_values=fill)

    routing = None
    if all(p.routing is not None for p in parts):  # [prompt ; completion], prompts re-padded
        routing = np.concatenate(
            [
                np.pad(
                    p.routing,
                    ((0, 0), (width - p.prompt_tokens.shape[1], 0), (0, 0), (0, 0)),
                    constant_values=-1,
                )
                for p in parts
            ]
        )

    def rows(field: str):
        values = [getattr(p, field) for p in parts]
        return None if any(v is None for v in values) else np.concatenate(values)

    info = (
        None
        if any(p.info is None for p in parts)
        else {k: np.concatenate([p.info[k] for p in parts]) for k in parts[0].info}
    )
    return Samples(
        prompt_tokens=np.concatenate([left_pad(p.prompt_tokens, 0) for p in parts]),
        prompt_mask=np.concatenate([left_pad(p.prompt_mask, False) for p in parts]),
        completion_tokens=rows("completion_tokens"),
        completion_mask=rows("completion_mask"),
        completions=[c for p in parts for c in p.completions],
        prompts=[c for p in parts for c in p.prompts],
        rewards=rows("rewards"),
        correct=rows("correct"),
        components={
            k: np.concatenate([p.components[k] for p in parts]) for k in parts[0].components
        },
        finished=rows("finished"),
        logprobs=rows("logprobs"),
        loss_mask=rows("loss_mask"),
        info=info,
        versions=rows("versions"),
        routing=routing,
    )


def select_groups(samples: Samples, groups: np.ndarray, group_size: int) -> Samples:
    """The rows of the given group indices, in that order. A pending scoring
    (``Samples.scoring``) gives its rewards and components for those rows when it finishes;
    the draw's ``engine`` statistics are kept."""
    rows = (groups[:, None] * group_size + np.arange(group_size)[None, :]).reshape(-1)
    take = lambda x: None if x is None else x[rows]  # noqa: E731
    scoring = None if samples.scoring is None else _rows_of(samples.scoring, rows)
    components = samples.components
    return Samples(
        prompt_tokens=take(samples.prompt_tokens),
        prompt_mask=take(samples.prompt_mask),
        completion_tokens=take(samples.completion_tokens),
        completion_mask=take(samples.completion_mask),
        completions=[samples.completions[r] for r in rows],
        prompts=[samples.prompts[r] for r in rows],
        rewards=take(samples.rewards),
        correct=take(samples.correct),
        components=None if components is None else {k: take(v) for k, v in components.items()},
        finished=take(samples.finished),
        logprobs=take(samples.logprobs),
        loss_mask=take(samples.loss_mask),
        info=None if samples.info is None else {k: take(v) for k, v in samples.info.items()},
        scoring=scoring,
        versions=take(samples.versions),
        engine=samples.engine,
        routing=take(samples.routing),
    )


def _rows_of(scoring: concurrent.futures.Future, rows: np.ndarray) -> concurrent.futures.Future:
    """A future of ``scoring``'s ``(rewards, components)`` at ``rows`` (its error, if any)."""
    out: concurrent.futures.Future = concurrent.futures.Future()

    def done(future: concurrent.futures.Future) -> None:
        try:
            rewards, components = future.result()
        except BaseException as err:  # noqa: BLE001  (passed on to whoever waits)
            out.set_exception(err)
            return
        picked = None
        if components is not None:
            picked = {k: np.asarray(v)[rows] for k, v in components.items()}
        out.set_result((np.asarray(rewards)[rows], picked))

    scoring.add_done_callback(done)
    return out


def constant_groups(rewards: np.ndarray, group_size: int) -> np.ndarray:
    """``[N]`` bool: groups whose rewards are all equal (zero advantage under GRPO)."""
    grouped = rewards.reshape(-1, group_size)
    return grouped.max(axis=1) == grouped.min(axis=1)


def reward_columns(samples: Samples) -> np.ndarray:
    """``[N*G, K]`` float32: each reward function's score of every row, before its weight (the
    ``rewards`` terms in order, then a learned reward model's): what GDPO normalises column by
    column before summing.

    Raises:
      ValueError: a draw without per-reward scores (still scoring).
    """
    if not samples.components:
        raise ValueError("reward columns need the draw's per-reward scores (Samples.components)")
    return np.stack([np.asarray(v, np.float32) for v in samples.components.values()], axis=1)


def zero_variance_info(samples: Samples, group_size: int) -> dict[str, float]:
    """``{"zero_variance_frac": .}``: the fraction of groups of a scored draw with equal rewards."""
    return {"zero_variance_frac": float(constant_groups(samples.rewards, group_size).mean())}


def engine_info(draws: Sequence[Samples]) -> dict[str, float]:
    """The continuous engine's figures over a step's draws (none from the static sampler):
    ``engine/slot_utilisation`` (tokens per slot-step run), ``engine/admissions``,
    ``engine/prefill_rows`` (prompts prefilled) and ``engine/reused_prompts`` (requests
    admitted from a prompt a live slot held, not prefilled again), and with a paged cache
    ``engine/preemptions`` (requests recomputed) and ``engine/kv_peak_blocks``
    (the most blocks in use at once)."""
    stats = [d.engine for d in draws if d.engine is not None]
    if not stats:
        return {}
    slot_steps = sum(s.slot_steps for s in stats)
    info = {
        "engine/slot_utilisation": sum(s.tokens for s in stats) / max(slot_steps, 1),
        "engine/admissions": float(sum(s.admissions for s in stats)),
        "engine/prefill_rows": float(sum(s.prefill_rows for s in stats)),
        "engine/reused_prompts": float(sum(s.reused_prompts for s in stats)),
    }
    if any(s.peak_blocks for s in stats):
        info["engine/preemptions"] = float(sum(s.preemptions for s in stats))
        info["engine/kv_peak_blocks"] = float(max(s.peak_blocks for s in stats))
    return info


def collect(
    draw: Callable[[int], Samples],
    *,
    prompts_per_step: int,
    group_size: int,
    dynamic_sampling: bool,
    max_attempts: int,
) -> tuple[Samples, dict[str, float]]:
    """One RL step's rollout: ``prompts_per_step`` groups, DAPO dynamic sampling optional.

    ``draw(attempt)`` samples ``prompts_per_step`` fresh prompts × ``group_size`` completions
    (always a full draw: one sampler program). With ``dynamic_sampling`` (Yu et al. 2025,
    DAPO) groups whose rewards are all equal (zero advantage) are dropped and the batch is
    refilled from further draws, at most ``max_attempts`` extra; groups still missing are
    filled with dropped groups under a zero completion mask (same batch shape: no re-trace).

    Without dynamic sampling the draw is returned as it comes, so it may still be scoring
    (``Samples.scoring``, a deferred draw): its ``info`` is then empty and the caller adds
    ``zero_variance_info`` after ``finish_scoring``. With it, every draw is scored first.

    Returns:
      ``(samples, info)``; ``info`` has ``zero_variance_frac`` of the first draw, the
      continuous engine's figures over every draw (``engine_info``) and, with dynamic
      sampling, ``dynamic/dropped_groups``, ``dynamic/filled_groups``, ``dynamic/attempts``.
    """
    first = draw(0)
    if not dynamic_sampling:  # a deferred draw's zero_variance_frac comes once it is scored
        scored = {} if first.scoring else zero_variance_info(first, group_size)
        return first, {**scored, **engine_info([first])}
    first = finish_scoring(first)
    constant = constant_groups(first.rewards, group_size)
    info: dict[str, float] = zero_variance_info(first, group_size)
    draws = [first]
    kept, dropped_pool = [], []
    need, dropped, attempts, samples = prompts_per_step, 0, 0, first
    while True:
        good = np.flatnonzero(~constant)[:need]
        kept.append(select_groups(samples, good, group_size))
        dropped_pool.append(select_groups(samples, np.flatnonzero(constant), group_size))
        dropped += int(constant.sum())
        need -= len(good)
        attempts += 1
        if need <= 0 or attempts > max_attempts:
            break
        samples = finish_scoring(draw(attempts))
        draws.append(samples)
        constant = constant_groups(samples.rewards, group_size)
    filled = max(need, 0)
    if filled:
        filler = select_groups(concat_samples(dropped_pool), np.arange(filled), group_size)
        kept.append(
            filler._replace(
                completion_mask=np.zeros_like(filler.completion_mask),
                loss_mask=None if filler.loss_mask is None else np.zeros_like(filler.loss_mask),
            )
        )
    info.update(
        {
            "dynamic/dropped_groups": dropped,
            "dynamic/filled_groups": filled,
            "dynamic/attempts": attempts,
            **engine_info(draws),
        }
    )
    return (concat_samples(kept) if len(kept) > 1 else kept[0]), info


class StepRollout:
    """One RL step's rollout: ``rollout.prompts_per_step`` prompts drawn from ``prompts``,
    ``G`` samples of each from given weights (``RunContext.sample``), DAPO's dynamic sampling
    replacing zero-variance groups (:func:`collect`). The pipeline calls it with each step's
    weights (``produce``), on the trainer or a sampler process of its own.

    Args:
      run: the run's ``RunContext``.
      prompts: the run's ``data.PromptSampler`` (the data position moves as it draws).
      key: the run's key (step ``s`` draws with ``fold_in(key, s)``).
      mesh: the mesh the weights live on (the sampler's serving layout).
      defer: without dynamic sampling, return the draw while the scoring workers run
        (``RunContext.finish_scoring`` completes it): the log-prob forwards are dispatched
        meanwhile.
    """

    def __init__(self, run: Any, prompts: Any, key: jax.Array, *, mesh: Any, defer: bool):
        self.run, self.prompts, self.key, self.mesh = run, prompts, key, mesh
        # Dynamic sampling waits for every draw's rewards before choosing the groups.
        self.defer = defer and not run.objective.advantage.dynamic_sampling

    def __call__(
        self, step: int, params: Any, timer: Any, updates: Any = None, version: int = 0
    ) -> tuple[Samples, dict]:
        """The step's groups from ``params`` and their info; ``updates``, ``version``:
        partial rollouts (``DrawRequest``)."""
        r = self.run.cfg.rollout
        step_key = jax.random.fold_in(self.key, step)

        def draw(attempt: int) -> Samples:
            return self.run.sample(
                params,
                self.prompts.next_batch(r.prompts_per_step),
                jax.random.fold_in(step_key, attempt),
                temperature=r.temperature,
                group_size=r.group_size,
                timer=timer,
                mesh=self.mesh,
                defer=self.defer,
                updates=updates,
                version=version,
            )

        return collect(
            draw,
            prompts_per_step=r.prompts_per_step,
            group_size=r.group_size,
            dynamic_sampling=self.run.objective.advantage.dynamic_sampling,
            max_attempts=r.max_resample_attempts,
        )


def prompt_excerpt(prompt: str, width: int = 60) -> str:
    """``prompt`` on one line in at most ``width`` characters, for a sample's log line: every
    run of whitespace (newlines included) one space, and when longer than ``width`` its start
    and its end with ``…`` between (the end, where the question usually is, one character
    longer than the start).

    Raises:
      ValueError: ``width`` under 3 (no room for a start, ``…`` and an end).
    """
    if width < 3:
        raise ValueError(f"width must be at least 3, got {width}")
    text = " ".join(prompt.split())
    if len(text) <= width:
        return text
    head = (width - 1) // 2
    return text[:head] + "…" + text[len(text) - (width - 1 - head) :]


def write_samples(path, step: int, samples: Samples, *, show: int = 0) -> None:
    """Appends ``samples``' completions to the JSONL file ``path`` (``step``, ``prompt``,
    ``completion``, ``reward``, ``correct``) and logs the first ``show``."""
    with open(path, "a", encoding="utf-8") as f:
        for i, (prompt, completion) in enumerate(zip(samples.prompts, samples.completions)):
            row = {
                "step": step,
                "prompt": prompt,
                "completion": completion,
                "reward": float(samples.rewards[i]),
                "correct": bool(samples.correct[i]),
            }
            f.write(json.dumps(row) + "\n")
    for i in range(min(show, len(samples.completions))):
        log.info(
            "sample %d: %r -> %r (reward %.3f)",
            i,
            prompt_excerpt(samples.prompts[i]),
            samples.completions[i][:120],
            float(samples.rewards[i]),
        )
