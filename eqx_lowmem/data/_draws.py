"""Batches drawn from an iterator source (`DataStream(source=...)`): in the source's order,
or at random out of a bounded buffer of samples."""

import numpy as np

from ._sources import SampleReader, empty_rows, row_gather

Batch = tuple[np.ndarray, ...]


def _joined(arrays: list[np.ndarray], new_axis: bool = True) -> np.ndarray:
    """`arrays` stacked along a new first axis (or concatenated along the first) into a
    fresh `empty_rows` array."""
    first = arrays[0]
    if new_axis:
        out = empty_rows(len(arrays), first.shape, first.dtype)
        return np.stack(arrays, out=out)
    out = empty_rows(sum(len(a) for a in arrays), first.shape[1:], first.dtype)
    return np.concatenate(arrays, out=out)


class InOrder:
    """Batches of consecutive samples from `reader`."""

    def __init__(self, reader: SampleReader):
        self._reader = reader

    def draw(self, size: int, gather: bool) -> tuple[Batch | None, int]:
        """The next `size` samples (fewer at the end) stacked into fresh arrays, or `None`
        when not `gather` (replaying an epoch to resume it); and how many there were."""
        samples = self._reader.take(size)
        if not (gather and samples):
            return None, len(samples)
        columns = zip(*samples, strict=True)
        return tuple(_joined(list(column)) for column in columns), len(samples)


class ShuffleBuffer:
    """At most `capacity` samples from `reader`, stacked in one array per field: batches are
    drawn from it at random and their slots refilled from the reader, a batch at a time.
    The filled slots are always `0 .. count-1`."""

    def __init__(
        self,
        reader: SampleReader,
        capacity: int,
        chunk: int,
        seed_sequence: np.random.SeedSequence,
    ):
        self._reader = reader
        self._rng = np.random.default_rng(seed_sequence)
        # Allocated once per epoch and reused: batches are gathered out of it, never views.
        spec = reader.spec or []
        self._fields = [np.empty((capacity, *shape), dtype) for shape, dtype in spec]
        self._rows = [row_gather(field) for field in self._fields]
        self.count = 0
        while self.count < capacity:
            samples = reader.take(min(chunk, capacity - self.count))
            if not samples:
                break
            self._store(samples, np.arange(self.count, self.count + len(samples)))
            self.count += len(samples)

    def _store(self, samples: list[tuple[np.ndarray, ...]], slots: np.ndarray) -> None:
        columns = zip(*samples, strict=True)
        for field, values in zip(self._fields, columns, strict=True):
            field[slots] = np.stack(values)

    def draw(self, size: int, gather: bool) -> tuple[Batch | None, int]:
        """Up to `size` samples drawn at random (fewer only at the end of the epoch) into
        fresh arrays, their slots refilled; and how many were drawn. Without `gather` the
        draws and refills happen but nothing is copied, as when replaying an epoch to
        resume it."""
        parts = []
        count = 0
        while count < size and self.count:
            take = min(size - count, self.count)
            slots = self._rng.choice(self.count, size=take, replace=False)
            if gather:
                parts.append(tuple(rows(slots) for rows in self._rows))
            count += take
            self._refill(slots)
        if not parts:
            return None, count
        if len(parts) == 1:
            return parts[0], count
        fields = zip(*parts, strict=True)
        return tuple(_joined(list(f), new_axis=False) for f in fields), count

    def _refill(self, slots: np.ndarray) -> None:
        """Refill the emptied `slots` from the reader. Where it has ended, move samples from
        the top of the buffer into the holes below, so the filled slots stay contiguous."""
        samples = self._reader.take(slots.size)
        if samples:
            self._store(samples, slots[: len(samples)])
        holes = slots[len(samples) :]
        if holes.size:
            count = self.count - holes.size
            top = np.arange(count, self.count)
            top = top[~np.isin(top, holes)]
            low_holes = np.sort(holes[holes < count])
            for field in self._fields:
                field[low_holes] = field[top]
            self.count = count
