"""`StepConfig`: every option of a step reaches the step that the Trainer, `memory_report`
and `plan` build from it (a field added to it and not passed on by one of them fails
here), and the keyword arguments they took before still work beside it."""

import dataclasses
import inspect

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import optax
import pytest

import eqx_lowmem as el
from eqx_lowmem.precision import get_policy

from .test_trainer import _Normed, _normed_loss  # a Linear and BatchNorm, and its loss


def keep(state, info):  # an after_update hook that changes nothing
    return state


def _options():
    """A value other than the default for every field but `has_state` (below)."""
    return dict(
        accumulate=2,
        precision="mixed_bf16",
        loss_scale=el.precision.dynamic_loss_scale(2.0**10),
        mesh=jax.make_mesh((1,), ("batch",)),
        data_axis="batch",
        shard="fsdp",
        after_update=keep,
        jit=False,
        accumulate_dtype=jnp.bfloat16,
        fuse_accumulation=False,
        skip_nonfinite=True,
    )


# How each field shows in a built Step, and in a MemoryReport's `config`.
IN_STEP = {
    "accumulate": lambda s: s.accumulate,
    "precision": lambda s: s.policy,
    "loss_scale": lambda s: None if s.loss_scale is None else float(s.loss_scale.scale),
    "has_state": lambda s: s.has_state,
    "mesh": lambda s: s.mesh,
    "data_axis": lambda s: s.data_axis,
    "shard": lambda s: s.shard,
    "after_update": lambda s: s.config.after_update,
    "jit": lambda s: s.config.jit,
    "accumulate_dtype": lambda s: s.accumulate_dtype,
    "fuse_accumulation": lambda s: s.config.fuse_accumulation,
    "skip_nonfinite": lambda s: s.skip_nonfinite,
}
IN_REPORT = {
    "accumulate": lambda c: c["accumulate"],
    "precision": lambda c: get_policy(c["precision"]),
    "loss_scale": lambda c: c["loss_scale"],
    "has_state": lambda c: c["has_state"],
    "mesh": lambda c: c["mesh"],
    "data_axis": lambda c: c["data_axis"],
    "shard": lambda c: c["shard"],
    "after_update": lambda c: c["after_update"],
    "accumulate_dtype": lambda c: jnp.dtype(c["accumulate_dtype"]),
    "fuse_accumulation": lambda c: c["fuse_accumulation"],  # (accumulate > 1 here)
    "skip_nonfinite": lambda c: c["skip_nonfinite"],
}
# The memory tools compile the step whatever `jit` says.
NOT_IN_REPORT = {"jit"}


def _expected_in_step(name, value):
    if name == "precision":
        return get_policy(value)
    if name == "loss_scale":
        return float(value.scale)
    if name == "accumulate_dtype":
        return jnp.dtype(value)
    return value


def _expected_in_report(name, value):
    if name == "mesh":
        return dict(value.shape)
    if name == "after_update":
        return value.__qualname__
    return _expected_in_step(name, value)


def test_the_config_holds_every_option_of_make_step():
    keywords = [
        p.name
        for p in inspect.signature(el.train.make_step).parameters.values()
        if p.kind is inspect.Parameter.KEYWORD_ONLY
    ]
    fields = [f.name for f in dataclasses.fields(el.train.StepConfig)]
    assert fields == keywords
    assert set(IN_STEP) == set(fields) and set(IN_REPORT) | NOT_IN_REPORT == set(fields)
    # Its defaults are make_step's.
    defaults = {
        p.name: p.default for p in inspect.signature(el.train.make_step).parameters.values()
    }
    assert all(getattr(el.train.StepConfig(), n) == defaults[n] for n in fields)


def test_every_field_reaches_the_trainer_memory_report_and_plan():
    options = _options()
    config = el.train.StepConfig(**options)
    model = el.nn.mlp([8, 16, 4], key=jr.PRNGKey(0))
    batch = (jax.ShapeDtypeStruct((8, 8), jnp.float32), jax.ShapeDtypeStruct((8, 4), jnp.float32))
    opt = optax.adam(1e-3)

    trainer = el.train.Trainer(model, el.train.mse, opt, step_config=config, progress=False)
    report = el.memory.memory_report(model, el.train.mse, opt, batch, step_config=config)
    planned = el.memory.plan(
        lambda remat: el.nn.mlp([8, 16, 4], key=jr.PRNGKey(0)), el.train.mse, opt, batch,
        budget="1GiB", remats=(False,), accumulates=(config.accumulate,),
        precisions=(config.precision,), shards=(config.shard,), step_config=config,
    ).best.report  # fmt: skip
    assert trainer.step_config == config
    for name, value in options.items():
        assert IN_STEP[name](trainer.step_fn) == _expected_in_step(name, value), name
        if name not in NOT_IN_REPORT:
            for where, got in (("memory_report", report), ("plan", planned)):
                assert IN_REPORT[name](got.config) == _expected_in_report(name, value), (
                    name,
                    where,
                )


def test_has_state_reaches_the_trainer_and_memory_report_and_plan_refuses_it():
    model, model_state = eqx.nn.make_with_state(_Normed)(key=jr.PRNGKey(0))
    config = el.train.StepConfig(has_state=True)
    trainer = el.train.Trainer(model, _normed_loss, optax.sgd(0.1), model_state=model_state,
                               step_config=config, progress=False)  # fmt: skip
    assert IN_STEP["has_state"](trainer.step_fn) is True
    batch = (jnp.ones((4, 2)), jnp.ones((4, 1)))
    report = el.memory.memory_report(model, _normed_loss, optax.sgd(0.1), batch,
                                     model_state=model_state, step_config=config)  # fmt: skip
    assert IN_REPORT["has_state"](report.config) is True
    with pytest.raises(ValueError, match=r"stateful model \(step_config.has_state=True\)"):
        el.memory.plan(lambda remat: model, _normed_loss, optax.sgd(0.1), batch,
                       budget="1GiB", step_config=config)  # fmt: skip


def test_the_trainer_trains_with_the_options_it_could_not_take_before():
    # accumulate_dtype and fuse_accumulation: the Trainer's updates equal make_step's.
    x = jr.normal(jr.PRNGKey(2), (32, 2))
    y = jnp.sum(x, axis=1, keepdims=True)
    config = el.train.StepConfig(accumulate=4, accumulate_dtype=jnp.bfloat16)
    model = el.nn.mlp([2, 4, 1], key=jr.PRNGKey(0))
    trainer = el.train.Trainer(model, el.train.mse, optax.sgd(0.05), step_config=config,
                               progress=False)  # fmt: skip
    trainer.fit(x, y, updates=2, micro_batch=4, key=jr.PRNGKey(1), shuffle=False)
    step = config.build(el.train.mse, optax.sgd(0.05))
    state = step.init(model, key=jr.split(jr.PRNGKey(1))[1])
    for n in range(2):
        state, _ = step(state, (x[16 * n : 16 * (n + 1)], y[16 * n : 16 * (n + 1)]))
    assert trainer.step_fn.accumulate_dtype == jnp.bfloat16
    assert eqx.tree_equal(trainer.state.model, state.model)


@pytest.mark.parametrize(
    "call",
    [
        lambda m, c: el.train.Trainer(
            m, el.train.mse, optax.sgd(0.1), accumulate=2, step_config=c
        ),  # fmt: skip
        lambda m, c: el.memory.memory_report(
            m,
            el.train.mse,
            optax.sgd(0.1),
            (jnp.ones((4, 2)), jnp.ones((4, 1))),
            accumulate=2,
            step_config=c,
        ),
    ],
    ids=["Trainer", "memory_report"],
)
def test_an_option_given_both_ways_is_refused_by_name(call):
    model = el.nn.mlp([2, 1], key=jr.PRNGKey(0))
    with pytest.raises(ValueError, match=r"accumulate= given beside step_config="):
        call(model, el.train.StepConfig(accumulate=4))
    with pytest.raises(TypeError, match="step_config"):  # (the suite's type checker first)
        call(model, {"accumulate": 4})
