"""How treeopt.t5x.adafactor factors each parameter: T5X's rule parsing, by hand-derived literals.

The expectations below were worked out by reading T5X's ``t5x/adafactor.py``
(its ``set_param_axes``, ``_parse_rule`` and ``_factored_dims``): a rule decides
the factoring only for parameters of rank above 2 or with a BATCH dimension;
every other parameter falls back to the size heuristic (the two largest
dimensions, when the smaller one is at least ``min_dim_size_to_factor``), its
rule ignored with a warning. T5X is not needed to run these tests.

"Averages" below name the parameter axes a statistic is the mean over:
``v_row`` keeps every axis but its averaged ones, and so does ``v_col``.
"""

from __future__ import annotations

import inspect
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from treeopt.t5x import adafactor
from treeopt.t5x.adafactor import HEURISTIC_RULE, Adafactor, FactorDim, HParamMap
from treeopt.t5x.optimizers import OptimizerState

ROW, COL, BATCH, NONE = FactorDim.ROW, FactorDim.COLUMN, FactorDim.BATCH, FactorDim.NONE
LOGGER = "treeopt.t5x.adafactor"

# -- a small T5-like model ----------------------------------------------------------------
# d_model 128, 4 heads of 32 (joined 128, so attention out is a square 128 x 128 kernel),
# mlp 256, vocab 256, 32 relative-position buckets, a decoder of 2 scanned layers whose
# params carry a "layers" axis (BATCH in the standard rules).

MODEL = {
    "token_embedder/embedding": ((256, 128), ("vocab", "embed")),
    "encoder/relpos_bias/rel_embedding": ((4, 32), ("heads", "relpos_buckets")),
    "encoder/layers_0/attention/query/kernel": ((128, 4, 32), ("embed", "heads", "kv")),
    "encoder/layers_0/attention/key/kernel": ((128, 128), ("embed", "joined_kv")),
    "encoder/layers_0/attention/value/kernel": ((128, 128), ("embed", "joined_kv")),
    "encoder/layers_0/attention/out/kernel": ((128, 128), ("joined_kv", "embed")),
    "encoder/layers_0/mlp/wi/kernel": ((128, 256), ("embed", "mlp")),
    "encoder/layers_0/mlp/wo/kernel": ((256, 128), ("mlp", "embed")),
    "encoder/layers_0/pre_attention_layer_norm/scale": ((128,), ("embed",)),
    "encoder/encoder_norm/scale": ((128,), ("embed",)),
    "decoder/relpos_bias/rel_embedding": ((4, 32), ("heads", "relpos_buckets")),
    "decoder/layers/self_attention/query/kernel": ((128, 2, 128), ("embed", "layers", "joined_kv")),
    "decoder/layers/self_attention/out/kernel": ((128, 2, 128), ("joined_kv", "layers", "embed")),
    "decoder/layers/encoder_decoder_attention/out/kernel": ((4, 2, 32, 128), ("heads", "layers", "kv", "embed")),
    "decoder/layers/mlp/wi/kernel": ((128, 2, 256), ("embed", "layers", "mlp")),
    "decoder/layers/mlp/wo/kernel": ((256, 2, 128), ("mlp", "layers", "embed")),
    "decoder/layers/pre_mlp_layer_norm/scale": ((128, 2), ("embed", "layers")),
    "decoder/decoder_norm/scale": ((128,), ("embed",)),
    "decoder/logits_dense/kernel": ((128, 256), ("embed", "vocab")),
}  # fmt: skip

# factor_map after set_param_axes with standard_logical_factor_rules(): a rule lacking ROW or
# COLUMN keeps only its BATCH entries.
EXPECTED_FACTOR_MAP = {
    "token_embedder/embedding": (COL, ROW),
    "encoder/relpos_bias/rel_embedding": (NONE, NONE),
    "encoder/layers_0/attention/query/kernel": (ROW, COL, COL),
    "encoder/layers_0/attention/key/kernel": (ROW, COL),
    "encoder/layers_0/attention/value/kernel": (ROW, COL),
    "encoder/layers_0/attention/out/kernel": (COL, ROW),
    "encoder/layers_0/mlp/wi/kernel": (ROW, COL),
    "encoder/layers_0/mlp/wo/kernel": (COL, ROW),
    "encoder/layers_0/pre_attention_layer_norm/scale": (NONE,),
    "encoder/encoder_norm/scale": (NONE,),
    "decoder/relpos_bias/rel_embedding": (NONE, NONE),
    "decoder/layers/self_attention/query/kernel": (ROW, BATCH, COL),
    "decoder/layers/self_attention/out/kernel": (COL, BATCH, ROW),
    "decoder/layers/encoder_decoder_attention/out/kernel": (COL, BATCH, COL, ROW),
    "decoder/layers/mlp/wi/kernel": (ROW, BATCH, COL),
    "decoder/layers/mlp/wo/kernel": (COL, BATCH, ROW),
    "decoder/layers/pre_mlp_layer_norm/scale": (NONE, BATCH),
    "decoder/decoder_norm/scale": (NONE,),
    "decoder/logits_dense/kernel": (ROW, COL),
}  # fmt: skip


def factored(v_row, v_col, v_row_averages, v_col_averages):
    return {"v_row": v_row, "v_col": v_col, "v": (1,), "row_avg": v_row_averages, "col_avg": v_col_averages}


def unfactored(shape):
    return {"v_row": (1,), "v_col": (1,), "v": shape, "row_avg": None, "col_avg": None}


# min_dim_size_to_factor=128 (the default). Rank <= 2 without BATCH: the heuristic, whatever
# the rule says. The square attention out kernel (joined_kv, embed) is where that shows:
# its rule would average v_row over axis 0, the heuristic averages it over axis 1 (of two
# equal dims, the later one counts as the largest).
EXPECTED_DEFAULT = {
    "token_embedder/embedding": factored((128,), (256,), (0,), (1,)),
    "encoder/relpos_bias/rel_embedding": unfactored((4, 32)),  # 4 < 128
    "encoder/layers_0/attention/query/kernel": factored((128,), (4, 32), (1, 2), (0,)),
    "encoder/layers_0/attention/key/kernel": factored((128,), (128,), (1,), (0,)),
    "encoder/layers_0/attention/value/kernel": factored((128,), (128,), (1,), (0,)),
    "encoder/layers_0/attention/out/kernel": factored((128,), (128,), (1,), (0,)),
    "encoder/layers_0/mlp/wi/kernel": factored((128,), (256,), (1,), (0,)),
    "encoder/layers_0/mlp/wo/kernel": factored((128,), (256,), (0,), (1,)),
    "encoder/layers_0/pre_attention_layer_norm/scale": unfactored((128,)),
    "encoder/encoder_norm/scale": unfactored((128,)),
    "decoder/relpos_bias/rel_embedding": unfactored((4, 32)),
    "decoder/layers/self_attention/query/kernel": factored((128, 2), (2, 128), (2,), (0,)),
    "decoder/layers/self_attention/out/kernel": factored((2, 128), (128, 2), (0,), (2,)),
    "decoder/layers/encoder_decoder_attention/out/kernel": factored((2, 128), (4, 2, 32), (0, 2), (3,)),
    "decoder/layers/mlp/wi/kernel": factored((128, 2), (2, 256), (2,), (0,)),
    "decoder/layers/mlp/wo/kernel": factored((2, 128), (256, 2), (0,), (2,)),
    # (NONE, BATCH): rank 2 but batched, so the rule holds: unfactored at any size.
    "decoder/layers/pre_mlp_layer_norm/scale": unfactored((128, 2)),
    "decoder/decoder_norm/scale": unfactored((128,)),
    "decoder/logits_dense/kernel": factored((128,), (256,), (1,), (0,)),
}  # fmt: skip

# min_dim_size_to_factor=4: the relative-position tables, ruled (NONE, NONE), are factored
# by the heuristic; nothing else changes.
EXPECTED_SMALL = {
    **EXPECTED_DEFAULT,
    "encoder/relpos_bias/rel_embedding": factored((4,), (32,), (1,), (0,)),
    "decoder/relpos_bias/rel_embedding": factored((4,), (32,), (1,), (0,)),
}


def nest(flat):
    out = {}
    for name, value in flat.items():
        node = out
        *parents, leaf = name.split("/")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    return out


def model_params(seed=0):
    rng = np.random.default_rng(seed)
    return nest({n: rng.normal(0.0, 0.5, shape).astype(np.float32) for n, (shape, _) in MODEL.items()})


def model_axes():
    return nest({n: P(*axes) for n, (_, axes) in MODEL.items()})


def standard_def(**kwargs):
    opt_def = Adafactor(0.01, logical_factor_rules=adafactor.standard_logical_factor_rules(), **kwargs)
    opt_def.set_param_axes(model_axes())
    return opt_def


# -- the differential test: state shapes, factored axes, numbers --------------------------


def test_set_param_axes_stores_a_plain_dict_of_rules_by_path():
    opt_def = standard_def()
    assert type(opt_def.hyper_params.factor_map) is dict
    assert opt_def.hyper_params.factor_map == EXPECTED_FACTOR_MAP


@pytest.mark.parametrize(
    "min_dim, expected", [(128, EXPECTED_DEFAULT), (4, EXPECTED_SMALL)], ids=["default", "small"]
)
@pytest.mark.parametrize("beta1", [None, 0.9])
def test_state_shapes_of_a_t5_like_model(min_dim, expected, beta1):
    opt = standard_def(min_dim_size_to_factor=min_dim, beta1=beta1).create(model_params())
    got = {}
    for name in MODEL:
        s = leaf(opt.state.param_states, name)
        got[name] = (s.v_row.shape, s.v_col.shape, s.v.shape, s.m.shape)
    want = {
        name: (e["v_row"], e["v_col"], e["v"], MODEL[name][0] if beta1 is not None else (1,))
        for name, e in expected.items()
    }
    assert got == want
    assert len(jax.tree.leaves(opt.state.param_states)) == 4 * len(MODEL)


def test_factored_axes_of_the_square_attention_kernel_are_the_heuristics():
    # (joined_kv, embed) ruled (COLUMN, ROW): ignored. v_row is the mean over axis 1.
    opt_def = standard_def()
    name = "encoder/layers_0/attention/out/kernel"
    rule = opt_def.hyper_params.factor_map[name]
    assert Adafactor._parse_rule(rule, (128, 128), name) == ((0, 1), HEURISTIC_RULE)
    assert opt_def._factored_dims((128, 128)) == ((0,), (1,))  # (v_col averages, v_row averages)
    grad = np.tile(np.arange(1.0, 129.0, dtype=np.float32), (128, 1))  # varies along axis 1 only
    params = {"kernel": np.ones((128, 128), np.float32)}
    opt_def = Adafactor(0.01, factor_map=HParamMap([("kernel", (COL, ROW))]))
    opt = opt_def.create(params).apply_gradient({"kernel": grad})
    state = opt.state.param_states["kernel"]
    # First step: no decay, so v_row is mean(g**2) over axis 1: one value everywhere.
    np.testing.assert_allclose(state.v_row, np.full(128, np.mean(np.arange(1.0, 129.0) ** 2)), rtol=1e-6)
    np.testing.assert_allclose(state.v_col, np.arange(1.0, 129.0) ** 2, rtol=1e-6)


def reference_run(params, grads, expected, steps, lr=0.01, beta1=None, start=None, first_step=0):
    """Adafactor in float64 NumPy from the paper's formulas, the factored axes taken from ``expected``.

    Statistics are kept with the averaged axes as size-1 dims; returns params and
    states ``{name: dict(v_row, v_col, v, m)}`` in the stored shapes.
    """
    p = {n: np.asarray(x, np.float64) for n, x in params.items()}
    st = {}
    for n, e in expected.items():
        shape = p[n].shape
        if start is None:
            r = np.zeros([1 if i in (e["row_avg"] or ()) else d for i, d in enumerate(shape)])
            c = np.zeros([1 if i in (e["col_avg"] or ()) else d for i, d in enumerate(shape)])
            st[n] = {"r": r, "c": c, "v": np.zeros(shape), "m": np.zeros(shape)}
        else:
            s = start[n]
            st[n] = {"v": np.asarray(s["v"], np.float64), "m": np.asarray(s["m"], np.float64)}
            if e["row_avg"] is not None:
                st[n]["r"] = np.expand_dims(np.asarray(s["v_row"], np.float64), e["row_avg"])
                st[n]["c"] = np.expand_dims(np.asarray(s["v_col"], np.float64), e["col_avg"])
    for t in range(first_step, first_step + steps):
        decay = 1.0 - (t + 1.0) ** -0.8
        for n, e in expected.items():
            x, g, s = p[n], np.asarray(grads[t][n], np.float64), st[n]
            batch = tuple(i for i, a in enumerate(MODEL[n][1]) if a == "layers") if n in MODEL else ()
            avg = tuple(i for i in range(x.ndim) if i not in batch)
            g2 = g * g + 1e-30
            if e["row_avg"] is None:
                s["v"] = decay * s["v"] + (1 - decay) * g2
                vhat = s["v"]
            else:
                s["r"] = decay * s["r"] + (1 - decay) * g2.mean(axis=e["row_avg"], keepdims=True)
                s["c"] = decay * s["c"] + (1 - decay) * g2.mean(axis=e["col_avg"], keepdims=True)
                vhat = s["r"] * s["c"] / s["r"].mean(axis=e["col_avg"], keepdims=True)
            u = g / np.sqrt(vhat)
            u = u / np.maximum(1.0, np.sqrt((u * u).mean(axis=avg, keepdims=True)))
            scale = np.maximum(np.sqrt((x * x).mean(axis=avg, keepdims=True)), 1e-3)
            step = lr * scale * u
            if beta1 is not None:
                s["m"] = beta1 * s["m"] + (1 - beta1) * step
                step = s["m"]
            p[n] = x - step
    out = {}
    for n, e in expected.items():
        s = st[n]
        stored = {"v_row": np.zeros(1), "v_col": np.zeros(1), "v": np.zeros(1), "m": np.zeros(1)}
        if e["row_avg"] is None:
            stored["v"] = s["v"]
        else:
            stored["v_row"] = np.squeeze(s["r"], axis=e["row_avg"])
            stored["v_col"] = np.squeeze(s["c"], axis=e["col_avg"])
        if beta1 is not None:
            stored["m"] = s["m"]
        out[n] = stored
    return p, out


def random_grads(steps, seed=1):
    rng = np.random.default_rng(seed)
    return [
        {n: rng.normal(0.0, 1.0, shape).astype(np.float32) for n, (shape, _) in MODEL.items()}
        for _ in range(steps)
    ]


def leaf(tree, name):
    for key in name.split("/"):
        tree = tree[key]
    return tree


@pytest.mark.parametrize(
    "min_dim, expected", [(128, EXPECTED_DEFAULT), (4, EXPECTED_SMALL)], ids=["default", "small"]
)
def test_three_steps_of_a_t5_like_model_match_the_reference(min_dim, expected):
    params, grads = model_params(), random_grads(3)
    opt = standard_def(min_dim_size_to_factor=min_dim).create(params)
    for g in grads:
        opt = opt.apply_gradient(nest(g))
    flat_params = {n: leaf(params, n) for n in MODEL}
    ref_params, ref_states = reference_run(flat_params, grads, expected, steps=3)
    for n in MODEL:
        np.testing.assert_allclose(leaf(opt.target, n), ref_params[n], rtol=2e-5, atol=1e-6, err_msg=n)
        state = leaf(opt.state.param_states, n)
        for slot in ("v_row", "v_col", "v"):
            np.testing.assert_allclose(
                getattr(state, slot), ref_states[n][slot], rtol=2e-5, err_msg=f"{n}/{slot}"
            )


def test_derived_logical_axes_shard_the_factored_statistics():
    opt_def = standard_def(beta1=0.9)
    abstract = jax.eval_shape(opt_def.create, model_params())
    derived = opt_def.derive_logical_axes(abstract, model_axes())
    assert derived.state.step is None
    out = leaf(derived.state.param_states, "encoder/layers_0/attention/out/kernel")
    # The heuristic averages v_row over axis 1 (embed) and v_col over axis 0 (joined_kv).
    assert (out.v_row, out.v_col, out.v, out.m) == (P("joined_kv"), P("embed"), None, P("joined_kv", "embed"))
    wo = leaf(derived.state.param_states, "decoder/layers/mlp/wo/kernel")
    assert (wo.v_row, wo.v_col, wo.v) == (P("layers", "embed"), P("mlp", "layers"), None)
    cross = leaf(derived.state.param_states, "decoder/layers/encoder_decoder_attention/out/kernel")
    assert (cross.v_row, cross.v_col) == (P("layers", "embed"), P("heads", "layers", "kv"))
    relpos = leaf(derived.state.param_states, "encoder/relpos_bias/rel_embedding")
    assert (relpos.v_row, relpos.v_col, relpos.v) == (None, None, P("heads", "relpos_buckets"))
    # One spec entry per axis of each state leaf.
    for spec, array in zip(
        jax.tree.leaves(derived.state.param_states, is_leaf=lambda x: x is None or isinstance(x, P)),
        jax.tree.leaves(abstract.state.param_states),
        strict=True,
    ):
        assert spec is None or len(spec) == len(array.shape)


def test_momentum_axes_follow_t5x_truth_test_of_beta1():
    params = {"w": jnp.ones((4, 8))}
    for beta1, m_axes in [(None, None), (0.0, None), (0.9, P("embed", "mlp"))]:
        opt_def = Adafactor(0.1, beta1=beta1, min_dim_size_to_factor=2)
        axes = opt_def.derive_logical_axes(opt_def.create(params), {"w": P("embed", "mlp")})
        assert axes.state.param_states["w"].m == m_axes


# -- rule parsing --------------------------------------------------------------------------


def test_a_rule_of_a_matrix_is_ignored_for_the_heuristic():
    for rule in [(ROW, COL), (COL, ROW), (NONE, NONE), (COL, NONE)]:
        opt_def = Adafactor(0.1, min_dim_size_to_factor=4, factor_map=HParamMap([("w", rule)]))
        state = opt_def.create({"w": jnp.ones((10, 6))}).state.param_states["w"]
        assert (state.v_row.shape, state.v_col.shape, state.v.shape) == ((6,), (10,), (1,)), rule
        assert Adafactor._parse_rule(rule, (10, 6), "w") == ((0, 1), HEURISTIC_RULE)
        assert opt_def._factored_dims((10, 6)) == ((1,), (0,))
    # Below min_dim_size_to_factor the heuristic leaves it unfactored, whatever the rule.
    small = Adafactor(0.1, factor_map=HParamMap([("w", (ROW, COL))]))
    assert small.create({"w": jnp.ones((10, 6))}).state.param_states["w"].v.shape == (10, 6)


def test_a_batch_axis_makes_a_rank_two_rule_count():
    opt_def = Adafactor(0.1, min_dim_size_to_factor=1, factor_map=HParamMap([("w", (BATCH, NONE))]))
    state = opt_def.create({"w": jnp.ones((3, 40))}).state.param_states["w"]
    assert state.v.shape == (3, 40) and state.v_row.shape == (1,)
    assert Adafactor._parse_rule((BATCH, NONE), (3, 40), "w") == ((1,), None)


def test_rules_of_higher_rank():
    x = jnp.ones((6, 3, 10))
    cases = {
        (ROW, BATCH, COL): ((6, 3), (3, 10)),
        (COL, BATCH, ROW): ((3, 10), (6, 3)),
        (ROW, COL, COL): ((6,), (3, 10)),
        (ROW, ROW, COL): ((6, 3), (10,)),
    }
    for rule, (v_row, v_col) in cases.items():
        opt_def = Adafactor(0.1, factor_map=HParamMap([("x", rule)]))
        state = opt_def.create({"x": x}).state.param_states["x"]
        assert (state.v_row.shape, state.v_col.shape, state.v.shape) == (v_row, v_col, (1,)), rule
    assert Adafactor._parse_rule((ROW, BATCH, COL), (6, 3, 10), "x") == ((0, 2), ((0,), (2,)))
    # A rank-3 rule without ROW nor COLUMN: unfactored, its BATCH dims kept out of the RMS.
    assert Adafactor._parse_rule((BATCH, NONE, NONE), (6, 3, 10), "x") == ((1, 2), None)


def test_a_none_rule_means_unfactored():
    opt_def = Adafactor(
        0.1, min_dim_size_to_factor=1, factor_map=HParamMap([("a", None), (".*", HEURISTIC_RULE)])
    )
    opt = opt_def.create({"a": jnp.ones((300, 200)), "b": jnp.ones((300, 200))})
    assert opt.state.param_states["a"].v.shape == (300, 200)
    assert opt.state.param_states["b"].v_row.shape == (200,)
    # Through set_param_axes: a parameter whose logical axes are None.
    opt_def = Adafactor(0.1, min_dim_size_to_factor=1, logical_factor_rules={"embed": ROW, "mlp": COL})
    opt_def.set_param_axes({"a": None, "b": P("embed", "mlp")})
    assert opt_def.hyper_params.factor_map == {"a": None, "b": (ROW, COL)}
    opt = opt_def.create({"a": jnp.ones((300, 200)), "b": jnp.ones((300, 200))})
    assert opt.state.param_states["a"].v.shape == (300, 200)
    assert opt.state.param_states["b"].v_col.shape == (300,)


def test_heuristic_rule_and_factored_false():
    assert Adafactor._parse_rule(HEURISTIC_RULE, (5, 7), "w") == ((0, 1), HEURISTIC_RULE)
    not_factored = Adafactor(0.1, factored=False, min_dim_size_to_factor=1)
    assert not_factored._factored_dims((300, 300)) is None
    assert not_factored.create({"w": jnp.ones((6, 10, 3))}).state.param_states["w"].v.shape == (6, 10, 3)
    # The heuristic: the later of two equal dims is the largest; rank 1 never factors.
    assert Adafactor(min_dim_size_to_factor=8)._factored_dims((9, 9)) == ((0,), (1,))
    assert Adafactor(min_dim_size_to_factor=8)._factored_dims((40, 9)) == ((1,), (0,))
    assert Adafactor(min_dim_size_to_factor=1)._factored_dims((40,)) is None
    # An empty factor_map counts as none at all: the heuristic.
    opt_def = Adafactor(0.1, min_dim_size_to_factor=4, logical_factor_rules={})
    opt_def.set_param_axes({})
    assert opt_def.hyper_params.factor_map == {}
    assert opt_def.create({"w": jnp.ones((10, 6))}).state.param_states["w"].v_row.shape == (6,)


def test_factor_name_spellings():
    spellings = {
        "row": ROW, "ROW": ROW, "col": COL, "Col": COL, "column": COL, "batch": BATCH,
        "none": NONE, "unfactorized": NONE,
    }  # fmt: skip
    for name, dim in spellings.items():
        assert adafactor.factor_name_to_factordim(name) is dim
    for not_a_name in (ROW, None, 3):
        assert adafactor.factor_name_to_factordim(not_a_name) is not_a_name
    for unknown in ("unfactored", "columns", "diag"):
        with pytest.raises(KeyError):
            adafactor.factor_name_to_factordim(unknown)
    opt_def = Adafactor(0.1, logical_factor_rules={"embed": "row", "mlp": "col", "layers": "Batch"})
    opt_def.set_param_axes({"wi": P("layers", "embed", "mlp")})
    assert opt_def.hyper_params.factor_map == {"wi": (BATCH, ROW, COL)}


def test_standard_logical_factor_rules():
    rules = adafactor.standard_logical_factor_rules()
    assert dict(rules) == {
        "vocab": COL, "embed": ROW, "mlp": COL, "heads": COL, "kv": COL, "joined_kv": COL,
        "relpos_buckets": NONE, "layers": BATCH, "stack": BATCH, "q_wi_fused": COL,
        "o_wo_fused": COL, "multiquery_heads": COL, "kv_fused": COL, "layer_norm_scale": NONE,
        "mlp_activations": COL,
    }  # fmt: skip


# -- errors --------------------------------------------------------------------------------


def test_errors_of_set_param_axes():
    opt_def = Adafactor(0.1, logical_factor_rules={"embed": ROW, "mlp": COL})
    with pytest.raises(KeyError, match="vocab"):
        opt_def.set_param_axes({"w": P("vocab", "embed")})
    opt_def = Adafactor(0.1, logical_factor_rules={"embed": ROW, "mlp": COL, "buckets": NONE})
    with pytest.raises(ValueError, match="Incomplete adafactor spec"):
        opt_def.set_param_axes({"w": P("embed", "mlp", "buckets")})
    opt_def = Adafactor(0.1, logical_factor_rules={"embed": "diagonal"})
    with pytest.raises(KeyError):
        opt_def.set_param_axes({"w": P("embed")})
    # Without logical_factor_rules set_param_axes leaves factor_map alone.
    opt_def = Adafactor(0.1)
    opt_def.set_param_axes({"w": P("vocab", "embed")})
    assert opt_def.hyper_params.factor_map is None


def test_errors_of_rules_and_construction():
    with pytest.raises(ValueError, match="explicit factorization rule"):
        Adafactor(0.1).create({"w": jnp.ones((6, 3, 10))})
    with pytest.raises(ValueError, match="rank 3"):
        Adafactor(0.1, factor_map=HParamMap([("w", (ROW, COL))])).create({"w": jnp.ones((6, 3, 10))})
    with pytest.raises(KeyError, match="No factor rule found for parameter: w"):
        Adafactor(0.1, factor_map=HParamMap([("kernel", (ROW, COL))])).create({"w": jnp.ones((6, 10))})
    opt_def = Adafactor(0.1, logical_factor_rules={"embed": ROW})
    opt_def.set_param_axes({"w": P("embed")})
    with pytest.raises(KeyError):  # a param set_param_axes did not see
        opt_def.create({"w": jnp.ones(4), "u": jnp.ones(4)})
    with pytest.raises(ValueError, match="factored=False"):
        Adafactor(0.1, factored=False, factor_map=HParamMap([]))
    with pytest.raises(TypeError, match="multiply_by_parameter_scale"):
        Adafactor(0.1, multiply_by_parameter_scale="yes")
    with pytest.raises(TypeError, match="factor_map"):
        Adafactor(0.1, factor_map={"w": (ROW, COL)})
    opt = Adafactor().create({"w": jnp.ones(3)})
    with pytest.raises(AssertionError, match="no learning rate"):
        opt.apply_gradient({"w": jnp.ones(3)})


# -- the warning, once per parameter ---------------------------------------------------------


def test_an_ignored_rule_is_logged_once_per_parameter(caplog):
    factor_map = HParamMap([("kernel", (ROW, COL)), ("bias", (ROW,)), ("stacked", (BATCH, ROW, COL))])
    opt_def = Adafactor(0.1, min_dim_size_to_factor=2, factor_map=factor_map)
    params = {"kernel": jnp.ones((4, 6)), "bias": jnp.ones(6), "stacked": jnp.ones((2, 4, 6))}
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        opt = opt_def.create(params)
        for _ in range(3):
            opt = opt.apply_gradient(jax.tree.map(jnp.ones_like, params))
        opt_def.derive_logical_axes(opt, {"kernel": P("a", "b"), "bias": P("b"), "stacked": P("l", "a", "b")})
    messages = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert len(messages) == 2
    assert sum("kernel" in m for m in messages) == 1 and sum("bias" in m for m in messages) == 1
    assert all(r.levelno == logging.WARNING for r in caplog.records if r.name == LOGGER)


def test_parse_rule_logs_each_call_like_t5x(caplog):
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        Adafactor._parse_rule((ROW, COL), (4, 6), "w")
        Adafactor._parse_rule((ROW, COL), (4, 6), "w")
        Adafactor._parse_rule((ROW, COL), (4, 6), "w", fallback_to_heuristics=False)
    assert len([r for r in caplog.records if r.name == LOGGER]) == 2
    assert Adafactor._parse_rule((ROW, COL), (4, 6), "w", fallback_to_heuristics=False) == (
        (0, 1),
        ((0,), (1,)),
    )


# -- T5X's signatures and equality -----------------------------------------------------------


def test_signatures_are_t5x_s():
    sig = lambda f: list(inspect.signature(f).parameters)  # noqa: E731
    assert sig(Adafactor.init_param_state) == ["self", "param", "path"]
    assert sig(Adafactor.apply_param_gradient) == [
        "self",
        "step",
        "hyper_params",
        "param",
        "state",
        "grad",
        "path",
    ]
    assert sig(Adafactor.apply_gradient) == ["self", "hyper_params", "params", "state", "grads"]
    assert sig(Adafactor._parse_rule) == ["rule", "shape", "path", "fallback_to_heuristics"]
    assert sig(Adafactor._factored_dims) == ["self", "shape"]
    assert sig(Adafactor.set_param_axes) == ["self", "param_logical_axes"]
    positional = [
        name
        for name, p in inspect.signature(Adafactor.derive_logical_axes).parameters.items()
        if p.kind is not inspect.Parameter.KEYWORD_ONLY
    ]
    assert positional == ["self", "optimizer_state", "param_logical_axes"]  # the ZeRO options are keywords
    assert list(adafactor._AdafactorHyperParams.__dataclass_fields__) == [
        "learning_rate", "factored", "multiply_by_parameter_scale", "beta1", "decay_rate",
        "step_offset", "clipping_threshold", "weight_decay_rate", "min_dim_size_to_factor",
        "epsilon1", "epsilon2", "factor_map", "logical_factor_rules",
        "weight_decay_rate_lr_exponent", "global_norm_clip_threshold", "max_parameter_scale",
        "skip_nan_updates",
    ]  # fmt: skip
    assert list(adafactor._AdafactorParamState.__dataclass_fields__) == ["v_row", "v_col", "v", "m"]


def test_init_param_state_looks_the_rule_up_by_path():
    opt_def = Adafactor(0.1, factor_map=HParamMap([("^enc/", (ROW, BATCH, COL)), (".*", None)]))
    x = jnp.ones((6, 3, 10))
    assert opt_def.init_param_state(x, "enc/wi").v_row.shape == (6, 3)
    assert opt_def.init_param_state(x, "dec/wi").v.shape == (6, 3, 10)


def test_equality_compares_hyperparameters():
    assert Adafactor(0.1) == Adafactor(0.1)
    assert Adafactor(0.1) != Adafactor(0.2)
    assert Adafactor(0.1, beta1=0.9) != Adafactor(0.1)
    assert Adafactor(0.1, dtype_momentum=jnp.bfloat16) != Adafactor(0.1)
    assert Adafactor(0.1) != "Adafactor(0.1)"
    a = Adafactor(0.1, logical_factor_rules={"embed": ROW, "mlp": COL})
    b = Adafactor(0.1, logical_factor_rules={"embed": ROW, "mlp": COL})
    a.set_param_axes({"w": P("embed", "mlp")})
    assert a != b
    b.set_param_axes({"w": P("embed", "mlp")})
    assert a == b
    assert adafactor._AdafactorHyperParams(0.1, True, True, None, 0.8, 0, 1.0, None, 128, 1e-30, 1e-3) == (
        Adafactor(0.1).hyper_params
    )


def test_hparam_map_first_match_wins_and_maps_trees():
    hp = HParamMap([("bias$", 0.0), ("^dense/", 1.0), (".*", 2.0)])
    assert (hp["dense/bias"], hp["dense/kernel"], hp["out/kernel"]) == (0.0, 1.0, 2.0)
    assert hp({"dense": {"kernel": 1, "bias": 2}, "out": {"kernel": 3}}) == {
        "dense": {"kernel": 1.0, "bias": 0.0},
        "out": {"kernel": 2.0},
    }


def test_a_restored_state_runs_with_other_containers():
    # A state read back from a checkpoint may hold plain dicts where the params are FrozenDicts.
    from flax.core import freeze

    opt_def = Adafactor(0.1, min_dim_size_to_factor=2)
    params = freeze({"a": {"w": jnp.ones((4, 6))}})
    state = opt_def.init_state({"a": {"w": jnp.ones((4, 6))}})
    new_params, new_state = opt_def.apply_gradient(
        opt_def.hyper_params, params, state, {"a": {"w": jnp.ones((4, 6))}}
    )
    assert isinstance(new_state, OptimizerState) and new_state.param_states["a"]["w"].v_row.shape == (4,)
    np.testing.assert_allclose(new_params["a"]["w"], 0.9, rtol=1e-6)
