"""The data stream, as in the guide's first section: batches without holding the dataset.

python examples/stream.py
"""

import tempfile
from pathlib import Path

import numpy as np

from eqx_lowmem.data import DataStream

# Six samples in batches of four: every sample once, the last batch smaller.
stream = DataStream((np.arange(6),), batch_size=4)
print([x.tolist() for (x,) in stream])  # [[0, 1, 2, 3], [4, 5]]

# A shuffle buffer of three still serves all six; the order comes from the key and epoch.
shuffled = DataStream((np.arange(6),), batch_size=4, shuffle_buffer=3, key=0)
print(sorted(i for (x,) in shuffled for i in x.tolist()))  # [0, 1, 2, 3, 4, 5]

# Arrays saved with np.save are read as memory maps: only the batch being served is read.
with tempfile.TemporaryDirectory() as tmp:
    x_path, y_path = Path(tmp) / "x.npy", Path(tmp) / "y.npy"
    np.save(x_path, np.random.default_rng(0).standard_normal((1000, 28, 28), np.float32))
    np.save(y_path, np.arange(1000) % 10)
    stream = DataStream((x_path, y_path), batch_size=32, shuffle_buffer=256, key=0)
    x, y = next(iter(stream))
    print(len(stream), "batches an epoch; the first:", x.shape, x.dtype, y.shape, y.dtype)

    # Resume: a new stream restored from the state continues with the same batches.
    state = stream.state()  # JSON-serialisable: the next batch to serve is batch 1
    resumed = DataStream((x_path, y_path), batch_size=32, shuffle_buffer=256, key=0)
    resumed.set_state(state)
    print(all(np.array_equal(a[1], b[1]) for a, b in zip(stream, resumed, strict=True)))
