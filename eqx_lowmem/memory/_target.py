"""The device a memory figure is for: this process's backend, or a GPU compiled for without one.

JAX compiles for a GPU it does not have through a compile-only topology
(`jax.experimental.topologies.get_topology_desc(platform="cuda", ..., target_config=TEXT)`,
with the CUDA plugin wheels installed and no driver): XLA's GPU compiler assigns the buffers
exactly as on the device, so the compiled peak is the GPU's. `TEXT` is a
`GpuTargetConfigProto` in text form, written here from the hardware facts of each GPU.
"""

import contextlib
import dataclasses
import difflib
import functools
import importlib.metadata
import importlib.util
import os
import tempfile
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

# The extra that installs the CUDA plugin (the wheels of JAX's `cuda12-local` extra).
EXTRA = "eqx-lowmem[gpu-plan]"
# JAX's CUDA plugins, either of which compiles for a GPU target (the extra installs 12's).
_CUDA_MAJORS = ("12", "13")
_INSTALL = f"pip install '{EXTRA}' (from a checkout: pip install -e '.[gpu-plan]')"
# JAX's default share of a GPU's memory that XLA may use (XLA_PYTHON_CLIENT_MEM_FRACTION).
DEFAULT_MEM_FRACTION = 0.75


@dataclasses.dataclass(frozen=True)
class _Gpu:
    """The hardware facts XLA's GPU compiler reads (one `gpu_device_info`)."""

    description: str  # what the CUDA driver calls it
    capability: tuple[int, int]  # CUDA compute capability
    cores: int  # streaming multiprocessors
    fpus_per_core: int  # float32 lanes per SM
    shared_per_core: int  # shared memory per SM, bytes
    shared_optin: int  # shared memory a block may opt into, bytes
    l2: int  # bytes
    memory: int  # bytes of device memory, as CUDA reports it
    bandwidth: int  # bytes/s
    clock_ghz: float


_KIB, _MIB = 1024, 1024 * 1024
# Memory sizes: the total CUDA reports for each board (`cudaMemGetInfo`, `nvidia-smi`).
GPUS: dict[str, _Gpu] = {
    "h100": _Gpu("NVIDIA H100 80GB HBM3", (9, 0), 132, 128, 228 * _KIB, 227 * _KIB,
                 50 * _MIB, 84_942_979_072, 3_352_320_000_000, 1.98),
    "h100-pcie": _Gpu("NVIDIA H100 PCIe", (9, 0), 114, 128, 228 * _KIB, 227 * _KIB,
                      50 * _MIB, 84_942_979_072, 2_039_040_000_000, 1.755),
    "h200": _Gpu("NVIDIA H200", (9, 0), 132, 128, 228 * _KIB, 227 * _KIB,
                 50 * _MIB, 151_397_597_184, 4_800_000_000_000, 1.98),
    "a100-40gb": _Gpu("NVIDIA A100-SXM4-40GB", (8, 0), 108, 64, 164 * _KIB, 163 * _KIB,
                      40 * _MIB, 42_298_834_944, 1_555_200_000_000, 1.41),
    "a100-80gb": _Gpu("NVIDIA A100-SXM4-80GB", (8, 0), 108, 64, 164 * _KIB, 163 * _KIB,
                      40 * _MIB, 85_100_068_864, 2_039_040_000_000, 1.41),
    "l4": _Gpu("NVIDIA L4", (8, 9), 58, 128, 100 * _KIB, 99 * _KIB,
               48 * _MIB, 23_034 * _MIB, 300_000_000_000, 2.04),
    "a10g": _Gpu("NVIDIA A10G", (8, 6), 80, 128, 100 * _KIB, 99 * _KIB,
                 6 * _MIB, 23_028 * _MIB, 600_000_000_000, 1.71),
    "rtx4090": _Gpu("NVIDIA GeForce RTX 4090", (8, 9), 128, 128, 100 * _KIB, 99 * _KIB,
                    72 * _MIB, 24_564 * _MIB, 1_008_000_000_000, 2.52),
    "v100": _Gpu("Tesla V100-SXM2-16GB", (7, 0), 80, 64, 96 * _KIB, 96 * _KIB,
                 6 * _MIB, 16_935_682_048, 898_048_000_000, 1.53),
}  # fmt: skip
_ALIASES = {"h100-sxm": "h100", "h100-80gb": "h100", "a100": "a100-80gb"}


@dataclasses.dataclass(frozen=True)
class _Tpu:
    """A TPU generation: libtpu compiles for its topologies without one."""

    memory: int  # HBM bytes per chip
    shapes: dict[int, str]  # chips -> topology shape (from one host's chips up)


# A slice of at least one host's chips; fewer devices are the first of the smallest.
_2D = {4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16", 256: "16x16"}
_3D = {4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4"}
# Installed with `eqx-lowmem[tpu-plan]` (libtpu, about 700 MB); HBM per chip.
TPUS: dict[str, _Tpu] = {
    "v4": _Tpu(32 * 2**30, _3D),
    "v5e": _Tpu(16 * 2**30, _2D),
    "v5p": _Tpu(95 * 2**30, _3D),
    "v6e": _Tpu(32 * 2**30, _2D),
}
# Not GPU names: where the program runs.
_HERE = ("cpu", "attached")


def known_targets() -> tuple[str, ...]:
    """Every name `Target` takes: `"cpu"`, `"attached"` and the GPUs (`"h100"`, ...)."""
    return (*_HERE, *GPUS, *_ALIASES, *TPUS)


def config_text(gpu: _Gpu) -> str:
    """`gpu` as a `GpuTargetConfigProto` in text form (what `target_config=` takes)."""
    major, minor = gpu.capability
    info = {
        "threads_per_block_limit": 1024,
        "threads_per_warp": 32,
        "shared_memory_per_block": 48 * _KIB,
        "shared_memory_per_core": gpu.shared_per_core,
        "threads_per_core_limit": 2048 if major != 8 or minor == 0 else 1536,
        "core_count": gpu.cores,
        "fpus_per_core": gpu.fpus_per_core,
        "block_dim_limit_x": 2**31 - 1,
        "block_dim_limit_y": 65535,
        "block_dim_limit_z": 65535,
        "memory_bandwidth": gpu.bandwidth,
        "l2_cache_size": gpu.l2,
        "clock_rate_ghz": gpu.clock_ghz,
        "device_memory_size": gpu.memory,
        "shared_memory_per_block_optin": gpu.shared_optin,
        "registers_per_core_limit": 65536,
        "registers_per_block_limit": 65536,
    }
    fields = " ".join(f"{k}: {v}" for k, v in info.items())
    capability = f"cuda_compute_capability {{ major: {major} minor: {minor} }}"
    return (
        f"gpu_device_info {{ {fields} {capability} }}"
        f' platform_name: "CUDA" dnn_version_info {{ major: 9 minor: 8 patch: 0 }}'
        f' device_description_str: "{gpu.description}"'
    )


@dataclasses.dataclass(frozen=True)
class Target:
    """The device(s) a memory figure is for.

    `memory_report(..., target=...)`, `plan(..., target=...)` and the command line's
    `--target` take one, or its `name` alone (`target="h100"` is `Target("h100")`).

    - `"cpu"` (or None): this process's backend, as without a target (XLA:CPU here);
    - `"attached"`: the device this process runs on (a GPU when JAX has one), with its
      memory as JAX reports it (`bytes_limit`);
    - a GPU name (`known_targets()`: `"h100"`, `"h100-pcie"`, `"h200"`, `"a100-40gb"`,
      `"a100-80gb"`, `"l4"`, `"a10g"`, `"rtx4090"`, `"v100"`): compiled for that GPU on any
      machine, with no GPU and no driver, from its hardware facts. Needs the CUDA plugin
      wheels: `pip install 'eqx-lowmem[gpu-plan]'` (about 180 MB, no NVIDIA libraries);
    - a TPU generation (`"v4"`, `"v5e"`, `"v5p"`, `"v6e"`), compiled for by libtpu the
      same way: `pip install 'eqx-lowmem[tpu-plan]'` (about 700 MB);
    - a path to a `GpuTargetConfigProto` text file (XLA keeps such specs of many GPUs in
      `xla/backends/gpu/target_config/specs/`), for a GPU not listed.

    A GPU target compiles the very program the device would run: cuDNN convolutions,
    native 16-bit arithmetic and XLA's GPU fusions, so its peak is the GPU's (XLA:CPU
    computes 16-bit products in float32 and fuses differently). Nothing runs: the compile
    takes seconds, like XLA:CPU's; `measure=True` needs `"attached"`.

    Attributes:
        name: as given (a known name, or the file's path).
        devices: how many such devices the step is compiled for (data parallel or FSDP over
            a mesh of that many; `memory_report`'s `mesh` gives its axes, otherwise one axis
            named by `data_axis`). Every figure is per device.
        mem_fraction: the share of each device's memory XLA may use, for `plan`'s default
            budget: JAX's default 0.75 (`XLA_PYTHON_CLIENT_MEM_FRACTION` when set).
        compiler_options: XLA options for every compile for this target (on top of the
            library's own; the report lists what it compiled with).

    Raises:
        ValueError: for an unknown name (the known ones are listed), a config file that
            does not parse (named, with XLA's message), or `devices` below 1.
        ImportError: for a GPU target without the CUDA plugin, or a plugin whose version
            differs from jaxlib's (naming the extra that installs the right one).

    Example:
        >>> import eqx_lowmem as el
        >>> t = el.memory.Target("a100-40gb")
        >>> t.description, round(t.memory_bytes / 2**30, 1), t.platform
        ('NVIDIA A100-SXM4-40GB', 39.4, 'cuda')
        >>> t.budget_bytes == int(0.75 * t.memory_bytes)
        True
    """

    name: str | os.PathLike = "cpu"
    devices: int = 1
    mem_fraction: float | None = None
    compiler_options: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self):
        if not isinstance(self.name, (str, os.PathLike)):
            raise TypeError(
                f"target must be a name such as 'h100', a path to a GpuTargetConfigProto text "
                f"file, or an eqx_lowmem.memory.Target; got {type(self.name).__name__}."
            )
        object.__setattr__(self, "name", os.fspath(self.name))
        if isinstance(self.devices, bool) or not isinstance(self.devices, (int, np.integer)):
            raise TypeError(f"Target(devices=...) must be an int, got {self.devices!r}.")
        if self.devices < 1:
            raise ValueError(f"Target(devices={self.devices}): expected at least 1 device.")
        object.__setattr__(self, "devices", int(self.devices))
        if self.mem_fraction is not None and not 0 < self.mem_fraction <= 1:
            raise ValueError(f"Target(mem_fraction={self.mem_fraction}): expected in (0, 1].")
        if isinstance(self.compiler_options, dict):
            object.__setattr__(self, "compiler_options", tuple(self.compiler_options.items()))
        self._spec  # noqa: B018 (resolve now: an unknown name fails here, before any compile)

    @staticmethod
    def names() -> tuple[str, ...]:
        """Every name a `Target` takes: `"cpu"`, `"attached"`, the GPUs and their aliases."""
        return known_targets()

    # -- what it is ------------------------------------------------------------------------

    @functools.cached_property
    def _spec(self) -> _Gpu | _Tpu | str | None:
        """The GPU's facts, a TPU's, a config file's text, or None for this process's
        device."""
        name = self.name.lower()
        if name in _HERE:
            return None
        if name in GPUS or name in _ALIASES:
            return GPUS[_ALIASES.get(name, name)]
        if name in TPUS:
            return TPUS[name]
        path = Path(self.name)
        if path.is_file():
            return path.read_text()
        close = difflib.get_close_matches(name, known_targets(), n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ValueError(
            f"target={self.name!r} is not a known target nor a file; expected one of "
            f"{known_targets()} or a path to a GpuTargetConfigProto text file.{hint}"
        )

    @property
    def compile_only(self) -> bool:
        """True for a device compiled for without one (a GPU or TPU name, a config file)."""
        return self._spec is not None

    @property
    def platform(self) -> str:
        """`"cuda"` for a GPU target, `"tpu"` for a TPU one, else this process's backend."""
        if not self.compile_only:
            return jax.default_backend()
        return "tpu" if isinstance(self._spec, _Tpu) else "cuda"

    @property
    def backend(self) -> str:
        """The backend kind the step is compiled for: `"gpu"` for a GPU target."""
        return "gpu" if self.platform == "cuda" else self.platform

    @property
    def config(self) -> str | None:
        """The `GpuTargetConfigProto` text compiled with (None without a GPU target)."""
        spec = self._spec
        if isinstance(spec, _Tpu):
            return None
        return config_text(spec) if isinstance(spec, _Gpu) else spec

    @property
    def description(self) -> str:
        """The device's name as its driver gives it (`"NVIDIA H100 80GB HBM3"`)."""
        if self.compile_only:
            return self.devices_of_topology()[0].device_kind
        device = jax.devices()[0]
        return str(getattr(device, "device_kind", device))

    @property
    def memory_bytes(self) -> int | None:
        """One device's memory in bytes; None where unknown (XLA:CPU)."""
        spec = self._spec
        if isinstance(spec, (_Gpu, _Tpu)):
            return spec.memory
        if isinstance(spec, str):
            found = _field(spec, "device_memory_size")
            return None if found is None else int(found)
        if self.name.lower() == "attached":
            stats = _memory_stats()
            if stats and "bytes_limit" in stats:
                return int(stats["bytes_limit"])
        return None

    @property
    def fraction(self) -> float:
        """The share of `memory_bytes` XLA may use (see `mem_fraction`)."""
        if self.mem_fraction is not None:
            return self.mem_fraction
        if self.name.lower() == "attached" or self.platform == "tpu":
            return 1.0  # bytes_limit is what the allocator may use; a TPU's XLA takes all
        return float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", DEFAULT_MEM_FRACTION))

    @property
    def budget_bytes(self) -> int | None:
        """What XLA may use of one device: `memory_bytes` times `fraction` (`plan`'s
        default budget); None where the memory is unknown."""
        memory = self.memory_bytes
        return None if memory is None else int(memory * self.fraction)

    def options(self) -> dict[str, Any]:
        """The compiler options given for this target."""
        return dict(self.compiler_options)

    def describe(self) -> str:
        """One line: the device, how many, and how it was compiled for."""
        what = self.description + (f" x {self.devices}" if self.devices > 1 else "")
        if self.compile_only:
            return f"{what} (compile-only target {self.name!r})"
        return what

    # -- compiling for it ------------------------------------------------------------------

    def devices_of_topology(self) -> list[Any]:
        """The target's devices: compile-only ones for a GPU target (nothing can run on
        them), else this process's first `devices`."""
        if not self.compile_only:
            found = jax.devices()
            if len(found) < self.devices:
                raise ValueError(
                    f"Target({self.name!r}, devices={self.devices}): this process has "
                    f"{len(found)} {jax.default_backend()} device(s)."
                )
            return found[: self.devices]
        spec = self._spec
        if isinstance(spec, _Tpu):
            topology = _tpu_topology(self.name.lower(), spec, self.devices)
            return list(topology.devices)[: self.devices]
        return list(_topology(self.config, self.devices, self.name).devices)

    def mesh(self, shape: tuple[int, ...], axis_names: tuple[str, ...]) -> Mesh:
        """A mesh of the target's devices with these axes (their sizes multiply to
        `devices`)."""
        if int(np.prod(shape)) != self.devices:
            raise ValueError(
                f"a mesh of shape {dict(zip(axis_names, shape, strict=True))} needs "
                f"{int(np.prod(shape))} devices, but the target has devices={self.devices}; "
                f"use Target({self.name!r}, devices={int(np.prod(shape))})."
            )
        devices = np.array(self.devices_of_topology()).reshape(shape)
        return Mesh(devices, axis_names)


def as_target(target: "Target | str | os.PathLike | None") -> Target:
    """`target` as a `Target` (None is `"cpu"`)."""
    if target is None:
        return Target("cpu")
    return target if isinstance(target, Target) else Target(target)


def _field(text: str, name: str) -> str | None:
    head = text.find(name + ":")
    if head < 0:
        return None
    return text[head + len(name) + 1 :].split()[0]


def _memory_stats() -> dict | None:
    try:
        return jax.devices()[0].memory_stats()
    except Exception:  # a backend without the counters
        return None


_TOPOLOGIES: dict[tuple[str | None, int], Any] = {}


def _topology(config: str, devices: int, name: str) -> Any:
    """The compile-only topology of `devices` GPUs described by `config` (kept)."""
    key = (config, devices)
    if key not in _TOPOLOGIES:
        major = _check_plugin()
        from jax.experimental import topologies

        def make():
            return topologies.get_topology_desc(
                platform="cuda", topology=f"1x1x{devices}", target_config=config
            )

        with _captured_stderr() as log:
            try:
                try:
                    topology = make()
                except NotImplementedError:
                    _register_plugin(major)
                    topology = make()
            except jax.errors.JaxRuntimeError as e:
                message = [line for line in log.read().splitlines() if "rror" in line]
                raise ValueError(
                    f"target={name!r}: XLA could not read the target config: {e}"
                    + (f"; XLA says: {message[-1].strip()}" if message else "")
                ) from None
        _TOPOLOGIES[key] = topology
    return _TOPOLOGIES[key]


def _tpu_topology(name: str, tpu: _Tpu, devices: int) -> Any:
    """The compile-only topology of `devices` chips of TPU `name` (kept)."""
    key = (name, devices)
    if key not in _TOPOLOGIES:
        if importlib.util.find_spec("libtpu") is None:
            raise ImportError(
                "a TPU target compiles with libtpu, which is not installed: pip install "
                "'eqx-lowmem[tpu-plan]' (about 700 MB; no TPU needed)."
            )
        chips = [n for n in sorted(tpu.shapes) if n >= devices]
        if not chips:
            raise ValueError(
                f"Target({name!r}, devices={devices}): at most {max(tpu.shapes)} chips."
            )
        from jax.experimental import topologies

        with _captured_stderr():  # libtpu logs that it finds no TPU host here
            _TOPOLOGIES[key] = topologies.get_topology_desc(
                platform="tpu", topology_name=f"{name}:{tpu.shapes[chips[0]]}"
            )
    return _TOPOLOGIES[key]


def _check_plugin() -> str:
    """The CUDA major version ("12" or "13") of JAX's CUDA plugin installed at jaxlib's
    version, or an ImportError that says how to install one."""
    jaxlib = importlib.metadata.version("jaxlib")
    found = {}
    for major in _CUDA_MAJORS:
        try:
            found[major] = importlib.metadata.version(f"jax-cuda{major}-plugin")
        except importlib.metadata.PackageNotFoundError:
            pass
    for major, plugin in found.items():
        if plugin == jaxlib:
            return major
    if not found:
        raise ImportError(
            "a GPU target compiles with JAX's CUDA plugin, which is not installed: "
            f"{_INSTALL}. It needs no GPU and no driver."
        )
    major, plugin = next(iter(found.items()))
    raise ImportError(
        f"jax-cuda{major}-plugin {plugin} is installed but jaxlib is {jaxlib}; they must be "
        f"the same version: pip install 'jax-cuda{major}-plugin=={jaxlib}' "
        f"'jax-cuda{major}-pjrt=={jaxlib}' (or {_INSTALL})."
    )


def _register_plugin(major: str) -> None:
    """Register the CUDA plugin for compiling only. JAX skips it where CUDA cannot load (no
    GPU or driver here); its registration needs neither, only its version check does."""
    jax.devices()  # start this process's backends first: they never include the plugin
    cuda = importlib.import_module(f"jax_plugins.xla_cuda{major}")

    saved = os.environ.get("JAX_SKIP_CUDA_CONSTRAINTS_CHECK")
    os.environ["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"] = "1"
    try:
        cuda.initialize()
    finally:
        if saved is None:
            del os.environ["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"]
        else:
            os.environ["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"] = saved


@contextlib.contextmanager
def _captured_stderr():
    """What native code writes to file descriptor 2 meanwhile (XLA logs parse errors
    there), readable from the yielded file."""
    with tempfile.TemporaryFile(mode="w+") as log:
        saved = os.dup(2)
        os.dup2(log.fileno(), 2)
        try:
            yield _Rewound(log)
        finally:
            os.dup2(saved, 2)
            os.close(saved)


class _Rewound:
    def __init__(self, file):
        self._file = file

    def read(self) -> str:
        self._file.flush()
        self._file.seek(0)
        return self._file.read()
