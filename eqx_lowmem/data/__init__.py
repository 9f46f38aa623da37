"""Data streams that serve batches without holding the dataset.

- `DataStream`: batches from arrays, `.npy` memory maps or an iterator; in order, globally
  shuffled, or shuffled with bounded memory; resumable at any batch.
- `prefetch`: put the next batches on the device from a background thread.
"""

from ._fashion_mnist import fashion_mnist as fashion_mnist
from ._prefetch import prefetch as prefetch
from ._stream import DataStream as DataStream
