"""DataStream's shuffles: every sample once per epoch, orders by key and epoch, mixing."""

import jax.random as jr
import numpy as np
from hypothesis import assume, given, settings, strategies as st

from eqx_lowmem.data import DataStream


def served(stream):
    """One epoch: the batches' first fields as lists."""
    return [b[0].tolist() for b in stream]


def source(kind, n):
    if kind == "arrays":
        return (np.arange(n),)
    return lambda: ((np.int64(i),) for i in range(n))


@settings(max_examples=150, deadline=None)
@given(
    kind=st.sampled_from(["arrays", "iterator"]),
    n=st.integers(1, 80),
    batch_size=st.integers(1, 9),
    buffer=st.none() | st.integers(1, 30),
    shuffle=st.booleans(),
    drop_last=st.booleans(),
)
def test_every_sample_served_once_per_epoch(kind, n, batch_size, buffer, shuffle, drop_last):
    if kind == "iterator" and buffer is None:
        shuffle = False  # an iterator cannot be shuffled globally
    key = 7 if shuffle or buffer is not None else None
    assume(not (drop_last and n < batch_size))  # no batches: an error (test_data_stream)
    stream = DataStream(source(kind, n), batch_size, buffer, key=key, drop_last=drop_last)
    for _ in range(3):
        batches = served(stream)
        sizes = [len(b) for b in batches]
        flat = [i for b in batches for i in b]
        assert len(set(flat)) == len(flat)
        if drop_last:
            assert sizes == [batch_size] * (n // batch_size)
        else:
            assert sorted(flat) == list(range(n))
            assert sizes[:-1] == [batch_size] * (len(sizes) - 1) and 0 < sizes[-1] <= batch_size


def test_block_and_window_edges():
    """Sizes around the block (buffer // 128) and window boundaries, one short block, and
    block orders stored (up to 16384 blocks) and computed."""
    for n in [1, 2, 127, 128, 129, 1023, 1024, 1025, 2049, 5000]:
        for buffer in [1, 3, 128, 129, 256, 300, 1000, 5000]:
            for batch_size in [1, 32, 33]:
                stream = DataStream((np.arange(n),), batch_size, buffer, key=n + buffer)
                flat = [i for b in served(stream) for i in b]
                assert sorted(flat) == list(range(n)), (n, buffer, batch_size)
    for n in [16384, 16385, 40_001]:
        for buffer in [1, 200, 300]:
            stream = DataStream((np.arange(n),), 33, buffer, key=n + buffer)
            flat = np.concatenate([b[0] for b in stream])
            np.testing.assert_array_equal(np.sort(flat), np.arange(n))


def test_global_order_of_large_sizes():
    """Above 16384 samples the global order is a Feistel network with cycle walking."""
    for n in [1025, 16384, 16385, 32_769, 70_001]:
        stream = DataStream((np.arange(n),), 1000, key=n)
        flat = np.concatenate([b[0] for b in stream])
        np.testing.assert_array_equal(np.sort(flat), np.arange(n))
        assert not np.array_equal(flat, np.arange(n))


KINDS = {
    "global": ("arrays", {}),
    "bounded": ("arrays", {"shuffle_buffer": 50}),
    "iterator": ("iterator", {"shuffle_buffer": 50}),
}


def test_orders_by_key_and_epoch():
    for kind, kwargs in KINDS.values():
        a, b, c = (DataStream(source(kind, 3000), 10, key=key, **kwargs) for key in (0, 0, 1))
        epochs_a = [served(a) for _ in range(3)]
        assert epochs_a == [served(b) for _ in range(3)]  # same key, same orders
        assert epochs_a[0] != epochs_a[1] != epochs_a[2] != epochs_a[0]  # new each epoch
        assert epochs_a[0] != served(c)  # another key, another order
        assert epochs_a[0] != served(DataStream(source(kind, 3000), 10))  # not in order


def test_keys_of_every_kind():
    x = (np.arange(100),)
    for key in [3, jr.PRNGKey(3), jr.key(3), np.array([1, 2], np.uint32)]:
        a = served(DataStream(x, 10, 20, key=key))
        assert a == served(DataStream(x, 10, 20, key=key))
        assert sorted(i for b in a for i in b) == list(range(100))
    assert served(DataStream(x, 10, 20, key=jr.PRNGKey(3))) == served(
        DataStream(x, 10, 20, key=jr.key(3))
    )
    assert served(DataStream(x, 10, 20, key=jr.key(3))) != served(
        DataStream(x, 10, 20, key=jr.key(4))
    )


def test_global_shuffle_places_samples_uniformly():
    """Which tenth of the epoch sample 0 lands in, over 400 epochs of 8 keys, for sizes
    stored (<= 16384) and computed (a Feistel network): a chi-squared test."""
    for n in [20, 1500, 20_000]:
        counts = np.zeros(10)
        for key in range(8):
            stream = DataStream((np.arange(n),), n // 10, key=key)  # 10 batches an epoch
            for _ in range(50):
                tenth = [k for k, (batch,) in enumerate(stream) if (batch == 0).any()]
                counts[tenth] += 1
        expected = counts.sum() / 10
        chi2 = ((counts - expected) ** 2 / expected).sum()
        assert chi2 < 27.9, (n, counts)  # 9 degrees of freedom, p = 0.001


def distinct_classes_per_batch(stream):
    return np.mean([np.unique(labels).size for labels, *_ in stream])


def sliding_buffer_order(labels, buffer, seed=0):
    """tf.data's and Hugging Face datasets' shuffle: a buffer of `buffer` samples, each read
    sample swapped in for one drawn at random."""
    rng, pool, out = np.random.default_rng(seed), [], []
    for label in labels:
        pool.append(label)
        if len(pool) > buffer:
            out.append(pool.pop(rng.integers(len(pool))))
    rng.shuffle(pool)
    return np.array(out + pool)


def test_mixing_of_data_stored_sorted_by_label():
    """60,000 samples sorted into 10 classes, batches of 32: a buffer of 1,000 *batches*
    mixes them almost as a full shuffle does (9.67 distinct classes per batch), where a
    sliding buffer of 1,000 *samples*, the common design, gives 1.6."""
    labels = np.repeat(np.arange(10), 6000)
    bounded = DataStream((labels,), 32, shuffle_buffer=1000, key=0, drop_last=True)
    global_ = DataStream((labels,), 32, key=0, drop_last=True)
    assert distinct_classes_per_batch(bounded) >= 9.3
    assert distinct_classes_per_batch(global_) >= 9.6
    sliding = sliding_buffer_order(labels, 1000)
    assert sorted(sliding.tolist()) == labels.tolist()  # a permutation of the samples
    assert distinct_classes_per_batch(sliding[: len(labels) // 32 * 32].reshape(-1, 1, 32)) < 2
