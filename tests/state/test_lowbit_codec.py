"""The block-wise low-bit codec: error bounds, the zero point, adversarial blocks, pytree behaviour."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from treeopt._state.lowbit import QuantizedLeaf, block_size, bytes_of, dequantize, is_quantized, quantize

# |x - decoded| <= bound * (the block's absolute maximum): half the widest gap of each map.
# Signed: the top decade's step (0.9 / 64 for 8 bits, 0.9 / 4 for 4 bits) halved.
# Unsigned: 0.9 / 128 halved for 8 bits; for 4 bits 1 / 16, the gap below the smallest level (0 -> 1/16).
BOUNDS = {(8, "signed"): 0.00704, (4, "signed"): 0.1126, (8, "unsigned"): 0.00352, (4, "unsigned"): 0.0626}
SMALLEST_UNSIGNED = {8: 1e-8, 4: 1 / 16}

shapes = st.lists(st.integers(1, 9), min_size=0, max_size=2).flatmap(
    lambda lead: st.integers(1, 600).map(lambda last: (*lead, last))
)


def _blocks(x: np.ndarray, bits: int) -> np.ndarray:
    """(rows, n_blocks, block) with NaN padding, as the codec cuts ``x``."""
    rows = x.reshape(-1, x.shape[-1]) if x.ndim else x.reshape(1, 1)
    block = block_size(rows.shape[-1], bits)
    n_blocks = -(-rows.shape[-1] // block)
    padded = np.full((rows.shape[0], n_blocks * block), np.nan, np.float64)
    padded[:, : rows.shape[-1]] = rows
    return padded.reshape(rows.shape[0], n_blocks, block)


def _round_trip(x: jax.Array, bits: int) -> jax.Array:
    return quantize(x, bits).dequantize()


_jit_round_trip = jax.jit(_round_trip, static_argnums=1)


@settings(max_examples=20, deadline=None)
@given(shape=shapes, bits=st.sampled_from([8, 4]), unsigned=st.booleans(), seed=st.integers(0, 2**31))
def test_round_trip_error_is_within_the_map_bound_per_block(shape, bits, unsigned, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(np.float32) * 10.0 ** rng.uniform(-3, 3, shape).astype(np.float32)
    x = np.abs(x) if unsigned else x
    decoded = np.asarray(_jit_round_trip(jnp.asarray(x), bits))
    assert decoded.shape == x.shape and decoded.dtype == np.float32
    err, ref = _blocks(np.abs(decoded - x), bits), _blocks(x, bits)
    absmax = np.nanmax(np.abs(ref), axis=-1, keepdims=True)
    kinds = np.where(np.nanmin(ref, axis=-1, keepdims=True) >= 0, "unsigned", "signed")
    bound = np.vectorize(lambda kind: BOUNDS[bits, kind])(kinds)
    assert np.all(np.nan_to_num(err) <= bound * absmax * (1 + 1e-5))


@pytest.mark.parametrize("bits", [8, 4])
def test_unsigned_blocks_never_decode_a_positive_value_to_zero(bits):
    # One block spanning twelve decades: the signed map would send the small values to 0.
    x = jnp.asarray(np.geomspace(1e-12, 1.0, 256, dtype=np.float32))
    decoded = quantize(x, bits).dequantize()
    assert bool(jnp.all(decoded > 0))
    assert float(decoded.min()) == pytest.approx(SMALLEST_UNSIGNED[bits], rel=1e-6)
    assert bool(jnp.signbit(quantize(x, bits).scales).all())


@pytest.mark.parametrize("bits", [8, 4])
def test_the_signed_map_keeps_exact_zero_and_plus_minus_one(bits):
    x = jnp.array([[0.0, 1.0, -1.0, 0.0], [-3.0, 0.0, 3.0, 0.0]])
    decoded = quantize(x, bits).dequantize()
    assert bool(jnp.array_equal(decoded, x))


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_all_zero_blocks_decode_to_exact_zeros(bits, dtype):
    x = jnp.zeros((3, 512), dtype).at[1, :256].set(2.0)
    decoded = quantize(x, bits).dequantize()
    assert decoded.dtype == dtype
    assert bool(jnp.all(decoded[0] == 0)) and bool(jnp.all(decoded[2] == 0))
    assert bool(jnp.all(decoded[1, 256:] == 0)) and bool(jnp.all(decoded[1, :256] == 2.0))


def _assert_other_blocks_untouched(clean, dirty, row):
    """Codes, scales and decoded values of every block but the last-axis row ``row`` bit-identical."""

    def rows(a):
        a = np.asarray(a)
        return np.delete(a.reshape(-1, a.shape[-1]), row, axis=0)

    for a, b in [(clean.codes, dirty.codes), (clean.scales, dirty.scales)]:
        assert np.array_equal(rows(a), rows(b))
    assert np.array_equal(rows(clean.dequantize()), rows(dirty.dequantize()))


@pytest.mark.parametrize("bits", [8, 4])
def test_one_huge_value_stays_in_its_block(bits):
    x = jax.random.normal(jax.random.key(0), (4, 256))
    clean, dirty = quantize(x, bits), quantize(x.at[2, 17].set(3e38), bits)
    _assert_other_blocks_untouched(clean, dirty, 2)
    decoded = dirty.dequantize()
    assert float(decoded[2, 17]) == pytest.approx(3e38, rel=1e-7)
    assert bool(jnp.all(jnp.isfinite(decoded)))


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nan_and_inf_turn_their_block_to_nan_and_no_other(bits, bad):
    x = jax.random.normal(jax.random.key(1), (4, 2, 256))
    clean, dirty = quantize(x, bits), quantize(x.at[1, 0, 5].set(bad), bits)
    decoded = dirty.dequantize()
    assert bool(jnp.all(jnp.isnan(decoded[1, 0])))
    assert bool(jnp.all(jnp.isfinite(decoded[1, 1])))
    _assert_other_blocks_untouched(clean, dirty, 2)


@pytest.mark.parametrize("bits", [8, 4])
def test_denormals_decode_finite_and_never_negative(bits):
    tiny = np.float32(np.finfo(np.float32).smallest_subnormal)
    x = jnp.asarray(np.array([[tiny * k for k in range(1, 257)], [1e-39] * 255 + [1.0]], np.float32))
    decoded = quantize(x, bits).dequantize()
    assert bool(jnp.all(jnp.isfinite(decoded))) and bool(jnp.all(decoded >= 0))
    # Unsigned with a normal scale: the denormals decode to the smallest level times 1, never 0.
    assert bool(jnp.all(decoded[1] > 0))
    signed = quantize(-x, bits).dequantize()
    assert bool(jnp.all(jnp.isfinite(signed))) and bool(jnp.all(signed <= 0))


@pytest.mark.parametrize("bits", [8, 4])
def test_jit_traces_and_matches_eager_bit_for_bit(bits):
    x = jax.random.normal(jax.random.key(2), (3, 700)) * jnp.array([[1.0], [-0.0], [1e-3]])
    x = x.at[2].set(jnp.abs(x[2]))
    eager = quantize(x, bits)
    jitted = jax.jit(quantize, static_argnums=1)(x, bits)
    assert jitted.block == eager.block and jitted.shape == eager.shape
    for a, b in zip(jax.tree.leaves(eager), jax.tree.leaves(jitted), strict=True):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    assert np.array_equal(np.asarray(jax.jit(dequantize)(jitted)), np.asarray(eager.dequantize()))


@pytest.mark.parametrize("shape", [(1,), (7,), (3, 1), (2, 5), (4, 257), (2, 513), (3, 1001)])
def test_4bit_packing_round_trips_odd_last_dims(shape):
    # Every element a level of the signed map, one block's max at 1: decoding is exact.
    levels = np.array(
        [-1.0, -0.775, -0.55, -0.325, -0.1, -0.055, -0.01, 0.0, 0.01, 0.055, 0.1, 0.325, 0.55, 0.775, 1.0]
    )
    rng = np.random.default_rng(3)
    x = levels[rng.integers(0, len(levels), shape)].astype(np.float32)
    x[..., :: block_size(shape[-1], 4)] = -1.0
    q = quantize(jnp.asarray(x), 4)
    assert q.codes.shape == (*shape[:-1], math.ceil(shape[-1] / 2)) and q.codes.dtype == jnp.uint8
    assert q.scales.shape == (*shape[:-1], math.ceil(shape[-1] / q.block))
    assert np.array_equal(np.asarray(q.dequantize()), x)


def test_0d_1d_and_empty_arrays():
    for bits in (8, 4):
        q = quantize(jnp.float32(-2.5), bits)
        assert q.codes.shape == () and q.scales.shape == () and q.dequantize().shape == ()
        assert float(q.dequantize()) == -2.5
        assert quantize(jnp.arange(5.0), bits).dequantize().shape == (5,)
        for shape in [(0,), (3, 0), (0, 4)]:
            assert quantize(jnp.zeros(shape), bits).dequantize().shape == shape


@settings(max_examples=200, deadline=None)
@given(last=st.integers(0, 5000), bits=st.sampled_from([8, 4]))
def test_block_size_divides_the_last_axis_when_it_can(last, bits):
    block = block_size(last, bits)
    assert 1 <= block <= 256 and (bits == 8 or block % 2 == 0)
    if last > 256:
        divisors = [d for d in range(64, 257) if last % d == 0 and (bits == 8 or d % 2 == 0)]
        assert block == (max(divisors) if divisors else 256)
    else:
        assert block - last in (0, 1 if bits == 4 else 0) or last == 0


def test_bytes_of_is_one_or_a_half_byte_per_element_plus_scales():
    x = jnp.zeros((1024, 1024))
    per_element = {bits: bytes_of(quantize(x, bits)) / x.size for bits in (8, 4)}
    assert per_element[8] == pytest.approx(1 + 4 / 256) and per_element[8] <= 1.02
    assert per_element[4] == pytest.approx(0.5 + 4 / 256)
    odd = quantize(jnp.zeros((3, 1001)), 4)
    assert bytes_of(odd) == 3 * 501 + 3 * 4 * 4


def test_a_quantized_leaf_is_a_pytree_of_codes_and_scales():
    q = quantize(jnp.ones((4, 300), jnp.bfloat16), 8)
    assert is_quantized(q) and not is_quantized(q.codes)
    leaves = jax.tree.leaves(q)
    assert [leaf.dtype for leaf in leaves] == [jnp.uint8, jnp.float32]
    paths = [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_flatten_with_path(q)[0]]
    assert paths == [".codes", ".scales"]
    through = jax.jit(lambda q: q)(q)
    assert isinstance(through, QuantizedLeaf)
    assert (through.shape, through.dtype, through.bits, through.block) == ((4, 300), jnp.bfloat16, 8, 150)
    assert (through.ndim, through.size) == (2, 1200)
    abstract = jax.eval_shape(lambda x: quantize(x, 4), jax.ShapeDtypeStruct((4, 300), jnp.float32))
    assert abstract.codes.shape == (4, 150) and abstract.scales.shape == (4, 2)
    assert jax.eval_shape(dequantize, q).dtype == jnp.bfloat16
    assert jax.jit(lambda q: q.dequantize())(q).dtype == jnp.bfloat16


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_narrow_inputs_decode_to_their_own_dtype(dtype):
    x = jax.random.normal(jax.random.key(4), (2, 256)).astype(dtype)
    decoded = quantize(x, 8).dequantize()
    assert decoded.dtype == dtype
    assert float(jnp.max(jnp.abs(decoded.astype(jnp.float32) - x.astype(jnp.float32)))) < 0.01 * float(
        jnp.max(jnp.abs(x.astype(jnp.float32)))
    )
    v = jnp.abs(x) * jnp.asarray(np.geomspace(1e-12, 1.0, 256), dtype)  # float16 underflows most of these
    assert bool(jnp.all(quantize(v, 8).dequantize() > 0))


def test_bad_bits_and_non_float_inputs_are_refused():
    with pytest.raises(ValueError, match="bits must be 8 or 4"):
        quantize(jnp.ones(3), 2)
    with pytest.raises(TypeError, match="floating-point"):
        quantize(jnp.arange(3), 8)


def test_an_adam_like_loop_on_8bit_state_stays_close_to_float32():
    rng = np.random.default_rng(5)
    n = 16 * 256
    scale = jnp.asarray(10.0 ** rng.uniform(-1, 0, n), jnp.float32)  # a decade of scales in each block
    drift = jnp.asarray(rng.normal(0.0, 0.3, n), jnp.float32)
    b1, b2, eps = 0.9, 0.999, 1e-8

    @jax.jit
    def step(full, low, key, t):
        g = scale * (drift + jax.random.normal(key, (n,)))
        m, v = b1 * full[0] + (1 - b1) * g, b2 * full[1] + (1 - b2) * g * g
        qm = b1 * low[0].dequantize() + (1 - b1) * g
        qv = b2 * low[1].dequantize() + (1 - b2) * g * g
        update = (m / (1 - b1**t)) / (jnp.sqrt(v / (1 - b2**t)) + eps)
        low_update = (qm / (1 - b1**t)) / (jnp.sqrt(qv / (1 - b2**t)) + eps)
        error = jnp.linalg.norm(update - low_update) / jnp.linalg.norm(update)
        return (m, v), (quantize(qm, 8), quantize(qv, 8)), error

    full = (jnp.zeros(n), jnp.zeros(n))
    low = (quantize(full[0], 8), quantize(full[1], 8))
    errors = []
    for t, key in enumerate(jax.random.split(jax.random.key(6), 150), start=1):
        full, low, error = step(full, low, key, t)
        errors.append(float(error))
    assert max(errors[-50:]) < 0.1, errors[-50:]


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("unsigned", [False, True])
def test_the_codes_are_the_nearest_levels_found_by_brute_force(bits, unsigned):
    from treeopt._state.lowbit import _levels, _nearest_codes

    k1, k2 = jax.random.split(jax.random.key(bits + 2 * unsigned))
    uniform = jax.random.uniform(k1, (20_000,), minval=-1.0, maxval=1.0)
    spread = jnp.exp(jax.random.uniform(k2, (20_000,), minval=-25.0, maxval=0.0)) * jnp.sign(uniform)
    edges = jnp.asarray([0.0, 1.0, -1.0, 1e-9, 1e-8, 1e-7, 1e-6, 1e-2, 0.1, -0.1, 0.55, 0.5 * (1e-6 + 1e-7)])
    y = jnp.concatenate([uniform, spread, edges])
    if unsigned:
        y = jnp.abs(y)
    n = 2**bits
    levels = jnp.asarray(_levels(bits))[n:] if unsigned else jnp.asarray(_levels(bits))[:n]
    codes = _nearest_codes(y, jnp.full(y.shape, unsigned), bits).astype(jnp.int32)
    best = jnp.min(jnp.abs(levels[None, :] - y[:, None]), axis=1)
    # The level chosen is a nearest one (ties may go either way).
    np.testing.assert_array_equal(jnp.abs(levels[codes] - y), best)
