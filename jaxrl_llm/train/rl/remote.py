"""Sampler and trainer in different processes of one job: ``mesh.rollout_devices`` across
processes (the separate rollout workers of verl and OpenRLHF, inside one JAX cluster).

When the last ``mesh.rollout_devices`` devices are every device of the last processes, those
processes only sample (:class:`SamplerProcess`) and the others train (``RLTrainer`` with a
:class:`RemotePipeline`). Each side runs its own programs on its own devices, and they meet
once a step:

- **weights, trainer → sampler, device to device.** The trainer casts its parameters to the
  compute dtype (fresh buffers the update never donates) and ``jax.device_put``s them onto the
  sampler's devices under their own partition specs (over a mesh of the sampler's devices
  shaped like the trainer's); the sampler makes the same call on placeholders of those arrays,
  receives them, and reshards them locally into its serving layout. On CPU, JAX moves them
  through its socket transfer service: set ``JAX_CROSS_HOST_TRANSFER_SOCKET_ADDRESS``
  (``host:port``, one per process) before the job starts.
- **the scored batch, sampler → trainer, through the job's coordination service** (its
  key-value store): host arrays (tokens, masks, rewards, the sampler's log-probs, each
  token's policy version) and the data position, small beside the weights.

The schedule is the one-process asynchronous loop's (``rollout.max_staleness = k``, k = 0
included): the rollout of step ``s`` samples from the weights of step ``max(s - k, start)``
and the trainer sends step ``s``'s weights before it waits for batch ``s``, so the update of
step ``s`` runs while the sampler generates batch ``s + k``. A run on two processes samples and
trains what the one-process run on the same devices does; its checkpoints hold the batches in
flight and the sampler's data position, so it resumes exactly as that run does.
"""

from __future__ import annotations

import logging
import pickle
import time
import traceback
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from jaxrl_llm import data, models, parallel
from jaxrl_llm.train import setup
from jaxrl_llm.train.core import PhaseTimer
from jaxrl_llm.train.rl.context import make_run_context
from jaxrl_llm.train.rl.pipeline import Pipeline, staleness_info
from jaxrl_llm.train.rl.rollout import StepRollout
from jaxrl_llm.train.rl.serving import trainer_sampler
from jaxrl_llm.train.rl.spec import resolve

log = logging.getLogger("jaxrl_llm")

_PREFIX = "jaxrl_llm/rollout/"
# How long a process waits for the other side's message (the slowest rollout or update).
WAIT_MS = 24 * 3600 * 1000


def is_remote(cfg: Any) -> bool:
    """Whether the job's sampler sits on processes of its own (``mesh.rollout_devices`` on a
    multi-process job)."""
    return bool(cfg.mesh.rollout_devices) and jax.process_count() > 1


def setup_roles(cfg: Any) -> bool:
    """Names the trainer processes of a remote job (they write its files and checkpoint);
    returns whether this process is one of its samplers (``is_remote`` jobs only)."""
    if not is_remote(cfg):
        return False
    sampler, trainer = setup.process_roles(setup.rollout_devices(cfg.mesh))
    parallel.set_trainer_processes(trainer)
    return jax.process_index() in sampler


def check_remote(cfg: Any) -> None:
    """Refuses what a sampler on other processes cannot run yet, naming the key.

    Raises:
      ValueError: what ``check_remote_split`` refuses, or CPU processes with no transfer
        address.
    """
    check_remote_split(cfg, jax.devices(), setup.make_run_mesh(cfg.mesh).devices.size)
    if jax.default_backend() == "cpu" and not jax.config.read(
        "jax_cross_host_transfer_socket_address"
    ):
        raise ValueError(
            f"mesh.rollout_devices={cfg.mesh.rollout_devices} on {jax.process_count()} CPU "
            f"processes: the weights cross between processes through JAX's socket transfers; "
            f"set {parallel.distributed.TRANSFER_ADDRESS_ENV}=host:port (a free port of this "
            "host, one per process) before the job starts"
        )


def check_remote_split(cfg: Any, devices: Sequence[Any], trainer_devices: int) -> None:
    """The refusals of a job whose last ``mesh.rollout_devices`` of ``devices`` (on several
    processes) sample, the trainer's mesh having ``trainer_devices`` devices (``plan`` checks
    a slice's compile-only devices with it).

    Raises:
      ValueError: partial rollouts, LoRA, a learned reward model, a process split between
        sampler and trainer, more than one process on either side, a trainer mesh with
        another device count than the sampler's.
    """
    n = cfg.mesh.rollout_devices
    processes = setup.process_count(devices)
    refused = {
        "rollout.partial": cfg.rollout.partial,
        "model.lora": cfg.model.lora is not None,
        "reward_model.path": cfg.reward_model.path is not None,
    }
    for key, set_ in refused.items():
        if set_:
            raise ValueError(
                f"{key}: not supported with the sampler on processes of its own "
                f"(mesh.rollout_devices={n} on {processes} processes); unset it, or sample "
                "on the trainer's processes"
            )
    sampler, trainer = setup.process_roles(n, devices)
    if len(sampler) > 1 or len(trainer) > 1:
        raise ValueError(
            f"mesh.rollout_devices={n} makes processes {list(sampler)} sample and "
            f"{list(trainer)} train: with the sampler on processes of its own, the job runs "
            "as two processes for now (one sampling, one training)"
        )
    if trainer_devices != n:
        raise ValueError(
            f"mesh.rollout_devices={n}: the weights cross to the sampler shard for shard, so "
            f"on several processes it needs as many devices as the trainer's mesh "
            f"({trainer_devices})"
        )


def mirror_mesh(trainer_mesh: Mesh, rollout_devices: int) -> Mesh:
    """The sampler's devices in the trainer mesh's shape and axes (the weights' landing)."""
    devices = np.asarray(setup.split_devices(rollout_devices)[0])
    devices = devices.reshape(trainer_mesh.devices.shape)
    return Mesh(devices, trainer_mesh.axis_names, axis_types=trainer_mesh.axis_types)


def to_serving(arrived: Any, shardings: Any) -> Any:
    """The landed weights (compute dtype, the trainer's layout on the sampler's devices) on
    the sampler's serving layout. ``jax.device_put``, not a jitted reshard: the serving mesh
    orders the same devices for the chips' topology (``parallel.make_mesh``), and a jitted
    program refuses arguments and outputs whose device orders differ; ``device_put``
    relabels the shards into the serving order, then reshards."""
    return jax.device_put(arrived, shardings)


def _mirrored(tree: Any, mesh: Mesh) -> Any:
    return jax.tree.map(lambda x: NamedSharding(mesh, x.sharding.spec), tree)


class Messages:
    """Pickled host messages between the processes, through the coordination service."""

    def __init__(self):
        from orbax.checkpoint import multihost  # noqa: PLC0415

        self.client = multihost.get_jax_distributed_client()

    def send(self, name: str, message: Any) -> None:
        self.client.key_value_set_bytes(_PREFIX + name, pickle.dumps(message))

    def receive(self, name: str) -> Any:
        key = _PREFIX + name
        message = pickle.loads(self.client.blocking_key_value_get_bytes(key, WAIT_MS))
        self.client.key_value_delete(key)
        if isinstance(message, dict) and "error" in message:
            raise RuntimeError(f"the other side of the job failed:\n{message['error']}")
        return message


def _clock_offset() -> float:
    """``time.time() - time.perf_counter()`` here: turns this process's timeline spans into
    another's clock (``perf_counter`` origins differ between processes and hosts)."""
    return time.time() - time.perf_counter()


def _shift(timer: PhaseTimer, offset: float) -> PhaseTimer:
    timer.spans = [(lane, name, a + offset, b + offset) for lane, name, a, b in timer.spans]
    return timer


class TrainerLink:
    """The trainer's side: sends each step's weights (``__call__``, the trainer's ``reshard``)."""

    def __init__(self, model_config: Any, trainer_mesh: Mesh, rollout_devices: int):
        self.model_config = model_config
        self.mesh = mirror_mesh(trainer_mesh, rollout_devices)
        self.cast = self.targets = self.sent = None

    def __call__(self, params: Any) -> Any:
        if self.cast is None:
            self.cast = jax.jit(
                lambda p: jax.tree.map(jax.numpy.copy, _cast(p, self.model_config)),
                out_shardings=jax.tree.map(lambda x: x.sharding, params),
            )
            self.targets = _mirrored(params, self.mesh)
        # Fresh buffers (the update donates the state's), kept until the next send.
        self.sent = self.cast(params)
        return jax.device_put(self.sent, self.targets)


def _cast(params: Any, model_config: Any) -> Any:
    return models.cast_params(params, model_config)


class RemotePipeline(Pipeline):
    """The trainer's pipeline when the sampler runs on processes of its own: batches come
    from them.

    ``prompts`` is the trainer's ``PromptSampler``: it follows the sampler process's data
    position (each batch carries it), so a checkpoint saves where the sampler stands, and a
    resumed run sends it back with the step to start from.
    """

    def __init__(self, max_staleness: int, prompts: data.PromptSampler):
        self.max_staleness = max_staleness
        self.prompts = prompts
        self.draw_starts: dict[int, Any] = {}  # the samplers draw: their batches carry it
        self.messages = Messages()
        self.ready: dict[int, tuple] = {}
        self.started = False
        self.step = 0

    def _receive(self, step: int) -> tuple:
        samples, info, timer, version, position, offset = self.messages.receive(f"batch/{step}")
        self.prompts.restore(position)
        return samples, info, _shift(timer, offset - _clock_offset()), version

    def next(self, step: int, snapshot, timer: PhaseTimer):
        if not self.started:
            in_flight = sorted(self.ready)
            self.messages.send(
                "start", {"step": step, "in_flight": in_flight, "data": self.prompts.state()}
            )
            self.started = True
        self.step = step
        self.messages.send(f"weights/{step}", step)
        snapshot()  # this step's weights, to the sampler
        with timer.phase("wait_rollout"):
            item = self.ready.pop(step, None) or self._receive(step)
        samples, info, produced, version = item
        timer.merge(produced)
        return samples, {**info, **staleness_info(samples, step, version)}

    def drain_until_failure(self, finish) -> tuple[list[tuple], tuple[int, Exception] | None]:
        """The batches in flight after the current step (received now, kept for later), up to
        the first that failed: ``(items before it, (its step, its error) or None)``.
        ``prompts`` stays at the last batch received."""
        items = []
        for step in range(self.step + 1, self.step + 1 + self.max_staleness):
            try:
                if step not in self.ready:
                    self.ready[step] = self._receive(step)
                samples, info, timer, version = self.ready[step]
                items.append((step, finish(samples, timer), info, version, timer))
            except Exception as err:
                return items, (step, err)
        return items, None

    def preload(self, items) -> None:
        self.ready = {step: (s, info, timer, version) for step, s, info, version, timer in items}

    def close(self) -> None:
        """Tells a sampler waiting for the run's start or for weights that none will come (the
        run stopped early); after the last step no sampler waits, and the message is unread."""
        stopped = {"error": f"the trainer stopped (after step {self.step})"}
        self.messages.send(f"weights/{self.step + 1}" if self.started else "start", stopped)


class SamplerProcess:
    """A sampler process of a remote job: receives weights, samples and scores each step's
    batch (a ``rollout_lib.StepRollout``, as the trainer's, on this process's devices) and
    sends it on."""

    def __init__(self, cfg: Any):
        self.cfg = cfg
        self.spec = spec = resolve(cfg)
        objective = spec.objective
        check_remote(cfg)
        trainer_mesh = setup.make_run_mesh(cfg.mesh)
        tokenizer, model_config = _policy(cfg, spec.precision, trainer_mesh)
        self.serving, _ = trainer_sampler(cfg, model_config, trainer_mesh)
        self.run = make_run_context(cfg, self.serving.mesh, tokenizer, model_config, objective)
        self.sampler = data.PromptSampler(
            self.run.train_examples, seed=cfg.seed, shuffle=cfg.data.shuffle
        )
        self.key = jax.random.key(cfg.seed)
        # Scored here, before the batch leaves (nothing to overlap the scoring with).
        self.rollout_from = StepRollout(
            self.run, self.sampler, self.key, mesh=self.serving.mesh, defer=False
        )
        self.messages = Messages()
        # Placeholders of the trainer's cast parameters: this process's half of the transfer.
        dtype = spec.precision.param
        shapes = jax.eval_shape(
            lambda p: _cast(p, model_config), models.param_shapes(model_config, dtype)
        )
        shardings = parallel.logical_to_sharding(
            models.logical_axes(model_config), trainer_mesh, parallel.PARAM_RULES, shapes=shapes
        )
        self.placeholders = jax.tree.map(
            lambda s, sh: jax.make_array_from_single_device_arrays(s.shape, sh, [], dtype=s.dtype),
            shapes,
            shardings,
        )
        self.landing = mirror_mesh(trainer_mesh, cfg.mesh.rollout_devices)

    def receive_weights(self, version: int) -> Any:
        """Step ``version``'s weights, once the trainer says it sends them (a trainer that
        stopped says so instead, and this raises)."""
        self.messages.receive(f"weights/{version}")
        arrived = jax.device_put(self.placeholders, _mirrored(self.placeholders, self.landing))
        return jax.block_until_ready(to_serving(arrived, self.serving.shardings))

    def loop(self) -> dict[str, Any]:
        """Samples until the trainer's last step (and the ``k`` batches after it, which a
        longer resumed run would train on); returns the rollouts' count."""
        cfg = self.cfg
        k = self.spec.sampler.max_staleness
        start = self.messages.receive("start")
        self.sampler.restore(start["data"])
        first = max([start["step"] - 1, *start["in_flight"]]) + 1
        version = start["step"]
        params = self.receive_weights(version)
        log.info("sampler process: rollouts %d..%d", first, cfg.trainer.max_steps + k - 1)
        steps = range(first, cfg.trainer.max_steps + k)
        for step in steps:
            while version < max(step - k, start["step"]):
                version += 1
                params = self.receive_weights(version)
            timer = PhaseTimer(lane="rollout")
            try:
                with jax.set_mesh(self.serving.mesh):
                    samples, info = self.rollout_from(step, params, timer)
                    samples = self.run.finish_scoring(samples, timer)
            except Exception:
                self.messages.send(f"batch/{step}", {"error": traceback.format_exc()})
                raise
            message = (samples, info, timer, version, self.sampler.state(), _clock_offset())
            self.messages.send(f"batch/{step}", message)
        return {"job": cfg.job, "role": "sampler", "rollouts": len(steps)}


def _policy(cfg: Any, precision: Any, trainer_mesh: Mesh) -> tuple[Any, Any]:
    """``(tokenizer, model_config)`` as the trainer builds them (no weights loaded here)."""
    if cfg.model.path is None:
        tokenizer, model_config, _ = setup.build_policy(cfg, trainer_mesh, precision)
        return tokenizer, model_config
    config, _ = setup.load_model(cfg.model.path, precision, weights=False)  # no LoRA (refused)
    return models.load_tokenizer(cfg.model.path), config


def run_sampler(cfg: Any) -> dict[str, Any]:
    """A sampler process's whole job."""
    return SamplerProcess(cfg).loop()
