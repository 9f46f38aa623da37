"""The benchmark scripts' harness: the environment record, atomic JSON output, timing
(rounds that interleave what is compared) and worker processes (fresh, or one per core,
pinned).

Every script in `benchmarks/` uses it: `sys.path.insert(0, <benchmarks>)`, then
`from _common import ...`.
"""

import datetime as dt
import importlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results"


def environment() -> dict[str, Any]:
    """Device, library versions and date: every result JSON carries this."""
    import jax

    device = jax.devices()[0]
    libraries = ("jax", "jaxlib", "equinox", "optax", "numpy")
    return {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "backend": jax.default_backend(),
        "device": getattr(device, "device_kind", str(device)),
        "device_count": jax.device_count(),
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "versions": {name: importlib.import_module(name).__version__ for name in libraries},
    }


def write_json(name: str, payload: dict[str, Any], directory: Path | None = None) -> Path:
    """Write `payload` plus the environment to `results/<name>.json`, atomically (the
    library's one writer: temporary file, fsync, rename; the mode the umask allows)."""
    from eqx_lowmem._io import write_json as atomic_write_json

    directory = RESULTS if directory is None else Path(directory)
    record = {"environment": environment(), **payload}
    return atomic_write_json(directory / f"{name}.json", record)


def interleaved(calls: dict[str, Callable[[], Any]], rounds: int) -> dict[str, list[float]]:
    """Wall seconds of every call, once per round, the calls in turn: in their order in even
    rounds and reversed in odd ones (ABBA), so that the drift of a machine shared with other
    work weighs on all of them alike. Compare two of them with `median_ratio`.

    Each call must block until its work is done (for JAX, `jax.block_until_ready`); burn
    in (compile) before.
    """
    names, wall = list(calls), {n: [] for n in calls}
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            t0 = time.perf_counter()
            calls[name]()
            wall[name].append(time.perf_counter() - t0)
    return wall


def median_ratio(a: Sequence[float], b: Sequence[float]) -> float:
    """The median over rounds of `a[i] / b[i]`: two timings taken side by side (the same
    round), which cancels the machine's drift better than a ratio of medians."""
    return statistics.median(x / y for x, y in zip(a, b, strict=True))


def compiled_memory(compiled) -> dict[str, int] | None:
    """Bytes from `compiled.memory_analysis()`, with peak = argument + output + temp - alias
    (XLA:CPU's own `peak_memory_in_bytes` leaves the temporaries out)."""
    m = compiled.memory_analysis()
    if m is None:
        return None
    parts = ("argument", "output", "temp", "alias")
    out = {part: getattr(m, f"{part}_size_in_bytes") for part in parts}
    out["peak"] = out["argument"] + out["output"] + out["temp"] - out["alias"]
    return out


# -------------------------------------------------------------------------------- workers


def cores() -> list[int]:
    """The cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def launcher(script: str | Path) -> list[str]:
    """The command line that started this process, up to `script`: a worker starts the way
    this process did (the same interpreter and options, or the `-c` launcher that the test
    suite runs a script under, with its type checking)."""
    me = Path(script).resolve()
    for i, arg in enumerate(sys.orig_argv[1:], start=1):
        try:
            if Path(arg).resolve() == me:
                return [sys.executable, *sys.orig_argv[1:i]]
        except (OSError, ValueError):  # not a path (the `-c` program's text, say)
            continue
    return [sys.executable]


def run_workers(
    script: str | Path,
    specs: list[Any],
    *,
    parallel: int = 1,
    pin: bool = False,
    timeout: float | None = None,
    env: dict[str, str] | None = None,
) -> list[Any]:
    """Run `script --worker ...` once per spec, each in a fresh process started the way
    this one was (`launcher`), with this environment updated by `env`, at most `parallel`
    at a time and (`pin`) each on a core of its own; return what each worker's `work`
    returned (`worker_main`), in the order of `specs`.

    Pinning suits jobs that gain little from a second core each (XLA:CPU runs one small
    update only about 1.2x faster on two cores than on one): two one-core processes side by
    side then do about 1.6x the work. The first worker to fail or to run past `timeout`
    seconds kills the others at once and raises, naming the specs' `label` (a spec's index
    otherwise) and exit codes; the workers' own output goes to this process's.
    """
    launch = [*launcher(script), str(Path(script).resolve()), "--worker"]
    environment = None if env is None else {**os.environ, **env}
    slots = max(1, min(parallel, len(specs)))
    free = [cores()[w % len(cores())] if pin else None for w in range(slots)]
    deadline = None if timeout is None else time.monotonic() + timeout
    with tempfile.TemporaryDirectory(prefix="benchmark_workers_") as tmp:
        outs = [Path(tmp) / f"worker{i}.json" for i in range(len(specs))]
        pending, running, failed = list(range(len(specs))), {}, []
        name = lambda i: specs[i].get("label", i) if isinstance(specs[i], dict) else i  # noqa: E731
        while pending or running:
            while pending and free:
                i, core = pending.pop(0), free.pop(0)
                job = json.dumps({"spec": specs[i], "core": core, "out": str(outs[i])})
                running[i] = (core, subprocess.Popen([*launch, job], env=environment))
            for i, (core, proc) in list(running.items()):
                if (rc := proc.poll()) is not None:
                    del running[i]
                    free.append(core)
                    failed += [f"{name(i)} exit code {rc}"] if rc else []
            if deadline is not None and time.monotonic() > deadline:
                failed += [f"{name(i)} ran past {timeout:.0f} s" for i in running]
            if failed:
                for _, proc in running.values():
                    proc.kill()
                    proc.wait()
                raise RuntimeError(f"{Path(script).stem} workers failed: {', '.join(failed)}")
            time.sleep(0.1 if running else 0)
        return [json.loads(out.read_text()) for out in outs]


def worker_main(job: str, work: Callable[[Any], Any]) -> int:
    """A worker of `run_workers` (`job`: the argument after `--worker`): pinned to its core
    where it has one (before JAX starts its threads), it runs `work(spec)` and writes the
    result atomically where `run_workers` reads it."""
    from eqx_lowmem._io import write_json as atomic_write_json

    job = json.loads(job)
    if job["core"] is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {job["core"]})
    atomic_write_json(job["out"], work(job["spec"]))
    return 0


# ------------------------------------------------------------------- the guide's model

# The guide's transformer: the size of every guide/remat/precision figure; and the
# accumulation figures' (the compiled peaks, and the CPU's times).
GUIDE = {"n_layers": 12, "d_model": 512, "n_heads": 8, "d_ff": 2048, "seq": 256, "batch": 32}
ACCUMULATE = {"n_layers": 2, "d_model": 256, "n_heads": 4, "d_ff": 1024, "seq": 128, "batch": 32}


def encoder(cfg: dict, key, remat="none", **options):
    """`eqx_lowmem.nn.transformer_encoder` at `cfg`'s size (options: segment, scan, ...)."""
    import eqx_lowmem as el

    dims = (cfg[k] for k in ("n_layers", "d_model", "n_heads", "d_ff"))
    return el.nn.transformer_encoder(*dims, key=key, remat=remat, **options)
