"""Streaming rates of DataStream from a `.npy` memory map, side by side, and shuffle quality.

Reads 6400 float32 samples of 64 KiB (shape (256, 64)) and of 1 KiB (shape (256,)) from a
`.npy` file in batches of 32, every batch copied out of the file, with a warm page cache:
in order, bounded shuffle (buffer 512), global shuffle, the guide's per-sample shuffle
buffer, an iterator source through DataStream's sample buffer, and grain's
`MapDataset.shuffle().batch()` where grain is installed. Then the mixing of data sorted by
label, and (on a GPU) the steps per second of a step fed by `stream.prefetch()`. The
stream's rows are copied by the kernel (`safe_reads`, the default); the `_plain_reads` rows
copy with NumPy from the mapping (`safe_reads=False`), to show what the safety costs.

    python benchmarks/stream.py            # writes benchmarks/results/stream.json
"""

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # the repo, if not installed
from _common import interleaved, median_ratio, write_json  # noqa: E402

from eqx_lowmem.data import DataStream  # noqa: E402

N = 6400
BATCH = 32
BUFFER = 512
SHAPES = {"64KiB": (256, 64), "1KiB": (256,)}
GOALS = {
    "shuffled_vs_in_order_64KiB": 0.9,
    "shuffled_vs_in_order_1KiB": 0.5,
    "shuffled_vs_grain": 5.0,
    "distinct_classes_bounded": 9.3,
    "gpu_prefetch_vs_on_device": 0.95,
}


def write_samples(path: Path, shape: tuple[int, ...]) -> None:
    """Sample i holds i in its first element, so an epoch's ids can be checked."""
    x = np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=(N, *shape))
    rng = np.random.default_rng(0)
    for start in range(0, N, 256):
        x[start : start + 256] = rng.standard_normal((min(256, N - start), *shape), np.float32)
    x.reshape(N, -1)[:, 0] = np.arange(N)
    x.flush()
    del x


def guide_per_sample_buffer(x: np.ndarray, seed: int):
    """The guide's shuffled stream: samples moved one at a time through a Python buffer."""
    rng = np.random.default_rng(seed)
    buffer, batch = [], []
    for i in range(x.shape[0]):
        buffer.append(np.array(x[i]))
        if len(buffer) > BUFFER:
            j = rng.integers(len(buffer))
            buffer[j], buffer[-1] = buffer[-1], buffer[j]
            batch.append(buffer.pop())
            if len(batch) == BATCH:
                yield (np.stack(batch),)
                batch = []
    rng.shuffle(buffer)
    for sample in buffer:
        batch.append(sample)
        if len(batch) == BATCH:
            yield (np.stack(batch),)
            batch = []
    if batch:
        yield (np.stack(batch),)


def raw_in_order(x: np.ndarray):
    """The floor of Python work: contiguous slices of the memory map, copied."""
    for start in range(0, x.shape[0], BATCH):
        yield (x[start : start + BATCH].copy(),)


def gather_then_unsort(x: np.ndarray, seed: int):
    """A global permutation, each batch gathered in sorted order and then put back in the
    shuffled order: the second copy DataStream avoids by serving batches sorted."""
    order = np.random.default_rng(seed).permutation(x.shape[0])
    for start in range(0, x.shape[0], BATCH):
        indices = order[start : start + BATCH]
        ranks = np.argsort(indices)
        gathered = x[indices[ranks]]
        batch = np.empty_like(gathered)
        batch[ranks] = gathered
        yield (batch,)


def grain_epochs(x: np.ndarray):
    """grain's shuffled batches, iterated directly and at several thread counts (0 is its
    advice for data in memory, 16 its default); the goal compares with the fastest."""
    try:
        import grain
    except ImportError:
        return None
    dataset = grain.MapDataset.source(x).shuffle(seed=0).batch(BATCH)
    variants = {"map_dataset_iter": lambda: ((b,) for b in dataset)}
    for threads in (0, 1, 2, 16):
        options = grain.ReadOptions(num_threads=threads, prefetch_buffer_size=2 * BATCH)
        variants[f"iter_dataset_threads_{threads}"] = lambda o=options: (
            (b,) for b in dataset.to_iter_dataset(o)
        )
    return variants


def consume(batches) -> int:
    """Exhaust an epoch, touching each batch, and count its samples."""
    total = 0
    for x, *_ in batches:
        total += x.shape[0]
    return total


def epoch_ids(batches) -> np.ndarray:
    return np.sort(np.concatenate([x.reshape(x.shape[0], -1)[:, 0] for (x, *_) in batches]))


# Each timing is the median of at least this much time in epochs: an epoch of 1 KiB samples
# takes about a millisecond, which one preemption on a shared machine would double.
MIN_TIMING_S = 0.03


def check_and_time(methods: dict, repeats: int, epochs: int) -> dict:
    """Check that each method serves every sample once (which burns it in), then time it;
    the methods are interleaved round by round (`_common.interleaved`), so drift in the
    machine hits all alike. A timing is `epochs` epochs back to back, or more when they are
    short (`MIN_TIMING_S`); a rate is over the median timing."""
    rates = {}
    per_timing = {}
    for name, epoch in methods.items():
        t0 = time.perf_counter()
        ids = epoch_ids(epoch())
        per_timing[name] = max(epochs, int(MIN_TIMING_S / (time.perf_counter() - t0)) + 1)
        exact = ids.shape == (N,) and bool((ids == np.arange(N)).all())
        if not exact:
            print(f"  {name}: {np.unique(ids).size} distinct of {N} samples, {ids.size} served")
        rates[name] = {"exactly_once": exact, "epochs_per_timing": per_timing[name]}

    def timing(epoch, count: int):
        def run():
            for _ in range(count):
                consume(epoch())

        return run

    calls = {name: timing(epoch, per_timing[name]) for name, epoch in methods.items()}
    times = interleaved(calls, repeats).wall
    for name in methods:
        rates[name]["samples_per_s"] = N * per_timing[name] / float(np.median(times[name]))
    return rates


def measure_rates(path: Path, repeats: int, epochs: int) -> dict:
    x = np.load(path, mmap_mode="r").view(np.ndarray)  # mapped once, as DataStream does
    streams = {
        "in_order": DataStream((path,), BATCH),
        "bounded_shuffle_512": DataStream((path,), BATCH, shuffle_buffer=BUFFER, key=0),
        "global_shuffle": DataStream((path,), BATCH, key=0),
        # The same with NumPy copying straight from the mapping (safe_reads=False): faster
        # on small rows, but a file truncated between the check and the read is SIGBUS.
        "in_order_plain_reads": DataStream((path,), BATCH, safe_reads=False),
        "global_shuffle_plain_reads": DataStream((path,), BATCH, key=0, safe_reads=False),
    }
    side_by_side = {name: (lambda s=s: iter(s)) for name, s in streams.items()}
    side_by_side["raw_in_order_slices"] = lambda: raw_in_order(x)
    side_by_side["global_gather_then_unsort"] = lambda: gather_then_unsort(x, 0)
    rates = check_and_time(side_by_side, repeats, epochs)

    # Measured after, because they leave the process slower for a while (grain's threads,
    # many small allocations), which would favour whatever runs after them.
    iterator_source = DataStream(
        lambda: ((x[i],) for i in range(N)), BATCH, shuffle_buffer=BUFFER, key=0
    )
    others = {
        "guide_per_sample_buffer_512": lambda: guide_per_sample_buffer(x, 0),
        "iterator_source_buffer_512": lambda: iter(iterator_source),
    }
    for name, epoch in (grain_epochs(x) or {}).items():
        others[f"grain_{name}"] = epoch
    rates.update(check_and_time(others, 1, repeats))
    return rates


def distinct_classes(batches) -> float:
    return float(np.mean([np.unique(labels).size for (labels, *_) in batches]))


def mixing() -> dict:
    """Distinct classes per batch of 32 over 60,000 samples stored sorted by label."""
    n, classes, buffer = 60_000, 10, 1000
    labels = np.repeat(np.arange(classes), n // classes)

    def sliding(seed):  # tf.data / HF datasets style: a buffer of samples, one at a time
        rng = np.random.default_rng(seed)
        pool, out = [], []
        for label in labels:
            pool.append(label)
            if len(pool) > buffer:
                out.append(pool.pop(rng.integers(len(pool))))
        rng.shuffle(pool)
        out = np.array(out + pool)
        return [(b,) for b in out[: n // BATCH * BATCH].reshape(-1, BATCH)]

    def full(seed):
        order = np.random.default_rng(seed).permutation(labels)
        return [(b,) for b in order[: n // BATCH * BATCH].reshape(-1, BATCH)]

    bounded = DataStream((labels,), BATCH, shuffle_buffer=buffer, key=0, drop_last=True)
    global_ = DataStream((labels,), BATCH, key=0, drop_last=True)
    iterator = DataStream(
        lambda: ((label,) for label in labels), BATCH, shuffle_buffer=buffer, key=0
    )
    epochs = 3
    return {
        "samples": n,
        "classes": classes,
        "batch": BATCH,
        "buffer": buffer,
        "epochs": epochs,
        "distinct_classes_per_batch": {
            "full_random": np.mean([distinct_classes(full(s)) for s in range(epochs)]),
            "bounded_shuffle_1000": np.mean([distinct_classes(bounded) for _ in range(epochs)]),
            "global_shuffle": np.mean([distinct_classes(global_) for _ in range(epochs)]),
            "iterator_buffer_1000": np.mean([distinct_classes(iterator) for _ in range(epochs)]),
            "sliding_sample_buffer_1000": np.mean(
                [distinct_classes(sliding(s)) for s in range(epochs)]
            ),
        },
    }


def prefetch_overlap(path: Path, repeats: int) -> dict:
    """Steps per second of a step fed by `stream.prefetch()` against data already on the
    device. On a CPU the step and the reading thread share the cores, so only a GPU figure
    is held to the goal."""
    import jax
    import jax.numpy as jnp

    on_gpu = jax.default_backend() == "gpu"
    width = 4096 if on_gpu else 256
    layers = 64 if on_gpu else 8
    stream = DataStream((path,), BATCH, shuffle_buffer=BUFFER, key=0, drop_last=True)
    w = jax.device_put(np.random.default_rng(0).standard_normal((width, width), np.float32))
    w = w / jnp.sqrt(jnp.float32(width))

    @jax.jit
    def step(w, x):
        h = x.reshape(x.shape[0], -1)[:, :width]  # (batch, width)
        for _ in range(layers):
            h = jnp.tanh(h @ w)
        return h.sum()

    resident = [jax.device_put(b) for b in stream]
    jax.block_until_ready(step(w, resident[0][0]))

    def from_device():
        out = None
        for (x,) in resident:
            out = step(w, x)
        jax.block_until_ready(out)

    def from_stream():
        out = None
        for (x,) in stream.prefetch(depth=2):
            out = step(w, x)
        jax.block_until_ready(out)

    steps = len(resident)
    from_stream()  # burn in: the reading thread's first start
    times = interleaved({"device": from_device, "stream": from_stream}, repeats).wall
    return {
        "backend": jax.default_backend(),
        "step": f"{layers} layers of tanh(h @ w), w ({width}, {width}), batch {BATCH}",
        "steps_per_s_on_device": steps / float(np.median(times["device"])),
        "steps_per_s_prefetch": steps / float(np.median(times["stream"])),
        "ratio": median_ratio(times["device"], times["stream"]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="rounds over all methods")
    parser.add_argument(
        "--epochs", type=int, default=3, help="epochs per timing (median), at least"
    )
    args = parser.parse_args()

    results: dict = {"samples": N, "batch": BATCH, "shuffle_buffer": BUFFER, "goals": GOALS}
    with tempfile.TemporaryDirectory() as tmp:
        for label, shape in SHAPES.items():
            path = Path(tmp) / f"x_{label}.npy"
            write_samples(path, shape)
            t0 = time.perf_counter()
            rates = measure_rates(path, args.repeats, args.epochs)
            in_order = rates["in_order"]["samples_per_s"]
            for row in rates.values():
                row["vs_in_order"] = row["samples_per_s"] / in_order
            results[f"rates_{label}"] = {"sample_shape": list(shape), "methods": rates}
            print(f"\n{label} samples, batch {BATCH} ({time.perf_counter() - t0:.0f} s)")
            print(f"  {'method':40s} {'samples/s':>12s} {'vs in order':>12s}  once")
            for name, row in rates.items():
                print(
                    f"  {name:40s} {row['samples_per_s']:12,.0f} {row['vs_in_order']:12.2f}"
                    f"  {row['exactly_once']}"
                )
            if label == "64KiB":
                results["prefetch"] = prefetch_overlap(path, args.repeats)

    results["mixing"] = mixing()

    achieved = {}
    for label in SHAPES:
        methods = results[f"rates_{label}"]["methods"]
        achieved[f"shuffled_vs_in_order_{label}"] = min(
            methods["bounded_shuffle_512"]["vs_in_order"], methods["global_shuffle"]["vs_in_order"]
        )
    grain_rates = [
        row["samples_per_s"]
        for name, row in results["rates_64KiB"]["methods"].items()
        if name.startswith("grain_")
    ]
    if grain_rates:
        methods = results["rates_64KiB"]["methods"]
        ours = min(methods[m]["samples_per_s"] for m in ("bounded_shuffle_512", "global_shuffle"))
        achieved["shuffled_vs_grain"] = ours / max(grain_rates)
    mixed = results["mixing"]["distinct_classes_per_batch"]
    achieved["distinct_classes_bounded"] = mixed["bounded_shuffle_1000"]
    if results["prefetch"]["backend"] == "gpu":
        achieved["gpu_prefetch_vs_on_device"] = results["prefetch"]["ratio"]
    results["achieved"] = achieved
    # What the kernel's copy (safe_reads, the default) costs against NumPy's: no goal.
    results["safe_reads_vs_plain"] = {
        label: {
            kind: results[f"rates_{label}"]["methods"][safe]["samples_per_s"]
            / results[f"rates_{label}"]["methods"][f"{safe}_plain_reads"]["samples_per_s"]
            for kind, safe in (("in_order", "in_order"), ("global_shuffle", "global_shuffle"))
        }
        for label in SHAPES
    }
    results["goals_met"] = {
        name: (bool(achieved[name] >= goal) if name in achieved else None)
        for name, goal in GOALS.items()
    }

    print("\nmixing, distinct classes per batch of 32 (60,000 samples sorted into 10 classes):")
    for name, value in mixed.items():
        print(f"  {name:40s} {value:6.2f}")
    p = results["prefetch"]
    print(
        f"\nprefetch ({p['backend']}): {p['steps_per_s_prefetch']:.1f} steps/s from the stream, "
        f"{p['steps_per_s_on_device']:.1f} from the device ({p['ratio']:.2f}x)"
    )
    print("\ngoals:")
    for name, goal in GOALS.items():
        value = achieved.get(name)
        shown = "not measured" if value is None else f"{value:.2f}"
        print(f"  {name:40s} goal {goal:5.2f}  achieved {shown:>12s}  {results['goals_met'][name]}")
    print(f"\nwrote {write_json('stream', results)}")


if __name__ == "__main__":
    main()
