"""Sharded everywhere: faces x precisions x state bits x mesh axis types x placements, on 8 virtual devices.

Each cell builds one optimizer through one face (the core ``treeopt.Optimizer``,
the ``treeopt.nnx`` drop-in, or ``treeopt.t5x``'s ``OptaxWrapper``) on a mesh
of ``data=4 x model=2`` and checks, against the same face unsharded:

- two jitted steps with the same gradients give the same params and state
  (floats within one float32 ulp, rtol 1e-6: XLA may fuse a multiply-add
  otherwise in two programs; codes, counts and keys bit for bit: the
  arithmetic is elementwise, and blocks follow shapes, not shards);
- the params keep the sharding they came in with, the state its own;
- a checkpoint restores onto the mesh, values and shardings;
- a warm start across state bits (8 -> 4 -> full -> 8) gives the values it
  gives unsharded, placed on the target's shardings.

The params: a kernel split by columns over ``model`` (its 8-bit blocks of 256
cut by the model shards of 128), one split by rows (ZeRO's ``data`` joins
``model`` there), and a bias. The full product (225 valid cells) is too slow
for CI: :data:`CELLS` covers every pair of values of two factors that a face
allows (``treeopt.t5x`` has no ``master_dtype``, ``param_rounding`` or
``state_bits``), and :func:`test_every_pair_of_factors_has_a_cell` fails when
a pair, or a new factor value, has none.
"""

from __future__ import annotations

import itertools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import treeopt
import treeopt.nnx
from treeopt.partitioning import init_sharded, named_shardings, optimizer_shardings
from treeopt.t5x import optimizers as t5x_optimizers

from _helpers import device_mesh

pytestmark = pytest.mark.slow

FACES = ("core", "nnx", "t5x")
PRECISIONS = ("float32", "master", "kahan", "stochastic")
BITS = (None, 8, 4)
# "default": as a new user writes it, JAX's own axis types (explicit in current JAX).
MESHES = ("auto", "explicit", "default")
PLACEMENTS = ("replicated", "zero", "model+zero")
FACTORS = {"face": FACES, "precision": PRECISIONS, "bits": BITS, "mesh": MESHES, "placement": PLACEMENTS}

# (face, precision, bits, mesh, placement): every valid pair of factor values in at least one cell.
CELLS = [
    # ZeRO with 8-bit state and Kahan-rounded bfloat16 params, on every mesh kind
    ("core", "kahan", 8, "auto", "zero"),
    ("core", "kahan", 8, "explicit", "zero"),
    ("core", "kahan", 8, "default", "zero"),
    # 8-bit blocks cut by the model shards, and ZeRO joining "model" on the rows, on explicit axes
    ("core", "master", 8, "explicit", "model+zero"),
    ("core", "stochastic", None, "explicit", "replicated"),
    ("core", "master", 4, "default", "zero"),
    ("core", "float32", 8, "auto", "replicated"),
    ("core", "kahan", None, "default", "model+zero"),
    ("nnx", "master", None, "auto", "replicated"),
    ("nnx", "stochastic", 4, "default", "model+zero"),
    ("nnx", "float32", 4, "explicit", "zero"),
    ("nnx", "kahan", 4, "auto", "replicated"),
    ("nnx", "stochastic", 8, "auto", "zero"),
    # 4-bit scales of model-sharded params on auto axes: the drop-in keeps the state's layout across nnx.jit
    ("nnx", "master", 4, "auto", "model+zero"),
    ("t5x", "float32", None, "default", "replicated"),
    ("t5x", "float32", None, "auto", "model+zero"),
    ("t5x", "float32", None, "explicit", "zero"),
]

SHAPES = {"up": (32, 256), "down": (256, 32), "bias": (256,)}
MODEL_SPECS = {"up": P(None, "model"), "down": P("model", None), "bias": P("model")}
T5X_AXES = {"up": P("embed", "mlp"), "down": P("mlp", "embed"), "bias": P("mlp")}
T5X_RULES = {  # T5X's logical axis rules: "mlp" on the model axis only where the placement shards it
    "replicated": [("batch", "data"), ("embed", None), ("mlp", None)],
    "zero": [("batch", "data"), ("embed", None), ("mlp", None)],
    "model+zero": [("batch", "data"), ("embed", None), ("mlp", "model")],
}
STEPS = 2


def valid(face, precision, bits):
    return face != "t5x" or (precision == "float32" and bits is None)


def test_every_pair_of_factors_has_a_cell():
    names = list(FACTORS)
    cells = [dict(zip(names, cell, strict=True)) for cell in CELLS]
    for cell in cells:
        for name, value in cell.items():
            assert value in FACTORS[name], (name, value)
        assert valid(cell["face"], cell["precision"], cell["bits"]), cell
    for a, b in itertools.combinations(names, 2):
        for x, y in itertools.product(FACTORS[a], FACTORS[b]):
            possible = any(
                valid(**{k: v for k, v in full.items() if k in ("face", "precision", "bits")})
                for full in (dict(zip(names, c, strict=True)) for c in itertools.product(*FACTORS.values()))
                if full[a] == x and full[b] == y
            )
            if possible:
                assert any(c[a] == x and c[b] == y for c in cells), f"no cell has {a}={x!r} and {b}={y!r}"


def is_explicit(mesh):
    return any(t == AxisType.Explicit for t in mesh.axis_types)


def param_specs(placement):
    return MODEL_SPECS if placement == "model+zero" else {name: P() for name in SHAPES}


def make_params(dtype):
    keys = iter(jax.random.split(jax.random.key(0), len(SHAPES)))
    return {
        name: (0.2 * jax.random.normal(next(keys), shape)).astype(dtype) for name, shape in SHAPES.items()
    }


def grads_at(params, i):
    return {name: jnp.sin(p.astype(jnp.float32) * (i + 2.0)).astype(p.dtype) for name, p in params.items()}


def options(precision, bits):
    out = {"state_bits": bits}
    if precision == "master":
        out["master_dtype"] = jnp.float32
    elif precision in ("kahan", "stochastic"):
        out["param_rounding"] = precision
    return out


def tx():
    return optax.adamw(1e-2, weight_decay=1e-3)


# -- the faces: each builds, steps, saves and restores its optimizer ------------------------------


class Model(nnx.Module):
    def __init__(self, params):
        for name, value in params.items():
            setattr(self, name, nnx.Param(value))


class Face:
    """One face's optimizer: ``params()`` and ``core()`` read it; ``step(grads)`` takes a jitted step."""

    def __init__(self, face, precision, bits, mesh, placement, transformation):
        self.face, self.mesh, self.placement = face, mesh, placement
        self.specs = param_specs(placement)
        self.zero = "data" if placement != "replicated" else None
        dtype = jnp.float32 if precision == "float32" else jnp.bfloat16
        params = make_params(dtype)
        self.param_shardings = named_shardings(self.specs, mesh) if mesh is not None else None
        placed = jax.device_put(params, self.param_shardings) if mesh is not None else params
        if face == "core":
            opt = treeopt.Optimizer(transformation, **options(precision, bits))
            self.opt = (
                init_sharded(opt, placed, mesh, self.specs, shard_state_over=self.zero)
                if mesh
                else opt.init(params)
            )
            self.state = placed
        elif face == "nnx":
            self.model = Model(placed)
            self.opt = treeopt.nnx.Optimizer(
                self.model, transformation, wrt=nnx.Param, **options(precision, bits)
            )
            if mesh is not None:
                core = self.optimizer()
                shardings = optimizer_shardings(core, self.specs, mesh, shard_state_over=self.zero)
                self.opt.treeopt.set_value(jax.device_put(core, shardings))
        else:
            self.opt_def = t5x_optimizers.OptaxWrapper(transformation)
            if mesh is None:
                self.opt = self.opt_def.create(params)
            else:
                abstract = jax.eval_shape(self.opt_def.create, params)
                rules = T5X_RULES[placement]
                logical = self.opt_def.derive_logical_axes(
                    abstract, T5X_AXES, shard_state_over="batch" if self.zero else None,
                    mesh=mesh if self.zero else None, logical_axis_rules=rules if self.zero else None,
                )  # fmt: skip
                self.t5x_shardings = jax.tree.map(
                    lambda s: NamedSharding(mesh, P() if s is None else nn.logical_to_mesh_axes(s, rules)),
                    logical,
                    is_leaf=lambda s: s is None or isinstance(s, P),
                )
                self.opt = jax.jit(self.opt_def.create, out_shardings=self.t5x_shardings)(placed)

    def params(self):
        if self.face == "core":
            return self.state
        if self.face == "nnx":
            return {name: getattr(self.model, name)[...] for name in SHAPES}
        return dict(self.opt.target)

    def optimizer(self):
        """The core optimizer (core and nnx faces)."""
        return self.opt if self.face == "core" else self.opt.treeopt.get_value()

    def step(self, i):
        grads = grads_at(self.params(), i)
        if self.param_shardings is not None:
            grads = jax.device_put(grads, self.param_shardings)
        if self.face == "core":
            out_shardings = None
            if self.mesh is not None and not is_explicit(self.mesh):  # auto axes: jit's out_shardings decide
                out_shardings = (
                    self.param_shardings,
                    optimizer_shardings(self.opt, self.specs, self.mesh, shard_state_over=self.zero),
                )
            step = jax.jit(lambda p, o, g: (o.update(g, p), o), out_shardings=out_shardings)
            self.state, self.opt = step(self.state, self.opt, grads)
        elif self.face == "nnx":
            grads = {name: nnx.Param(g) for name, g in grads.items()}
            nnx.jit(lambda m, o, g: o.update(m, g))(self.model, self.opt, grads)
        else:
            shardings = getattr(self, "t5x_shardings", None)
            if self.mesh is not None and is_explicit(self.mesh):
                shardings = None  # the types carry the layouts: the target must keep its own
            step = jax.jit(lambda o, g: o.apply_gradient(g), out_shardings=shardings)
            self.opt = step(self.opt, grads)

    def values(self):
        """Everything a step changes, as plain arrays: params and the state's state dict."""
        state = self.opt.state_dict() if self.face == "t5x" else self.optimizer().state_dict()
        return jax.tree.map(np.asarray, (self.params(), state))


def assert_same(got, want):
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want), strict=True):
        where = jax.tree_util.keystr(path)
        if np.issubdtype(a.dtype, np.floating) or a.dtype == jnp.bfloat16:
            np.testing.assert_allclose(
                a.astype(np.float64), b.astype(np.float64), rtol=1e-6, atol=1e-8, err_msg=where
            )
        else:
            np.testing.assert_array_equal(a, b, err_msg=where)


def assert_on(tree, shardings):
    for leaf, sharding in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings), strict=True):
        assert leaf.sharding.is_equivalent_to(sharding, leaf.ndim), (leaf.shape, leaf.sharding, sharding)


@pytest.mark.parametrize(("face", "precision", "bits", "mesh", "placement"), CELLS)
def test_cell(face, precision, bits, mesh, placement, tmp_path):
    transformation = tx()  # one object: shardings and restores compare the optimizers' static data
    the_mesh = device_mesh((4, 2), ("data", "model"), mesh)
    sharded = Face(face, precision, bits, the_mesh, placement, transformation)
    plain = Face(face, precision, bits, None, placement, transformation)
    with jax.set_mesh(sharded.mesh):
        for i in range(STEPS):
            sharded.step(i)
    for i in range(STEPS):
        plain.step(i)
    assert_same(sharded.values(), plain.values())
    assert_on(sharded.params(), sharded.param_shardings)  # the params kept their layout
    if face == "t5x":
        assert_on(sharded.opt.state, sharded.t5x_shardings.state)
        return  # no low-bit state, no core checkpoint: T5X's checkpointer saves its own state dict

    core = sharded.optimizer()
    shardings = optimizer_shardings(core, sharded.specs, sharded.mesh, shard_state_over=sharded.zero)
    assert_on(core, shardings)  # the state kept its own
    if sharded.zero and bits is None:
        assert "data" in str(core.opt_state[0].mu["down"].sharding.spec)

    treeopt.checkpoint.save(tmp_path / "ckpt", sharded.opt)
    abstract = jax.eval_shape(lambda: core)
    restored = treeopt.checkpoint.restore(tmp_path / "ckpt", abstract, shardings=shardings)
    assert_on(restored, shardings)
    assert_same(jax.tree.map(np.asarray, restored.state_dict()), jax.tree.map(np.asarray, core.state_dict()))

    other = {None: 8, 8: 4, 4: None}[bits]  # the next in 8 -> 4 -> full -> 8
    target_opt = treeopt.Optimizer(transformation, **options(precision, other))
    target = init_sharded(
        target_opt, sharded.params(), sharded.mesh, sharded.specs, shard_state_over=sharded.zero
    )
    warm, _ = treeopt.serialization.warm_start(target, core)
    want, _ = treeopt.serialization.warm_start(target_opt.init(plain.params()), plain.optimizer())
    assert_same(jax.tree.map(np.asarray, warm.state_dict()), jax.tree.map(np.asarray, want.state_dict()))
    assert_on(warm, optimizer_shardings(target, sharded.specs, sharded.mesh, shard_state_over=sharded.zero))
