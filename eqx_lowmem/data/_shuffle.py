"""Shuffled orders of an epoch, computed piece by piece from (key, epoch, position).

An order maps epoch positions `0 .. n-1` to sample indices. It is evaluated a chunk of
positions at a time, so no order holds `n` indices and any position can be reached without
computing the ones before it: that is what lets a stream resume at any batch without
replaying the epoch.
"""

import numpy as np

# Feistel rounds, each with a random round function (a table). Luby and Rackoff (1988)
# show four make a pseudo-random permutation; six left no trace in chi-squared tests of
# where one or two positions land (20,000 keys, n from 1025 to 70,000).
_ROUNDS = 6
# Tables of 2**16 entries at most: up to 2**32 elements.
_MAX_ELEMENTS = 1 << 32
# Indices an order computes at a time (128 KiB): each computation costs tens of
# microseconds of NumPy calls, which would dominate small samples if done per window.
_CHUNK = 16384
# Up to this many elements (one chunk, 128 KiB) a permutation is drawn whole and stored: it
# takes no more memory than the chunk an order holds anyway, is exactly uniform, and costs
# no more than the network and its cycle walks, which small datasets pay every epoch (92
# against 180 microseconds for 6400 elements, 165 against 172 for 16384: f7b0d4f).
_STORED = _CHUNK
# Bounded shuffle: blocks of `shuffle_buffer // _BLOCKS_PER_BUFFER` contiguous samples. On
# 60,000 samples sorted into 10 classes with a buffer of 1000, batches of 32 hold 9.54
# distinct classes with blocks of 7, 9.66 for a full shuffle (`memory_and_data.json`'s
# `mixing`); blocks of 15 held 9.35 (2ed537c).
_BLOCKS_PER_BUFFER = 128


def seed(entropy: list[int], *spawn_key: int) -> np.random.SeedSequence:
    """The seed of one purpose (`spawn_key`, e.g. (epoch, window)) under one key."""
    return np.random.SeedSequence(entropy, spawn_key=spawn_key)


class KeyedPermutation:
    """A pseudo-random permutation of `range(n)`, evaluated at any positions.

    A Feistel network with random round functions (one table per round, `O(sqrt(n))`
    entries, at most 2**16) permutes `range(2**bits)`, `2**bits < 2 n`; values that land at
    `n` or above are permuted again until they fall inside ("cycle walking", Black and
    Rogaway, 2002), which keeps it a permutation of `range(n)`. Vectorised over positions,
    about 15 ns each (measured for f7b0d4f). Up to `_STORED` elements, a stored permutation
    instead.
    """

    def __init__(self, n: int, seed_sequence: np.random.SeedSequence):
        if n > _MAX_ELEMENTS:
            raise ValueError(f"cannot shuffle {n} samples or blocks; at most 2**32 are supported.")
        self.n = n
        rng = np.random.default_rng(seed_sequence)
        self._stored = rng.permutation(n) if n <= _STORED else None
        if self._stored is not None:
            self._stored.flags.writeable = False  # `span` hands out views of it
        # Round functions, one table each; `x` is split into a high and a low part, the
        # low part `self._low_bits` wide.
        self._functions: list[np.ndarray] = []
        bits = (n - 1).bit_length()
        left_bits, right_bits = bits - bits // 2, bits // 2
        self._low_bits = right_bits
        for _ in range(_ROUNDS if self._stored is None else 0):
            # (left, right) -> (right, left ^ f(right)): one table lookup and one xor.
            self._functions.append(rng.integers(0, 1 << left_bits, size=1 << right_bits))
            left_bits, right_bits = right_bits, left_bits  # the halves swap widths
        self._out_low_bits = right_bits  # the low part's width after the last round

    def _encrypt(self, x: np.ndarray) -> np.ndarray:
        high, low = x >> self._low_bits, x & ((1 << self._low_bits) - 1)
        for f in self._functions:
            new_low = f.take(low)
            new_low ^= high
            high, low = low, new_low
        high <<= self._out_low_bits
        high |= low
        return high

    def span(self, start: int, stop: int) -> np.ndarray:
        """The permutation at positions `start .. stop-1`, read-only."""
        if self._stored is not None:
            return self._stored[start:stop]
        return self(np.arange(start, stop))

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        if self._stored is not None:
            return self._stored[positions]
        x = self._encrypt(positions)
        outside = np.flatnonzero(x >= self.n)
        while outside.size:
            walked = self._encrypt(x[outside])
            x[outside] = walked
            outside = outside[walked >= self.n]
        return x


class Order:
    """An epoch's order, computed `chunk_size` positions at a time."""

    chunk_size: int

    def __init__(self):
        self._cached: tuple[int, np.ndarray] | None = None

    def chunk(self, c: int) -> np.ndarray:
        """The sample indices at positions `c * chunk_size ..` (fewer in the last chunk)."""
        raise NotImplementedError

    def indices(self, start: int, stop: int) -> np.ndarray:
        """Sample indices at positions `start .. stop-1`. Holds one chunk (two while a range
        crosses from one to the next); sequential calls compute each chunk once."""
        size = self.chunk_size
        parts = []
        for c in range(start // size, (stop - 1) // size + 1):
            if self._cached is None or self._cached[0] != c:
                self._cached = (c, self.chunk(c))
            parts.append(self._cached[1][max(start - c * size, 0) : stop - c * size])
        return parts[0] if len(parts) == 1 else np.concatenate(parts)


class GlobalOrder(Order):
    """A fresh pseudo-random permutation of all `n` samples for each (key, epoch)."""

    chunk_size = _CHUNK

    def __init__(self, n: int, entropy: list[int], epoch: int):
        super().__init__()
        self._n = n
        self._permutation = KeyedPermutation(n, seed(entropy, epoch, 0))

    def chunk(self, c: int) -> np.ndarray:
        start = c * self.chunk_size
        return self._permutation.span(start, min(start + self.chunk_size, self._n))


def block_size(shuffle_buffer: int) -> int:
    """Contiguous samples per block of the bounded shuffle."""
    return max(1, shuffle_buffer // _BLOCKS_PER_BUFFER)


class BlockOrder(Order):
    """Blocks of contiguous samples in a keyed random order, shuffled a window at a time.

    The blocks' order is a `KeyedPermutation` of the block numbers. Each window of
    `shuffle_buffer // block` consecutive blocks (at most `shuffle_buffer` samples) is
    shuffled on its own, so a window mixes samples from about 128 places spread over the
    whole dataset, and reads stay within the blocks of one window. Windows are computed and
    shuffled together, whole windows of about `_CHUNK` indices at a time, with one generator
    seeded by (key, epoch, chunk).

    One block has fewer samples when `block` does not divide `n`: the one whose turn comes
    last this epoch, so positions map to blocks by arithmetic alone.
    """

    def __init__(self, n: int, shuffle_buffer: int, entropy: list[int], epoch: int):
        super().__init__()
        self._block = block_size(shuffle_buffer)
        self._blocks_per_window = max(1, shuffle_buffer // self._block)
        self._window = self._blocks_per_window * self._block
        self._windows_per_chunk = max(1, _CHUNK // self._window)
        self.chunk_size = self._windows_per_chunk * self._window
        self._num_blocks = -(-n // self._block)
        self._short = self._block * self._num_blocks - n  # samples missing from the last turn
        self._permutation = KeyedPermutation(self._num_blocks, seed(entropy, epoch, 0))
        # The block that comes last, and so is the short one, this epoch.
        self._short_block = int(self._permutation(np.array([self._num_blocks - 1]))[0])
        self._entropy = entropy
        self._epoch = epoch

    def chunk(self, c: int) -> np.ndarray:
        blocks_per_chunk = self._windows_per_chunk * self._blocks_per_window
        stop = min((c + 1) * blocks_per_chunk, self._num_blocks)
        blocks = self._permutation.span(c * blocks_per_chunk, stop)
        starts = blocks * self._block - self._short * (blocks > self._short_block)
        # (blocks, block) sample indices, flattened in the blocks' order
        indices = (starts[:, None] + np.arange(self._block)).reshape(-1)
        if stop == self._num_blocks:  # the chunk holds the short block
            indices = indices[: indices.size - self._short]
        rng = np.random.default_rng(seed(self._entropy, self._epoch, 1, c))
        full = indices.size // self._window * self._window
        # (windows, window): each row shuffled on its own, in one call
        indices[:full] = rng.permuted(indices[:full].reshape(-1, self._window), axis=1).reshape(-1)
        rng.shuffle(indices[full:])  # the epoch's last, shorter window
        return indices
