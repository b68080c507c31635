"""Low-bit state that never trains silently worse: which leaves, conversions, formats, shapes, dtypes, globs.

- Only known running statistics become codes: every optax alias and every
  ``optax.contrib`` optimizer either trains with ``state_bits=8`` like it does
  at full precision, or keeps its state at full precision; copies of the
  params (DoG, DoWG, mechanize, prodigy, COCOB, schedule-free, MultiSteps)
  never become codes.
- Codes, scales and format are one value: converted, loaded or refused whole.
- The format travels with the codes; state dicts written before it still load.
"""

from __future__ import annotations

import dataclasses
import re
import warnings
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import treeopt
from treeopt._lowbit import state as lowbit_state
from treeopt._lowbit import statistics
from treeopt._lowbit.codec import Format, QuantizedLeaf, is_quantized, quantize
from treeopt._state.plain import flatten_paths
from treeopt.errors import StateDictError, StateDictWarning

from _helpers import x64

FIXTURE = Path(__file__).parent / "fixtures" / "lowbit_state_dicts_v1.npz"


def quantized_fields(opt_state: Any) -> set[str]:
    """``"Type.field"`` of every state field that holds codes."""
    fields = statistics.fields_by_path(opt_state)
    out = set()
    for path, leaf in jax.tree_util.tree_flatten_with_path(opt_state, is_leaf=is_quantized)[0]:
        if is_quantized(leaf):
            field = next(fields[tuple(path[:k])] for k in range(len(path), 0, -1) if tuple(path[:k]) in fields)
            out.add(f"{field[0].__name__}.{field[1]}")
    return out


# -- every optax optimizer --------------------------------------------------------------------------

PARAMS = {"w": jax.random.normal(jax.random.key(0), (64, 64)) / 8, "b": jnp.zeros(64)}
TARGET = jax.random.normal(jax.random.key(1), (64, 64)) / 8


def loss_fn(params: Any) -> jax.Array:
    return jnp.mean((params["w"] - TARGET) ** 2) + jnp.mean((params["b"] - 0.1) ** 2)


def _update(opt: Any, tx: Any, grads: Any, params: Any, loss: Any = loss_fn) -> Any:
    """``opt.update``, with what an optimizer needs beyond grads and params (a value, a line search's or a
    Hessian estimate's function)."""
    value, grad = jax.value_and_grad(loss)(params)
    for extra in ({}, {"value": value, "grad": grad, "value_fn": loss}, {"obj_fn": loss}):
        try:
            return opt.update(grads, params, **extra)
        except (TypeError, ValueError):
            continue
    raise AssertionError(f"no update of {tx} took the extra arguments tried")


def run(tx: Any, state_bits: Any, steps: int = 25) -> tuple[Any, Any]:
    """``steps`` jitted steps, as a training loop runs them (one compilation, not op-by-op dispatch)."""

    @jax.jit
    def step(opt: Any, params: Any) -> tuple[Any, Any]:
        params = _update(opt, tx, jax.grad(loss_fn)(params), params)
        return opt, params

    opt, params = treeopt.Optimizer(tx, state_bits=state_bits).init(PARAMS), PARAMS
    for _ in range(steps):
        opt, params = step(opt, params)
    return params, opt


TRANSFORMATIONS = dict(statistics.transformations())


@pytest.mark.parametrize("name", sorted(TRANSFORMATIONS))
def test_every_optax_optimizer_trains_like_full_precision_or_keeps_its_state(name):
    tx = TRANSFORMATIONS[name]()
    if tx is None:
        pytest.fail(f"{name} builds no transformation")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # deprecated aliases
        low_params, low = run(tx, 8)
        full_params, _ = run(tx, None)
    held = quantized_fields(low.opt_state)
    known = {f"{t.__name__}.{f}" for (_, t), fields in _statistics().items() for f in fields}
    assert held <= known, f"{name}: {held - known} held as codes but not known statistics"
    if not held:  # full precision: the very same numbers
        for a, b in zip(jax.tree.leaves(low_params), jax.tree.leaves(full_params), strict=True):
            np.testing.assert_array_equal(a, b)
        return
    low_loss, full_loss, start = float(loss_fn(low_params)), float(loss_fn(full_params)), float(loss_fn(PARAMS))
    # Trains like full precision: the same distance from the start, within 8-bit noise.
    assert abs(low_loss - full_loss) <= 0.02 * abs(start - full_loss) + 1e-4 * full_loss, (name, low_loss, full_loss)


def _statistics() -> dict[tuple[str, type], dict[str, str]]:
    out = {}
    for (module, type_name), fields in statistics.STATISTICS.items():
        cls = getattr(__import__(module, fromlist=[type_name]), type_name, None)
        if cls is not None:
            out[(module, cls)] = fields
    return out


COPIES = {
    "dog": lambda: optax.contrib.dog(),
    "dowg": lambda: optax.contrib.dowg(),
    "mechanize": lambda: optax.contrib.mechanize(optax.adam(1e-2)),
    "prodigy": lambda: optax.contrib.prodigy(1e-1),
    "cocob": lambda: optax.contrib.cocob(),
    "schedule_free": lambda: optax.contrib.schedule_free_adamw(1e-2),
    "multi_steps": lambda: optax.MultiSteps(optax.adam(1e-2), every_k_schedule=2),
}


@pytest.mark.parametrize("name", sorted(COPIES))
def test_param_copies_never_become_codes_and_training_moves_as_at_full_precision(name):
    low_params, low = run(COPIES[name](), 8, steps=20)
    full_params, _ = run(COPIES[name](), None, steps=20)
    held = quantized_fields(low.opt_state)
    for field in held:
        assert statistics.full_precision_reason(*_field_type(field)) is None, field
    if not held:  # nothing of it is a statistic: the very same numbers
        np.testing.assert_array_equal(low_params["w"], full_params["w"])
        return
    moved = float(jnp.linalg.norm(full_params["w"] - PARAMS["w"]))
    apart = float(jnp.linalg.norm(low_params["w"] - full_params["w"]))
    # Its moments at 8 bits move it about as far; copies of the params as codes moved it 12,000x to 100,000x as far.
    assert moved > 0 and apart <= 0.5 * moved, (apart, moved)


def _field_type(field: str) -> tuple[type, str]:
    type_name, attr = field.split(".")
    for (_, cls), _ in _statistics().items():
        if cls.__name__ == type_name:
            return cls, attr
    raise AssertionError(field)


class CustomState(NamedTuple):
    stat: Any


def test_a_field_treeopt_does_not_know_keeps_full_precision_and_is_reported():
    tx = optax.GradientTransformation(
        lambda params: CustomState(jax.tree.map(jnp.zeros_like, params)),
        lambda updates, state, params=None: (updates, CustomState(jax.tree.map(jnp.add, state.stat, updates))),
    )
    with pytest.warns(UserWarning, match=r"\['CustomState.stat'\] are not known running statistics"):
        opt = treeopt.Optimizer(tx, state_bits=8).init({"w": jnp.ones((64, 64))})
    assert not is_quantized(opt.opt_state.stat["w"])


@pytest.mark.parametrize("container", ["dict", "dataclass"])
def test_a_dict_or_dataclass_field_treeopt_does_not_know_is_reported_by_name(container):
    @jax.tree_util.register_dataclass
    @dataclasses.dataclass
    class Running:
        stat: Any

    wrap = (lambda x: {"stat": x}) if container == "dict" else Running
    read = (lambda state: state["stat"]) if container == "dict" else (lambda state: state.stat)
    tx = optax.GradientTransformation(
        lambda params: wrap(jax.tree.map(jnp.zeros_like, params)),
        lambda updates, state, params=None: (updates, wrap(jax.tree.map(jnp.add, read(state), updates))),
    )
    named = "dict['stat']" if container == "dict" else "Running.stat"
    with pytest.warns(UserWarning, match=re.escape(f"{[named]} are not known running statistics")):
        opt = treeopt.Optimizer(optax.chain(optax.adam(1e-3), tx), state_bits=8).init({"w": jnp.ones((64, 64))})
    assert not is_quantized(read(opt.opt_state[1])["w"]) and is_quantized(opt.opt_state[0][0].mu["w"])


def test_a_polyak_average_kept_in_optax_ema_state_opts_into_codes():
    # EmaState is optax's running average of the gradients: a transformation that reuses the type for
    # something else (here an average of the params) is read as that statistic, as the docs say.
    tx = optax.GradientTransformation(
        lambda params: optax.EmaState(count=jnp.zeros([], jnp.int32), ema=jax.tree.map(jnp.copy, params)),
        lambda updates, state, params=None: (updates, state),
    )
    opt = treeopt.Optimizer(tx, state_bits=8).init({"w": jnp.ones((64, 64))})
    assert is_quantized(opt.opt_state.ema["w"])


def _table_on_the_page() -> str:
    page = (Path(__file__).parents[2] / "docs" / "low-bit-state.md").read_text().splitlines()
    start = page.index("| optimizer | state field | with state_bits |")
    end = next(i for i in range(start, len(page)) if not page[i].startswith("|"))
    return "\n".join(page[start:end])


def test_the_docs_table_is_the_one_the_code_makes():
    assert _table_on_the_page() == statistics.markdown_table()  # regenerate: see markdown_table's doc


def test_the_table_holds_each_field_as_the_code_does_on_the_shapes_it_names():
    by = {(r.transformation, r.field): r.held for r in statistics.field_table()}
    assert by[("optax.adam", "ScaleByAdamState.nu")] == "8/4-bit unsigned"
    assert by[("optax.contrib.dog", "DoGState.init_params")] == "full precision: a copy of the params"
    assert by[("optax.lbfgs", "ScaleByLBFGSState.params")].startswith("full precision")
    # SM3: mu is the cover of accumulated squares (vectors per axis), nu the momentum shaped like the param.
    assert by[("optax.sm3", "ScaleBySM3State.nu")] == "8/4-bit signed"
    assert by[("optax.sm3", "ScaleBySM3State.mu")].startswith("full precision: SM3's cover")
    assert by[("optax.rmsprop(centered=True)", "ScaleByRStdDevState.nu")].startswith("full precision: read as")
    # GaLore projects a non-square kernel's moments to a shape of their own, which keeps full precision.
    galore = by[("optax.contrib.galore", "ScaleByAdamState.mu")]
    assert galore == "full precision for (128, 256): not shaped like its param; 8/4-bit signed for (64, 64), (4096,)"
    params = {name: jnp.zeros(shape) for name, shape in statistics.TABLE_SHAPES.items()}
    opt = treeopt.Optimizer(optax.contrib.galore(1e-3), state_bits=8).init(params)
    mu = opt.opt_state[0].base_optimizer_state.mu
    assert [is_quantized(mu[name]) for name in ("kernel", "square", "vector")] == [False, True, True]
    sm3 = treeopt.Optimizer(optax.sm3(1e-3), state_bits=8).init(params).opt_state[0]
    assert is_quantized(sm3.nu["kernel"]) and not any(is_quantized(v) for v in jax.tree.leaves(sm3.mu))


# -- statistics an update reads together -------------------------------------------------------------

# Every optax alias and optax.contrib optimizer whose update reads two statistics together (as the table
# finds them: two fields held as codes, or one kept because of such a read): Adam's mu / sqrt(nu) and its
# kin, Adan's (m + (1 - b2) v) / sqrt(n), AdEMAMix's (m1 + alpha m2) / sqrt(nu), AMSGrad's max(nu_max, nu),
# AdaDelta's e_x / e_g, Sophia's mu / max(gamma nu, eps), AdaBelief's and ACProp's nu of (g - mu)**2,
# and the two kept at full precision: centered RMSprop's nu - mu**2 and Momo's exp_avg . params - gamma.
COMBINING = (
    "optax.adabelief", "optax.adadelta", "optax.adam", "optax.adamax", "optax.adamaxw", "optax.adamw",
    "optax.adan", "optax.amsgrad", "optax.lamb", "optax.optimistic_adam", "optax.optimistic_adam_v2",
    "optax.radam", "optax.yogi", "optax.contrib.acprop", "optax.contrib.ademamix", "optax.contrib.adopt",
    "optax.contrib.dadapt_adamw", "optax.contrib.galore", "optax.contrib.mechanize", "optax.contrib.momo",
    "optax.contrib.momo_adam", "optax.contrib.muon", "optax.contrib.prodigy", "optax.contrib.scale_by_galore",
    "optax.contrib.schedule_free", "optax.contrib.simplified_ademamix", "optax.contrib.sophia",
    "optax.rmsprop(centered=True)", "optax.rmsprop(centered=True, bias_correction=True)",
)


def test_the_optimizers_that_combine_statistics_are_those_the_table_finds():
    held: dict[str, list[str]] = {}
    for row in statistics.field_table():
        held.setdefault(row.transformation, []).append(row.held)
    found = {
        name
        for name, fields in held.items()
        if sum("8/4-bit" in h for h in fields) >= 2 or any("read as" in h for h in fields)
    }
    assert found == set(COMBINING)


NOISY_TARGET = 3.0 + jax.random.normal(jax.random.key(7), (64, 128))
NOISY_START = {"w": jnp.full((64, 128), 3.0)}


def noisy_loss(params: Any) -> jax.Array:
    return 0.5 * jnp.mean((params["w"] - NOISY_TARGET) ** 2)


NOISE = jax.random.normal(jax.random.key(8), (30, 64, 128))


@jax.jit
def _noisy_grads(params: Any, noise: jax.Array) -> tuple[jax.Array, Any]:
    value, grads = jax.value_and_grad(noisy_loss)(params)
    return value, {"w": grads["w"] + 0.5 * jnp.abs(grads["w"]).mean() * noise}


def noisy_run(tx: Any, state_bits: Any, steps: int = 30) -> jax.Array:
    """A noisy quadratic (a (64, 128) param away from the origin, gradient noise half their mean size):
    the param after ``steps`` steps."""
    opt = treeopt.Optimizer(tx, state_bits=state_bits).init(NOISY_START)
    params, extras = NOISY_START, ((), ("value",), ("obj_fn",), ("value", "grad", "value_fn"))
    for i in range(steps):
        value, grads = _noisy_grads(params, NOISE[i])
        given = {"value": value, "grad": grads, "value_fn": noisy_loss, "obj_fn": noisy_loss}
        for extra in extras:  # what the optimizer needs beyond grads and params, found on the first step
            try:
                new = opt.update(grads, params, **{k: given[k] for k in extra})
            except (TypeError, ValueError):
                continue
            params, extras = new, (extra,)
            break
        else:
            raise AssertionError(f"no update of {tx} took the extra arguments tried")
    return params["w"]


@pytest.mark.slow  # 29 optimizers trained at 8 and 4 bits: the slow tier (-m slow) runs the walk
@pytest.mark.parametrize("name", COMBINING)
def test_statistics_an_update_combines_never_turn_nan_and_train_like_float32(name):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # deprecated aliases
        full = float(noisy_loss({"w": noisy_run(TRANSFORMATIONS[name](), None)}))
        for bits, tolerance in ((8, 0.02), (4, 0.10)):
            w = noisy_run(TRANSFORMATIONS[name](), bits)
            assert not bool(jnp.isnan(w).any()), (name, bits, int(jnp.isnan(w).sum()))
            low = float(noisy_loss({"w": w}))
            assert abs(low - full) <= tolerance * full, (name, bits, low, full)


@pytest.mark.parametrize("bias_correction", [False, True])
def test_centered_rmsprop_keeps_its_mean_and_mean_square_full_precision_and_never_turns_nan(bias_correction):
    # Its step reads nu - mu**2 under a root: codes of each made it negative (all 8,192 params NaN at 4 bits).
    tx = lambda: optax.rmsprop(1e-2, centered=True, bias_correction=bias_correction)  # noqa: E731
    full = float(noisy_loss({"w": noisy_run(tx(), None)}))
    for bits, tolerance in ((8, 0.02), (4, 0.05)):
        w = noisy_run(tx(), bits)
        assert not bool(jnp.isnan(w).any())
        assert abs(float(noisy_loss({"w": w})) - full) <= tolerance * full
    state = treeopt.Optimizer(tx(), state_bits=4).init(NOISY_START).opt_state[0]
    assert not is_quantized(state.mu["w"]) and not is_quantized(state.nu["w"])


@pytest.mark.parametrize(
    "make", [lambda: optax.contrib.momo(1000.0), lambda: optax.contrib.momo_adam(1.0)], ids=["momo", "momo_adam"]
)
def test_momo_keeps_the_momentum_it_reads_against_an_exact_inner_product_full_precision(make):
    # Momo's step size reads exp_avg . params - gamma, gamma the exact running grad . params: with
    # exp_avg as 4-bit codes Momo ended at 1.76x, MomoAdam at 7.75x float32 state's loss here.
    full = float(noisy_loss({"w": noisy_run(make(), None)}))
    low = float(noisy_loss({"w": noisy_run(make(), 4)}))
    assert abs(low - full) <= 0.10 * full, (low, full)


def test_a_state_dict_of_centered_rmsprop_codes_warm_starts_into_full_precision():
    # Written when the table held ScaleByRStdDevState as codes: converted, never loaded as it is.
    tx = optax.rmsprop(1e-2, centered=True)
    opt = treeopt.Optimizer(tx, state_bits=8).init(NOISY_START)
    opt.update({"w": jnp.cos(NOISY_TARGET)}, NOISY_START)
    sd = opt.state_dict()
    mu = jnp.asarray(sd["opt_state"]["0"]["mu"]["w"])
    old = quantize(mu, 8)
    sd["opt_state"]["0"]["mu"]["w"] = {"codes": old.codes, "scales": old.scales, "format": old.format.entry()}
    with pytest.raises(StateDictError, match="opt_state/0/mu/w/codes"):
        treeopt.Optimizer(tx, state_bits=8).init(NOISY_START).load_state_dict(sd)
    warm, report = treeopt.serialization.warm_start(treeopt.Optimizer(tx, state_bits=8).init(NOISY_START), sd)
    assert report.converted == (("opt_state/0/mu/w", "8-bit signed codes", "float32[64, 128]"),)
    np.testing.assert_array_equal(warm.opt_state[0].mu["w"], old.dequantize())


# -- codes, scales and format: one value -------------------------------------------------------------

PARAMS2 = {"w": jax.random.normal(jax.random.key(2), (128, 96)), "col": jax.random.normal(jax.random.key(3), (8192, 1))}


def trained(bits: Any, steps: int = 3) -> Any:
    opt = treeopt.Optimizer(optax.adam(1e-2), state_bits=bits).init(PARAMS2)
    params = PARAMS2
    for i in range(steps):
        params = opt.update(jax.tree.map(lambda x, i=i: jnp.sin(x * (i + 1)), params), params)
    return opt


def moments(opt: Any) -> dict[str, np.ndarray]:
    state = opt.opt_state[0]
    read = lambda x: np.asarray(x.dequantize() if is_quantized(x) else x)  # noqa: E731
    return {f"{k}/{n}": read(getattr(state, k)[n]) for k in ("mu", "nu") for n in PARAMS2}


def test_eight_to_four_bits_keeps_the_values_and_reports_each_conversion():
    eight = trained(8)
    four, report = treeopt.serialization.warm_start(treeopt.Optimizer(optax.adam(1e-2), state_bits=4).init(PARAMS2), eight)
    assert {p for p, _, _ in report.converted} == {f"opt_state/0/{k}/{n}" for k in ("mu", "nu") for n in PARAMS2}
    assert ("opt_state/0/mu/w", "8-bit signed codes", "4-bit signed codes") in report.converted
    before, after = moments(eight), moments(four)
    for key in before:
        scale = np.abs(before[key]).max()
        np.testing.assert_allclose(after[key], before[key], atol=0.13 * scale, err_msg=key)
        assert np.all(np.sign(after[key]) * np.sign(before[key]) >= 0), key  # never the wrong sign


def test_four_bits_to_full_precision_keeps_the_decoded_values_exactly():
    four = trained(4)
    full, report = treeopt.serialization.warm_start(treeopt.Optimizer(optax.adam(1e-2)).init(PARAMS2), four)
    assert report.ok and len(report.converted) == 4
    for key, value in moments(four).items():
        np.testing.assert_array_equal(moments(full)[key], value, err_msg=key)


def test_strict_loading_other_bits_is_a_mismatch_naming_codes_and_format():
    eight = trained(8).state_dict()
    four = treeopt.Optimizer(optax.adam(1e-2), state_bits=4).init(PARAMS2)
    with pytest.raises(StateDictError, match=r"opt_state/0/mu/w/format") as caught:
        four.load_state_dict(eight)
    text = str(caught.value)
    assert "opt_state/0/mu/w/codes" in text and "8-bit signed" in text and "4-bit signed" in text


def test_lenient_loading_refuses_codes_and_scales_together():
    eight = trained(8).state_dict()
    four = treeopt.Optimizer(optax.adam(1e-2), state_bits=4).init(PARAMS2)
    with pytest.warns(StateDictWarning, match="format"):
        loaded = four.load_state_dict(eight, strict=False)
    q, fresh = loaded.opt_state[0].mu["col"], four.opt_state[0].mu["col"]
    # The (8192, 1) leaf: scales of the same shape at 8 and 4 bits; neither part of the value loads alone.
    np.testing.assert_array_equal(q.scales, fresh.scales)
    np.testing.assert_array_equal(q.codes, fresh.codes)
    assert int(loaded.step) == 3  # the rest loads


def test_an_n_by_1_leaf_at_4_bits_reads_as_4_bits_everywhere():
    four = trained(4)
    sd = four.state_dict()
    assert Format.from_entry(sd["opt_state"]["0"]["nu"]["col"]["format"]).bits == 4
    with pytest.raises(StateDictError, match="opt_state/0/nu/col"):
        treeopt.Optimizer(optax.adam(1e-2), state_bits=8).init(PARAMS2).load_state_dict(sd)
    eight, _ = treeopt.serialization.warm_start(treeopt.Optimizer(optax.adam(1e-2), state_bits=8).init(PARAMS2), sd)
    full, _ = treeopt.serialization.warm_start(treeopt.Optimizer(optax.adam(1e-2)).init(PARAMS2), sd)
    want = moments(four)["nu/col"]
    np.testing.assert_array_equal(moments(full)["nu/col"], want)
    np.testing.assert_allclose(moments(eight)["nu/col"], want, rtol=0.035)


def test_full_precision_state_into_low_bits_converts_in_a_warm_start_and_mismatches_in_a_load():
    full = trained(None)
    with pytest.raises(StateDictError, match="opt_state/0/mu/w/codes"):
        treeopt.Optimizer(optax.adam(1e-2), state_bits=8).init(PARAMS2).load_state_dict(full.state_dict())
    low, report = treeopt.serialization.warm_start(treeopt.Optimizer(optax.adam(1e-2), state_bits=8).init(PARAMS2), full)
    assert ("opt_state/0/nu/w", "float32[128, 96]", "8-bit unsigned codes") in report.converted
    for key, value in moments(full).items():
        np.testing.assert_allclose(moments(low)[key], value, atol=0.0157 * np.abs(value).max(), err_msg=key)


def test_state_dicts_written_before_formats_were_recorded_still_load():
    saved = np.load(FIXTURE)
    for bits in (8, 4):
        sd: dict[str, Any] = {}
        for key in saved.files:
            head, *path = key.split("/")
            if head == str(bits) and path[0] != "decoded":
                node = sd
                for part in path[:-1]:
                    node = node.setdefault(part, {})
                node[path[-1]] = saved[key]
        decoded = {k.split("/", 2)[2]: saved[k] for k in saved.files if k.startswith(f"{bits}/decoded/")}
        params = {"w": jnp.zeros((64, 64)), "col": jnp.zeros((8192, 1)), "row": jnp.zeros((2, 3000))}
        # Into full precision: the values that release decoded, exactly.
        full, report = treeopt.serialization.warm_start(treeopt.Optimizer(optax.adam(1e-2)).init(params), sd)
        assert report.ok and len(report.converted) == 6
        for key, value in decoded.items():
            kind, name = key.split("/")
            np.testing.assert_allclose(getattr(full.opt_state[0], kind)[name], value, rtol=1e-6, err_msg=key)
        # A strict load into the same configuration: read, and held in today's format.
        low = treeopt.Optimizer(optax.adam(1e-2), state_bits=bits).init(params).load_state_dict(sd)
        assert int(low.step) == 3
        for key, value in decoded.items():
            kind, name = key.split("/")
            got = np.asarray(getattr(low.opt_state[0], kind)[name].dequantize())
            np.testing.assert_allclose(got, value, atol=(0.016 if bits == 8 else 0.13) * np.abs(value).max())


# -- formats that cannot be the leaf ----------------------------------------------------------------

WIDE = {"w": jax.random.normal(jax.random.key(9), (64, 512))}  # 8-bit blocks of 256 from axis 1


def wide_state_dict() -> dict[str, Any]:
    opt = treeopt.Optimizer(optax.adam(1e-2), state_bits=8).init(WIDE)
    opt.update({"w": jnp.sin(WIDE["w"])}, WIDE)
    return opt.state_dict()


def with_format(sd: dict[str, Any], field: str, index: int, value: int) -> dict[str, Any]:
    """``sd`` with one number of ``field``'s format entry of ``w`` changed: [version, bits, signed, axis, block]."""
    sd = jax.tree.map(lambda x: x, sd)
    entry = np.array(sd["opt_state"]["0"][field]["w"]["format"])
    entry[index] = value
    sd["opt_state"]["0"][field]["w"]["format"] = entry
    return sd


def _targets() -> dict[str, Any]:
    return {f"{bits}-bit": treeopt.Optimizer(optax.adam(1e-2), state_bits=bits).init(WIDE) for bits in (8, 4, None)}


@pytest.mark.parametrize("block", [0, -256, 200])
def test_a_block_the_codes_cannot_have_is_an_error_naming_the_leaf_in_a_load_and_a_warm_start(block, monkeypatch):
    sd = with_format(wide_state_dict(), "mu", 4, block)
    # A strict load refuses the entry as it is, before decoding anything.
    monkeypatch.setattr(lowbit_state, "_decode", lambda q: pytest.fail("a strict load decoded the source"))
    with pytest.raises(StateDictError, match=re.escape("opt_state/0/mu/w/format: expected format [2, 8, 1, 1, 256]")) as caught:
        _targets()["8-bit"].load_state_dict(sd)
    why = "blocks of 200 from axis 1" if block == 200 else f"not valid: block {block}, expected 1 to 256"
    assert why in str(caught.value)
    monkeypatch.undo()
    why = "scales of shape (64, 2) where blocks of 200" if block == 200 else f"block {block}, expected 1 to 256"
    for name, target in _targets().items():  # into 8 bits, 4 bits and full precision alike
        with pytest.raises(StateDictError, match=re.escape("opt_state/0/mu/w/format")) as caught:
            treeopt.serialization.warm_start(target, sd)
        assert why in str(caught.value), name


def test_a_warm_start_refuses_the_map_of_the_other_sign_and_an_axis_beyond_the_rank_naming_the_leaf():
    sd = wide_state_dict()
    cases = [
        (with_format(sd, "mu", 2, 0), "the unsigned map, where the leaf is a signed statistic"),
        (with_format(sd, "nu", 2, 1), "the signed map, where the leaf is an unsigned statistic"),
        (with_format(sd, "mu", 3, 5), "axis 5 of a 2-d leaf"),
    ]
    for bad, why in cases:
        for name, target in _targets().items():
            with pytest.raises(StateDictError, match=r"opt_state/0/(mu|nu)/w/format") as caught:
                treeopt.serialization.warm_start(target, bad)
            assert why in str(caught.value), (name, why)
    # The formats as written still convert.
    _, report = treeopt.serialization.warm_start(_targets()["4-bit"], sd)
    assert ("opt_state/0/mu/w", "8-bit signed codes", "4-bit signed codes") in report.converted


def test_a_format_of_a_newer_version_is_left_to_the_report():
    sd = with_format(wide_state_dict(), "mu", 0, 3)
    target = _targets()["4-bit"]
    loaded, report = treeopt.serialization.warm_start(target, sd)
    assert "opt_state/0/mu/w/format" in {p for p, _, _ in report.mismatched}
    assert "opt_state/0/mu/w" not in {p for p, _, _ in report.converted}
    np.testing.assert_array_equal(loaded.opt_state[0].mu["w"].codes, target.opt_state[0].mu["w"].codes)
def test_the_low_bit_reader_runs_only_where_a_side_holds_codes(monkeypatch):
    from treeopt._lowbit import state as lowbit_state

    calls = []
    converter = lowbit_state.converted_source

    def counted(*args, **kwargs):
        calls.append(None)
        return converter(*args, **kwargs)

    monkeypatch.setattr(lowbit_state, "converted_source", counted)
    params = {"w": jnp.zeros((64, 64))}
    full = treeopt.Optimizer(optax.adam(1e-2)).init(params)
    low = treeopt.Optimizer(optax.adam(1e-2), state_bits=8).init(params)
    full.load_state_dict(full.state_dict())
    treeopt.serialization.check_state_dict(full, full.state_dict())
    treeopt.serialization.warm_start(full, full.state_dict())
    assert calls == []  # full precision on both sides: neither the converter nor the v1 reader runs
    low.load_state_dict(low.state_dict())  # the target holds codes
    treeopt.serialization.warm_start(full, low.state_dict())  # the source does
    assert len(calls) == 2


# -- bytes, dtypes, globs ---------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(128, 64), (64, 4, 64), (8192, 1), (96, 96)])
@pytest.mark.parametrize(("bits", "target"), [(8, 2.05), (4, 1.07)])
def test_adam_state_bytes_per_parameter_on_narrow_shapes(shape, bits, target):
    opt = treeopt.Optimizer(optax.adam(1e-3), state_bits=bits).init({"w": jnp.zeros(shape)})
    moments_bytes = sum(x.nbytes for x in jax.tree.leaves((opt.opt_state[0].mu, opt.opt_state[0].nu)))
    assert moments_bytes / np.prod(shape) <= target


def test_a_glob_shadowed_by_an_earlier_one_is_an_error_naming_both():
    params = {"embed": {"table": jnp.ones((64, 64))}, "dense": jnp.ones((64, 64))}
    with pytest.raises(ValueError, match=re.escape("the glob 'embed/*' comes after '*'")):
        treeopt.Optimizer(optax.adam(1e-3), state_bits={"*": 8, "embed/*": None}).init(params)
    opt = treeopt.Optimizer(optax.adam(1e-3), state_bits={"embed/*": None, "*": 8}).init(params)
    assert not is_quantized(opt.opt_state[0].mu["embed/table"]) and is_quantized(opt.opt_state[0].mu["dense"])


def test_float16_state_updates_as_float16_state_does():
    params = {"w": (jax.random.normal(jax.random.key(4), (64, 64)) * 0.1).astype(jnp.float16)}
    # Second moments of 4e-7 to 1.6e-6: float16 subnormals, below its smallest normal (6.1e-5).
    grads = {"w": jax.random.uniform(jax.random.key(5), (64, 64), minval=0.02, maxval=0.04).astype(jnp.float16)}
    updates = {}
    for bits in (None, 8):
        opt = treeopt.Optimizer(optax.adam(1e-3), state_bits=bits).init(params)
        opt.update(grads, params, apply_updates=False)
        updates[bits] = np.asarray(opt.update(grads, params, apply_updates=False)["w"], np.float32)
    np.testing.assert_allclose(updates[8], updates[None], rtol=0.05)  # was 3.5x too small


def test_float64_moments_beyond_the_float32_range_stay_finite():
    with x64():
        params = {"w": jnp.zeros((64, 64), jnp.float64)}
        opt = treeopt.Optimizer(optax.sgd(1.0, momentum=0.9), state_bits=8).init(params)
        opt.update({"w": jnp.full((64, 64), 1e300, jnp.float64)}, params)
        trace = opt.opt_state[0].trace["w"]
        assert isinstance(trace, QuantizedLeaf) and trace.scales.dtype == jnp.float64
        np.testing.assert_allclose(np.asarray(trace.dequantize()), 1e300, rtol=1e-6)


def test_a_jitted_init_builds_the_codes_of_zeros_instead_of_computing_them():
    opt = treeopt.Optimizer(optax.adam(1e-3), state_bits=8)
    text = jax.jit(opt.init).lower({"w": jnp.ones((512, 512))}).as_text()
    assert "optimization_barrier" not in text  # zeros: built, no encoder behind a barrier
    agrad = treeopt.Optimizer(optax.adagrad(1e-3, initial_accumulator_value=0.1), state_bits=8)
    state = jax.jit(agrad.init)({"w": jnp.ones((512, 512))}).opt_state[0].sum_of_squares["w"]
    np.testing.assert_allclose(np.asarray(state.dequantize()), 0.1, rtol=1e-6)
    flat = flatten_paths(jax.jit(opt.init)({"w": jnp.ones((512, 512))}).state_dict())
    assert float(np.abs(np.asarray(flat[("opt_state", "0", "mu", "w", "scales")])).max()) == 0.0
