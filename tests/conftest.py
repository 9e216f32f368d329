"""Test-wide setup: 8 fake CPU devices for sharding tests, set before JAX is imported, and one
persistent compilation cache for the session."""

import os
import pathlib
import shutil
import tempfile

_flag = "--xla_force_host_platform_device_count=8"
if _flag not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# LLVM at -O0 for the session's own compiles: XLA:CPU compiling is ~70% of this suite's time
# and LLVM's optimisation a third of each compile (tests/sampling/test_engine.py: 150 s -> 105
# s). The HLO -- fusions, layouts, collectives, memory -- is the same at every level; the CPU
# kernels run slower and round differently in the last bits (-O2 fuses multiply-adds), so a
# result compared with this session's to the bit must come from the same level (the
# multi-process launcher passes it on). Runs "as a user runs them" (the console-script jobs,
# ``tests.train.helpers.single_device_env``) drop it.
FAST_COMPILE_FLAG = "--xla_backend_optimization_level=0"
if "--xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ["XLA_FLAGS"] + " " + FAST_COMPILE_FLAG).strip()

import numpy as np  # noqa: E402
import pytest  # noqa: E402

# The session's compilation cache (``tests.train.helpers.SHARED_CACHE_ENV``): the controller
# makes it, the xdist workers and subprocess sessions inherit it, so the many tiny jobs that
# compile the same programs compile them once between both workers.
CACHE_ENV = "JAXRL_TEST_JAX_CACHE"
_made_cache: list[str] = []

# Modules whose tests read compiled executables (HLO text, memory or cost analysis): a cached
# executable's text differs from a fresh compile's, so they always compile. (A jit's in-memory
# ``_cache_size``, which others count, is the same either way.)
_UNCACHED = (
    "tests/plan/",
    "tests/parallel/",
    "tests/models/test_attention.py",
    "tests/sampling/test_layout.py",
    "tests/sampling/test_serving.py",
)
_ROOT = pathlib.Path(__file__).resolve().parents[1]


def _atomic_cache_writes() -> None:
    """JAX's on-disk cache without a size limit writes an entry in place (``LRUCache.put``:
    ``write_bytes``, no lock), so the other xdist worker can read it half-written and crash
    deserializing it (seen once: a segfault in ``compilation_cache.get_executable_and_time``).
    Here an entry is written to a temporary file and renamed into place (atomic on POSIX)."""
    from jax._src import lru_cache  # noqa: PLC0415

    put = lru_cache.LRUCache.put

    def atomic_put(self, key: str, value: bytes) -> None:
        if self.eviction_enabled or not key:  # locked (or refused) by JAX itself
            return put(self, key, value)
        path = self.path / f"{key}{lru_cache._CACHE_SUFFIX}"
        if path.exists():
            return None
        partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
        partial.write_bytes(value)
        os.replace(partial, path)
        return None

    lru_cache.LRUCache.put = atomic_put


def pytest_configure(config):
    _atomic_cache_writes()
    if CACHE_ENV not in os.environ:
        os.environ[CACHE_ENV] = tempfile.mkdtemp(prefix="jaxrl-test-jax-cache-")
        _made_cache.append(os.environ[CACHE_ENV])


def pytest_unconfigure(config):
    for path in _made_cache:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module", autouse=True)
def _compilation_cache(request, tmp_path_factory):
    """Every module's programs go through the session's on-disk cache (compiles of 0.2 s or
    more), except the modules that inspect compiled executables."""
    path = pathlib.Path(request.node.path).resolve()
    name = path.relative_to(_ROOT).as_posix() if path.is_relative_to(_ROOT) else ""
    if not name or name.startswith(_UNCACHED):
        yield
        return
    from tests.train.helpers import persistent_compilation_cache  # noqa: PLC0415

    fallback = tmp_path_factory.getbasetemp() / "jax_cache"
    with persistent_compilation_cache(fallback, min_compile_secs=0.2):
        yield


def _memory_maps() -> tuple[int, int] | None:
    """(this process's memory mappings, the kernel's per-process limit), where readable."""
    try:
        with open("/proc/self/maps") as maps, open("/proc/sys/vm/max_map_count") as limit:
            return sum(1 for _ in maps), int(limit.read())
    except (OSError, ValueError):
        return None


@pytest.fixture(scope="module", autouse=True)
def _bounded_compiled_code():
    """XLA:CPU maps every compiled program's code and data into the process (about six
    mappings a program), and JAX keeps every program of the session alive in its caches. An
    xdist worker that ran ~1,400 tests passed Linux's default limit of 65,530 mappings, and
    the next compile or cache read died in LLVM (an abort in ``executable.serialize()``, a
    segfault in ``deserialize_executable``; seen in three full runs). After a module, past
    40% of the limit, JAX's caches are dropped (later modules' programs come back from the
    on-disk cache)."""
    yield
    counts = _memory_maps()
    if counts is not None and counts[0] > 0.4 * counts[1]:
        import gc  # noqa: PLC0415

        import jax  # noqa: PLC0415

        jax.clear_caches()
        gc.collect()


@pytest.fixture
def rng():
    """A NumPy generator with a fixed seed, fresh for every test."""
    return np.random.default_rng(0)


def pytest_runtest_setup(item):
    """``cpu_only``: the test checks the CPU backend's own behaviour; ``needs_devices(n)``: it
    builds an ``n``-device mesh. Both skip elsewhere (e.g. on one GPU), where CI never runs."""
    cpu_only = item.get_closest_marker("cpu_only")
    needs = item.get_closest_marker("needs_devices")
    if cpu_only is None and needs is None:
        return
    import jax  # noqa: PLC0415  (after XLA_FLAGS above)

    if cpu_only is not None and jax.default_backend() != "cpu":
        pytest.skip(f"checks the CPU backend; this run's is {jax.default_backend()}")
    if needs is not None and jax.device_count() < needs.args[0]:
        pytest.skip(f"needs {needs.args[0]} devices, this run has {jax.device_count()}")


# The longest test files (minutes of two-process or 8-device work each), run first: with
# ``--dist loadfile`` the workers then fill in with the short files and finish together
# (longest-first scheduling) instead of one of them running a long file alone at the end.
_FIRST = (
    "tests/train/rl/test_tool_task.py",
    "tests/train/rl/test_default_learns.py",
    "tests/plan/test_cli.py",
    "tests/train/test_adapters.py",
    "tests/parallel/test_two_process_step.py",
    "tests/train/rl/test_pipeline.py",
)


def pytest_collection_modifyitems(config, items):
    """The longest files run first (``_FIRST``); the mutation check (its two halves,
    tests/test_mutation.py and tests/test_mutation_second_half.py) runs last: its child
    sessions reuse the compilation cache the rest of the suite filled."""
    first = [item for item in items if item.nodeid.split("::")[0] in _FIRST]
    first.sort(key=lambda item: _FIRST.index(item.nodeid.split("::")[0]))
    last = [item for item in items if item.nodeid.endswith("test_every_mutant_is_killed")]
    middle = [item for item in items if item not in first and item not in last]
    items[:] = first + middle + last
