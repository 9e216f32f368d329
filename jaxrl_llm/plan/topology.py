"""Cloud TPU topologies for deviceless (ahead-of-time) compilation, with per-chip hardware specs.

``resolve_topology(name)`` accepts a Cloud TPU accelerator type or a raw JAX topology name and
returns a ``TopologySpec``; ``get_devices(spec)`` returns compile-only TPU devices for it through
``jax.experimental.topologies.get_topology_desc`` (needs ``libtpu``: ``pip install jax[tpu]``,
no TPU attached); ``try_compile(lowered)`` compiles, turning XLA:TPU's compile-time
out-of-HBM error into a ``CompileOutcome`` with the sizes it names. One JAX device is one
chip: v4 and v5p run their two TensorCores as one "megacore" device
(``chip_config_name="megacore"``; without it a v4 chip shows as two devices).

Accepted names (case-insensitive):

* ``v4-N``, ``v5p-N``: N TensorCores, two per chip (``v5p-8`` = 4 chips = ``v5p:2x2x1``).
* ``v5litepod-N``, ``v5e-N``, ``v6e-N``: N chips, N in {1, 4, 8, 16, 32, 64, 128, 256}.
* raw JAX names ``v4:AxBxC``, ``v5p:AxBxC`` (``v5:AxBxC`` too), ``v5e:AxB``, ``v6e:AxB``.

Shapes of Cloud names follow Google's tables (v5e / v6e: 1x1, 2x2, 2x4, 4x4, 4x8, 8x8, 8x16,
16x16; v4 / v5p: 2x2x1, 2x2x2, 2x2x4, 2x4x4, 4x4x4, 4x4x8, 4x8x8, 8x8x8, ...): the most balanced
``A <= B <= C`` factorisation of the chip count, every dimension a multiple of 4 from 64 chips on
(full 4x4x4 cubes), the first two even below that (hosts hold 2x2x1 chips), and 4 chips = 2x2x1.
Checked in ``get_topology_desc`` (libtpu 0.0.42): a layout must be divisible by the per-host
chip bounds (default 2x2x1), so 1 or 2 chip layouts pass smaller bounds, which is done here.
Wraparound links (torus) are set where Google's docs have them: every dimension of v4 / v5p
slices whose dimensions are all multiples of 4, and the 16-chip dimensions of v5e / v6e.

Per-chip specs (Google Cloud TPU documentation, "TPU v4", "TPU v5e", "TPU v5p", "TPU v6e"
system-architecture tables, https://cloud.google.com/tpu/docs/<version>, read 2026):

========  ========  ==============  ===============  ====================================
chip      HBM       peak bf16       HBM bandwidth    ICI (bidirectional, per chip; ports)
========  ========  ==============  ===============  ====================================
v4        32 GiB    275 TFLOP/s     1200 GB/s        6 ports; ~50 GB/s each way a link [1]
v5e       16 GiB    197 TFLOP/s     819 GB/s         400 GB/s over 4 ports
v5p       95 GiB    459 TFLOP/s     2765 GB/s        1200 GB/s over 6 ports
v6e       32 GiB    918 TFLOP/s     1638 GB/s        800 GB/s over 4 ports
========  ========  ==============  ===============  ====================================

``ici_bandwidth_bytes_per_s_per_link`` is one direction of one link: bidirectional per-chip
bandwidth / (2 x ports) = 50 GB/s (v5e), 100 GB/s (v5p, v6e). [1] The v4 page gives no per-chip
ICI figure; 50 GB/s each way (400 Gb/s) over 6 links is from the TPU v4 paper (Jouppi et al.,
ISCA 2023) and is the least certain number here. v5e and v6e list HBM as "16 GB" / "32 GB";
16 / 32 GiB is what the chips carry. The TPU compiler (libtpu 0.0.42) refuses programs over
15.75 GiB (v5e), 30.75 GiB (v4), 31.25 GiB (v6e) and 95.74 GiB (v5p: so the chip has 96 GiB,
Google's table rounds down) a chip, read from its RESOURCE_EXHAUSTED messages on deviceless
compiles; ``usable_hbm_bytes_per_chip`` holds these and ``estimate.memory_breakdown`` checks
``fits`` against them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import math
import os
import re
import time
from typing import Any

from jax.experimental import topologies

GiB = 1024**3

_ACCEPTED = (
    "accepted forms: 'v4-N' / 'v5p-N' (N TensorCores, 2 per chip, e.g. v4-8, v5p-128), "
    "'v5litepod-N' / 'v5e-N' / 'v6e-N' (N chips in 1, 4, 8, 16, 32, 64, 128, 256), or a raw "
    "JAX topology name 'v4:AxBxC', 'v5p:AxBxC', 'v5e:AxB', 'v6e:AxB' (e.g. v5e:4x4, v5p:2x2x4)"
)


@dataclasses.dataclass(frozen=True)
class _Chip:
    generation: str
    jax_prefix: str  # the version prefix get_topology_desc accepts
    dims: int  # 2 (2D torus) or 3 (3D torus)
    hbm_bytes: int
    usable_hbm_bytes: int  # what the compiler lets a program use (libtpu 0.0.42)
    peak_bf16_flops: float
    hbm_bandwidth: float  # bytes / s
    ici_link_bandwidth: float  # bytes / s, one direction of one link
    ici_links: int
    cores_per_chip: int
    max_chips: int
    chip_config_name: str | None


def _gib(value: float) -> int:
    return round(value * GiB)


_CHIPS = {
    "v4": _Chip("v4", "v4", 3, 32 * GiB, _gib(30.75), 275e12, 1200e9, 50e9, 6, 2, 4096, "megacore"),
    "v5e": _Chip("v5e", "v5e", 2, 16 * GiB, _gib(15.75), 197e12, 819e9, 50e9, 4, 1, 256, None),
    "v5p": _Chip(
        "v5p", "v5p", 3, 95 * GiB, _gib(95.74), 459e12, 2765e9, 100e9, 6, 2, 8960, "megacore"
    ),
    "v6e": _Chip("v6e", "v6e", 2, 32 * GiB, _gib(31.25), 918e12, 1638e9, 100e9, 4, 1, 256, None),
}
_CLOUD_PREFIX = {"v4": "v4", "v5p": "v5p", "v5litepod": "v5e", "v5e": "v5e", "v6e": "v6e"}
_RAW_PREFIX = {"v4": "v4", "v5p": "v5p", "v5": "v5p", "v5e": "v5e", "v6e": "v6e"}
_CLOUD_NAME = {"v4": "v4", "v5p": "v5p", "v5e": "v5litepod", "v6e": "v6e"}
_SHAPES_2D = {
    1: (1, 1),
    4: (2, 2),
    8: (2, 4),
    16: (4, 4),
    32: (4, 8),
    64: (8, 8),
    128: (8, 16),
    256: (16, 16),
}


@dataclasses.dataclass(frozen=True)
class TopologySpec:
    """A TPU slice: its names, shape and per-chip hardware numbers.

    Attributes:
      cloud_name: Cloud accelerator type, e.g. ``"v5litepod-16"``, ``"v5p-8"``.
      jax_topology_name: what ``get_topology_desc`` takes, e.g. ``"v5e:4x4"``.
      chips: number of chips (= JAX devices; v4 / v5p megacore).
      generation: ``"v4" | "v5e" | "v5p" | "v6e"``.
      shape: chips along each physical axis (2 or 3 entries).
      wrap: wraparound (torus) link on each axis of ``(x, y, z)``.
      chips_per_host_bounds: the per-host chip block passed to ``get_topology_desc``.
      chip_config_name: ``"megacore"`` for v4 / v5p, else None (the default config).
      hbm_bytes_per_chip: HBM capacity (Google's published figure).
      usable_hbm_bytes_per_chip: the most HBM the TPU compiler lets one program use, from its
        out-of-memory message (libtpu 0.0.42; a larger program fails to compile).
      peak_bf16_flops_per_chip: dense bf16 matmul peak, FLOP/s.
      hbm_bandwidth_bytes_per_s: HBM bandwidth per chip.
      ici_bandwidth_bytes_per_s_per_link: one direction of one ICI link.
      ici_links: ICI ports per chip (4 on 2D tori, 6 on 3D).
      cores_per_chip: TensorCores per chip.
    """

    cloud_name: str
    jax_topology_name: str
    chips: int
    generation: str
    shape: tuple[int, ...]
    wrap: tuple[bool, bool, bool]
    chips_per_host_bounds: tuple[int, int, int]
    chip_config_name: str | None
    hbm_bytes_per_chip: int
    usable_hbm_bytes_per_chip: int
    peak_bf16_flops_per_chip: float
    hbm_bandwidth_bytes_per_s: float
    ici_bandwidth_bytes_per_s_per_link: float
    ici_links: int
    cores_per_chip: int

    @property
    def ici_ring_bandwidth_bytes_per_s(self) -> float:
        """Per-chip bandwidth of a bidirectional ring along one axis: ``2 x`` one link's one way.

        A chip on a ring sends to (and receives from) both neighbours at once, so ring
        collectives move data at twice the one-way link bandwidth.
        """
        return 2.0 * self.ici_bandwidth_bytes_per_s_per_link

    @property
    def ici_bandwidth_bytes_per_s_per_chip(self) -> float:
        """All ports, both directions: the Cloud docs' "bidirectional ICI bandwidth per chip"."""
        return 2.0 * self.ici_links * self.ici_bandwidth_bytes_per_s_per_link


def resolve_topology(name: str) -> TopologySpec:
    """The ``TopologySpec`` of a Cloud TPU accelerator type or raw JAX topology name.

    Args:
      name: e.g. ``"v5litepod-16"``, ``"v5e-16"``, ``"v6e-8"``, ``"v4-8"``, ``"v5p-128"``,
        ``"v5e:4x4"``, ``"v5p:2x2x4"``, ``"v4:2x2x2"``.

    Raises:
      ValueError: an unknown generation, a malformed name, or a size with no valid slice shape
        (the message lists the accepted forms).
    """
    if not isinstance(name, str):
        raise ValueError(f"topology name must be a str, got {name!r}; {_ACCEPTED}")
    text = name.strip().lower()
    raw = re.fullmatch(r"([a-z0-9]+):(\d+(?:x\d+){1,2})", text)
    if raw:
        prefix, dims = raw.groups()
        if prefix not in _RAW_PREFIX:
            raise ValueError(f"unknown TPU generation {prefix!r} in {name!r}; {_ACCEPTED}")
        chip = _CHIPS[_RAW_PREFIX[prefix]]
        shape = tuple(int(d) for d in dims.split("x"))
        if chip.dims == 2 and len(shape) == 3 and shape[2] == 1:
            shape = shape[:2]
        if len(shape) != chip.dims:
            raise ValueError(
                f"{name!r}: {chip.generation} slices are {chip.dims}-D (got {len(shape)} "
                f"dimensions); {_ACCEPTED}"
            )
        return _spec(chip, shape, name)
    cloud = re.fullmatch(r"([a-z0-9]+)-(\d+)", text)
    if not cloud or cloud.group(1) not in _CLOUD_PREFIX:
        raise ValueError(f"unknown TPU topology {name!r}; {_ACCEPTED}")
    chip = _CHIPS[_CLOUD_PREFIX[cloud.group(1)]]
    count = int(cloud.group(2))
    if chip.dims == 2:
        if count not in _SHAPES_2D:
            raise ValueError(
                f"{name!r}: {chip.generation} slices have {sorted(_SHAPES_2D)} chips; {_ACCEPTED}"
            )
        return _spec(chip, _SHAPES_2D[count], name)
    if count % (2 * chip.cores_per_chip) or count < 4 * chip.cores_per_chip:
        raise ValueError(
            f"{name!r}: the number after '-' counts TensorCores ({chip.cores_per_chip} a chip) and "
            f"must be a multiple of {2 * chip.cores_per_chip}, at least "
            f"{4 * chip.cores_per_chip} (a 2x2x1 host); {_ACCEPTED}"
        )
    return _spec(chip, _shape_3d(count // chip.cores_per_chip, name), name)


def _shape_3d(chips: int, name: str) -> tuple[int, int, int]:
    """The most balanced ``A <= B <= C`` slice of ``chips`` chips (Google's default shapes)."""
    if chips == 4:
        return (2, 2, 1)
    best = None
    for a in range(1, round(chips ** (1 / 3)) + 2):
        if chips % a:
            continue
        for b in range(a, math.isqrt(chips // a) + 1):
            if (chips // a) % b:
                continue
            c = chips // (a * b)
            dims = (a, b, c)
            if chips >= 64 and any(d % 4 for d in dims):
                continue
            if chips < 64 and (a % 2 or b % 2):
                continue
            key = (c, b)
            if best is None or key < best[0]:
                best = (key, dims)
    if best is None:
        raise ValueError(
            f"{name!r}: no valid slice shape for {chips} chips (below 64 chips the first two "
            f"dimensions must be even, from 64 on every dimension a multiple of 4); {_ACCEPTED}"
        )
    return best[1]


def _spec(chip: _Chip, shape: tuple[int, ...], name: str) -> TopologySpec:
    if any(d < 1 for d in shape):
        raise ValueError(f"{name!r}: every dimension must be >= 1; {_ACCEPTED}")
    chips = math.prod(shape)
    if chips > chip.max_chips:
        raise ValueError(
            f"{name!r}: {chips} chips exceed a {chip.generation} pod ({chip.max_chips} chips)"
        )
    bounds = (min(2, shape[0]), min(2, shape[1]), 1)
    if shape[0] % bounds[0] or shape[1] % bounds[1]:
        raise ValueError(
            f"{name!r}: the first two dimensions must be even or 1 (hosts hold 2x2x1 chips); "
            f"{_ACCEPTED}"
        )
    if chip.dims == 3:
        wrap3 = all(d % 4 == 0 for d in shape)
        wrap = (wrap3, wrap3, wrap3)
    else:
        wrap = (shape[0] == 16, shape[1] == 16, False)
    dims_text = "x".join(str(d) for d in shape)
    cores = chips * chip.cores_per_chip if chip.dims == 3 else chips
    return TopologySpec(
        cloud_name=f"{_CLOUD_NAME[chip.generation]}-{cores}",
        jax_topology_name=f"{chip.jax_prefix}:{dims_text}",
        chips=chips,
        generation=chip.generation,
        shape=tuple(shape),
        wrap=wrap,
        chips_per_host_bounds=bounds,
        chip_config_name=chip.chip_config_name,
        hbm_bytes_per_chip=chip.hbm_bytes,
        usable_hbm_bytes_per_chip=chip.usable_hbm_bytes,
        peak_bf16_flops_per_chip=chip.peak_bf16_flops,
        hbm_bandwidth_bytes_per_s=chip.hbm_bandwidth,
        ici_bandwidth_bytes_per_s_per_link=chip.ici_link_bandwidth,
        ici_links=chip.ici_links,
        cores_per_chip=chip.cores_per_chip,
    )


def topology_kwargs(spec: TopologySpec) -> dict[str, Any]:
    """Keyword arguments of ``get_topology_desc`` for ``spec`` (besides ``platform="tpu"``)."""
    kwargs: dict[str, Any] = {
        "topology_name": spec.jax_topology_name,
        "chips_per_host_bounds": spec.chips_per_host_bounds,
        "wrap": spec.wrap,
    }
    if spec.chip_config_name is not None:
        kwargs["chip_config_name"] = spec.chip_config_name
    return kwargs


def get_devices(spec: TopologySpec) -> list[Any]:
    """Compile-only TPU devices of ``spec`` (one per chip), built without a TPU attached.

    Works with ``JAX_PLATFORMS=cpu``; build a mesh with
    ``Mesh(np.array(devices).reshape(...), names)`` and compile with
    ``jax.jit(f).lower(*abstract_args_with_shardings).compile()``.

    libtpu lets one process at a time load it (``/tmp/libtpu_lockfile``), and any JAX process
    without ``JAX_PLATFORMS=cpu`` loads it once it is installed; compile-only use touches no
    TPU, so ``ALLOW_MULTIPLE_LIBTPU_LOAD=1`` is set (unless already set) to skip that lock.

    Raises:
      RuntimeError: libtpu is not installed (``pip install "jax[tpu]"``).
      ValueError: the device count does not match ``spec.chips``.
    """
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    try:
        with deviceless_libtpu_env(spec):
            desc = topologies.get_topology_desc(platform="tpu", **topology_kwargs(spec))
    except RuntimeError as err:
        if "TPU support not installed" in str(err):
            raise RuntimeError(
                f"deviceless TPU compilation needs libtpu: pip install 'jax[tpu]' ({err})"
            ) from err
        raise
    devices = list(desc.devices)
    if len(devices) != spec.chips:
        raise ValueError(
            f"{spec.jax_topology_name}: get_topology_desc returned {len(devices)} devices, "
            f"expected {spec.chips} (one per chip)"
        )
    return devices


#: What libtpu asks a Cloud TPU VM's metadata server (or these variables) when it initialises,
#: with values that describe a one-host slice; read once, by the first ``get_topology_desc``.
_DEVICELESS_ENV = {"TPU_WORKER_HOSTNAMES": "localhost", "TPU_SKIP_MDS_QUERY": "1"}


def _tpu_attached() -> bool:
    """Whether this machine has TPU chips (JAX's own PCI probe; False if it cannot tell)."""
    try:
        from jax._src import hardware_utils  # noqa: PLC0415  (JAX's probe, no backend)

        return bool(hardware_utils.num_available_tpu_chips_and_device_id()[0])
    except (ImportError, AttributeError, OSError):
        return False


@contextlib.contextmanager
def deviceless_libtpu_env(spec: TopologySpec):
    """The TPU variables libtpu reads at initialisation, set for a deviceless compile while
    the block runs, where the user left them unset and no TPU is attached.

    Off a Cloud TPU VM libtpu cannot find the accelerator type and worker hostnames it asks
    the metadata server for, and prints lines of C++ initialisation errors to the process's
    stderr (``Failed to find host bounds for accelerator type``, ``unexpected worker
    hostname``, a source-location trace) before anything a command prints. Given the slice's
    own type (``spec.cloud_name``) and one local worker it initialises quietly; the devices
    and compiled programs of every topology are the same either way (the topology comes from
    ``get_topology_desc``'s arguments). The variables are removed again afterwards: libtpu has
    read them, and processes started later do not inherit them.
    """
    added = []
    if not _tpu_attached():
        for key, value in {"TPU_ACCELERATOR_TYPE": spec.cloud_name, **_DEVICELESS_ENV}.items():
            if key not in os.environ:
                os.environ[key] = value
                added.append(key)
    try:
        yield
    finally:
        for key in added:
            os.environ.pop(key, None)


def libtpu_available() -> bool:
    """True when libtpu can be found (deviceless TPU topologies can then be built here)."""
    path = os.environ.get("TPU_LIBRARY_PATH", "")
    return importlib.util.find_spec("libtpu") is not None or os.path.isfile(path)


@dataclasses.dataclass(frozen=True)
class CompileOutcome:
    """A compile that may run out of HBM.

    Attributes:
      compiled: the compiled program, or None when the compiler ran out of HBM.
      seconds: wall time of ``lowered.compile()``.
      error: the compiler's out-of-memory message, or None.
      required_bytes, available_bytes: read from that message (per chip), or None.
    """

    compiled: Any | None
    seconds: float
    error: str | None = None
    required_bytes: int | None = None
    available_bytes: int | None = None


_SIZE = r"(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?"
_UNITS = {"": 1, "B": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def parse_hbm_oom(message: str) -> tuple[int, int] | None:
    """``(required, available)`` bytes per chip from an XLA:TPU out-of-memory message, or None.

    The message reads "Ran out of memory on HBM, the total memory required for HLO temporaries
    (16.00G) exceeds available HBM (15.75G)" (libtpu 0.0.42; ``G`` is GiB).
    """
    required = re.search(r"required[^(]*\(" + _SIZE + r"\)", message)
    available = re.search(r"available[^(]*\(" + _SIZE + r"\)", message)
    if required is None or available is None:
        return None

    def to_bytes(match: re.Match) -> int:
        unit = (match.group(2) or "")[:1]
        return round(float(match.group(1)) * _UNITS[unit])

    return to_bytes(required), to_bytes(available)


def try_compile(lowered: Any) -> CompileOutcome:
    """``lowered.compile()``, turning an out-of-HBM compile error into a ``CompileOutcome``.

    XLA:TPU refuses at compile time a program that needs more than the chip's usable HBM
    (``RESOURCE_EXHAUSTED: Ran out of memory on HBM ...``); the plan reports that as "does not
    fit" with the sizes from the message. Other errors propagate.
    """
    start = time.perf_counter()
    try:
        compiled = lowered.compile()
    except Exception as err:  # JaxRuntimeError; only running out of HBM is handled here
        message = str(err)
        if "RESOURCE_EXHAUSTED" not in message or "memory" not in message.lower():
            raise
        sizes = parse_hbm_oom(message)
        return CompileOutcome(
            compiled=None,
            seconds=time.perf_counter() - start,
            error=message,
            required_bytes=None if sizes is None else sizes[0],
            available_bytes=None if sizes is None else sizes[1],
        )
    return CompileOutcome(compiled=compiled, seconds=time.perf_counter() - start)


__all__ = [
    "CompileOutcome",
    "GiB",
    "TopologySpec",
    "deviceless_libtpu_env",
    "get_devices",
    "libtpu_available",
    "parse_hbm_oom",
    "resolve_topology",
    "topology_kwargs",
    "try_compile",
]
