"""The block-wise low-bit codec: maps, layouts, error bounds, the zero point, adversarial blocks, formats."""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from treeopt._lowbit import codec as lowbit
from treeopt._lowbit import maps as lowbit_maps
from treeopt._lowbit.codec import (
    Format,
    QuantizedLeaf,
    block_layout,
    block_maxima,
    bytes_of,
    codes_shape,
    constant,
    dequantize,
    encode_with,
    is_quantized,
    scales_shape,
)
from treeopt._lowbit.codec import quantize as quantize_eagerly

from _helpers import x64

# One compiled program per shape and format (eagerly, the codec would compile op by op).
quantize = jax.jit(quantize_eagerly, static_argnums=1, static_argnames=("signed", "fmt"))

MAPS = [(8, True), (8, False), (4, True), (4, False)]


def _sorted_levels(bits, signed):
    return np.unique(lowbit_maps.levels(bits, signed).astype(np.float64))


def _bound(bits, signed):
    """|x - decoded| <= bound * (the block maximum): half the widest gap between levels (from 0 unsigned)."""
    levels = _sorted_levels(bits, signed)
    if not signed:
        levels = np.concatenate([[0.0], levels])
    return float(np.max(np.diff(levels))) / 2 if signed else float(np.max(np.diff(levels)))


def _blocks(x, q):
    """``x`` cut as ``q`` cuts it: ``(..., blocks, block)``, NaN-padded."""
    fmt = q.format
    rows = np.asarray(x, np.float64).reshape((*q.shape[: fmt.axis], -1)) if q.shape else np.asarray(x).reshape(1)
    n = -(-rows.shape[-1] // fmt.block)
    padded = np.full((*rows.shape[:-1], n * fmt.block), np.nan)
    padded[..., : rows.shape[-1]] = rows
    return padded.reshape((*rows.shape[:-1], n, fmt.block))


shapes = st.lists(st.integers(1, 9), min_size=0, max_size=2).flatmap(
    lambda lead: st.integers(1, 600).map(lambda last: (*lead, last))
)


@settings(max_examples=12, deadline=None)
@given(shape=shapes, map_=st.sampled_from(MAPS), seed=st.integers(0, 2**31))
def test_round_trip_error_is_within_the_map_bound_of_each_block(shape, map_, seed):
    bits, signed = map_
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(np.float32) * 10.0 ** rng.uniform(-3, 3, shape).astype(np.float32)
    x = x if signed else np.abs(x)
    q = quantize(jnp.asarray(x), bits, signed=signed)
    decoded = np.asarray(q.dequantize())
    assert decoded.shape == x.shape and decoded.dtype == np.float32
    err, ref = _blocks(np.abs(decoded - x), q), _blocks(x, q)
    absmax = np.nanmax(np.abs(ref), axis=-1, keepdims=True)
    assert np.all(np.nan_to_num(err) <= _bound(bits, signed) * absmax * (1 + 1e-5))


@pytest.mark.parametrize(("bits", "signed"), MAPS)
def test_every_code_is_the_nearest_level_found_by_brute_force(bits, signed):
    k1, k2 = jax.random.split(jax.random.key(bits + 2 * signed))
    uniform = jax.random.uniform(k1, (20_000,), minval=-1.0, maxval=1.0)
    spread = jnp.exp(jax.random.uniform(k2, (20_000,), minval=-30.0, maxval=0.0)) * jnp.sign(uniform)
    levels = _sorted_levels(bits, signed)
    edges = np.concatenate([levels, (levels[1:] + levels[:-1]) / 2, [0.0, 1.0, -1.0, 1e-9, 2.0**-7]])
    y = jnp.concatenate([uniform, spread, jnp.asarray(edges, jnp.float32)])
    y = jnp.clip(y if signed else jnp.abs(y), -1.0, 1.0)
    table = jnp.asarray(lowbit_maps.levels(bits, signed))
    codes = lowbit_maps.encode(y, bits, signed)
    assert int(codes.min()) >= 0 and int(codes.max()) < 2**bits
    chosen = jnp.abs(table[codes] - y)
    best = jnp.min(jnp.abs(table[None, :] - y[:, None]), axis=1)
    # The nearest level; within float32 rounding of a midpoint, either neighbour.
    np.testing.assert_array_less(chosen - best, 2.4e-7)
    assert float(jnp.mean((chosen > best).astype(jnp.float32))) < 1e-3


@pytest.mark.parametrize(("bits", "signed"), MAPS)
def test_the_maps_are_sorted_and_reach_one_exactly(bits, signed):
    table = lowbit_maps.levels(bits, signed)
    magnitudes = table[: 2**bits // 2] if (bits, signed) == (8, True) else table
    if (bits, signed) == (4, True):
        magnitudes = table[7:]
        assert table[0] == -1.0 and np.all(np.diff(table) > 0)
    assert np.all(np.diff(magnitudes) > 0)
    assert float(np.max(table)) == 1.0


def test_the_signed_maps_keep_exact_zero_and_plus_minus_one_and_waste_no_code():
    for bits in (8, 4):
        x = jnp.asarray([[0.0, 1.0, -1.0, 0.5] * 64])
        np.testing.assert_array_equal(quantize(x, bits).dequantize()[0, :3], [0.0, 1.0, -1.0])
    table = lowbit_maps.levels(4, True)
    assert len(np.unique(table)) == 16  # every 4-bit code its own level


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_unsigned_blocks_never_decode_a_positive_value_to_zero(bits, dtype):
    x = jnp.asarray(np.geomspace(1e-12, 1.0, 256), dtype)  # one block spanning twelve decades
    decoded = quantize(x, bits, signed=False).dequantize()
    assert decoded.dtype == dtype and bool(jnp.all(decoded > 0))


def test_a_float16_second_moment_is_not_floored_at_float16s_smallest_normal():
    # Values below float16's smallest normal (6.1e-5) are subnormal but representable: they keep their size.
    x = jnp.full((256,), 1e-5, jnp.float16).at[0].set(2e-5)
    decoded = quantize(x, 8, signed=False).dequantize()
    np.testing.assert_allclose(np.asarray(decoded[1:], np.float32), 1e-5, rtol=0.05)


def test_a_float64_moment_beyond_the_float32_range_stays_finite():
    with x64():
        x = jnp.asarray(np.linspace(1e300, 2e300, 4096), jnp.float64)
        q = quantize(x, 8, signed=False)
        assert q.scales.dtype == jnp.float64
        decoded = q.dequantize()
        assert decoded.dtype == jnp.float64 and bool(jnp.all(jnp.isfinite(decoded)))
        np.testing.assert_allclose(np.asarray(decoded), np.asarray(x), rtol=0.04)


@pytest.mark.parametrize(("bits", "signed"), MAPS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_all_zero_blocks_decode_to_exact_zeros(bits, signed, dtype):
    x = jnp.zeros((3, 256), dtype).at[1].set(jnp.linspace(0.1, 1.0, 256).astype(dtype))
    decoded = quantize(x, bits, signed=signed).dequantize()
    assert bool(jnp.all(decoded[0] == 0)) and bool(jnp.all(decoded[2] == 0))


def _assert_other_blocks_untouched(clean, dirty, changed_rows):
    """Blocks of rows other than ``changed_rows`` keep their codes and scales bit for bit."""
    rows = lambda a: np.delete(np.asarray(a), changed_rows, axis=0)  # noqa: E731
    np.testing.assert_array_equal(rows(clean.codes), rows(dirty.codes))
    np.testing.assert_array_equal(rows(clean.scales), rows(dirty.scales))


@pytest.mark.parametrize("bits", [8, 4])
def test_one_huge_value_stays_in_its_block_and_decodes_exactly(bits):
    x = jax.random.normal(jax.random.key(0), (4, 512))
    clean, dirty = quantize(x, bits), quantize(x.at[2, 17].set(3e38), bits)
    assert clean.format.axis == 1  # blocks within rows: the other rows' blocks are other blocks
    _assert_other_blocks_untouched(clean, dirty, [2])
    decoded = dirty.dequantize()
    assert float(decoded[2, 17]) == pytest.approx(3e38, rel=1e-7)
    assert bool(jnp.all(jnp.isfinite(decoded)))


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nan_and_inf_turn_their_block_to_nan_and_no_other(bits, bad):
    x = jax.random.normal(jax.random.key(1), (4, 512))
    clean, dirty = quantize(x, bits), quantize(x.at[1, 5].set(bad), bits)
    block = clean.format.block
    decoded = dirty.dequantize()
    assert bool(jnp.all(jnp.isnan(decoded[1, :block])))
    assert bool(jnp.all(jnp.isfinite(decoded[1, block:])))
    _assert_other_blocks_untouched(clean, dirty, [1])


@pytest.mark.parametrize("bits", [8, 4])
def test_denormals_decode_finite_and_never_negative(bits):
    tiny = np.float32(np.finfo(np.float32).smallest_subnormal)
    # Row 1: denormals with a normal maximum in every block of 64 (blocks are 128 or 256 long).
    x = jnp.asarray(np.array([[tiny * k for k in range(1, 257)], ([1e-39] * 63 + [1.0]) * 4], np.float32))
    decoded = quantize(x, bits, signed=False).dequantize()
    assert bool(jnp.all(jnp.isfinite(decoded))) and bool(jnp.all(decoded >= 0))
    assert bool(jnp.all(decoded[1] > 0))  # a normal scale: never 0
    signed = quantize(-x, bits).dequantize()
    assert bool(jnp.all(jnp.isfinite(signed))) and bool(jnp.all(signed <= 0))


@pytest.mark.parametrize("bits", [8, 4])
def test_jit_traces_and_matches_eager_bit_for_bit(bits):
    x = jax.random.normal(jax.random.key(2), (8, 300))
    eager = quantize_eagerly(x, bits)
    jitted = quantize(x, bits)
    np.testing.assert_array_equal(eager.codes, jitted.codes)
    np.testing.assert_array_equal(eager.scales, jitted.scales)
    np.testing.assert_array_equal(eager.dequantize(), jax.jit(dequantize)(jitted))


@pytest.mark.parametrize("shape", [(3, 7), (5,), (2, 3, 5), (1,), (4097,), (2, 129)])
@pytest.mark.parametrize("bits", [8, 4])
def test_odd_shapes_round_trip_codes_exactly(shape, bits):
    x = jax.random.normal(jax.random.key(3), shape)
    q = quantize(x, bits)
    again = encode_with(q.dequantize(), q.scales, q.format)  # decoded values are levels: same codes
    np.testing.assert_array_equal(again.codes, q.codes)
    assert q.codes.shape == codes_shape(shape, q.format) and q.scales.shape == scales_shape(shape, q.format)


def test_0d_1d_and_empty_arrays():
    for bits in (8, 4):
        q = quantize(jnp.float32(-2.5), bits)
        assert q.shape == () and q.codes.shape == () and float(q.dequantize()) == -2.5
        assert quantize(jnp.arange(5.0), bits).dequantize().shape == (5,)


@pytest.mark.parametrize(
    ("shape", "bits", "expected"),
    [
        ((1024, 4096), 8, (1, 256)),
        ((128, 64), 8, (0, 256)),
        ((64, 4, 64), 8, (1, 256)),
        ((8192, 1), 8, (0, 256)),
        ((96, 96), 8, (0, 256)),
        ((1000, 150), 8, (0, 240)),
        ((128, 64), 4, (0, 128)),
        ((8192, 1), 4, (0, 128)),
    ],
)
def test_block_layout_spans_rows_when_the_last_axis_is_short(shape, bits, expected):
    assert block_layout(shape, bits) == expected


@settings(max_examples=60, deadline=None)
@given(
    shape=st.lists(st.integers(1, 5000), min_size=1, max_size=3).filter(
        lambda s: 4096 <= math.prod(s) <= 2**22
    ),
    bits=st.sampled_from([8, 4]),
)
def test_every_leaf_of_4096_elements_or_more_meets_the_bytes_target(shape, bits):
    """Adam holds two such leaves: <= 2.05 B/param at 8 bits, <= 1.07 at 4."""
    fmt = Format(bits, True, *block_layout(shape, bits))
    codes = math.prod(codes_shape(shape, fmt)) * 1
    scales = math.prod(scales_shape(shape, fmt)) * 4
    assert 2 * (codes + scales) / math.prod(shape) <= (2.05 if bits == 8 else 1.07)


def test_bytes_of_counts_codes_and_scales():
    x = jnp.zeros((1024, 1024))
    assert bytes_of(quantize(x, 8)) == 1024 * 1024 + 4 * 1024 * 4
    assert bytes_of(quantize(x, 4)) == 1024 * 1024 // 2 + 4 * 1024 * 8
    assert bytes_of(x) == 4 * 1024 * 1024


def test_a_quantized_leaf_is_a_pytree_of_codes_and_scales_keeping_its_format():
    q = quantize(jnp.ones((16, 300)), 4, signed=False)
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(q)[0]]
    assert paths == [".codes", ".scales"]
    back = jax.jit(lambda q: q)(q)
    assert is_quantized(back) and back.format == q.format and back.shape == q.shape
    abstract = jax.eval_shape(lambda x: quantize(x, 8), jnp.ones((16, 300)))
    assert abstract.format.bits == 8 and abstract.codes.shape == (16, 300)
    assert isinstance(jax.tree.map(lambda a: a, q), QuantizedLeaf)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_narrow_inputs_decode_to_their_own_dtype(dtype):
    x = jnp.linspace(-1, 1, 512, dtype=dtype)
    decoded = quantize(x, 8).dequantize()
    assert decoded.dtype == dtype
    np.testing.assert_allclose(np.asarray(decoded, np.float32), np.asarray(x, np.float32), atol=0.01)


def test_bad_bits_and_non_float_inputs_are_refused():
    with pytest.raises(ValueError, match="bits must be 8 or 4"):
        quantize(jnp.ones(4), 16)
    with pytest.raises(TypeError, match="floating-point"):
        quantize(jnp.ones(4, jnp.int32), 8)


def test_the_format_entry_round_trips_and_an_unknown_one_is_refused():
    fmt = Format(4, False, 1, 128)
    assert Format.from_entry(fmt.entry()) == fmt
    with pytest.raises(ValueError, match="unknown low-bit format"):
        Format.from_entry(np.array([9, 8, 1, 0, 256]))


@pytest.mark.parametrize(
    ("entry", "why"),
    [
        ([2, 8, 1, 1, 0], "block 0, expected 1 to 256 elements at 8 bits"),
        ([2, 8, 1, 1, -256], "block -256, expected 1 to 256 elements at 8 bits"),
        ([2, 4, 1, 1, 256], "block 256, expected 1 to 128 elements at 4 bits"),
        ([2, 8, 1, -1, 256], "axis -1, expected 0 or more"),
        ([2, 8, 2, 0, 256], "signed 2, expected 0 or 1"),
        ([2, 16, 1, 0, 256], "bits 16, expected 8 or 4"),
    ],
)
def test_a_format_entry_no_layout_makes_is_refused_saying_why(entry, why):
    with pytest.raises(ValueError, match=re.escape(f"low-bit format {entry} is not valid: {why}")):
        Format.from_entry(np.array(entry))
    assert lowbit.describe_entry(np.array(entry)) == f"format {entry} (not valid: {why})"


def test_a_format_says_why_it_cannot_describe_a_leaf():
    fmt = Format(8, True, *block_layout((64, 512), 8))
    assert fmt.misfit((64, 512), (64, 512), (64, 2)) is None
    assert fmt.misfit((64, 512), (64, 512), (64, 3)) == (
        "scales of shape (64, 3) where blocks of 256 from axis 1 of (64, 512) make (64, 2)"
    )
    assert fmt.misfit((64, 256), (64, 512)) == (
        "codes of shape (64, 512) where blocks of 256 from axis 1 of (64, 256) make (64, 256)"
    )
    assert fmt.misfit((4096,)) == "axis 1 of a 1-d leaf"
    assert Format(8, True, 0, 1).misfit(()) is None  # a scalar: one block of one


@pytest.mark.parametrize("bits", [8, 4])
def test_a_leaf_made_under_vmap_names_its_batch_axes_outside_vmap(bits):
    batch = jax.vmap(lambda x: quantize_eagerly(x, bits))(jax.random.normal(jax.random.key(5), (3, 64, 128)))
    with pytest.raises(ValueError, match=re.escape("holds a batch: its codes and scales have the leading axes (3,)")):
        batch.dequantize()
    decoded = jax.vmap(lambda q: q.dequantize())(batch)
    one = jax.tree.map(lambda x: x[1], batch)
    np.testing.assert_array_equal(decoded[1], one.dequantize())
    bad = QuantizedLeaf(batch.codes[0, :32], batch.scales[0], shape=(64, 128), dtype=jnp.float32, format=batch.format)
    with pytest.raises(ValueError, match=r"has codes of shape \(32, "):
        bad.dequantize()


@pytest.mark.parametrize(("bits", "signed"), MAPS)
@pytest.mark.parametrize("value", [0.0, 0.25, -3.0])
def test_the_codes_of_a_constant_are_built_as_the_encoder_would_compute_them(bits, signed, value):
    if value < 0 and not signed:
        return
    fmt = Format(bits, signed, *block_layout((64, 80), bits))
    built = constant(value, (64, 80), jnp.float32, fmt)
    computed = quantize(jnp.full((64, 80), value), bits, signed=signed, fmt=fmt)
    np.testing.assert_array_equal(built.codes, computed.codes)
    np.testing.assert_array_equal(built.scales, computed.scales)


@pytest.mark.parametrize("sharded", [True, False], ids=["strided slices", "contiguous runs"])
@pytest.mark.parametrize("bits, block", [(8, 256), (4, 128), (4, 124), (8, 250)])
def test_block_maxima_take_every_element_and_keep_nan(monkeypatch, sharded, bits, block):
    # Eight slices of a block (four of a block of 124, a plain reduction of 250), taken as on
    # one device or where a mesh may split the blocks: every element counts either way.
    monkeypatch.setattr(lowbit, "_slices_may_be_sharded", lambda: sharded)
    x = jax.random.normal(jax.random.key(4), (64, 4 * block))
    fmt = Format(bits, True, 1, block)
    expected = np.abs(np.asarray(x)).reshape(64, -1, block).max(-1)
    np.testing.assert_array_equal(jax.jit(block_maxima, static_argnums=1)(x, fmt), expected)
    assert bool(jnp.isnan(block_maxima(x.at[3, block + 7].set(jnp.nan), fmt)[3, 1]))


@pytest.mark.parametrize("dtype, top", [(jnp.float32, 1e-34), (jnp.bfloat16, 1e-34), (jnp.float16, 1e-3)])
def test_a_block_of_tiny_second_moments_never_decodes_to_zero(dtype, top):
    # The smallest unsigned level (1.9e-6 of the scale) times a tiny scale underflows the dtype:
    # the decoder floors it at the smallest positive number the dtype holds.
    x = jnp.asarray(np.geomspace(top * 1e-9, top, 256), dtype)
    decoded = quantize(x, 8, signed=False).dequantize()
    assert bool(jnp.all(decoded > 0)), decoded


def _dynamic_4bit_levels():
    """The 4-bit signed map of the dynamic-exponent kind (torchao's and Li et al.'s): decades below 1 each
    cut in equal steps whose midpoints are the levels (1, 2 and 4 steps), plus 0 and 1."""
    levels = [0.0, 1.0]
    for i in range(3):
        edges = np.linspace(0.1, 1.0, 2**i + 1)
        for mid in (edges[:-1] + edges[1:]) / 2 * 10.0 ** (i - 2):
            levels += [mid, -mid]
    return np.sort(np.array(levels))


def test_the_4bit_signed_map_has_a_smaller_error_than_the_dynamic_one_on_adam_like_moments():
    # First moments of a block: gradients' running mean, heavy-tailed, normalized by their block maximum.
    rng = np.random.default_rng(0)
    g = rng.standard_t(4, size=(4096, 128)).astype(np.float32)
    moments = (g * rng.lognormal(0, 1, size=(4096, 1))).astype(np.float32)
    y = moments / np.abs(moments).max(axis=1, keepdims=True)
    ours = np.asarray(lowbit_maps.levels(4, True))[np.asarray(lowbit_maps.encode(jnp.asarray(y), 4, True))]
    dynamic = _dynamic_4bit_levels()
    nearest = dynamic[np.abs(dynamic[None, :] - y.reshape(-1, 1)).argmin(1)].reshape(y.shape)
    err = lambda q: np.linalg.norm(q - y) / np.linalg.norm(y)  # noqa: E731
    assert err(ours) < 0.85 * err(nearest), (err(ours), err(nearest))
