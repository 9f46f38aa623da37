"""Shared test helpers."""

import equinox as eqx


def tree_allclose(x, y, *, rtol=1e-5, atol=1e-8):
    """True when two pytrees have the same structure, dtypes and allclose leaves."""
    return bool(eqx.tree_equal(x, y, typematch=True, rtol=rtol, atol=atol))
