"""The one home of JAX private APIs: each function says what public behaviour it stands in for.

JAX exposes no public way to ask for the innermost active trace, the trace a
tracer belongs to, a weakly typed copy of an array, or the key implementation
of an abstract typed key. Each reach is guarded: on a JAX release where the
private name is gone, the function falls back to a safe answer (documented
below) instead of failing, and the tests of the behaviour it serves say so.

Example:
    >>> import jax.numpy as jnp
    >>> weakly_typed(jnp.float32(1.0)).weak_type
    True
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

__all__ = ["abstract_key_impl", "current_trace", "trace_of", "weakly_typed"]


def current_trace() -> Any:
    """The innermost active JAX trace, or ``None`` where this JAX does not expose it.

    Fallback ``None``: the capture guards that use it then rely on the tracers alone.
    """
    try:
        from jax._src import core as jax_core

        return jax_core.trace_ctx.trace
    except (ImportError, AttributeError):  # pragma: no cover - other JAX versions
        return None


def trace_of(tracer: Any) -> Any:
    """The trace ``tracer`` belongs to, or ``None`` (not a tracer, or not exposed by this JAX)."""
    return getattr(tracer, "_trace", None)


def weakly_typed(x: jax.Array) -> jax.Array:
    """``x`` as a weakly typed array of its dtype: the aval of the weak value it replaces.

    Fallback: ``x`` as it is (strongly typed), which costs one retrace of a jitted step.
    """
    try:
        from jax._src.lax.lax import _convert_element_type
    except ImportError:  # pragma: no cover - other JAX versions
        return x
    return _convert_element_type(x, np.dtype(x.dtype), weak_type=True)


def abstract_key_impl(dtype: Any) -> Any:
    """The key implementation behind a typed key's dtype (``key<fry>``), concrete or abstract.

    Fallback ``None``: the default implementation.
    """
    return getattr(dtype, "_impl", None)
