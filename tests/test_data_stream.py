"""DataStream: sources, batches, resuming, several processes, and errors on bad input."""

import json
import os

import jax.random as jr
import numpy as np
import pytest
from hypothesis import assume, given, settings, strategies as st

from eqx_lowmem.data import DataStream


def ids(batches):
    """Each batch's first field as a list."""
    return [b[0].tolist() for b in batches]


def counting(n, dtype=np.int64):
    """An iterator source of samples (i, 10 i)."""
    return lambda: ((np.asarray(i, dtype), np.asarray(10 * i, dtype)) for i in range(n))


def take(stream, count):
    """The next `count` batches, crossing epochs, stopping mid-epoch if need be."""
    out = []
    while len(out) < count:
        before = len(out)
        for batch in stream:
            out.append(batch)
            if len(out) == count:
                break
        if len(out) == before:  # epochs without batches
            break
    return out


def assert_same_batches(xs, ys):
    assert len(xs) == len(ys)
    for x, y in zip(xs, ys, strict=True):
        assert len(x) == len(y)
        for a, b in zip(x, y, strict=True):
            assert a.dtype == b.dtype and a.shape == b.shape
            np.testing.assert_array_equal(a, b)


# ----------------------------------------------------------------------------- the guide


def test_guide_first_example():
    stream = DataStream((np.arange(6),), batch_size=4)
    assert ids(stream) == [[0, 1, 2, 3], [4, 5]]
    shuffled = DataStream((np.arange(6),), batch_size=4, shuffle_buffer=3, key=0)
    assert sorted(i for batch in ids(shuffled) for i in batch) == [0, 1, 2, 3, 4, 5]
    from_iterator = DataStream(counting(6), batch_size=4, shuffle_buffer=3, key=0)
    assert sorted(i for batch in ids(from_iterator) for i in batch) == [0, 1, 2, 3, 4, 5]


def test_iterating_again_gives_the_next_epoch():
    stream = DataStream((np.arange(6),), 4)
    assert ids(stream) == ids(stream) == [[0, 1, 2, 3], [4, 5]]
    assert stream.epoch == 2


def test_drop_last():
    stream = DataStream((np.arange(10),), 4, drop_last=True)
    assert ids(stream) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert len(stream) == stream.num_batches == 2
    assert len(DataStream((np.arange(10),), 4)) == 3
    assert ids(DataStream(counting(10), 4, drop_last=True)) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    # No batch at all is an error, not an epoch with a loss of 0.0.
    with pytest.raises(ValueError, match="drop_last=True with 3 samples and batch_size=4"):
        DataStream((np.arange(3),), 4, drop_last=True)
    with pytest.raises(ValueError, match="no batches in epoch 1 .3 samples, fewer than"):
        list(DataStream(counting(3), 4, drop_last=True))


# ----------------------------------------------------------------------------- sources


def test_arrays_stay_aligned_across_fields():
    x = np.arange(20, dtype=np.float32).reshape(10, 2)
    y = np.arange(10) * 3
    z = np.arange(10).astype(np.int8)
    for kwargs in [{}, {"key": 1}, {"shuffle_buffer": 4, "key": 1}]:
        seen = []
        for bx, by, bz in DataStream((x, y, z), 3, **kwargs):
            assert bx.dtype == np.float32 and by.dtype == y.dtype and bz.dtype == np.int8
            np.testing.assert_array_equal(by, bz.astype(by.dtype) * 3)
            np.testing.assert_array_equal(bx, x[bz])
            seen.extend(bz.tolist())
        assert sorted(seen) == list(range(10))


def test_npy_paths_are_read_as_memory_maps(tmp_path):
    x = np.random.default_rng(0).standard_normal((50, 4, 3)).astype(np.float32)
    y = np.arange(50, dtype=np.int32)
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", y)
    for kwargs in [{}, {"key": 0}, {"shuffle_buffer": 8, "key": 0}]:
        stream = DataStream((tmp_path / "x.npy", str(tmp_path / "y.npy")), 8, **kwargs)
        seen = []
        for bx, by in stream:
            assert type(bx) is np.ndarray and type(by) is np.ndarray  # copies, not memmaps
            assert bx.flags.writeable and bx.flags.owndata or bx.base is not None
            np.testing.assert_array_equal(bx, x[by])
            bx[:] = 0  # a batch is the caller's: writing it leaves the file alone
            seen.extend(by.tolist())
        assert sorted(seen) == list(range(50))
    np.testing.assert_array_equal(np.load(tmp_path / "x.npy"), x)


def test_paths_and_arrays_mix(tmp_path):
    np.save(tmp_path / "x.npy", np.arange(7) * 2)
    stream = DataStream((tmp_path / "x.npy", np.arange(7)), 3)
    assert [[a.tolist() for a in b] for b in stream] == [
        [[0, 2, 4], [0, 1, 2]],
        [[6, 8, 10], [3, 4, 5]],
        [[12], [6]],
    ]


def test_iterator_source_of_unknown_length():
    stream = DataStream(counting(7), 3)
    assert stream.num_batches is None and stream.num_samples is None
    with pytest.raises(TypeError, match="unknown"):
        len(stream)
    batches = list(stream)
    assert ids(batches) == [[0, 1, 2], [3, 4, 5], [6]]
    assert [b[1].tolist() for b in batches] == [[0, 10, 20], [30, 40, 50], [60]]
    with pytest.raises(ValueError, match=r"source\(\) gave no batches in epoch 1 \(0 samples\)"):
        list(DataStream(lambda: iter([]), 3))


def test_scalar_and_array_samples_from_an_iterator():
    def samples():
        for i in range(5):
            yield np.full((2, 3), i, np.float32), i

    (x, y), _ = DataStream(samples, 4, shuffle_buffer=2, key=0)
    assert x.shape == (4, 2, 3) and x.dtype == np.float32 and y.shape == (4,)
    np.testing.assert_array_equal(x[:, 0, 0], y.astype(np.float32))


def test_batches_are_never_overwritten():
    """Keep every batch of an epoch, run another epoch (buffers get reused), then compare
    with what a fresh stream serves."""
    x = np.arange(40 * 3, dtype=np.float32).reshape(40, 3)
    sources = [(x,), (lambda: ((row,) for row in x))]
    for source in sources:
        for kwargs in [{}, {"shuffle_buffer": 7, "key": 0}]:
            stream = DataStream(source, 6, **kwargs)
            kept = list(stream)
            list(stream)
            assert_same_batches(kept, list(DataStream(source, 6, **kwargs)))


def test_batches_held_across_groups_are_never_overwritten(tmp_path):
    """Small shuffled batches are slices of one array per group of batches: keep every
    batch (as served, and a copy taken then) over several groups and epochs, and check
    that none changed, none overlaps another or the file, and each belongs to the caller."""
    n = 1000
    x = np.arange(n * 4, dtype=np.float32).reshape(n, 4)
    np.save(tmp_path / "x.npy", x)
    for kwargs in [{"key": 0}, {"shuffle_buffer": 64, "key": 0}]:
        stream = DataStream((tmp_path / "x.npy", np.arange(n)), 10, **kwargs)
        mapped = stream._arrays[0]
        kept, copies = [], []
        for _ in range(3):  # 100 batches an epoch: groups of 8 and a partial group
            for batch in stream:
                kept.append(batch)
                copies.append(tuple(a.copy() for a in batch))
        assert_same_batches(kept, copies)
        for bx, by in kept[:20]:
            assert not np.shares_memory(bx, mapped)
            np.testing.assert_array_equal(bx, x[by])
        for (a, _), (b, _) in zip(kept[:30], kept[1:31], strict=True):
            assert not np.shares_memory(a, b)
        kept[0][0][:] = -1  # writing a served batch leaves its neighbours alone
        assert_same_batches(kept[1:], copies[1:])


# ----------------------------------------------------------------------------- state


def test_state_is_plain_json():
    stream = DataStream((np.arange(10),), 3, shuffle_buffer=4, key=jr.PRNGKey(5))
    take(stream, 2)
    state = stream.state()
    assert json.loads(json.dumps(state)) == state
    assert state["epoch"] == 0 and state["batch"] == 2
    take(stream, 2)
    assert (stream.state()["epoch"], stream.state()["batch"]) == (1, 0)


def test_state_of_a_finished_epoch_points_at_the_next():
    stream = DataStream(counting(5), 2, shuffle_buffer=3, key=0)
    batches = []
    for batch in stream:
        batches.append(batch)
        if len(batches) == 3:  # the last batch, taken without finishing the loop
            break
    assert (stream.state()["epoch"], stream.state()["batch"]) == (1, 0)


SOURCES = ["arrays", "iterator"]


def make_source(kind, n):
    if kind == "arrays":
        return (np.arange(n), np.arange(n, dtype=np.float32) / 2)
    return lambda: ((np.int64(i), np.float32(i / 2)) for i in range(n))


@settings(max_examples=150, deadline=None)
@given(
    kind=st.sampled_from(SOURCES),
    n=st.integers(1, 40),
    batch_size=st.integers(1, 7),
    mode=st.sampled_from(["in_order", "global", "bounded"]),
    buffer=st.integers(1, 12),
    drop_last=st.booleans(),
    stop=st.integers(0, 30),
    key=st.integers(0, 2**32),
)
def test_resume_equals_the_uninterrupted_stream(
    kind, n, batch_size, mode, buffer, drop_last, stop, key
):
    if kind == "iterator" and mode == "global":
        mode = "bounded"
    assume(not (drop_last and n < batch_size))  # no batches: an error (tested apart)
    kwargs = {
        "in_order": {},
        "global": {"key": key},
        "bounded": {"shuffle_buffer": buffer, "key": key},
    }[mode]
    make = lambda: DataStream(make_source(kind, n), batch_size, drop_last=drop_last, **kwargs)  # noqa: E731
    per_epoch = len(list(make()))
    total = 3 * per_epoch
    stop = min(stop, total)
    reference = take(make(), total)

    first = make()
    before = take(first, stop)
    state = json.loads(json.dumps(first.state()))
    resumed = make()
    resumed.set_state(state)
    after = take(resumed, total - stop)
    assert_same_batches(before + after, reference)


@pytest.mark.parametrize("width", [0, 300])  # small batches, grouped; batches of 38 KiB
@pytest.mark.parametrize("mode", [{"key": 4}, {"shuffle_buffer": 300, "key": 4}])
@pytest.mark.parametrize("processes, drop_last", [(1, False), (3, True)])
def test_resume_across_chunks_and_groups(width, mode, processes, drop_last):
    """Resuming at batches around the groups of 8 and the chunks of 16384 indices, for
    more samples than a stored permutation holds, in one process and in three."""
    n = 17_001 if width else 40_003
    x = np.arange(n)
    y = np.repeat(np.arange(n, dtype=np.float32)[:, None], max(width, 1), axis=1)

    def make(p):
        return DataStream(
            (x, y),
            32 * processes,
            drop_last=drop_last,
            process_index=p,
            process_count=processes,
            **mode,
        )

    num_batches = make(0).num_batches
    total = num_batches + 9  # into the second epoch
    stops = [1, 7, 8, 9, 511, 512, 513, num_batches - 1, num_batches + 3]
    for p in {0, processes - 1}:
        reference = take(make(p), total)
        for stop in [s for s in stops if s <= total]:
            first = make(p)
            before = take(first, stop)
            resumed = make(p)
            resumed.set_state(json.loads(json.dumps(first.state())))
            after = take(resumed, total - stop)
            assert_same_batches(before + after, reference)


def test_set_state_rejects_another_streams_state():
    stream = DataStream((np.arange(10),), 4, shuffle_buffer=3, key=0)
    others = [
        DataStream((np.arange(10),), 2, shuffle_buffer=3, key=0),
        DataStream((np.arange(10),), 4, shuffle_buffer=5, key=0),
        DataStream((np.arange(10),), 4, shuffle_buffer=3, key=1),
        DataStream((np.arange(10),), 4, shuffle_buffer=3, key=0, drop_last=True),
        DataStream((np.arange(11),), 4, shuffle_buffer=3, key=0),
    ]
    for other, field in zip(
        others, ["batch_size", "shuffle_buffer", "key", "drop_last", "samples"], strict=True
    ):
        with pytest.raises(ValueError, match=f"state has {field}="):
            stream.set_state(other.state())
    with pytest.raises(ValueError, match="lacks"):
        stream.set_state({"epoch": 0})
    state = stream.state()
    with pytest.raises(ValueError, match="batch=4"):
        stream.set_state({**state, "batch": 4})


def test_a_replayed_iterator_that_ran_short():
    lengths = iter([10, 3])
    stream = DataStream(lambda: counting(next(lengths))(), 2)
    take(stream, 4)
    resumed = DataStream(lambda: counting(next(lengths))(), 2)
    resumed.set_state(stream.state())
    with pytest.raises(ValueError, match="the state says 4 batches of epoch 0"):
        list(resumed)


def test_a_superseded_iterator_raises():
    stream = DataStream((np.arange(10),), 2)
    old = iter(stream)
    next(old)
    new = iter(stream)
    next(new)
    with pytest.raises(RuntimeError, match="superseded"):
        next(old)


# ----------------------------------------------------------------------------- processes


@settings(max_examples=150, deadline=None)
@given(
    kind=st.sampled_from(SOURCES),
    n=st.integers(1, 40),
    local_batch=st.integers(1, 4),
    processes=st.integers(1, 4),
    buffer=st.none() | st.integers(1, 12),
    drop_last=st.booleans(),
)
def test_processes_split_each_global_batch(kind, n, local_batch, processes, buffer, drop_last):
    batch_size = local_batch * processes
    assume(not (drop_last and n < batch_size))  # no batches: an error (tested apart)
    key = None if buffer is None and kind == "iterator" else 3
    make = lambda **p: DataStream(  # noqa: E731
        make_source(kind, n), batch_size, buffer, key=key, drop_last=drop_last, **p
    )
    single = list(make(process_index=0, process_count=1))
    parts = [list(make(process_index=p, process_count=processes)) for p in range(processes)]
    for p in range(processes):
        assert len(parts[p]) == len(single)
    for k, whole in enumerate(single):
        slices = [parts[p][k] for p in range(processes)]
        sizes = [s[0].shape[0] for s in slices]
        assert max(sizes) - min(sizes) <= 1  # as even as possible
        if whole[0].shape[0] == batch_size:
            assert sizes == [local_batch] * processes
        for field in range(2):
            joined = np.concatenate([s[field] for s in slices])
            np.testing.assert_array_equal(joined, whole[field])


# ----------------------------------------------------------------------------- bad input


def test_errors_name_the_argument(tmp_path):
    x = np.arange(6)
    with pytest.raises(ValueError, match="batch_size must be an int >= 1, got 0"):
        DataStream((x,), 0)
    with pytest.raises(ValueError, match="shuffle_buffer must be None or an int >= 1"):
        DataStream((x,), 2, shuffle_buffer=0, key=0)
    with pytest.raises(ValueError, match="shuffle_buffer=4 needs a key"):
        DataStream((x,), 2, shuffle_buffer=4)
    with pytest.raises(ValueError, match="global shuffle .* of an iterator"):
        DataStream(counting(3), 2, key=0)
    with pytest.raises(ValueError, match="batch_size=5 is not divisible by process_count=2"):
        DataStream((x,), 5, process_index=0, process_count=2)
    with pytest.raises(ValueError, match="process_index=2 with process_count=2"):
        DataStream((x,), 4, process_index=2, process_count=2)
    with pytest.raises(ValueError, match="key=-1 is negative"):
        DataStream((x,), 2, key=-1)
    with pytest.raises(ValueError, match="key has dtype float32"):
        DataStream((x,), 2, key=np.zeros(2, np.float32))
    with pytest.raises(TypeError):
        DataStream(x, 2)  # a bare array: wrap it as (x,)
    with pytest.raises(ValueError, match="empty tuple"):
        DataStream((), 2)


def test_errors_name_the_source_index(tmp_path):
    with pytest.raises(ValueError, match=r"source\[1\] has 5 samples but source\[0\] has 6"):
        DataStream((np.arange(6), np.arange(5)), 2)
    with pytest.raises(ValueError, match=r"source\[0\] has dtype object"):
        DataStream((np.array([{}, None], dtype=object),), 2)
    with pytest.raises(ValueError, match=r"source\[1\] is a scalar"):
        DataStream((np.arange(2), np.float32(1)), 2)
    with pytest.raises(ValueError, match=r"source\[0\] has no samples"):
        DataStream((np.zeros((0, 3)),), 2)
    with pytest.raises(FileNotFoundError, match=r"source\[1\] = .*missing.npy' does not exist"):
        DataStream((np.arange(2), tmp_path / "missing.npy"), 2)
    (tmp_path / "x.txt").write_text("0 1 2\n")
    with pytest.raises(ValueError, match=r"source\[0\] = .*x.txt' is not a .npy file"):
        DataStream((tmp_path / "x.txt",), 2)
    np.savez(tmp_path / "z.npz", a=np.arange(3))
    (tmp_path / "z.npz").rename(tmp_path / "z.npy")
    with pytest.raises(ValueError, match=r"source\[0\] = .*z.npy' is not a .npy file"):
        DataStream((tmp_path / "z.npy",), 2)
    np.save(tmp_path / "objects.npy", np.array([{}, None], dtype=object), allow_pickle=True)
    with pytest.raises(ValueError, match=r"source\[0\] = .*objects.npy' holds Python objects"):
        DataStream((tmp_path / "objects.npy",), 2)


def test_errors_name_the_sample_of_an_iterator():
    def shapes():
        yield np.zeros(3), 0
        yield np.zeros(3), 1
        yield np.zeros(4), 2

    with pytest.raises(ValueError, match=r"sample 2 from source\(\), field 0, has shape \(4,\)"):
        list(DataStream(shapes, 2))

    def dtypes():
        yield np.zeros(3), 0
        yield np.zeros(3, np.float32), 1

    with pytest.raises(ValueError, match=r"sample 1 from source\(\), field 0, .* dtype float32"):
        list(DataStream(dtypes, 2, shuffle_buffer=4, key=0))

    def fields():
        yield np.zeros(3), 0
        yield (np.zeros(3),)

    with pytest.raises(ValueError, match=r"sample 1 from source\(\) has 1 fields"):
        list(DataStream(fields, 2))

    def not_tuples():
        yield np.zeros(3)

    with pytest.raises(TypeError, match=r"sample 0 from source\(\) is a ndarray"):
        list(DataStream(not_tuples, 2))

    def objects():
        yield ({"a": 1},)

    with pytest.raises(ValueError, match=r"sample 0 from source\(\), field 0, has dtype object"):
        list(DataStream(objects, 2))


# ----------------------------------------------------------------------------- bad inputs


def test_key_is_keyword_only():
    with pytest.raises(TypeError, match="positional"):
        DataStream((np.arange(6),), 2, 4, 0)  # type: ignore[misc]
    assert len(DataStream((np.arange(6),), 2, 4, key=0)) == 3


def test_sizes_keys_and_states_of_the_wrong_type_are_refused():
    x = (np.arange(6),)
    # Our TypeError, or the tests' runtime type checker first; both name the argument.
    for kwargs, name in [
        ({"batch_size": True}, "batch_size"),
        ({"batch_size": 2.5}, "batch_size"),
        ({"batch_size": "4"}, "batch_size"),
        ({"batch_size": 2, "shuffle_buffer": 2.5, "key": 0}, "shuffle_buffer"),
        ({"batch_size": 2, "shuffle_buffer": True, "key": 0}, "shuffle_buffer"),
        ({"batch_size": 2, "shuffle_buffer": 4, "key": True}, "key"),
        ({"batch_size": 2, "drop_last": "yes"}, "drop_last"),
    ]:
        with pytest.raises(TypeError, match=name):
            DataStream(x, **kwargs)
    stream = DataStream(x, 2)
    with pytest.raises(TypeError, match="state"):
        stream.set_state(None)  # type: ignore[arg-type]
    # Without the tests' type checker (as users run it): our message.
    unchecked = getattr(DataStream.set_state, "__wrapped__", DataStream.set_state)
    with pytest.raises(TypeError, match=r"set_state\(state\) takes the dict .* got NoneType"):
        unchecked(stream, None)
    state = stream.state()
    with pytest.raises(ValueError, match="batch=True"):
        stream.set_state({**state, "batch": True})


def test_non_numeric_dtypes_are_refused_when_the_stream_is_built(tmp_path):
    cases = [
        (np.array(["a", "b"]), "is not numeric"),
        (np.array([b"a", b"b"]), "is not numeric"),
        (np.zeros(2, [("x", np.float32), ("y", np.int32)]), "structured"),
        (np.array(["2024-01-01", "2024-01-02"], dtype="datetime64[D]"), "is not numeric"),
    ]
    for array, what in cases:
        with pytest.raises(ValueError, match=rf"source\[1\] has dtype .*{what}"):
            DataStream((np.arange(2), array), 2)
        np.save(tmp_path / "a.npy", array)
        with pytest.raises(ValueError, match=rf"source\[0\] = .*a.npy' has dtype .*{what}"):
            DataStream((tmp_path / "a.npy",), 2)
    stream = DataStream(lambda: iter([(np.zeros(2), np.str_("cat"))]), 1)
    with pytest.raises(ValueError, match=r"sample 0 from source\(\), field 1, has dtype <U3"):
        list(stream)
    # Booleans and 16-bit floats are numbers a device holds.
    import ml_dtypes

    DataStream((np.zeros(2, bool), np.zeros(2, ml_dtypes.bfloat16)), 2)


def test_a_truncated_or_corrupt_npy_is_reported_as_such(tmp_path):
    path = tmp_path / "x.npy"
    np.save(path, np.arange(100, dtype=np.float32).reshape(25, 4))
    good = path.read_bytes()
    path.write_bytes(good[:-5])
    with pytest.raises(ValueError, match=r"x.npy' is truncated: .*shape \(25, 4\).*has 523 bytes"):
        DataStream((path,), 5)
    path.write_bytes(good + b"\0" * 8)
    with pytest.raises(ValueError, match=r"x.npy' is corrupt"):
        DataStream((path,), 5)
    path.write_bytes(good[:30])  # inside the header
    with pytest.raises(ValueError, match=r"x.npy' has a corrupt or truncated .npy header"):
        DataStream((path,), 5)
    path.write_bytes(good.replace(b"'descr'", b"'dexcr'"))
    with pytest.raises(ValueError, match=r"corrupt or truncated .npy header"):
        DataStream((path,), 5)


@pytest.mark.parametrize("change", ["truncate", "rewrite", "replace"])
@pytest.mark.parametrize("prefetched", [False, True])
def test_a_memory_mapped_file_changed_mid_epoch_is_an_error_not_sigbus(
    tmp_path, change, prefetched
):
    path = tmp_path / "x.npy"
    x = np.arange(4096 * 64, dtype=np.float32).reshape(4096, 64)  # 1 MiB, 256 B a row
    np.save(path, x)
    stream = DataStream((path,), 64, key=0)  # batches of 16 KiB: read 8 at a time
    batches = stream.prefetch(depth=1) if prefetched else iter(stream)
    with pytest.raises(RuntimeError, match=r"source\[0\] = .*x.npy' changed while") as info:
        for i, _ in enumerate(batches):
            if i == 1:
                if change == "truncate":
                    os.truncate(path, 4096)  # reading the lost pages would be SIGBUS
                elif change == "rewrite":
                    np.save(path, x + 1)  # in place: same size, new content
                else:
                    np.save(tmp_path / "y.npy", x)
                    os.replace(tmp_path / "y.npy", path)
    assert "Do not write the data files during training" in str(info.value)
    if prefetched:
        batches.close()


def test_an_iterator_source_must_give_a_fresh_iterator_each_epoch():
    generator = counting(4)()
    stream = DataStream(lambda: generator, 2)
    assert ids(stream) == [[0, 1], [2, 3]]
    with pytest.raises(ValueError, match="same iterator in epoch 2.*generator function"):
        list(stream)
    lengths = iter([4, 0])
    stream = DataStream(lambda: counting(next(lengths))(), 2)
    assert ids(stream) == [[0, 1], [2, 3]]
    with pytest.raises(ValueError, match=r"no batches in epoch 2 \(0 samples\)"):
        list(stream)


def test_process_arguments_must_be_ints():
    with pytest.raises(TypeError, match="process_index"):
        DataStream((np.arange(4),), 2, process_index=True, process_count=2)


@pytest.mark.parametrize("shape", [(600, 8), (600, 784), (90, 32, 48)], ids=["32B", "3KiB", "6KiB"])
def test_shuffled_batches_are_fresh_copies_of_the_sources_rows(shape):
    # Rows are gathered whole (small gathers) or with np.take (from 64 KiB): either way a
    # batch holds exactly the source's rows, in a fresh C-contiguous array of its own.
    from eqx_lowmem.data._sources import row_gather

    x = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    gather = row_gather(x)
    rng = np.random.default_rng(0)
    for count in (1, 20, 256, shape[0]):
        indices = np.sort(rng.choice(shape[0], min(count, shape[0]), replace=False))
        got = gather(indices)
        np.testing.assert_array_equal(got, x[indices])
        assert got.flags.c_contiguous and not np.shares_memory(got, x)
    stream = DataStream((x,), batch_size=256, key=0)
    served = np.concatenate([b[0] for b in stream]).reshape(shape[0], -1)
    np.testing.assert_array_equal(served[np.argsort(served[:, 0])], x.reshape(shape[0], -1))


@pytest.mark.parametrize(
    "kind", ["arrays", "arrays_in_order", "npy", "npy_plain_reads", "iterator", "iterator_buffer"]
)
def test_large_batches_reach_the_device_in_place(tmp_path, kind):
    # XLA:CPU uses a host array in place only where its data starts on a 64-byte boundary;
    # anywhere else `jax.device_put` copies it (123 against 32 microseconds at 256 KiB).
    import jax

    x = np.arange(200 * 1024, dtype=np.float32).reshape(200, 1024)  # 4 KiB rows
    labels = np.arange(200, dtype=np.int32)
    np.save(tmp_path / "x.npy", x)
    key = None if kind.endswith("in_order") or kind == "iterator" else 0
    source = {
        "npy": (str(tmp_path / "x.npy"), labels),
        "npy_plain_reads": (str(tmp_path / "x.npy"), labels),
        "iterator": lambda: zip(x, labels, strict=True),
        "iterator_buffer": lambda: zip(x, labels, strict=True),
    }.get(kind, (x, labels))
    options = {"safe_reads": False} if kind == "npy_plain_reads" else {}
    buffer = {"shuffle_buffer": 64} if kind == "iterator_buffer" else {}
    stream = DataStream(source, batch_size=32, key=key, **options, **buffer)
    batches = list(stream)
    assert len(batches) == 7
    for rows, ids in batches[:-1]:  # 32 rows of 4 KiB; the last batch is 8 rows
        np.testing.assert_array_equal(rows, x[ids])
        assert rows.ctypes.data % 64 == 0
    rows = batches[0][0]
    on_cpu = jax.device_put(rows, jax.devices("cpu")[0])  # a GPU copies it whatever its start
    assert on_cpu.unsafe_buffer_pointer() == rows.ctypes.data
