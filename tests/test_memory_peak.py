"""The report's reading of the compiled peak: what is live at it, from XLA's buffer
assignment, by part (compile only)."""

import jax
import jax.numpy as jnp
import jax.random as jr
import optax
import pytest

import eqx_lowmem as el
from eqx_lowmem.memory._peak import PEAK_PARTS


def _report(precision, remat, accumulate=4):
    model = el.nn.CausalLM(64, 32, 2, 64, 2, 128, key=jr.PRNGKey(0), remat=remat)
    tokens = (jax.ShapeDtypeStruct((8, 33), jnp.int32),)
    dtype = jnp.float16 if precision == "half_fp16" else jnp.float32
    return el.memory.memory_report(model, el.train.next_token_loss, optax.adam(1e-3), tokens,
                                   accumulate=accumulate, precision=precision,
                                   accumulate_dtype=dtype)  # fmt: skip


@pytest.fixture(scope="module")
def reports():
    return {p: _report(p, True) for p in ("float32", "half_fp16")}


@pytest.mark.parametrize("precision", ["float32", "half_fp16"])
def test_the_live_parts_and_the_packing_add_up_to_the_compiled_peak(reports, precision):
    r = reports[precision]
    assert r.at_peak is not None and set(r.at_peak) == set(PEAK_PARTS)
    assert r.live_peak_bytes + r.packing_bytes == r.peak_bytes
    # XLA packs its temporaries into one block, which leaves room between them; it never
    # holds more than it allocated.
    assert 0 <= r.packing_bytes < 0.5 * r.peak_bytes
    # The arguments are held whole for the step: the state's parts are the report's, up
    # to a few scalars XLA keeps beside them (the optimizer's step count, its new value).
    assert 0 <= r.at_peak["optimizer"] - r.sizes["optimizer"] <= 64
    assert r.at_peak["batch"] == r.sizes["batch"]
    assert r.at_peak["parameters"] >= r.sizes["parameters"]
    table = str(r)
    assert "live at the compiled peak" in table and "packing" in table
    assert r.to_dict()["at_peak"] == r.at_peak


def test_recomputation_and_the_backends_float32_copies_are_named(reports):
    # Every block recomputed: at the peak, inside the backward loop, the recomputed block's
    # values and the backward pass's temporaries are live.
    for r in reports.values():
        assert r.at_peak["recomputation"] + r.at_peak["backward"] > 0, r.at_peak
    # XLA:CPU computes 16-bit matrix products in float32: those copies are the backend's.
    assert reports["half_fp16"].at_peak["upcasts"] > 0
    assert reports["float32"].at_peak["upcasts"] == 0


def test_without_recomputation_the_saved_activations_are_live_instead():
    r = _report("float32", False, accumulate=1)
    assert r.at_peak["recomputation"] == 0
    assert r.at_peak["activations"] > 0
