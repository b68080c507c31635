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

__all__ = ["abstract_key_impl", "current_trace", "eager_or_autodiff", "trace_of", "weakly_typed"]


def current_trace() -> Any:
    """The innermost active JAX trace, or ``None`` where this JAX does not expose it.

    Fallback ``None``: the capture guards that use it then rely on the tracers alone.
    """
    try:
        from jax._src import core as jax_core

        return jax_core.trace_ctx.trace
    except (ImportError, AttributeError):  # pragma: no cover - other JAX versions
        return None


# JAX's traces of eager evaluation and of eager jax.grad / jvp / linearize, named by class: JAX gives
# them no public type.
_EAGER_OR_AUTODIFF = frozenset({"EvalTrace", "JVPTrace", "LinearizeTrace"})


def eager_or_autodiff(trace: Any) -> bool:
    """Whether ``trace`` (a :func:`current_trace`) is eager evaluation or an eager autodiff trace.

    Those are the traces under which updating a concrete optimizer in place is
    sound (``jax.grad`` of a function holding it, outside ``jit``). Fallback on
    a JAX whose classes have other names: ``False``, so the capture guards
    refuse instead of letting a tracer leak.

    Example:
        >>> import jax
        >>> seen = []
        >>> _ = jax.jit(lambda x: seen.append(eager_or_autodiff(current_trace())) or x)(1.0)
        >>> eager_or_autodiff(current_trace()), seen
        (True, [False])
    """
    return type(trace).__name__ in _EAGER_OR_AUTODIFF


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
