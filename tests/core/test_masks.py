"""Masks and labels from names: the same callable works on treeopt's flat dict and on nested trees."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from hypothesis import given, settings
from hypothesis import strategies as st

import treeopt

PARAMS = {
    "encoder": {"layers_0": {"kernel": jnp.ones((2, 2)), "bias": jnp.ones(2)}},
    "decoder": {"layers_0": {"kernel": jnp.ones((2, 2)), "bias": jnp.ones(2)}},
    "embed": jnp.ones((3, 2)),
}


def test_glob_mask_on_nested_and_flat():
    kernels = treeopt.mask("*kernel")
    nested = kernels(PARAMS)
    assert nested["encoder"]["layers_0"] == {"kernel": True, "bias": False}
    assert nested["embed"] is False
    flat = kernels({"encoder/layers_0/kernel": 1.0, "embed": 2.0})
    assert flat == {"encoder/layers_0/kernel": True, "embed": False}


def test_regex_mask_and_invert():
    not_encoder = treeopt.mask(r"^encoder/", regex=True, invert=True)
    out = not_encoder(PARAMS)
    assert out["encoder"]["layers_0"]["kernel"] is False
    assert out["decoder"]["layers_0"]["kernel"] is True


def test_labels_first_rule_wins_and_default():
    label = treeopt.labels([("encoder/*", "frozen"), ("*kernel", "decay")], default="plain")
    out = label(PARAMS)
    assert out["encoder"]["layers_0"]["kernel"] == "frozen"
    assert out["decoder"]["layers_0"]["kernel"] == "decay"
    assert out["decoder"]["layers_0"]["bias"] == "plain"


def test_adamw_mask_by_name_matches_raw_optax():
    make = lambda: optax.adamw(0.1, weight_decay=0.5, mask=treeopt.mask("*kernel"))  # noqa: E731
    grads = jax.tree.map(jnp.ones_like, PARAMS)
    tx = make()
    updates, _ = tx.update(grads, tx.init(PARAMS), PARAMS)
    expected = optax.apply_updates(PARAMS, updates)
    got = treeopt.Optimizer(make()).init(PARAMS).update(grads, PARAMS)
    # treeopt's eager update runs compiled, raw optax op by op: allow float rounding.
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6)


def test_freezing_by_name_with_multi_transform():
    tx = optax.multi_transform(
        {"train": optax.sgd(0.1), "frozen": optax.set_to_zero()},
        treeopt.labels({"encoder/*": "frozen"}, default="train"),
    )
    opt = treeopt.Optimizer(tx).init(PARAMS)
    new = opt.update(jax.tree.map(jnp.ones_like, PARAMS), PARAMS)
    np.testing.assert_array_equal(new["encoder"]["layers_0"]["kernel"], 1.0)
    np.testing.assert_allclose(new["decoder"]["layers_0"]["kernel"], 0.9)


@settings(max_examples=50, deadline=None)
@given(
    names=st.lists(st.from_regex(r"[a-z]{1,3}(/[a-z0-9]{1,3}){0,2}", fullmatch=True), max_size=6),
    pattern=st.from_regex(r"[a-z*]{1,4}", fullmatch=True),
)
def test_mask_and_its_inverse_partition_every_name(names, pattern):
    flat = {n: 0.0 for n in names}
    yes, no = treeopt.mask(pattern)(flat), treeopt.mask(pattern, invert=True)(flat)
    assert all(yes[n] != no[n] for n in flat)


def test_mask_given_to_inject_hyperparams_without_static_args_is_an_error():
    tx = optax.inject_hyperparams(optax.adamw)(learning_rate=0.1, mask=treeopt.mask("*kernel"))
    try:
        tx.init(PARAMS)
    except TypeError as error:
        assert "static_args='mask'" in str(error)
    else:
        raise AssertionError("a mask taken for a schedule must not pass silently")
    fixed = optax.inject_hyperparams(optax.adamw, static_args="mask")(
        learning_rate=0.1, mask=treeopt.mask("*kernel")
    )
    opt = treeopt.Optimizer(fixed).init(PARAMS)
    new = opt.update(jax.tree.map(jnp.zeros_like, PARAMS), PARAMS)  # decay only
    assert float(new["encoder"]["layers_0"]["kernel"][0, 0]) < 1.0 and float(new["embed"][0, 0]) == 1.0


def test_params_that_are_one_bare_array_are_named_and_trained():
    # Its only name is "": it must not be taken for the step count inject_hyperparams passes.
    params = jnp.float32(2.0)
    tx = optax.masked(optax.sgd(0.5), treeopt.mask("*"))
    opt = treeopt.Optimizer(tx).init(params)
    assert opt.paths == ("",)
    assert float(opt.update(jnp.float32(1.0), params)) == 1.5
    assert treeopt.labels({"*": "all"})(jnp.ones(3)) == "all"


def test_regex_is_searched_anywhere_in_the_name_glob_matches_the_whole_name():
    names = {"dense/kernel": 0.0, "kernel_init/bias": 0.0, "out/kernel/scale": 0.0}
    # A regular expression may match anywhere: "kernel$" finds the name's end, not its start.
    assert treeopt.mask(r"kernel$", regex=True)(names) == {
        "dense/kernel": True,
        "kernel_init/bias": False,
        "out/kernel/scale": False,
    }
    assert treeopt.mask(r"/kernel", regex=True)(names)["out/kernel/scale"]
    # A glob must match the whole name: "kernel" alone is no name here.
    assert not any(treeopt.mask("kernel")(names).values())
    assert treeopt.mask("*/kernel")(names) == {
        "dense/kernel": True,
        "kernel_init/bias": False,
        "out/kernel/scale": False,
    }
    assert treeopt.name_matcher("kernel*")("kernel_init/bias")
    assert not treeopt.name_matcher("kernel*")("dense/kernel")
