"""Streaming rates of DataStream from a `.npy` memory map, side by side.

Reads float32 samples of 64 KiB and of 1 KiB from a `.npy` file in batches, every batch
copied out of the file, with a warm page cache: in order, bounded shuffle, global shuffle,
the global shuffle copied by NumPy from the mapping (`safe_reads=False`: what safe reads
cost) and grain's `MapDataset.shuffle().batch()` where grain is installed. (A step fed by
`stream.prefetch()` against batches already on the device was the speed grid's `stream/*`
group until commit 80a7b30, `speed_stream.json`. How a bounded shuffle mixes data stored
sorted by label is deterministic, so `tests/test_data_shuffle.py` checks it; this script
measured it until commit c02c0aa, `stream.json`'s `mixing`.)

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
from _common import interleaved, write_json  # noqa: E402

from eqx_lowmem.data import DataStream  # noqa: E402

N, BATCH, BUFFER = 6400, 32, 512
SHAPES = {"64KiB": (256, 64), "1KiB": (256,)}
GOALS = {"shuffled_vs_in_order_64KiB": 0.9, "shuffled_vs_in_order_1KiB": 0.5,
         "safe_vs_plain_reads_64KiB": 0.9, "safe_vs_plain_reads_1KiB": 0.9,
         "shuffled_vs_grain": 5.0}  # fmt: skip
# Each timing is the median of at least this much time in epochs: an epoch of 1 KiB samples
# takes about a millisecond, which one preemption on a shared machine would double.
MIN_TIMING_S = 0.03


def write_samples(path: Path, shape: tuple[int, ...]) -> None:
    """Sample i holds i in its first element, so an epoch's ids can be checked."""
    x = np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=(N, *shape))
    np.random.default_rng(0).standard_normal(dtype=np.float32, out=x)  # in place: no copy
    x.reshape(N, -1)[:, 0] = np.arange(N)
    x.flush()


def grain_epochs(x: np.ndarray) -> dict:
    """grain's shuffled batches, iterated directly and at several thread counts (0 is its
    advice for data in memory, 16 its default); the goal compares with the fastest."""
    try:
        import grain
    except ImportError:
        return {}
    dataset = grain.MapDataset.source(x).shuffle(seed=0).batch(BATCH)
    variants = {"grain_map_dataset_iter": lambda: ((b,) for b in dataset)}
    for threads in (0, 1, 2, 16):
        options = grain.ReadOptions(num_threads=threads, prefetch_buffer_size=2 * BATCH)
        variants[f"grain_iter_dataset_threads_{threads}"] = lambda o=options: (
            (b,) for b in dataset.to_iter_dataset(o)
        )
    return variants


def check_and_time(methods: dict, repeats: int, epochs: int) -> dict:
    """Check that each method serves every sample exactly once (or raise; this burns it in),
    then time it in interleaved rounds (`_common.interleaved`), so drift in the machine hits
    all alike. A timing is `epochs` epochs back to back, or more when they are short
    (`MIN_TIMING_S`); a rate is over the median timing."""
    rates, calls = {}, {}
    for name, epoch in methods.items():
        t0 = time.perf_counter()
        ids = np.sort(np.concatenate([x.reshape(x.shape[0], -1)[:, 0] for x, *_ in epoch()]))
        count = max(epochs, int(MIN_TIMING_S / (time.perf_counter() - t0)) + 1)
        if ids.shape != (N,) or not (ids == np.arange(N)).all():
            raise RuntimeError(f"{name} did not serve each of the {N} samples exactly once")
        rates[name] = {"epochs_per_timing": count}

        def run(epoch=epoch, count=count):
            for _ in range(count):
                for _batch in epoch():
                    pass

        calls[name] = run
    times = interleaved(calls, repeats)
    for name, row in rates.items():
        row["samples_per_s"] = N * row["epochs_per_timing"] / float(np.median(times[name]))
    return rates


def measure_rates(path: Path, repeats: int, epochs: int) -> dict:
    streams = {
        "in_order": DataStream((path,), BATCH),
        "bounded_shuffle_512": DataStream((path,), BATCH, shuffle_buffer=BUFFER, key=0),
        "global_shuffle": DataStream((path,), BATCH, key=0),
        # NumPy copying straight from the mapping with no lease (safe_reads=False): a file
        # truncated between the check and the read is SIGBUS.
        "global_shuffle_plain_reads": DataStream((path,), BATCH, key=0, safe_reads=False),
    }
    rates = check_and_time({n: (lambda s=s: iter(s)) for n, s in streams.items()}, repeats, epochs)
    # After, because grain's threads leave the process slower for a while.
    x = np.load(path, mmap_mode="r").view(np.ndarray)
    rates.update(check_and_time(grain_epochs(x), 1, repeats))
    for row in rates.values():
        row["vs_in_order"] = row["samples_per_s"] / rates["in_order"]["samples_per_s"]
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="rounds over all methods")
    parser.add_argument("--epochs", type=int, default=3, help="epochs per timing, at least")
    parser.add_argument("--out", type=Path, default=None, help="directory for the JSON")
    args = parser.parse_args()
    results: dict = {"samples": N, "batch": BATCH, "shuffle_buffer": BUFFER, "goals": GOALS,
                     "repeats": args.repeats, "epochs": args.epochs}  # fmt: skip
    achieved = {}
    with tempfile.TemporaryDirectory() as tmp:
        for label, shape in SHAPES.items():
            path = Path(tmp) / f"x_{label}.npy"
            write_samples(path, shape)
            m = measure_rates(path, args.repeats, args.epochs)
            results[f"rates_{label}"] = {"sample_shape": list(shape), "methods": m}
            for name, row in m.items():
                print(f"{label} {name:36s} {row['samples_per_s']:12,.0f} samples/s "
                      f"{row['vs_in_order']:6.2f}x")  # fmt: skip
            rate = {n: r["samples_per_s"] for n, r in m.items()}
            shuffled = min(rate["bounded_shuffle_512"], rate["global_shuffle"])
            achieved[f"shuffled_vs_in_order_{label}"] = shuffled / rate["in_order"]
            # What safe reads (the default) cost against NumPy's copy from the mapping.
            safe = rate["global_shuffle"] / rate["global_shuffle_plain_reads"]
            achieved[f"safe_vs_plain_reads_{label}"] = safe
            grain = [r for n, r in rate.items() if n.startswith("grain_")]
            if grain and label == "64KiB":
                achieved["shuffled_vs_grain"] = shuffled / max(grain)
    results["achieved"] = achieved
    results["goals_met"] = {n: bool(achieved[n] >= g) if n in achieved else None
                            for n, g in GOALS.items()}  # fmt: skip
    print(f"achieved: {achieved}")
    print(f"wrote {write_json('stream', results, args.out)}")


if __name__ == "__main__":
    main()
