"""`DataStream`: batches from arrays, `.npy` memory maps or an iterator, shuffled, resumable."""

import inspect
import mmap
import weakref
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from itertools import chain, repeat
from typing import Any

import jax
import numpy as np

from .._checks import check_int, seed_entropy
from ._draws import InOrder, ShuffleBuffer
from ._mapped import MappedRows
from ._prefetch import Batches, check_depth, checked, run_ahead, to_device
from ._shuffle import BlockOrder, GlobalOrder, Order, seed
from ._sources import (
    SOURCE_KINDS,
    SampleReader,
    Watched,
    copy_rows,
    open_arrays,
    row_gather,
)

Batch = tuple[np.ndarray, ...]

# What a state holds: the position, and what must match for it to mean the same batches.
_POSITION = ("epoch", "batch")
_ORDER = ("key", "batch_size", "shuffle_buffer", "drop_last", "samples")
# A shuffled stream gathers batches of up to `_GROUP_BATCH_BYTES` (per process) in groups of
# `_GROUP_BATCHES`, one gather per field into fresh arrays, and serves each batch as a slice
# of them: it saves a gather call and an array per batch, 13-17% of an epoch of 1 KiB
# samples in batches of 32 (f7b0d4f). A served batch keeps its group (at most 256 KiB)
# alive. Larger groups were slower (for f7b0d4f: 0.55x in-order at 512 KiB against 0.65x at
# 256 KiB), and so were groups of batches of 128 KiB: the fresh arrays stop fitting in the
# L2 cache.
_GROUP_BATCHES = 8
_GROUP_BATCH_BYTES = 32 << 10


def _mapped_file(a: Any) -> bool:
    """`a` is a view of a memory-mapped file (`np.load(mmap_mode=...)`, `np.memmap`)."""
    while a is not None:
        if isinstance(a, mmap.mmap):
            return True
        a = getattr(a, "base", None)
    return False


def _is_int(x: Any) -> bool:
    """An int that is not a bool (`True` is an int to Python, never a size here)."""
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


class DataStream:
    """Batches of samples served one epoch per iteration, without holding the dataset.

    `source` is one of

    - a tuple of arrays with the same first dimension, e.g. `(x, y)`;
    - a tuple of `.npy` paths, opened as read-only memory maps: only the samples of the
      batch being served are read (arrays and paths may be mixed);
    - a function of no arguments returning an iterator of samples, each a tuple of arrays
      `(x_i, y_i)` with the same shapes and dtypes; the number of samples may be unknown.
      It is called once per epoch and must yield the same samples each time for
      `set_state` to resume exactly.

    Iterating gives one epoch of tuples of numpy arrays, each batch copied out of the source
    into a fresh array (or a slice of one, see below) that the stream never writes to again;
    iterating again gives the next epoch in a new order derived from `key` and the epoch
    number. Every sample is served exactly once per epoch; the last batch is smaller unless
    `drop_last`.

    The order, and its cost:

    - `shuffle_buffer=None, key=None`: in order. Memory: one batch. Time: one contiguous
      copy per batch.
    - `shuffle_buffer=None, key=k`: a fresh global permutation each epoch (arrays and
      memory maps only). Memory: 16384 indices, tables of `O(sqrt(N))` integers (at most
      3 MiB) and one group of batches (below). Time: about 15 to 30 ns of index work per
      sample (measured for f7b0d4f), one gather per group of batches.
    - `shuffle_buffer=n, key=k`: bounded. For arrays and memory maps, blocks of
      `max(1, n // 128)` contiguous samples in random order, shuffled `n` indices at a
      time. Memory: about `max(n, 16384)` indices and one group of batches. Time: as the
      global shuffle. For iterators, a buffer of `n` samples. Memory: `n` samples. Time:
      one random gather per batch out of the buffer, and one stacked write of the samples
      that refill it.

    For arrays and memory maps the shuffle moves indices, never data: each field of a batch
    is read with one gather over its indices in ascending order, and within a batch the
    samples come in ascending index order (which samples share a batch is what the shuffle
    decides; putting them back in shuffled order would cost a second copy of every batch).
    Batches of up to 32 KiB (this process's part, all fields) are read 8 at a time, one
    gather per field into one fresh array, and served as slices of it (an epoch of batches
    of 32 samples of 1 KiB is about 15% faster, measured for f7b0d4f). A batch so served
    keeps its group's arrays (at most 256 KiB) alive while it is held; larger batches are
    read one at a time into arrays of their own. An array of 64 KiB or more starts on a
    64-byte boundary: on the CPU backend `jax.device_put` (and a jitted step) then uses it
    in place instead of copying it (a copy of 256 KiB took 123 us, 1 MiB 186 us: 423dbdc).
    The global order is a keyed pseudo-random permutation (a Feistel network; up to 16384
    samples, a stored one) computed a chunk of positions at a time, so it needs no O(N)
    memory and a stream can start anywhere in it. The bounded order mixes about `n`
    samples at a time from about 128 blocks spread over the whole dataset: on 60,000
    samples stored sorted into 10 classes, batches of 32 with `n=1000` hold 9.5 distinct
    classes, against 9.66 for a full shuffle and 1.6 for a sliding buffer of 1000 samples.

    For iterators, `shuffle_buffer=n` keeps a buffer of `n` samples: each batch is drawn at
    random from it and its slots refilled from the iterator, in vectorised steps, and the
    buffer is emptied at the end of the epoch so no sample is lost. It can only mix samples
    that arrive within about `n` of each other (1.6 classes per batch on the sorted data
    above), so prefer arrays or `.npy` files for data stored in order. A global shuffle of
    an iterator would hold every sample, so it is refused.

    **Several processes.** Each process reads only its contiguous slice of every global
    batch of `batch_size` samples (`batch_size / process_count` samples; the last,
    smaller batch is split as evenly as possible, so pass `drop_last=True` for equal
    shapes); the global order does not depend on the number of processes. An iterator
    cannot seek, so with an iterator source every process reads every sample and keeps its
    slice; give each process its own source to split the reading.

    **Resuming.** `state()` is a small JSON-serialisable dict; `set_state(state)` on a
    stream built with the same arguments continues with the same batches, bit for bit. Taken
    between batches, it means "the next batch to serve is batch `state['batch']` of epoch
    `state['epoch']`". Array sources jump there directly; iterator sources replay the
    epoch's first batches (reading, not copying, their samples), since an iterator cannot
    seek. The state does not depend on the number of processes, so a run may resume on a
    different number of them.

    **Files that change.** A `.npy` file is memory-mapped: reading a page that a
    truncation removed kills the process with SIGBUS, and a file rewritten in place serves
    a mix of old and new data. Before each read (each group of batches) the stream checks
    every mapped file's size, modification time and inode against those it opened, and
    raises `RuntimeError` naming the file if any changed. A truncation after the check
    must not reach the copy either: the stream holds a read lease on each file (Linux),
    so a writer opening or truncating it, in any process, waits (at most about 10 ms)
    until the copy in progress ends and the stream gives the lease up; NumPy copies from
    the mapping meanwhile, at NumPy's speed. Where no lease is granted (a file open for
    writing, another user's file, NFS, another OS) or once one is given up, the kernel
    copies the rows (`process_vm_readv` on the stream's own mapping, or `pread`), so a
    file shrunk after the check raises the same error instead of SIGBUS, at half
    NumPy's rate or less on shuffled reads. `safe_reads=False` copies with NumPy and no
    lease (`benchmarks/stream.py` measures both): a window of microseconds between the
    check and the copy in which a truncation is fatal. What no check catches: a change
    that keeps size, inode and modification time (a clock set back, or `os.utime`), and
    changes on filesystems whose modification times are coarse (a rewrite within the same
    second on some). Keep data files unchanged while a stream runs.

    Args:
        source: arrays, `.npy` paths, or a function returning an iterator of samples, as
            above.
        batch_size: samples per global batch (over all processes). Memory: one batch per
            batch in use or waiting in `prefetch`.
        shuffle_buffer: `None` for no shuffle or (with a key) a global shuffle; an int for a
            bounded shuffle holding that many indices (arrays) or samples (iterators). More
            mixes better; see the table for memory and time.
        key: keyword-only: an int seed, `jr.PRNGKey(seed)` or `jr.key(seed)`. Needed to
            shuffle; the same key gives the same orders.
        drop_last: drop the last batch of an epoch when it has fewer than `batch_size`
            samples, so every batch has the same shape (and the step compiles once).
        process_index: this process's index; default `jax.process_index()`.
        process_count: the number of processes; default `jax.process_count()`.
        safe_reads: keyword-only: read memory-mapped files under a lease or through the
            kernel, so a file shrunk mid-read raises instead of SIGBUS (default); False
            reads the mapping with no lease. Arrays in memory are unaffected.

    Raises:
        TypeError: if `source` is none of the three kinds, or `batch_size`,
            `shuffle_buffer` or `key` is not an int (`True` and `2.5` are not).
        ValueError: for `batch_size < 1`, `shuffle_buffer < 1`, a shuffle without a key, a
            global shuffle of an iterator, a `batch_size` not divisible by
            `process_count`, arrays of different lengths, `drop_last` with fewer samples
            than a batch, a non-`.npy`, truncated or corrupt file, or an array that is not
            numeric (objects, pickled, strings, records). Samples of inconsistent shape or
            dtype from an iterator raise when they are read, naming the sample; an
            iterator source that gives no batch in an epoch (empty, or a used-up generator
            returned again) raises when that epoch is iterated.
        FileNotFoundError: for a missing file.

    Example:
        >>> import numpy as np
        >>> from eqx_lowmem.data import DataStream
        >>> stream = DataStream((np.arange(6),), batch_size=4)
        >>> [b[0].tolist() for b in stream]
        [[0, 1, 2, 3], [4, 5]]
        >>> shuffled = DataStream((np.arange(6),), batch_size=4, shuffle_buffer=3, key=0)
        >>> sorted(int(i) for b in shuffled for i in b[0])
        [0, 1, 2, 3, 4, 5]
    """

    def __init__(
        self,
        source: Sequence[Any] | Callable[[], Iterable[Any]],
        batch_size: int,
        shuffle_buffer: int | None = None,
        *,
        key: int | jax.Array | np.ndarray | None = None,
        drop_last: bool = False,
        process_index: int | None = None,
        process_count: int | None = None,
        safe_reads: bool = True,
    ):
        check_int("batch_size", batch_size, 1)
        check_int("shuffle_buffer", shuffle_buffer, 1, none=True, alternative="None: no shuffle")
        for name, flag in (("drop_last", drop_last), ("safe_reads", safe_reads)):
            if not isinstance(flag, (bool, np.bool_)):
                raise TypeError(f"{name}={flag!r}; expected True or False.")
        batch_size = int(batch_size)
        shuffle_buffer = None if shuffle_buffer is None else int(shuffle_buffer)
        if shuffle_buffer is not None and key is None:
            raise ValueError(
                f"shuffle_buffer={shuffle_buffer} needs a key to shuffle with; pass key=0 "
                "(an int seed) or key=jr.PRNGKey(0)."
            )
        process_index = jax.process_index() if process_index is None else process_index
        process_count = jax.process_count() if process_count is None else process_count
        check_int("process_index", process_index, 0)
        check_int("process_count", process_count, 1)
        if not 0 <= process_index < process_count:
            raise ValueError(
                f"process_index={process_index} with process_count={process_count}; expected "
                f"0 <= process_index < process_count."
            )
        if batch_size % process_count:
            raise ValueError(
                f"batch_size={batch_size} is not divisible by process_count={process_count}; "
                "batch_size is the global batch, split equally over the processes: use a "
                f"multiple of {process_count}."
            )
        self._watched: list[Watched] = []
        self._mapped: dict[int, MappedRows] = {}  # by source index: the copiers of files
        if isinstance(source, (tuple, list)):
            self._arrays: list[np.ndarray] | None
            self._arrays, self._watched = open_arrays(source)
            if safe_reads:
                self._mapped = {
                    w.source_index: MappedRows(
                        self._arrays[w.source_index], w.path, w.data_offset, w.check
                    )
                    for w in self._watched
                }
            self._factory: Callable[[], Iterable[Any]] | None = None
            n = self._arrays[0].shape[0]
            if drop_last and n < batch_size:
                raise ValueError(
                    f"drop_last=True with {n} samples and batch_size={batch_size} leaves no "
                    f"batches; use a batch_size of at most {n} or drop_last=False."
                )
        elif callable(source):
            if key is not None and shuffle_buffer is None:
                raise ValueError(
                    "a global shuffle (key given, shuffle_buffer=None) of an iterator source "
                    "would hold every sample; pass shuffle_buffer=n to shuffle n samples at "
                    "a time."
                )
            _check_no_arguments(source)
            self._arrays = None
            self._factory = source
        else:
            raise TypeError(
                f"source is a {type(source).__name__}; wrap a single array as (x,).\n{SOURCE_KINDS}"
            )
        self.batch_size = batch_size
        self.shuffle_buffer = shuffle_buffer
        self.drop_last = drop_last
        self.process_index = process_index
        self.process_count = process_count
        self._entropy = seed_entropy("key", key)
        self._epoch = 0
        self._batch = 0
        self._generation = 0  # which iteration may move the position
        self._last_iterator: Any = None  # a weakref to what source() returned last

    # ----------------------------------------------------------------------------- sizes

    @property
    def num_samples(self) -> int | None:
        """Samples in the source, or `None` for an iterator."""
        return None if self._arrays is None else self._arrays[0].shape[0]

    @property
    def num_batches(self) -> int | None:
        """Global batches per epoch, or `None` for an iterator (its length is unknown)."""
        n = self.num_samples
        if n is None:
            return None
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def __len__(self) -> int:
        """Batches per epoch. Raises `TypeError` for an iterator source; see `num_batches`."""
        num_batches = self.num_batches
        if num_batches is None:
            raise TypeError(
                "the number of batches of an iterator source is unknown; "
                "stream.num_batches is None."
            )
        return num_batches

    @property
    def arrays(self) -> tuple[np.ndarray, ...] | None:
        """The source's arrays (memory maps for `.npy` files), or `None` for an iterator."""
        return None if self._arrays is None else tuple(self._arrays)

    @property
    def in_memory(self) -> bool:
        """Whether every batch is a copy of arrays already in memory: no `.npy` file or
        `np.memmap` to read (which may wait on the disk) and no iterator to run."""
        return self._arrays is not None and not any(map(_mapped_file, self._arrays))

    @property
    def epoch(self) -> int:
        """The epoch the next batch belongs to."""
        return self._epoch

    # ----------------------------------------------------------------------------- state

    def state(self) -> dict[str, Any]:
        """The position: the next batch to serve is batch `state["batch"]` of epoch
        `state["epoch"]`. Plain ints, lists and bools, so `json.dumps` can store it; the
        other fields identify the order, and `set_state` checks them."""
        return {
            "epoch": self._epoch,
            "batch": self._batch,
            "key": self._entropy,
            "batch_size": self.batch_size,
            "shuffle_buffer": self.shuffle_buffer,
            "drop_last": self.drop_last,
            "samples": self.num_samples,
        }

    def set_state(self, state: dict[str, Any]) -> None:
        """Continue from `state`, taken by `state()` on a stream with the same arguments.

        Any iterator over this stream started before is stopped: its next batch raises.

        Raises:
            ValueError: if `state` comes from a stream with a different key, batch size,
                shuffle buffer, `drop_last` or number of samples, whose batches would
                differ, or is not a position of this stream.
        """
        if not isinstance(state, dict):
            raise TypeError(
                f"set_state(state) takes the dict that stream.state() returned, got "
                f"{type(state).__name__}: {state!r:.80}."
            )
        missing = [f for f in _POSITION + _ORDER if f not in state]
        if missing:
            raise ValueError(f"state lacks {missing}; pass a dict returned by stream.state().")
        mine = self.state()
        for field in _ORDER:
            if state[field] != mine[field]:
                raise ValueError(
                    f"state has {field}={state[field]!r} but this stream has "
                    f"{field}={mine[field]!r}; its batches would not be this stream's. "
                    "Build the stream with the arguments of the one that took the state."
                )
        epoch, batch = state["epoch"], state["batch"]
        num_batches = self.num_batches
        if (
            not _is_int(epoch)
            or not _is_int(batch)
            or epoch < 0
            or batch < 0
            or (num_batches is not None and batch > num_batches)
        ):
            raise ValueError(
                f"state has epoch={epoch!r}, batch={batch!r}; expected ints >= 0 with batch "
                f"<= {num_batches} (batches per epoch)."
            )
        if num_batches is not None and batch == num_batches:
            epoch, batch = epoch + 1, 0
        self._epoch, self._batch = epoch, batch
        self._generation += 1

    # ----------------------------------------------------------------------------- serving

    def __iter__(self) -> Iterator[Batch]:
        """The batches from the current position to the end of its epoch."""
        return self._serve(None)

    def prefetch(
        self,
        *,
        depth: int = 2,
        sharding: jax.sharding.Sharding | None = None,
        check: Callable[[Batch], None] | None = None,
    ) -> Batches:
        """Like `iter(stream)`, with each batch read and put on the device by a background
        thread `depth` batches ahead, so loading overlaps the step. `state()` counts the
        batches handed to the caller, not those read ahead.

        Use it as `with stream.prefetch() as batches: for batch in batches: ...`: leaving
        the block by any path (the end, `break`, an exception, Ctrl-C) stops the thread and
        waits for it. Without `with`, the thread stops when the iterator is exhausted,
        closed (`batches.close()`) or garbage-collected; a traceback that holds the
        iterator (an exception caught further up) keeps it waiting until then.

        Args:
            depth: batches read and placed ahead. Memory: up to `depth` batches on the
                device besides the one in use, and one on the host.
            sharding: where each batch goes (`jax.device_put`); `None` for the default
                device. With several processes, each passes its slice and the global array
                is assembled with `jax.make_array_from_process_local_data`.
            check: `check(batch)` on each batch's host arrays, in the background thread
                before the batch is copied to the device (no copy back, no wait on the
                device); what it raises is raised here, at that batch.
        """
        check_depth(depth)
        return Batches(self._serve((depth, sharding, check)))

    def _serve(self, prefetch: tuple[int, Any, Any] | None) -> Generator[Any, None, None]:
        self._generation += 1
        generation = self._generation
        epoch, start = self._epoch, self._batch
        batches = self._batches(epoch, start)
        if prefetch is not None:
            depth, sharding, check = prefetch
            put = lambda b: (to_device(checked(b[0], check), sharding), b[1])  # noqa: E731
            batches = run_ahead(batches, put, depth)
        try:
            for k, (batch, last) in enumerate(batches, start):
                if self._generation != generation:
                    raise RuntimeError(
                        "this iterator over the stream was superseded by a later "
                        "iter(stream), stream.prefetch() or stream.set_state(); iterate one "
                        "epoch at a time."
                    )
                # Moved before the batch is handed out: between batches, the position is
                # the next batch to serve.
                self._epoch, self._batch = (epoch + 1, 0) if last else (epoch, k + 1)
                yield batch
        finally:
            close = getattr(batches, "close", None)
            if close is not None:
                close()  # stops the prefetching thread when the caller stops early
        if self._generation == generation:  # the epoch ran to its end (perhaps no batches)
            self._epoch, self._batch = epoch + 1, 0

    def _batches(self, epoch: int, start: int) -> Iterator[tuple[Batch, bool]]:
        """Epoch `epoch` from batch `start`: (this process's part of the batch, whether it
        is the epoch's last). Depends on nothing but its arguments and the configuration."""
        if self._arrays is not None:
            return self._array_batches(self._arrays, epoch, start)
        assert self._factory is not None
        return self._iterator_batches(self._factory, epoch, start)

    def _check_files(self) -> None:
        """Refuse to read a memory-mapped file that changed since it was opened."""
        for watched in self._watched:
            watched.check()

    def _local(self, size: int) -> tuple[int, int]:
        """This process's slice of a global batch of `size` samples."""
        p, count = self.process_index, self.process_count
        return p * size // count, (p + 1) * size // count

    def _array_batches(
        self, arrays: list[np.ndarray], epoch: int, start: int
    ) -> Iterator[tuple[Batch, bool]]:
        if self._entropy is None:
            return self._in_order_batches(arrays, start)
        gathers = [
            self._mapped[i].gather if i in self._mapped else row_gather(x)
            for i, x in enumerate(arrays)
        ]

        def group_batches(group: tuple[int, np.ndarray, bool]) -> Iterator[tuple[Batch, bool]]:
            count, indices, last = group
            self._check_files()
            # One gather per field of the group's rows (ascending within each batch) into
            # fresh arrays; each batch is a slice of them. A batch is never written after.
            fields = [gather(indices) for gather in gathers]
            if count == 1:
                return iter(((tuple(fields), last),))
            local = indices.size // count
            batches = zip(*[f.reshape(count, local, *f.shape[1:]) for f in fields], strict=True)
            if last:
                return zip(batches, chain(repeat(False, count - 1), (True,)), strict=True)
            return zip(batches, repeat(False), strict=False)

        # C iterators below `_serve`: no Python frame of this method runs per batch.
        return chain.from_iterable(map(group_batches, self._groups(arrays, epoch, start)))

    def _in_order_batches(
        self, arrays: list[np.ndarray], start: int
    ) -> Generator[tuple[Batch, bool], None, None]:
        n, size = arrays[0].shape[0], self.batch_size
        num_batches = self.num_batches
        assert num_batches is not None
        # Copies of rows start:stop, chosen once per epoch rather than per batch.
        slices = [
            self._mapped[i].slice if i in self._mapped else copy_rows(x)
            for i, x in enumerate(arrays)
        ]
        for k in range(start, num_batches):
            self._check_files()
            first = k * size
            lo, hi = self._local(min(size, n - first))
            batch = tuple([copy(first + lo, first + hi) for copy in slices])
            yield batch, k == num_batches - 1

    def _groups(
        self, arrays: list[np.ndarray], epoch: int, start: int
    ) -> Generator[tuple[int, np.ndarray, bool], None, None]:
        """The shuffled epoch from batch `start` in groups of consecutive batches: (batches
        in the group, this process's indices of them, sorted within each batch, whether
        the group ends the epoch)."""
        n, size = arrays[0].shape[0], self.batch_size
        num_batches = self.num_batches
        assert num_batches is not None and self._entropy is not None
        if self.shuffle_buffer is None:
            order: Order = GlobalOrder(n, self._entropy, epoch)
        else:
            order = BlockOrder(n, self.shuffle_buffer, self._entropy, epoch)
        lo, hi = self._local(size)
        batch_bytes = (hi - lo) * sum(x[0].nbytes for x in arrays)
        group = _GROUP_BATCHES if batch_bytes <= _GROUP_BATCH_BYTES else 1
        # Batches whose indices are computed and sorted at once: a chunk of the order.
        span = max(1, order.chunk_size // size // group) * group
        full = n // size  # batches of `size`; a last, smaller one may follow
        for first in range(start, full, span):
            stop = min(first + span, full)
            rows = np.sort(order.indices(first * size, stop * size).reshape(-1, size), axis=1)
            rows = rows[:, lo:hi]
            for g in range(0, stop - first, group):
                part = rows[g : g + group]
                yield part.shape[0], part.reshape(-1), first + g + part.shape[0] == num_batches
        if full < num_batches and start <= full:  # the epoch's last, smaller batch
            indices = np.sort(order.indices(full * size, n))
            last_lo, last_hi = self._local(indices.size)
            yield 1, indices[last_lo:last_hi], True

    def _iterator_batches(
        self, factory: Callable[[], Iterable[Any]], epoch: int, start: int
    ) -> Generator[tuple[Batch, bool], None, None]:
        """Batches from `factory()`; the first `start` are read but not served."""
        iterator = factory()
        last = None if self._last_iterator is None else self._last_iterator()
        if iterator is last and iterator is not None:
            raise ValueError(
                f"source() returned the same iterator in epoch {epoch + 1} as before, which "
                "is used up; source must be a function that returns a fresh iterator each "
                "epoch, e.g. `lambda: iter(samples)` or a generator function (not a "
                "generator)."
            )
        try:
            self._last_iterator = weakref.ref(iterator)
        except TypeError:  # not weakly referenceable: cannot be told apart, not checked
            self._last_iterator = None
        reader = SampleReader(lambda: iterator)
        size = self.batch_size
        if self.shuffle_buffer is None:
            draws: InOrder | ShuffleBuffer = InOrder(reader)
        else:
            assert self._entropy is not None
            draws = ShuffleBuffer(reader, self.shuffle_buffer, size, seed(self._entropy, epoch, 2))

        def complete(count: int) -> bool:
            return count > 0 and not (self.drop_last and count < size)

        # Each batch is drawn before the previous one is served: it tells whether that one
        # is the epoch's last.
        batch, count = draws.draw(size, gather=start == 0)
        k = 0
        while complete(count):
            following, following_count = draws.draw(size, gather=k + 1 >= start)
            if k >= start:
                assert batch is not None
                lo, hi = self._local(count)
                if hi - lo < count:
                    batch = tuple(x[lo:hi].copy() for x in batch)
                yield batch, not complete(following_count)
            batch, count, k = following, following_count, k + 1
        if k == 0:
            raise ValueError(
                f"source() gave no batches in epoch {epoch + 1} ({count} samples"
                f"{f', fewer than batch_size={size} with drop_last' if count else ''}); "
                "a stream must serve at least one batch per epoch. If source returns a "
                "generator, it must return a new one each call (a generator function)."
            )
        if k < start:
            raise ValueError(
                f"the state says {start} batches of epoch {epoch} were served, but source() "
                f"gave only {k}; it must yield the same samples each epoch to resume."
            )


def _check_no_arguments(source: Callable[..., Any]) -> None:
    """A source function is called with no arguments, once per epoch: refuse, when it is
    built, one that needs some (it would fail at the first batch)."""
    try:
        signature = inspect.signature(source)
    except (TypeError, ValueError):  # a builtin without a signature: let it be
        return
    try:
        signature.bind()
    except TypeError:
        raise TypeError(
            f"source is a function taking arguments {signature}; a DataStream calls it with "
            "none, once per epoch, for a fresh iterator of samples. Bind them first, e.g. "
            "DataStream(lambda: read(path, split), ...) or functools.partial(read, path)."
        ) from None
