"""A ``wrt=(name, leaf)`` predicate is asked about array leaves only.

An equinox model holds functions (``MLP``'s ``activation`` is a
``custom_jvp``), and modules may hold Python numbers or strings: those are
never trained, so the predicate never sees them, as a glob skips them. The
recipes of docs/optimizer.md ("train everything but a sub-tree") run as
written on an equinox model.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

import treeopt


class Net(eqx.Module):
    encoder: eqx.nn.MLP
    norm: eqx.nn.LayerNorm
    head: eqx.nn.Linear
    scale: float = 2.0
    name: str = eqx.field(static=False, default="net")

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.encoder = eqx.nn.MLP(3, 4, 8, 1, key=k1)
        self.norm = eqx.nn.LayerNorm(4)
        self.head = eqx.nn.Linear(4, 2, key=k2)

    def __call__(self, x):
        return self.head(self.norm(self.encoder(x))) * self.scale


def test_predicate_sees_only_arrays():
    model = Net(jax.random.key(0))
    seen = []

    def everything_but_the_encoder(name, leaf):
        seen.append((name, type(leaf)))
        assert hasattr(leaf, "shape"), name  # never a function, a float or a string
        return not name.startswith("encoder/")

    opt = treeopt.Optimizer(optax.adam(1e-3), wrt=everything_but_the_encoder).init(model)
    assert sorted(opt.paths) == ["head/bias", "head/weight", "norm/bias", "norm/weight"]
    names = {name for name, _ in seen}
    assert "encoder/activation" not in names and "scale" not in names and "name" not in names
    assert "encoder/layers/0/weight" in names


def test_the_docs_recipe_trains_all_but_a_subtree_of_an_equinox_model():
    model = Net(jax.random.key(0))
    frozen = treeopt.name_matcher("head/*")  # the encoder's activation functions are outside it
    opt = treeopt.Optimizer(optax.adam(1e-2), wrt=lambda name, leaf: not frozen(name)).init(model)
    x = jnp.ones((3,))
    grads = eqx.filter_grad(lambda m: jnp.sum(m(x) ** 2))(model)
    new = opt.update(grads, model)
    assert all(a is b for a, b in zip(jax.tree.leaves(new.head), jax.tree.leaves(model.head), strict=True))
    assert not jnp.array_equal(new.encoder.layers[0].weight, model.encoder.layers[0].weight)
    assert new.encoder.activation is model.encoder.activation and new.scale == model.scale


def test_a_glob_and_a_predicate_select_the_same_leaves():
    model = Net(jax.random.key(0))
    by_glob = treeopt.Optimizer(optax.sgd(0.1), wrt="encoder/*").init(model)
    by_predicate = treeopt.Optimizer(optax.sgd(0.1), wrt=lambda name, leaf: name.startswith("encoder/")).init(
        model
    )
    assert by_glob.paths == by_predicate.paths
    assert "encoder/activation" not in by_predicate.paths
