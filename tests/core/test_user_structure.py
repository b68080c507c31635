"""``tx`` sees the params in the structure the user gave them: optax code written for raw optax runs unchanged.

Each idiom below selects params by their structure (a mask or labels
callable over paths, a mask or labels tree, ``optax.partition``); with
treeopt it must select what it selects with raw optax, over several jitted
steps, on linen-style nested dicts, ``nnx.State`` and equinox modules, while
the state treeopt stores stays keyed by name.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx, traverse_util

import treeopt

from _helpers import assert_trees_close, device_mesh

# A tree with every nnx Variable replaced by its value (nnx.pure before flax 0.12.7).
as_pure = getattr(nnx, "as_pure", None) or nnx.pure

STEPS = 4
RTOL = 1e-6  # both sides jitted alike; what differs is where XLA contracts a multiply-add


# -- the params, in three containers ------------------------------------------------


def linen_params() -> dict[str, Any]:
    key = jax.random.key(0)
    k1, k2, k3 = jax.random.split(key, 3)
    return {
        "encoder": {"dense": {"kernel": jax.random.normal(k1, (3, 4)), "bias": jnp.full((4,), 0.5)}},
        "norm": {"scale": jnp.ones(4), "bias": jnp.full((4,), -0.25)},
        "head": {"kernel": jax.random.normal(k2, (4, 2)), "bias": jax.random.normal(k3, (2,))},
    }


class _Mlp(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.dense = nnx.Linear(3, 4, rngs=rngs)
        self.norm = nnx.LayerNorm(4, rngs=rngs)
        self.head = nnx.Linear(4, 2, rngs=rngs)
        self.bn = nnx.BatchNorm(2, rngs=rngs)  # batch statistics: not trained, not seen by tx


def nnx_state() -> Any:
    model = _Mlp(nnx.Rngs(0))
    return as_pure(nnx.state(model, nnx.Param))


class _EqxMlp(eqx.Module):
    dense: eqx.nn.Linear
    head: eqx.nn.Linear
    activation: Callable[[jax.Array], jax.Array]
    depth: int = eqx.field(static=True)

    def __init__(self, key: jax.Array, depth: int = 2):
        k1, k2 = jax.random.split(key)
        self.dense = eqx.nn.Linear(3, 4, key=k1)
        self.head = eqx.nn.Linear(4, 2, key=k2)
        self.activation = jax.nn.relu
        self.depth = depth


def eqx_model() -> Any:
    return _EqxMlp(jax.random.key(0))


def _grads(params: Any, step: int) -> Any:
    """Deterministic grads of each step, the same for treeopt and raw optax (non-arrays left as they are)."""
    leaves, treedef = jax.tree.flatten(params)
    out = []
    for i, leaf in enumerate(leaves):
        if eqx.is_inexact_array(leaf):
            out.append(jnp.sin(jnp.arange(leaf.size, dtype=leaf.dtype).reshape(leaf.shape) + i + 3 * step))
        else:
            out.append(leaf)
    return treedef.unflatten(out)


def _run_raw(tx: optax.GradientTransformation, params: Any) -> Any:
    """``STEPS`` jitted raw optax steps on the arrays of ``params`` (equinox's own idiom: filter first)."""
    arrays = eqx.filter(params, eqx.is_inexact_array)
    state = jax.jit(tx.init)(arrays)

    @jax.jit
    def step(arrays: Any, state: Any, grads: Any) -> Any:
        updates, state = tx.update(grads, state, arrays)
        return optax.apply_updates(arrays, updates), state

    for i in range(STEPS):
        grads = eqx.filter(_grads(params, i), eqx.is_inexact_array)
        arrays, state = step(arrays, state, grads)
    return arrays


def _run_treeopt(tx: optax.GradientTransformation, params: Any) -> tuple[Any, treeopt.Optimizer]:
    opt = treeopt.Optimizer(tx).init(params)

    @eqx.filter_jit
    def step(params: Any, opt: treeopt.Optimizer, grads: Any) -> Any:
        return opt.update(grads, params), opt

    for i in range(STEPS):
        params, opt = step(params, opt, _grads(params, i))
    return params, opt


def assert_same_as_raw(tx: optax.GradientTransformation, params: Any) -> treeopt.Optimizer:
    expected = _run_raw(tx, params)
    trained, opt = _run_treeopt(tx, params)
    assert_trees_close(eqx.filter(trained, eqx.is_inexact_array), expected, rtol=RTOL, atol=1e-7)
    # The step changed every param it should: a selection of nothing would pass the comparison above only
    # if raw optax also selected nothing, which the idioms below never do.
    assert not np.allclose(
        np.asarray(jax.tree.leaves(expected)[0]),
        np.asarray(jax.tree.leaves(eqx.filter(params, eqx.is_inexact_array))[0]),
    )
    return opt


# -- the idioms ------------------------------------------------------------------


def _flatten_dict_mask(params: Any) -> Any:
    """Flax programs' weight-decay mask: no decay on biases and norm scales, written over the nested paths."""
    flat = traverse_util.flatten_dict(params)
    return traverse_util.unflatten_dict({path: path[-1] == "kernel" for path in flat})


def _path_aware_mask(params: Any) -> Any:
    return traverse_util.path_aware_map(lambda path, _: path[-1] != "bias", params)


def _kind_labels(params: Any) -> Any:
    flat = traverse_util.flatten_dict(params)
    return traverse_util.unflatten_dict({path: "fast" if path[-1] == "bias" else "slow" for path in flat})


def test_weight_decay_mask_over_flatten_dict_paths_decays_kernels_only() -> None:
    tx = optax.adamw(0.1, weight_decay=0.5, mask=_flatten_dict_mask)
    assert_same_as_raw(tx, linen_params())


def test_path_aware_map_mask_selects_as_raw_optax() -> None:
    tx = optax.masked(optax.add_decayed_weights(0.5), _path_aware_mask)
    assert_same_as_raw(optax.chain(tx, optax.sgd(0.1)), linen_params())


def test_mask_given_as_a_tree_and_as_a_prefix() -> None:
    params = linen_params()
    full = jax.tree.map(lambda x: x.ndim > 1, params)
    prefix = {"encoder": True, "norm": False, "head": {"kernel": True, "bias": False}}
    for mask in (full, prefix):
        assert_same_as_raw(optax.masked(optax.adam(0.1), mask), params)


def test_multi_transform_labels_tree_and_partition_labels_callable() -> None:
    params = linen_params()
    transforms = {"fast": optax.adam(0.1), "slow": optax.sgd(0.01, momentum=0.9)}
    assert_same_as_raw(optax.multi_transform(transforms, _kind_labels(params)), params)
    assert_same_as_raw(optax.partition(transforms, _kind_labels), params)


def test_nnx_state_labels_from_map_state() -> None:
    state = nnx_state()
    labels = nnx.map_state(lambda path, _: "fast" if path[-1] == "bias" else "slow", state)
    tx = optax.partition({"fast": optax.adam(0.1), "slow": optax.sgd(0.01)}, labels)
    assert_same_as_raw(tx, state)


def test_nnx_state_mask_callable_and_tree() -> None:
    state = nnx_state()
    mask = nnx.map_state(lambda path, _: path[-1] == "kernel", state)
    assert_same_as_raw(optax.adamw(0.1, weight_decay=0.5, mask=mask), state)
    by_rank = lambda p: jax.tree.map(lambda x: x.ndim > 1, p)  # noqa: E731
    assert_same_as_raw(optax.adamw(0.1, weight_decay=0.5, mask=by_rank), state)


def test_nnx_module_given_to_the_core_shows_tx_a_state_of_its_params() -> None:
    model = _Mlp(nnx.Rngs(0))
    seen = []

    def labels(params: Any) -> Any:
        seen.append(params)
        return nnx.map_state(lambda path, _: "fast" if path[-1] == "bias" else "slow", params)

    tx = optax.partition({"fast": optax.adam(0.1), "slow": optax.sgd(0.01)}, labels)
    opt = treeopt.Optimizer(tx).init(model)
    assert isinstance(seen[0], nnx.State)
    shown = sorted("/".join(map(str, path)) for path, _ in nnx.to_flat_state(seen[0]))
    assert shown == sorted(opt.paths)
    assert "bn/mean" not in shown and "bn/scale" in shown  # batch statistics are not trained, not shown


def test_equinox_mask_over_filtered_model_and_labels() -> None:
    model = eqx_model()
    mask = jax.tree.map(lambda x: x.ndim > 1, eqx.filter(model, eqx.is_array))
    assert_same_as_raw(optax.adamw(0.1, weight_decay=0.5, mask=mask), model)
    labels = jax.tree.map(lambda x: "m" if x.ndim > 1 else "v", eqx.filter(model, eqx.is_array))
    assert_same_as_raw(optax.multi_transform({"m": optax.adam(0.1), "v": optax.sgd(0.1)}, labels), model)


def test_name_masks_keep_working_on_nested_params() -> None:
    params = linen_params()
    by_name = optax.adamw(0.1, weight_decay=0.5, mask=treeopt.mask("*kernel"))
    by_path = optax.adamw(0.1, weight_decay=0.5, mask=_flatten_dict_mask)
    a, _ = _run_treeopt(by_name, params)
    b, _ = _run_treeopt(by_path, params)
    assert_trees_close(a, b, rtol=0, atol=0)
    labels = treeopt.labels({"*bias": "fast"}, default="slow")
    tx = optax.multi_transform({"fast": optax.adam(0.1), "slow": optax.sgd(0.01, momentum=0.9)}, labels)
    assert_same_as_raw(tx, params)


# -- what treeopt stores stays keyed by name ------------------------------------


def test_state_stays_keyed_by_name_with_masked_entries() -> None:
    params = linen_params()
    tx = optax.masked(optax.adam(0.1), {"encoder": True, "norm": False, "head": True})
    opt = treeopt.Optimizer(tx).init(params)
    mu = opt.opt_state.inner_state[0].mu
    assert sorted(mu) == sorted(opt.paths)
    assert isinstance(mu["norm/scale"], optax.MaskedNode) and mu["encoder/dense/kernel"].shape == (3, 4)
    sd = opt.state_dict()
    restored = treeopt.Optimizer(tx).init(params).load_state_dict(sd)
    assert_trees_close(restored.opt_state, opt.opt_state, rtol=0, atol=0)


def test_a_changed_static_field_keeps_the_state() -> None:
    model = eqx_model()
    tx = optax.adamw(0.1, weight_decay=0.5, mask=lambda m: jax.tree.map(lambda x: x.ndim > 1, m))
    opt = treeopt.Optimizer(tx).init(model)
    model = opt.update(eqx.filter(_grads(model, 0), eqx.is_array), model)
    changed = copy.copy(model)
    object.__setattr__(changed, "depth", 3)  # a static field: another treedef, the same names
    assert jax.tree.structure(changed) != jax.tree.structure(model)
    resumed = treeopt.Optimizer(tx).init(changed).load_state_dict(opt.state_dict())
    grads = eqx.filter(_grads(model, 1), eqx.is_array)
    expected = opt.update(grads, model)
    got = resumed.update(grads, changed)
    assert got.depth == 3 and int(resumed.step) == 2
    assert_trees_close(
        jax.tree.leaves(eqx.filter(got, eqx.is_array)),
        jax.tree.leaves(eqx.filter(expected, eqx.is_array)),
        rtol=0,
        atol=0,
    )


def test_a_mask_tree_of_another_structure_is_an_error_at_init_naming_the_fix() -> None:
    params = linen_params()
    wrong = {"encoder/dense/kernel": True}  # written against treeopt's flat names, not the params
    with pytest.raises(ValueError, match=r"mask or labels tree.*treeopt\.mask"):
        treeopt.Optimizer(optax.masked(optax.adam(0.1), wrong)).init(params)


# -- optax's single-array habits -------------------------------------------------


def _quadratic(x: jax.Array) -> jax.Array:
    return jnp.sum((x - jnp.arange(4.0)) ** 2)


@pytest.mark.parametrize("which", ["lbfgs", "sophia"])
def test_function_extra_arguments_pass_through_on_a_bare_array(which: str) -> None:
    tx = optax.lbfgs() if which == "lbfgs" else optax.contrib.sophia(0.1)

    def extra(x: jax.Array, value: jax.Array, grad: jax.Array) -> dict[str, Any]:
        if which == "lbfgs":
            return {"value": value, "grad": grad, "value_fn": _quadratic}
        return {"obj_fn": _quadratic}

    @jax.jit
    def raw(x: jax.Array, state: Any) -> Any:
        value, grad = jax.value_and_grad(_quadratic)(x)
        updates, state = tx.update(grad, state, x, **extra(x, value, grad))
        return optax.apply_updates(x, updates), state

    @jax.jit
    def ours(x: jax.Array, opt: treeopt.Optimizer) -> Any:
        value, grad = jax.value_and_grad(_quadratic)(x)
        return opt.update(grad, x, **extra(x, value, grad)), opt

    x0 = jnp.zeros(4)
    x, state = x0, tx.init(x0)
    y, opt = x0, treeopt.Optimizer(tx).init(x0)
    for _ in range(3):
        x, state = raw(x, state)
        y, opt = ours(y, opt)
    assert_trees_close(y, x, rtol=RTOL, atol=1e-7)
    assert float(jnp.abs(y).max()) > 0
    value, grad = jax.value_and_grad(_quadratic)(x0)  # eagerly too
    eager = treeopt.Optimizer(tx).init(x0).update(grad, x0, **extra(x0, value, grad))
    assert eager.shape == (4,)


def test_a_single_partition_spec_for_bare_array_params() -> None:
    from jax.sharding import PartitionSpec as P

    from treeopt import partitioning

    params = jnp.zeros(16)
    mesh = device_mesh((8,), ("data",), "default")
    opt = treeopt.Optimizer(optax.adam(1e-3)).init(params)
    assert partitioning.param_specs_of(params) == P()
    assert opt.partition_specs(P("data")).opt_state[0].mu[""] == P("data")
    shardings = partitioning.optimizer_shardings(opt, P(), mesh)
    assert shardings.opt_state[0].mu[""].spec == P()
    placed = partitioning.init_sharded(treeopt.Optimizer(optax.adam(1e-3)), params, mesh, P())
    assert placed.opt_state[0].mu[""].sharding.mesh.shape == mesh.shape
    with pytest.raises(TypeError, match="single"):
        opt2 = treeopt.Optimizer(optax.adam(1e-3)).init({"w": params})
        opt2.partition_specs(P("data"))


def test_whole_leaf_calls_are_named_by_the_gradient_they_compute_from() -> None:
    """Eleven layers of one shape: the view meets them 0, 1, 2, ..., 10, the flat dict's keys 0, 1, 10, 2, ..."""
    from treeopt._sharding.ownership import analysis
    from treeopt._sharding.whole_leaf import collected
    from treeopt._step.viewed import over_names
    from treeopt._tree.layout import ParamLayout

    params = {"layers": [jnp.full((8, 4), float(i + 1)) for i in range(11)]}
    layout = ParamLayout.of(params)
    keys = jax.random.split(jax.random.key(1), 11)
    flat = {f"layers/{i}": jax.random.normal(keys[i], (8, 4)) for i in range(11)}
    tx = over_names(optax.contrib.muon(1e-2), layout)
    with collected() as calls:
        tx.update(flat, tx.init(flat), flat)
    names = [found.param for found in analysis(tx, flat, tx.init(flat), flat, {})]
    assert sorted(names) == sorted(flat)
    for call, name in zip(calls, names, strict=True):  # each call computes from its own param's gradient
        ratio = np.asarray(call.leaf) / np.asarray(flat[name])
        np.testing.assert_allclose(ratio, ratio.flat[0], rtol=1e-5)
