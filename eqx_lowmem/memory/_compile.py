"""Compile a training step for shapes alone, and read its memory figures."""

from typing import Any

import jax
import jax.numpy as jnp

from ._peak import Peak, argument_parts, compile_with_peak
from ._target import Target

# XLA:CPU: LLVM's optimisation of the generated code is most of the compile time and does
# not change buffer assignment, so every memory figure equals the default compilation's
# (tests/test_memory_report.py checks it against the step's own) in about 60% of the time
# (measured for 53e7859).
_FAST_CPU_COMPILE = {"xla_backend_optimization_level": 0}
_FIGURES = ("argument", "output", "temp", "alias")
_HOST = ("host_argument", "host_output", "host_temp", "host_alias")


# XLA's GPU compiler picks some matrix products' Triton tiles by autotuning on the device;
# compiled for a GPU it does not have, it can find none ("Couldn't find output tile sizes")
# and compiles them with cuBLAS instead when told to.
NO_TRITON_GEMM = {"xla_gpu_enable_triton_gemm": False}


def options_for(target: Target) -> dict[str, Any]:
    """The compiler options the library compiles with for `target` (the target's own on top:
    XLA:CPU's without LLVM's optimisation, which leaves buffer assignment as it is)."""
    own = _FAST_CPU_COMPILE if target.backend == "cpu" else {}
    return {**own, **target.options()}


def compile_step(
    step: Any, state: Any, batch: tuple, target: Target | None = None
) -> tuple[Any, Any, Peak | None, dict[str, Any]]:
    """Compile `step` for a state and batch of shapes without running it, and trace its jaxpr.

    The compiled step is `step.lower(state, batch).compile()`: the very program a call of
    the step runs, with the state donated (on XLA:CPU without LLVM's optimisation of the
    machine code, which leaves the buffers as they are). Nothing is allocated on the device.
    XLA writes its buffer assignment to a temporary directory meanwhile (`_peak`).

    For a GPU `target` the step must be built on a mesh of the target's devices
    (`Target.mesh`): its state and batch are placed there, so XLA's GPU compiler compiles it.
    A matrix product whose Triton tiles cannot be chosen without the device is compiled
    again with `NO_TRITON_GEMM` (cuBLAS), as the options returned say.

    Returns:
        `(jaxpr, compiled, peak, options)`: the step's `ClosedJaxpr` (for `jaxpr_cost`), the
        compiled step (`memory_analysis()`, `cost_analysis()`), what is live at its peak
        (None where XLA's dump could not be read), and the compiler options it compiled with.
    """
    target = Target("cpu") if target is None else target
    traced = step.trace(state, batch)
    parts = argument_parts([_STATE_PARTS.get(_field(path), "other") for path in
                            _paths(state)])  # fmt: skip
    # XLA:CPU computes 16-bit products in float32: their float32 results are its upcasts.
    sixteen = target.backend == "cpu" and jnp.dtype(step.policy.compute_dtype).itemsize == 2
    lowered = traced.lower()
    options = options_for(target)
    try:
        compiled, peak = compile_with_peak(
            lowered, options, parts, sixteen_bit=sixteen, target=repr(target)
        )
    except Exception as e:
        retry = options.get("xla_gpu_enable_triton_gemm") is not False
        if target.backend == "gpu" and "tile sizes" in str(e) and retry:
            options = {**options, **NO_TRITON_GEMM}
            compiled, peak = compile_with_peak(
                lowered, options, parts, sixteen_bit=sixteen, target=repr(target)
            )
        elif "compile option" in str(e):  # an XLA without the option: compile as usual
            compiled, peak, options = lowered.compile(), None, {}
        else:
            raise
    return traced.jaxpr, compiled, peak, options


# The part of each field of a `TrainState` in the live set at the peak.
_STATE_PARTS = {"model": "parameters", "model_state": "parameters", "opt_state": "optimizer"}


def _paths(state: Any) -> list[Any]:
    return [path for path, _ in jax.tree_util.tree_flatten_with_path(state)[0]]


def _field(path: Any) -> str:
    return str(getattr(path[0], "name", "")) if path else ""


def memory_figures(compiled: Any) -> dict[str, int]:
    """`compiled.memory_analysis()` as `{"argument", "output", "temp", "alias", "peak",
    and "host_*" where the backend reports host memory}`, per device.

    Raises:
        RuntimeError: when the backend gives no memory analysis.
    """
    analysis = compiled.memory_analysis()
    if analysis is None:
        raise RuntimeError(
            f"the {jax.default_backend()} backend gives no memory_analysis() for the compiled "
            "step; the report needs it."
        )
    figures = {k: int(getattr(analysis, f"{k}_size_in_bytes")) for k in _FIGURES}
    figures["peak"] = int(getattr(analysis, "peak_memory_in_bytes", 0))
    for k in _HOST:
        value = getattr(analysis, f"{k}_size_in_bytes", None)
        if value is not None:
            figures[k] = int(value)
    return figures
