"""The report's reading of the compiled peak: what is live at it, from XLA's buffer
assignment, by part (compile only)."""

import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import jax.random as jr
import optax
import pytest

import eqx_lowmem as el
from eqx_lowmem.memory import _peak as el_peak
from eqx_lowmem.memory._peak import PEAK_PARTS
from eqx_lowmem.nn._jvp import RULE_SCOPE

from .helpers import users_env


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
    # Every argument (state and batch) is held whole for the step: all of it is live at the
    # peak, as XLA's own memory analysis counts it.
    assert r.live_peak_bytes >= r.compiled["argument"]
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


def test_a_second_report_of_the_same_step_reuses_its_compilation(reports):
    # `reports` compiled float32 with remat=True: the same report again compiles nothing.
    before = el_peak.compile_count
    again = _report("float32", True)
    assert el_peak.compile_count == before
    assert again.peak_bytes == reports["float32"].peak_bytes
    assert again.at_peak == reports["float32"].at_peak
    # Another program (two micro-batches, not four) is compiled: the key is the program.
    _report("float32", True, accumulate=2)
    assert el_peak.compile_count == before + 1


_DUMP_OFF = (
    "--xla_dump_buffer_assignment_analysis=false --xla_dump_hlo_as_text=false "
    "--xla_dump_disable_metadata=true --xla_dump_hlo_module_re=^nothing$"
)
_PEAK_SCRIPT = """
import jax, jax.numpy as jnp
from eqx_lowmem.memory._peak import compile_with_peak
f = jax.jit(lambda w, x: jnp.tanh(x @ w) @ w.T)
w, x = jnp.ones((64, 64)), jnp.ones((32, 64))
_, peak = compile_with_peak(f.lower(w, x), {}, lambda op: "parameters")
print(peak is not None and peak.live_bytes > 0 and any(b.op_name for b in peak.buffers))
"""


def test_the_peak_is_read_whatever_the_users_xla_flags_turn_off():
    env = users_env()
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + _DUMP_OFF).strip()
    out = subprocess.run(
        [sys.executable, "-c", _PEAK_SCRIPT], env=env, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "True", out.stderr[-2000:]


def test_a_layers_own_rule_recomputes_as_part_of_the_backward_pass():
    # LayerNorm's rule recomputes its normalised input in reverse mode inside its
    # tangent's jax.checkpoint (nn/_jvp): the report counts that as the backward pass's, as
    # it did the former custom_vjp's, and only remat's own recomputation as recomputation.
    ln, x = el.nn.LayerNorm(8), jnp.ones((4, 8))
    lowered = jax.jit(jax.grad(lambda x: jnp.sum(jax.vmap(ln)(x) ** 2))).lower(x)
    names = re.findall(r'loc\("([^"]*rematted_computation[^"]*)"', lowered.as_text(debug_info=True))
    assert names and all(RULE_SCOPE in n for n in names)

    def part(op_name):
        return el_peak._by_op_name(el_peak._Instruction("c", "multiply", "f32[4]", (), op_name, ()))

    assert {part(n) for n in names} == {"backward"}
    assert part(names[0].replace(RULE_SCOPE, "eqx_lowmem.nn.TransformerBlock")) == "recomputation"
