"""Making a model sparse (`sparsify`), dense again (`densify`), and counting (`stats`)."""

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
from jaxtyping import PRNGKeyArray, PyTree

from ._layers import (
    check_density,
    check_key,
    check_storage,
    is_sparse,
    kept_count,
    sparse_type_of,
)

_DISTRIBUTIONS = ("uniform", "erk")
# Layers with weight matrices that sparsify cannot convert: named in its error.
_UNSUPPORTED = (eqx.nn.Conv, eqx.nn.ConvTranspose, eqx.nn.Embedding, eqx.nn.GRUCell,
                eqx.nn.LSTMCell)  # fmt: skip


def _is_unsupported(x: Any) -> bool:
    return isinstance(x, _UNSUPPORTED) and sparse_type_of(x) is None


def _is_node(x: Any) -> bool:
    return sparse_type_of(x) is not None or is_sparse(x) or _is_unsupported(x)


def _shapes(layer: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(stacked-layer axes, one dense weight's shape) of a dense layer that a sparse
    layer type converts."""
    rank = sparse_type_of(layer).dense_rank  # pyright: ignore[reportOptionalMemberAccess]
    shape = tuple(layer.weight.shape)
    return shape[:-rank], shape[-rank:]


def erk_densities(
    shapes: Sequence[tuple[int, ...]], density: float, counts: Sequence[int] | None = None
) -> list[float]:
    """Erdos-Renyi-Kernel densities of layers with dense weight `shapes` (each repeated
    `counts` times, for stacked layers), keeping `density` of all their weights overall.

    A layer's density is `eps * sum(shape) / prod(shape)` (for a `(out, in, kh, kw)` kernel
    `(out + in + kh + kw) / (out * in * kh * kw)`): small layers stay denser. Layers that
    would exceed 1 are made dense and `eps` is solved again for the rest.

    References:
        Evci et al., "Rigging the Lottery: Making All Tickets Winners", ICML 2020,
        Section 3 ("Sparsity distribution") and Appendix.

    Example:
        >>> [round(d, 3) for d in erk_densities([(256, 784), (256, 256), (10, 256)], 0.3)]
        [0.261, 0.393, 1.0]
    """
    counts = [1] * len(shapes) if counts is None else list(counts)
    sizes = [math.prod(s) * c for s, c in zip(shapes, counts, strict=True)]
    raw = [sum(s) / math.prod(s) for s in shapes]
    dense: set[int] = set()
    while True:
        budget = density * sum(sizes) - sum(sizes[i] for i in dense)
        rest = [i for i in range(len(shapes)) if i not in dense]
        eps = budget / sum(raw[i] * sizes[i] for i in rest)
        over = [i for i in rest if eps * raw[i] > 1.0]
        if not over:
            return [1.0 if i in dense else eps * raw[i] for i in range(len(shapes))]
        dense.add(max(over, key=lambda i: raw[i]))


def _path_str(path: tuple) -> str:
    return jax.tree_util.keystr(path)


def sparsify(
    model: PyTree,
    density: float | Callable[[str, Any], float],
    *,
    key: PRNGKeyArray,
    distribution: str = "uniform",
    slack: float = 0.0,
    exclude: Sequence[str] | Callable[[str, Any], bool] = (),
    storage: str = "indices",
) -> PyTree:
    """Replace every `eqx.nn.Linear` and `eqx.nn.Conv2d` of `model` by a sparse layer.

    The transformer's projections (`TransformerBlock.qkv`, `proj`, `ff1`, `ff2`) are such
    layers. Stacked layers (built with `eqx.filter_vmap`, as `transformer_encoder` stacks its
    blocks: weights with a leading layer axis) become stacked sparse layers: each layer of
    the stack gets its own positions and the same count of non-zeros.

    Memory: with Adam in float32, 16 bytes per slot (value, two moments, int32 index; less
    with narrower indices) against 12 per dense weight: 0.40x at density 0.3, 0.44x with
    `slack=0.1`. With `storage="bits"` the index is one bit per dense weight instead:
    0.31x at density 0.3. Biases and all other parameters stay dense.

    Args:
        model: any pytree of Equinox modules.
        density: fraction of each layer's weights kept, in (0, 1]: a float for the whole
            model (spread by `distribution`), or a function `(path, layer) -> density`
            for per-layer densities (`path` as `jax.tree_util.keystr`, e.g.
            `".layers[0]"`).
        key: a JAX PRNG key (`jr.PRNGKey(0)` or `jr.key(0)`; an int is refused with a
            TypeError): picks the initial positions (uniformly at random per layer).
        distribution: how a float `density` is spread: `"uniform"` (every layer the same)
            or `"erk"` (Erdos-Renyi-Kernel, `erk_densities`; the same total count).
        slack: extra empty slots per layer as a fraction of its non-zeros (capacity
            `ceil(nnz * (1 + slack))`, at most the dense size). DSR (`dsr`) moves weights
            between layers and needs them (0.1 is 10% more memory for the sparse layers);
            SET and RigL keep every layer's count and do not.
        exclude: paths of layers to keep dense (`".layers[-1]"` style strings; one string
            is one path), or a predicate `(path, layer) -> bool`.
        storage: where each layer's slots are: `"indices"` (one integer per slot,
            `index_dtype`), `"bits"` (a bit set, one bit per dense weight: smaller above a
            density of 1/16 for int16 indices, 1/32 for int32) or `"auto"` (per layer,
            the smaller). The same numbers either way; rewiring keeps the storage.

    Returns:
        The model with sparse layers in place of the dense ones.

    Raises:
        ValueError: a density outside (0, 1], a negative `slack` (a capacity below the
            count of non-zeros), an unknown `distribution`, an `exclude` path that names
            no layer, or a model without any layer to sparsify.
        TypeError: a layer with a weight matrix that `sparsify` cannot convert (named,
            with its path): exclude it to keep it dense; a `key` that is not a PRNG key.

    Example:
        >>> import jax.random as jr
        >>> import eqx_lowmem as el
        >>> net = el.nn.mlp([8, 16, 4], key=jr.PRNGKey(0))
        >>> sparse = sparsify(net, 0.25, key=jr.PRNGKey(1))
        >>> type(sparse.layers[0]).__name__, round(density(sparse), 2)
        ('SparseLinear', 0.25)
    """
    if distribution not in _DISTRIBUTIONS:
        raise ValueError(
            f"distribution={distribution!r}; expected one of {_DISTRIBUTIONS} "
            "(or pass density as a function of (path, layer) for per-layer densities)."
        )
    if callable(density) and distribution != "uniform":
        raise ValueError(
            "density is a per-layer function, so distribution must stay 'uniform'; got "
            f"distribution={distribution!r}."
        )
    if not callable(density):
        density = check_density(density)
    storage = check_storage(storage)
    check_key(key, "sparsify")
    if isinstance(slack, bool) or not isinstance(slack, (int, float)) or slack < 0:
        raise ValueError(
            f"slack={slack!r} would give a capacity below the count of non-zeros; expected "
            "a fraction >= 0 of extra empty slots (0.1 for DSR)."
        )
    flat, treedef = jax.tree_util.tree_flatten_with_path(model, is_leaf=_is_node)
    if isinstance(exclude, str):  # one path, not its characters
        exclude = [exclude]
    excluded = set(exclude) if not callable(exclude) else set()
    targets: list[int] = []
    for i, (path, leaf) in enumerate(flat):
        name = _path_str(path)
        if not _is_node(leaf):
            continue
        skip = exclude(name, leaf) if callable(exclude) else name in excluded
        excluded.discard(name)
        if skip or is_sparse(leaf):
            continue
        if _is_unsupported(leaf):
            raise TypeError(
                f"sparsify does not know the layer type {type(leaf).__module__}."
                f"{type(leaf).__qualname__} at {name!r}; it converts eqx.nn.Linear and "
                f"eqx.nn.Conv2d. Keep it dense: sparsify(..., exclude=[{name!r}])."
            )
        targets.append(i)
    if excluded:
        names = [_path_str(p) for p, x in flat if _is_node(x)]
        raise ValueError(
            f"exclude names {sorted(excluded)}, which are not layers of the model; its "
            f"layers are {names}."
        )
    if not targets:
        raise ValueError(
            "the model has no eqx.nn.Linear or eqx.nn.Conv2d to sparsify (all excluded, "
            "already sparse, or none present)."
        )
    layers = [flat[i][1] for i in targets]
    names = [_path_str(flat[i][0]) for i in targets]
    if callable(density):
        densities = [
            check_density(density(n, x), f"density({n!r})")
            for n, x in zip(names, layers, strict=True)
        ]
    elif distribution == "erk":
        shapes = [_shapes(x) for x in layers]
        densities = erk_densities(
            [s for _, s in shapes], density, [math.prod(st) for st, _ in shapes]
        )
    else:
        densities = [density] * len(layers)
    keys = jr.split(key, len(targets))
    leaves = [x for _, x in flat]
    for i, layer, d, k in zip(targets, layers, densities, keys, strict=True):
        size = math.prod(_shapes(layer)[1])
        capacity = min(size, math.ceil(kept_count(size, d) * (1.0 + slack)))
        kind = sparse_type_of(layer)
        leaves[i] = kind.from_dense(  # pyright: ignore[reportOptionalMemberAccess]
            layer, d, key=k, capacity=capacity, storage=storage
        )
    return jax.tree_util.tree_unflatten(treedef, leaves)


def densify(model: PyTree) -> PyTree:
    """Replace every sparse layer by the equal dense `eqx.nn.Linear` / `eqx.nn.Conv2d`
    (stacked layers stay stacked), for export and for comparisons.

    Memory: the dense weights of every sparse layer.

    Example:
        >>> import jax.numpy as jnp, jax.random as jr
        >>> import eqx_lowmem as el
        >>> net = sparsify(el.nn.mlp([8, 16, 4], key=jr.PRNGKey(0)), 0.5, key=jr.PRNGKey(1))
        >>> dense = densify(net)
        >>> bool(jnp.allclose(dense(jnp.ones(8)), net(jnp.ones(8))))
        True
    """
    return jax.tree.map(lambda x: x.to_dense() if is_sparse(x) else x, model, is_leaf=is_sparse)


class SparseStats(NamedTuple):
    """Counts over the sparse layers of a model (stacked layers counted one by one).

    Attributes:
        layers: number of sparse layers.
        size: their dense weight count.
        capacity: their slots.
        nnz: occupied slots.
        density: `nnz / size` (1.0 for a model without sparse layers).
        value_bytes: bytes of their values (all slots).
        index_bytes: bytes of their indices (integers: parameters too, though no optimizer
            sees them).
    """

    layers: int
    size: int
    capacity: int
    nnz: int
    density: float
    value_bytes: int
    index_bytes: int


def sparse_layers(model: PyTree) -> list[tuple[str, Any]]:
    """`(path, layer)` for every sparse layer of `model`, in pytree order."""
    flat, _ = jax.tree_util.tree_flatten_with_path(model, is_leaf=is_sparse)
    return [(_path_str(p), x) for p, x in flat if is_sparse(x)]


def stats(model: PyTree) -> SparseStats:
    """Count the sparse layers' weights, slots and bytes (needs concrete arrays).

    Example:
        >>> import jax.random as jr
        >>> import eqx_lowmem as el
        >>> net = sparsify(el.nn.mlp([8, 16, 4], key=jr.PRNGKey(0)), 0.5, key=jr.PRNGKey(1))
        >>> s = stats(net)
        >>> s.size, s.nnz, s.index_bytes
        (192, 96, 160)
    """
    layers = sparse_layers(model)
    n = size = capacity = nnz = value_bytes = index_bytes = 0
    for _, x in layers:
        count = math.prod(x.stack_shape)
        n += count
        size += x.size * count
        capacity += x.capacity * count
        nnz += int(jnp.sum(x.nnz()))
        value_bytes += x.values.size * x.values.dtype.itemsize
        index_bytes += x.indices.size * x.indices.dtype.itemsize
    return SparseStats(
        n, size, capacity, nnz, nnz / size if size else 1.0, value_bytes, index_bytes
    )


def density(model: PyTree) -> float:
    """The fraction of the sparse layers' dense weights that are stored non-zeros
    (`stats(model).density`; 1.0 without sparse layers)."""
    return stats(model).density
