"""prefetch and DataStream.prefetch: device batches, errors, early stops, positions."""

import threading
import time

import jax
import numpy as np
import pytest

from eqx_lowmem.data import DataStream, prefetch

THREAD = "eqx_lowmem.data.prefetch"


def prefetch_threads():
    return [t for t in threading.enumerate() if t.name == THREAD and t.is_alive()]


def test_batches_arrive_on_the_device_in_order():
    stream = DataStream((np.arange(10, dtype=np.float32), np.arange(10)), 4)
    expected = list(DataStream((np.arange(10, dtype=np.float32), np.arange(10)), 4))
    got = list(prefetch(stream))
    assert len(got) == len(expected)
    for device_batch, host_batch in zip(got, expected, strict=True):
        for a, b in zip(device_batch, host_batch, strict=True):
            assert isinstance(a, jax.Array)
            np.testing.assert_array_equal(np.asarray(a), b)
    assert not prefetch_threads()


def test_sharding():
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    stream = DataStream((np.arange(6),), 3)
    for (x,) in stream.prefetch(sharding=sharding):
        assert x.sharding == sharding


@pytest.mark.parametrize("through", ["stream", "function"])
def test_a_check_sees_the_host_arrays_before_the_transfer_and_stops_at_its_batch(through):
    # The Trainer's data check runs here: on the host, in the thread, never on arrays the
    # device holds (which would copy them back and wait for the device).
    seen = []

    def check(batch):
        seen.append((threading.current_thread().name, [type(a) for a in batch]))
        if batch[0][0] == 8:
            raise ValueError("bad batch 3")

    stream = DataStream((np.arange(12, dtype=np.float32),), 4)
    if through == "stream":
        batches = stream.prefetch(check=check)
    else:
        batches = prefetch(iter(DataStream((np.arange(12, dtype=np.float32),), 4)), check=check)
    got = []
    with pytest.raises(ValueError, match="bad batch 3"):
        for (x,) in batches:
            assert isinstance(x, jax.Array)
            got.append(np.asarray(x).tolist())
    assert got == [[0, 1, 2, 3], [4, 5, 6, 7]]  # the batches before the bad one
    assert seen == [(THREAD, [np.ndarray])] * 3
    if through == "stream":
        assert stream.state()["batch"] == 2  # the bad batch was not served
    assert not prefetch_threads()


def test_an_error_in_the_thread_is_raised_at_its_batch():
    def batches():
        yield np.zeros(2)
        yield np.ones(2)
        raise OSError("disk gone")

    got = []
    with pytest.raises(OSError, match="disk gone"):
        for batch in prefetch(batches()):
            got.append(batch)
    assert len(got) == 2
    assert not prefetch_threads()


def test_stopping_early_stops_the_thread_and_closes_the_source():
    closed = threading.Event()

    def endless():
        try:
            i = 0
            while True:
                yield np.full(2, i)
                i += 1
        finally:
            closed.set()

    batches = prefetch(endless(), depth=3)
    for i, _ in enumerate(batches):
        if i == 5:
            break
    batches.close()
    assert closed.is_set()
    assert not prefetch_threads()


def test_depth_bounds_the_batches_read_ahead():
    pulled = []

    def counted():
        for i in range(100):
            pulled.append(i)
            yield np.full(2, i)

    batches = prefetch(counted(), depth=3)
    next(batches)
    deadline = time.monotonic() + 10
    while len(pulled) < 4 and time.monotonic() < deadline:  # let the thread fill up
        time.sleep(0.01)
    time.sleep(0.2)
    assert len(pulled) == 4  # the batch taken, and 3 ahead
    batches.close()


def test_depth_must_be_positive():
    with pytest.raises(ValueError, match="depth=0"):
        prefetch([], depth=0)
    with pytest.raises(ValueError, match="depth=0"):
        DataStream((np.arange(3),), 2).prefetch(depth=0)


def test_stream_state_counts_the_batches_consumed_not_those_read_ahead():
    make = lambda: DataStream((np.arange(40),), 4, shuffle_buffer=6, key=0)  # noqa: E731
    reference = [b[0].tolist() for b in make()]
    stream = make()
    got = []
    for (x,) in stream.prefetch(depth=4):
        got.append(np.asarray(x).tolist())
        if len(got) == 3:
            break
    assert stream.state()["batch"] == 3
    resumed = make()
    resumed.set_state(stream.state())
    got += [np.asarray(x).tolist() for (x,) in resumed.prefetch()]
    assert got == reference
    assert not prefetch_threads()


# ----------------------------------------------------------------------------- every exit


def _wait_for_no_threads():
    deadline = time.monotonic() + 5
    while prefetch_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    return not prefetch_threads()


def _fit_like(batches, fail_at, error):
    """A training loop that fails at a batch and lets the error escape (its traceback
    then holds this frame, and with it the iterator)."""
    with batches:
        for i, _ in enumerate(batches):
            if i == fail_at:
                raise error


@pytest.mark.parametrize("error", [FloatingPointError("nan"), KeyboardInterrupt()])
@pytest.mark.parametrize("make", ["stream", "prefetch"])
def test_the_thread_is_joined_on_every_way_out(error, make):
    stream = DataStream((np.arange(200),), 4)
    batches = stream.prefetch(depth=2) if make == "stream" else prefetch(stream, depth=2)
    with pytest.raises(type(error)) as info:
        _fit_like(batches, 3, error)
    assert info.traceback  # still held: the `with` block, not garbage collection, joined it
    assert not prefetch_threads()
    with pytest.raises(StopIteration):
        next(batches)


def test_an_interrupt_in_the_source_reaches_the_consumer_and_the_thread_ends():
    def interrupted():
        yield np.zeros(2)
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        with prefetch(interrupted()) as batches:
            for _ in batches:
                pass
    assert not prefetch_threads()


def test_close_and_exhaustion_join_the_thread():
    stream = DataStream((np.arange(40),), 4)
    batches = stream.prefetch()
    next(batches)
    batches.close()
    assert not prefetch_threads()
    with stream.prefetch() as batches:
        assert len(list(batches)) == 9  # the rest of the epoch
    assert _wait_for_no_threads()
