"""``jaxrl-llm plan`` of a job whose sampler has chips of its own (``mesh.rollout_devices``):
which chips, what each side holds, the weight copy after each update and the RL step's model,
worked out by hand; the deviceless TPU compiles of both paths (one host; hosts of its own).

The tiny job of ``test_programs`` (4 prompts x 2 samples, prompts bucketed to 16 tokens, 8 new
tokens; 106,816 parameters) on the 8 fake CPU devices: the sampler on the first 4, the
trainer's fsdp 4 on the others.
"""

import types

import jax
import numpy as np
import pytest

from jaxrl_llm.plan import _split
from jaxrl_llm.plan import estimate as est
from jaxrl_llm.plan import programs as pr
from jaxrl_llm.plan.cli import format_report
from jaxrl_llm.plan.topology import libtpu_available, resolve_topology
from tests.plan.test_programs import (  # noqa: F401  (fixture)
    TINY_PARAMS,
    V5E_4,
    _cfg,
    compiled_report,
    tiny_path,
)

SPLIT = ("mesh.rollout_devices=4", "rollout.max_staleness=1")
W = 2 * TINY_PARAMS  # the whole model in bf16: every parameter is a float

needs_libtpu = pytest.mark.skipif(
    not libtpu_available(),
    reason="libtpu not importable (pip install 'jax[tpu]'): no deviceless TPU compiles",
)


def _split_job(path, *overrides):
    return pr.build_job(_cfg(path, *SPLIT, *overrides), V5E_4, devices=jax.devices())


def test_each_side_holds_its_own_by_hand(tiny_path):  # noqa: F811
    job = _split_job(tiny_path)
    devices = jax.devices()
    assert job.split.sampler_devices == tuple(devices[:4]) and not job.split.remote
    assert list(job.mesh.devices.flat) == devices[4:]  # the trainer's fsdp 4
    assert dict(job.serving.mesh.shape) == {"data": 2, "fsdp": 1, "tensor": 2}
    assert {d for d in job.serving.mesh.devices.flat} == set(devices[:4])
    programs = job.programs
    # The trainer casts its fsdp shard (P / 4 parameters) to bf16: 2 P / 4 bytes.
    reshard = programs["reshard"]
    assert reshard.argument_parts == {"parameters": TINY_PARAMS}
    assert reshard.inner_parts == {"sampler_weights": W // 4}
    assert "serving_reshard" not in programs  # one process: device_put lands it laid out
    # The sampler's chips hold its weights (tensor 2: each matrix halved, the two norms'
    # 2 x 64 + 64 entries whole... by hand below), its cache and temporaries; nothing else.
    layers, hidden, vocab = 2, 64, 256
    norms = (2 * layers + 1) * hidden  # replicated over tensor
    matrices = TINY_PARAMS - norms
    served = 2 * (matrices // 2 + norms)
    for name in ("prefill", "decode_step"):
        assert programs[name].resident == {}, name
        assert programs[name].argument_parts["sampler_weights"] == served, name
    assert vocab * hidden * 2 <= served  # sanity: both tables are in it
    # After each update: each of the 2 data replicas (tensor 2) gets all of W, W / 2 a chip.
    sync = job.split.sync
    assert sync["received_bytes_per_chip"] == W / 2
    assert sync["bytes"] == W / 2 * 4
    assert sync["sent_bytes_per_chip"] == W / 2 * 4 / 4
    assert sync["cut_links"] is None  # CPU devices have no coordinates
    ports = V5E_4.ici_links * V5E_4.ici_bandwidth_bytes_per_s_per_link
    assert sync["seconds"] == pytest.approx(W / 2 / ports)


def test_each_program_runs_on_its_sides_chips(tiny_path):  # noqa: F811
    """The trainer's mesh on 2 of its 4 chips (fsdp 2, no -1), the sampler on 4: each
    program's roofline divides its FLOPs over its own chips, not the slice's 8."""
    spec = resolve_topology("v5litepod-8")
    job = pr.build_job(_cfg(tiny_path, *SPLIT, "mesh.fsdp=2"), spec, devices=jax.devices())
    chips = {name: program.chips for name, program in job.programs.items()}
    assert chips == {
        "update": 2,
        "logprobs": 2,
        "ref_logprobs": 2,
        "reshard": 2,
        "prefill": 4,
        "decode_step": 4,
    }
    flops, peak = 1e12, spec.peak_bf16_flops_per_chip
    times = est.roofline(spec, flops=flops, hbm_bytes=0.0, chips=2)
    assert times["compute_s"] == flops / (2 * peak)
    assert times["roofline_mfu_bound"] == pytest.approx(1.0)
    assert est.roofline(spec, flops=flops, hbm_bytes=0.0)["compute_s"] == flops / (8 * peak)


def test_what_to_change_names_the_side_that_is_over(tiny_path):  # noqa: F811
    job = _split_job(tiny_path)
    usable = V5E_4.usable_hbm_bytes_per_chip

    def advice(*over):
        programs = {
            name: {
                "total_bytes": usable + 1 if name in over else 0,
                "compiled": True,
                "memory_bytes": {"kv_cache": 0},
            }
            for name in job.programs
        }
        return [line for line in pr.suggestions(job, programs) if "sampler chips" in line]

    assert advice("decode_step") == [
        "more sampler chips (mesh.rollout_devices=4 now): the sampler's side is over"
    ]
    assert advice("update") == [
        "fewer sampler chips (mesh.rollout_devices=4 now): the trainer's side is over"
    ]
    assert advice("update", "prefill") == []  # both sides: moving chips does not help


def test_the_step_model_by_hand():
    """``rollout + sync + trainer`` synchronous, ``max(rollout, sync + trainer)`` one step off;
    the sampler's programs are the rollout, every other program the trainer's."""

    def program(calls, seconds, conservative):
        return {
            "calls_per_step": calls,
            "times": {"step_s": seconds, "step_conservative_s": conservative},
        }

    programs = {
        "update": program(2, 1.0, 1.5),
        "logprobs": program(1, 0.5, 0.5),
        "reshard": program(1, 0.25, 0.25),
        "prefill": program(1, 0.5, 1.0),
        "decode_step": program(10, 0.2, 0.3),
    }
    split = types.SimpleNamespace(
        sampler_devices=(0, 1), trainer_devices=(2, 3, 4), remote=False, sync={"seconds": 0.5}
    )
    for k, step in ((0, 2.5 + 0.5 + 2.75), (1, max(2.5, 0.5 + 2.75))):
        job = types.SimpleNamespace(
            split=split, run=types.SimpleNamespace(sampler=types.SimpleNamespace(max_staleness=k))
        )
        got = _split.split_report(job, programs)
        assert (got["rollout_s"], got["trainer_s"], got["weight_sync_s"]) == (2.5, 2.75, 0.5)
        assert got["step_s"] == pytest.approx(step), k
        assert got["sampler_idle"] == pytest.approx(1 - 2.5 / step)
        assert got["trainer_idle"] == pytest.approx(1 - 3.25 / step)
        conservative = _split.split_report(job, programs, "step_conservative_s")
        rollout, trainer = 1.0 + 3.0, 3.0 + 0.5 + 0.25
        assert conservative["step_s"] == pytest.approx(
            max(rollout, 0.5 + trainer) if k else rollout + 0.5 + trainer
        )


def _grid(spec, hosts_of=lambda x, y: 0):
    return [
        types.SimpleNamespace(id=i, coords=(x, y, 0), process_index=hosts_of(x, y))
        for i, (y, x) in enumerate(np.ndindex(spec.shape[1], spec.shape[0]))
    ]


def test_cut_links_by_hand():
    spec = resolve_topology("v5litepod-16")  # 4 x 4, no wraparound
    chips = _grid(spec)
    corner = [d for d in chips if d.coords[0] >= 2 and d.coords[1] >= 2]  # a 2 x 2 block
    rest = [d for d in chips if d not in corner]
    assert _split.cut_links(rest, corner, spec) == 4  # 2 across x = 1|2, 2 across y = 1|2
    row = [d for d in chips if d.coords[1] == 3]
    assert _split.cut_links([d for d in chips if d not in row], row, spec) == 4
    torus = spec.__class__(**{**spec.__dict__, "wrap": (True, True, False)})
    assert _split.cut_links(rest, corner, torus) == 8  # and 2 more each way around
    assert _split.cut_links(rest, corner + [types.SimpleNamespace(id=99)], spec) is None


def test_weight_sync_by_hand():
    spec = resolve_topology("v5litepod-16")
    link = spec.ici_bandwidth_bytes_per_s_per_link
    chips = _grid(spec)
    last = tuple(d for d in chips if d.coords[1] == 3)  # 4 sampler chips, a row of the 4 x 4
    first = tuple(d for d in chips if d.coords[1] < 3)
    gib = 2.0**30
    # One host, a sampler of tensor 2 on 4 chips: 2 replicas of W, W / 2 into each chip.
    one = _split.weight_sync(spec, _split.Split(last, first, False), 8 * gib, 2)
    assert (one["bytes"], one["received_bytes_per_chip"]) == (16 * gib, 4 * gib)
    assert one["sent_bytes_per_chip"] == 16 * gib / 12 and one["cut_links"] == 4
    assert one["cut_s"] == 16 * gib / (4 * link)
    assert one["ports_s"] == 4 * gib / (4 * link)
    assert one["seconds"] == one["cut_s"]
    # Hosts of its own: shard for shard, W once (the trainer's mesh as large as the sampler's).
    far = _split.weight_sync(spec, _split.Split(last, first[:4], True), 8 * gib, 2)
    assert (far["bytes"], far["received_bytes_per_chip"], far["sent_bytes_per_chip"]) == (
        8 * gib,
        2 * gib,
        2 * gib,
    )


@pytest.mark.parametrize(
    "overrides, message",
    [
        (("mesh.rollout_devices=8",), r"mesh.rollout_devices must be an int in \[0, 8\)"),
        (("mesh.rollout_devices=2", "model.lora.rank=4"), "model.lora with mesh.rollout"),
        (
            ("mesh.rollout_devices=4", "rollout.tensor_parallel=trainer"),
            "the sampler's layout: rollout.tensor_parallel=trainer",
        ),
    ],
)
def test_refusals_name_the_key(tiny_path, overrides, message):  # noqa: F811
    with pytest.raises(pr.PlanError, match=message):
        pr.build_job(_cfg(tiny_path, *overrides), V5E_4, devices=jax.devices())


@pytest.mark.parametrize(
    "overrides, trainer_chips, message",
    [
        (("mesh.rollout_devices=2",), 6, r"splits process\(es\) \[1\]"),
        (("mesh.rollout_devices=4",), 2, "as many devices as the trainer's mesh"),
        (
            ("mesh.rollout_devices=4", "rollout.partial=true", "rollout.engine=continuous"),
            4,
            "rollout.partial: not supported with the sampler on processes of its own",
        ),
        (("mesh.rollout_devices=4",), 4, None),
    ],
)
def test_a_sampler_on_hosts_of_its_own_is_refused_as_train_refuses_it(
    tiny_path,  # noqa: F811
    overrides,
    trainer_chips,
    message,
):
    """Two hosts of 4 chips: the sampler takes the last whole host, the trainer's mesh as
    many chips (``train.rl.remote.check_remote_split``)."""
    chips = [types.SimpleNamespace(id=i, process_index=i // 4) for i in range(8)]
    cfg = _cfg(tiny_path, *overrides)

    def plan():
        split = _split.split_job(cfg, chips)
        trainer_mesh = types.SimpleNamespace(devices=np.empty(trainer_chips))
        _split.check_trainer_mesh(cfg, split, trainer_mesh)
        return split

    if message is None:
        split = plan()
        assert split.remote and split.sampler_devices == tuple(chips[4:])
    else:
        with pytest.raises(pr.PlanError, match=message):
            plan()


@needs_libtpu
@pytest.mark.parametrize(
    "topology, overrides, hosts_of_its_own",
    [
        # v5e 2 x 4 as two hosts of 2 x 2: the sampler on the second host, the trainer's fsdp 4
        # on the first; the landed shards resharded on the sampler's chips.
        ("v5litepod-8", ("mesh.fsdp=4", *SPLIT), True),
        # v5p-8 (one host, 2 x 2): the sampler on 2 chips in the trainer's process.
        ("v5p-8", ("mesh.fsdp=2", "mesh.rollout_devices=2"), False),
    ],
)
def test_deviceless_tpu_plans_of_both_paths(tiny_path, topology, overrides, hosts_of_its_own):  # noqa: F811
    spec = resolve_topology(topology)
    job = pr.build_job(_cfg(tiny_path, *overrides), spec)
    assert job.split.remote is hosts_of_its_own
    report = compiled_report(job, pr.compile_job(job))
    assert report["fits"]
    split = report["split"]
    assert split["weight_sync"]["cut_links"] == 2  # two chips face the other side
    assert ("serving_reshard" in report["programs"]) is hosts_of_its_own
    if hosts_of_its_own:
        # The reshard into the serving layout moves collectives on the sampler's chips.
        assert sum(report["programs"]["serving_reshard"]["collective_bytes"].values()) > 0
        assert split["step_model"] == "max(rollout, sync + trainer)"
    # The update's FLOPs over the trainer's chips only (half the slice).
    trainer_chips = len(job.split.trainer_devices)
    assert report["programs"]["update"]["times"]["compute_s"] == pytest.approx(
        job.programs["update"].flops / (trainer_chips * spec.peak_bf16_flops_per_chip)
    )
    rollout = sum(
        p["calls_per_step"] * p["times"]["step_s"]
        for n, p in report["programs"].items()
        if n in _split.SAMPLER_PROGRAMS
    )
    assert split["rollout_s"] == pytest.approx(rollout)
    assert report["est_step_s"] == split["step_s"]
    text = format_report(report)
    assert f"sampler: {split['sampler_chips']} chips of its own" in text
    assert f"RL step with rollout.max_staleness={job.cfg.rollout.max_staleness}" in text
