"""Put the next batches on the device from a background thread while the step runs."""

import queue
import threading
from collections.abc import Callable, Generator, Iterable, Iterator
from typing import Any, TypeVar

import jax
import numpy as np

T = TypeVar("T")
U = TypeVar("U")

# How often a waiting producer looks whether the consumer has stopped.
_POLL_SECONDS = 0.05


def to_device(batch: Any, sharding: jax.sharding.Sharding | None) -> Any:
    """`batch` (a pytree of host arrays) on the device, or laid out by `sharding`.

    With several processes each one holds only its slice of the global batch, so the global
    array is assembled with `jax.make_array_from_process_local_data`.
    """
    if sharding is None:
        return jax.device_put(batch)
    if jax.process_count() == 1:
        return jax.device_put(batch, sharding)
    return jax.tree.map(lambda x: jax.make_array_from_process_local_data(sharding, x), batch)


def checked(batch: T, check: Callable[[T], None] | None) -> T:
    """`batch`, after `check(batch)` (which raises on a bad one) where given."""
    if check is not None:
        check(batch)
    return batch


def check_depth(depth: Any) -> None:
    if isinstance(depth, bool) or not isinstance(depth, (int, np.integer)):
        raise TypeError(
            f"prefetch depth={depth!r} is a {type(depth).__name__}; expected an int >= 1 "
            "(batches read ahead; default 2), e.g. depth=2."
        )
    if depth < 1:
        raise ValueError(f"prefetch depth={depth}; expected at least 1 batch ahead (default 2).")


def run_ahead(items: Iterable[T], put: Callable[[T], U], depth: int) -> Generator[U, None, None]:
    """`put(item)` for each item, computed by a background thread at most `depth` ahead.

    An exception in the thread is raised here, at the item where it happened. Closing this
    generator (a `break`, or dropping it) stops the thread, closes `items`, and waits for it.
    """
    results: queue.Queue[tuple[str, Any]] = queue.Queue()
    slots = threading.Semaphore(depth)  # items computed but not yet taken by the consumer
    stop = threading.Event()

    def produce() -> None:
        iterator = iter(items)
        try:
            while True:
                while not slots.acquire(timeout=_POLL_SECONDS):
                    if stop.is_set():
                        return
                if stop.is_set():
                    return
                try:
                    item = next(iterator)
                except StopIteration:
                    results.put(("done", None))
                    return
                results.put(("item", put(item)))
        except BaseException as e:  # handed to the consumer, which re-raises it
            results.put(("error", e))
        finally:
            close = getattr(iterator, "close", None)
            if close is not None:
                close()

    thread = threading.Thread(target=produce, name="eqx_lowmem.data.prefetch", daemon=True)
    thread.start()
    try:
        while True:
            kind, value = results.get()
            if kind == "done":
                return
            if kind == "error":
                raise value
            slots.release()
            yield value
    finally:
        stop.set()
        slots.release()  # a producer waiting for a slot sees `stop` now, not at its next poll
        thread.join()


class Batches(Iterator[Any]):
    """An iterator of prefetched batches that is also a context manager: leaving
    `with ... as batches:` by any path closes it, which stops the background thread and
    waits for it (`close()` does the same)."""

    def __init__(self, generator: Generator[Any, None, None]):
        self._generator = generator

    def __iter__(self):
        return self

    def __next__(self) -> Any:
        return next(self._generator)

    def close(self) -> None:
        """Stop the background thread and wait for it; the iterator is then exhausted."""
        self._generator.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def prefetch(
    batches: Iterable[Any],
    *,
    depth: int = 2,
    sharding: jax.sharding.Sharding | None = None,
    check: Callable[[Any], None] | None = None,
) -> Batches:
    """Batches put on the device by a background thread, `depth` ahead of the consumer.

    `jax.device_put` starts the copy and returns, so the next batches are read and copied
    while the current step runs. For a `DataStream`, prefer `stream.prefetch(...)`: it also
    keeps `stream.state()` at the batches actually consumed.

    Args:
        batches: any iterable of pytrees of host arrays, e.g. a `DataStream`.
        depth: batches read and placed ahead of the one in use. Memory: up to `depth` more
            batches on the device and one on the host; more depth absorbs uneven read times.
        sharding: where each batch goes; `None` puts it on the default device. With several
            processes each process passes its own slice and the global array is assembled
            with `jax.make_array_from_process_local_data`.
        check: `check(batch)` on each batch's host arrays, in the background thread before
            the batch is copied to the device (no copy back, no wait on the device); what
            it raises is raised here, at that batch.

    Returns:
        An iterator of the batches as `jax.Array` pytrees, in order, and a context manager
        (`with prefetch(...) as batches:`) that stops and joins the background thread on
        every way out of the block. An exception raised while reading or placing a batch
        is raised here.

    Raises:
        ValueError: if `depth < 1`.

    Example:
        >>> import numpy as np
        >>> from eqx_lowmem.data import DataStream, prefetch
        >>> stream = DataStream((np.arange(6),), batch_size=4)
        >>> [b[0].tolist() for b in prefetch(stream)]
        [[0, 1, 2, 3], [4, 5]]
    """
    check_depth(depth)
    return Batches(run_ahead(batches, lambda b: to_device(checked(b, check), sharding), depth))
