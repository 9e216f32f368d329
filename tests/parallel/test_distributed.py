"""Cluster detection and initialize_distributed, with jax.distributed.initialize mocked."""

import jax
import pytest

from jaxrl_llm.parallel import (
    ClusterSpec,
    detect_cluster,
    distributed,
    first_slurm_host,
    initialize_distributed,
)

_PREFIXES = ("SLURM_", "TPU_", "MEGASCALE_", "JAX_COORDINATOR", "JAX_NUM_PROCESSES", "JAX_PROCESS")


@pytest.fixture
def calls(monkeypatch):
    """A clean launcher environment and a recording stand-in for jax.distributed.initialize."""
    import os

    for name in list(os.environ):
        if name.startswith(_PREFIXES):
            monkeypatch.delenv(name)
    monkeypatch.setattr(distributed, "_initialized_as", None)
    monkeypatch.setattr(jax.distributed, "is_initialized", lambda: False)
    recorded = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kwargs: recorded.append(kwargs))
    return recorded


def test_detect_nothing():
    assert detect_cluster({}) == ClusterSpec("none")
    assert detect_cluster({"SLURM_NTASKS": "1", "SLURM_PROCID": "0"}).kind == "none"
    assert (
        detect_cluster({"TPU_WORKER_HOSTNAMES": "localhost", "TPU_WORKER_ID": "0"}).kind == "none"
    )
    assert detect_cluster({"JAX_COORDINATOR_ADDRESS": "h:1"}).kind == "none"


def test_detect_explicit():
    env = {
        "JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234",
        "JAX_NUM_PROCESSES": "4",
        "JAX_PROCESS_ID": "2",
    }
    assert detect_cluster(env) == ClusterSpec("explicit", 4, 2, "10.0.0.1:1234")
    single = {**env, "JAX_NUM_PROCESSES": "1", "JAX_PROCESS_ID": "0"}
    assert detect_cluster(single).kind == "none"
    # Explicit variables win over a surrounding SLURM allocation.
    assert detect_cluster({**env, "SLURM_NTASKS": "8", "SLURM_PROCID": "5"}).kind == "explicit"


@pytest.mark.parametrize(
    "env, match",
    [
        ({"JAX_NUM_PROCESSES": "2"}, r"missing \['JAX_COORDINATOR_ADDRESS', 'JAX_PROCESS_ID'\]"),
        ({"JAX_PROCESS_ID": "0", "JAX_COORDINATOR_ADDRESS": "h:1"}, r"missing \['JAX_NUM_PROC"),
        (
            {"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "2"},
            r"process id 2 is not in \[0, 2\)",
        ),
        (
            {"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "two", "JAX_PROCESS_ID": "0"},
            "JAX_NUM_PROCESSES='two' is not an integer",
        ),
        ({"SLURM_NTASKS": "4"}, "SLURM_PROCID is not set"),
        ({"SLURM_NTASKS": "4", "SLURM_PROCID": "4"}, r"process id 4 is not in \[0, 4\)"),
        ({"SLURM_NTASKS": "4", "SLURM_PROCID": "1"}, "SLURM_STEP_NODELIST"),
        ({"SLURM_NTASKS": "4", "SLURM_PROCID": "1", "SLURM_NODELIST": "n1"}, "SLURM_JOB_ID"),
    ],
)
def test_detect_errors(env, match):
    with pytest.raises(ValueError, match=match):
        detect_cluster(env)


def test_detect_slurm():
    env = {
        "SLURM_JOB_ID": "12345",
        "SLURM_NTASKS": "4",
        "SLURM_PROCID": "3",
        "SLURM_LOCALID": "1",
        "SLURM_STEP_NODELIST": "gpu[007-008],cpu1",
    }
    # Port: 12345 mod 4096 = 57, + 61440 (JAX's SLURM convention) = 61497.
    assert detect_cluster(env) == ClusterSpec("slurm", 4, 3, "gpu007:61497")
    assert detect_cluster({**env, "JAX_COORDINATOR_PORT": "7777"}).coordinator_address == (
        "gpu007:7777"
    )
    assert detect_cluster({**env, "JAX_COORDINATOR_ADDRESS": "head:9"}).coordinator_address == (
        "head:9"
    )
    # The step's task count wins over the allocation's.
    assert detect_cluster({**env, "SLURM_STEP_NUM_TASKS": "1"}).kind == "none"
    assert detect_cluster({**env, "SLURM_STEP_NUM_TASKS": "2", "SLURM_PROCID": "1"}) == (
        ClusterSpec("slurm", 2, 1, "gpu007:61497")
    )


@pytest.mark.parametrize(
    "nodelist, host",
    [
        ("node001", "node001"),
        ("node001,host2", "node001"),
        ("node[001-015],host2", "node001"),
        ("node[007,009-015]", "node007"),
        ("a[1-2]b[7-8],c", "a1b7"),
        ("gpu-[3-4]-ib", "gpu-3-ib"),
    ],
)
def test_first_slurm_host(nodelist, host):
    assert first_slurm_host(nodelist) == host


def test_first_slurm_host_errors():
    with pytest.raises(ValueError, match="unclosed"):
        first_slurm_host("node[001-003")
    with pytest.raises(ValueError, match="empty SLURM node list"):
        first_slurm_host(",node1")


def test_detect_tpu():
    env = {"TPU_WORKER_HOSTNAMES": "h0,h1,h2,h3", "TPU_WORKER_ID": "2"}
    assert detect_cluster(env) == ClusterSpec("tpu", 4, 2, None)
    multislice = {
        "TPU_WORKER_HOSTNAMES": "h0,h1",
        "TPU_WORKER_ID": "1",
        "MEGASCALE_NUM_SLICES": "2",
        "MEGASCALE_SLICE_ID": "1",
        "MEGASCALE_COORDINATOR_ADDRESS": "h0",
    }
    assert detect_cluster(multislice) == ClusterSpec("tpu", 4, 3, None)
    assert detect_cluster({"MEGASCALE_NUM_SLICES": "2"}) == ClusterSpec("tpu")


def test_no_env_is_a_no_op(calls):
    info = initialize_distributed()
    assert calls == []
    assert info == (0, 1, 8, 8, "none")
    assert info.process_index == 0 and info.global_device_count == jax.device_count()


def test_explicit_env_and_idempotence(calls, monkeypatch):
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "127.0.0.1:4321")
    monkeypatch.setenv("JAX_NUM_PROCESSES", "2")
    monkeypatch.setenv("JAX_PROCESS_ID", "1")
    info = initialize_distributed(initialization_timeout=17)
    assert calls == [
        {
            "coordinator_address": "127.0.0.1:4321",
            "num_processes": 2,
            "process_id": 1,
            "cluster_detection_method": "deactivate",
            "initialization_timeout": 17,
        }
    ]
    assert info.cluster == "explicit"
    assert initialize_distributed().cluster == "explicit"
    assert len(calls) == 1


def test_slurm_env(calls, monkeypatch):
    for name, value in {
        "SLURM_JOB_ID": "4096",
        "SLURM_NTASKS": "16",
        "SLURM_PROCID": "5",
        "SLURM_LOCALID": "1",
        "SLURM_JOB_NODELIST": "tpu-host[10-25]",
    }.items():
        monkeypatch.setenv(name, value)
    info = initialize_distributed(local_device_ids=(1,))
    (kwargs,) = calls
    assert kwargs["coordinator_address"] == "tpu-host10:61440"
    assert (kwargs["num_processes"], kwargs["process_id"]) == (16, 5)
    assert kwargs["local_device_ids"] == [1]
    assert "cluster_detection_method" not in kwargs
    assert info.cluster == "slurm"


def test_tpu_env_leaves_the_details_to_jax(calls, monkeypatch):
    monkeypatch.setenv("TPU_WORKER_HOSTNAMES", "w0,w1")
    monkeypatch.setenv("TPU_WORKER_ID", "0")
    assert initialize_distributed().cluster == "tpu"
    assert calls == [{"initialization_timeout": 300}]


def test_force_uses_jax_auto_detection(calls):
    assert initialize_distributed(force=True).cluster == "auto"
    assert calls == [{"initialization_timeout": 300}]


def test_already_initialized_elsewhere(calls, monkeypatch):
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "127.0.0.1:4321")
    monkeypatch.setenv("JAX_NUM_PROCESSES", "2")
    monkeypatch.setenv("JAX_PROCESS_ID", "0")
    monkeypatch.setattr(jax.distributed, "is_initialized", lambda: True)
    assert initialize_distributed().cluster == "external"
    assert calls == []


def test_half_specified_env_raises(calls, monkeypatch):
    monkeypatch.setenv("JAX_NUM_PROCESSES", "2")
    with pytest.raises(ValueError, match="JAX_PROCESS_ID"):
        initialize_distributed()
    assert calls == []
