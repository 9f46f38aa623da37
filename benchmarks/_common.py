"""Shared by the benchmark scripts: the environment record and atomic JSON output."""

import datetime as dt
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
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
    """Write `payload` plus the environment to `results/<name>.json`, atomically."""
    directory = RESULTS if directory is None else Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.json"
    record = {"environment": environment(), **payload}
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(record, f, indent=2, sort_keys=False)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    return path


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


def spawn(script: str | Path, spec: dict, *, timeout: float = 1800) -> dict:
    """Run `script --worker <spec as JSON>` in a fresh Python process; return the JSON it
    printed on its last line starting with `MARKER`."""
    cmd = [sys.executable, str(Path(script).resolve()), "--worker", json.dumps(spec)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(MARKER)]
    if proc.returncode or not lines:
        raise RuntimeError(
            f"worker {spec} failed with exit code {proc.returncode}:\n{proc.stderr[-4000:]}"
        )
    return json.loads(lines[-1][len(MARKER) :])
