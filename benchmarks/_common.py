"""Shared by the benchmark scripts: the environment record and atomic JSON output."""

import datetime as dt
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results"


def environment() -> dict[str, Any]:
    """Device, library versions and date: every result JSON carries this."""
    import equinox
    import jax
    import jaxlib
    import numpy as np
    import optax

    device = jax.devices()[0]
    return {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "backend": jax.default_backend(),
        "device": getattr(device, "device_kind", str(device)),
        "device_count": jax.device_count(),
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "versions": {
            "jax": jax.__version__,
            "jaxlib": jaxlib.__version__,
            "equinox": equinox.__version__,
            "optax": optax.__version__,
            "numpy": np.__version__,
        },
    }


def write_json(name: str, payload: dict[str, Any], directory: Path | None = None) -> Path:
    """Write `payload` plus the environment to `results/<name>.json`, atomically (the
    library's one writer: temporary file, fsync, rename; the mode the umask allows)."""
    from eqx_lowmem._io import write_json as atomic_write_json

    directory = RESULTS if directory is None else Path(directory)
    record = {"environment": environment(), **payload}
    return atomic_write_json(directory / f"{name}.json", record)


def time_median(fn: Callable[[], Any], *, repeats: int = 5, burn_in: int = 2) -> float:
    """Median wall seconds of `fn()` after `burn_in` untimed calls.

    `fn` must block until its work is done (for JAX, `jax.block_until_ready`).
    """
    for _ in range(burn_in):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def compiled_memory(compiled) -> dict[str, int] | None:
    """Bytes from `compiled.memory_analysis()`, with peak = argument + output + temp - alias
    (XLA:CPU's own `peak_memory_in_bytes` leaves the temporaries out)."""
    m = compiled.memory_analysis()
    if m is None:
        return None
    out = {
        "argument": m.argument_size_in_bytes,
        "output": m.output_size_in_bytes,
        "temp": m.temp_size_in_bytes,
        "alias": m.alias_size_in_bytes,
    }
    out["peak"] = out["argument"] + out["output"] + out["temp"] - out["alias"]
    return out


MARKER = "RESULT "


def spawn_results(
    script: str | Path, payload: Any, *, timeout: float
) -> tuple[list[Any], subprocess.CompletedProcess | None]:
    """Run `script --worker <payload as JSON>` in a fresh Python process; return the JSON of
    every stdout line starting with `MARKER`, in order, and the finished process (None when
    it ran past `timeout`: then the lines printed so far are lost with it)."""
    cmd = [sys.executable, str(Path(script).resolve()), "--worker", json.dumps(payload)]

    def results(stdout: str) -> list[Any]:
        return [
            json.loads(ln[len(MARKER) :]) for ln in stdout.splitlines() if ln.startswith(MARKER)
        ]

    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        return results(out), None
    return results(proc.stdout), proc


def spawn(script: str | Path, spec: dict, *, timeout: float = 1800) -> dict:
    """Run `script --worker <spec as JSON>` in a fresh Python process; return the JSON it
    printed on its last line starting with `MARKER`."""
    lines, proc = spawn_results(script, spec, timeout=timeout)
    if proc is None or proc.returncode or not lines:
        code = "a timeout" if proc is None else f"exit code {proc.returncode}"
        stderr = "" if proc is None else proc.stderr[-4000:]
        raise RuntimeError(f"worker {spec} failed with {code}:\n{stderr}")
    return lines[-1]
