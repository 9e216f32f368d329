"""The sampler's role is read from the config once (``SamplerRole.of``) and answers for the
trainer: its place, layout, weight transfer, pipeline and evaluation target."""

from __future__ import annotations

import pytest

from jaxrl_llm import data
from jaxrl_llm.train import setup
from jaxrl_llm.train.rl import remote
from jaxrl_llm.train.rl.pipeline import RolloutPipeline
from jaxrl_llm.train.rl.sampler_role import SamplerRole
from tests.train.rl import rl_helpers


def _role(tmp_path, *overrides):
    cfg = rl_helpers.tiny_config(None, tmp_path, *overrides)
    mesh = setup.make_run_mesh(cfg.mesh)
    _, model_config, _ = setup.build_policy(cfg, mesh)
    return cfg, mesh, SamplerRole.of(cfg, model_config, mesh)


@pytest.mark.needs_devices(8)
@pytest.mark.parametrize(
    ("overrides", "place", "sampler_devices"),
    [((), "shared", 1), (("mesh.rollout_devices=4", "mesh.fsdp=-1"), "separate", 4)],
)
def test_one_process_roles_place_the_sampler_and_sample_there(
    tmp_path, overrides, place, sampler_devices
):
    cfg, mesh, role = _role(tmp_path, *overrides)
    assert role.place == place
    assert role.layout.mesh.devices.size == sampler_devices
    if place == "separate":  # devices of its own, apart from the trainer's
        assert not set(role.layout.mesh.devices.flat) & set(mesh.devices.flat)
    prompts = data.PromptSampler(data.arithmetic_examples(8, seed=0), seed=0)
    pipeline = role.pipeline(
        lambda *a: None, max_staleness=0, mesh=mesh, partial=False, prompts=prompts
    )
    assert isinstance(pipeline, RolloutPipeline)
    sampled = object()
    assert role.evaluation("policy", lambda: sampled, mesh) == (sampled, role.layout.mesh)


def test_a_remote_role_evaluates_on_the_trainer_and_receives_batches(tmp_path, monkeypatch):
    _, mesh, shared = _role(tmp_path)
    role = SamplerRole("remote", shared.layout, shared.send)
    made = []
    monkeypatch.setattr(remote, "RemotePipeline", lambda *args: made.append(args) or "remote")
    prompts = object()
    pipeline = role.pipeline(
        lambda *a: None, max_staleness=1, mesh=mesh, partial=False, prompts=prompts
    )
    assert (pipeline, made) == ("remote", [(1, prompts)])
    # The sampler's devices are another process's: the policy evaluates on the trainer's mesh.
    assert role.evaluation("policy", lambda: pytest.fail("no sampler here"), mesh) == (
        "policy",
        mesh,
    )
