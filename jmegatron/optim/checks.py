"""Argument checks of the optimizer factories: refused at construction, in one line.

Every check raises ``ValueError("<name> must be <what>, got <value>")``, so a bad
argument fails where it is given, not as NaN params some steps later or deep
inside JAX. What cannot be read at construction passes unchecked:

- a schedule (a callable learning rate): its values are computed during the
  update, under ``jit``, where nothing can raise; a schedule returning NaN or a
  negative rate is the caller's to test;
- a traced value: ``optax.inject_hyperparams`` hands its hyperparameters to the
  factory as arrays, traced when its ``update`` runs under ``jit``.

An option that fixes the program (an integer such as a step count or a period, a
fraction that sets a shape) cannot be an array at all: ``static`` refuses one,
saying to name it in ``inject_hyperparams``'s ``static_args``.

``matrix_leaf`` checks, at init, a leaf a matrix optimizer is given.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np


def _shown(value: Any) -> str:
    """A short one-line picture of a bad value."""
    shape = getattr(value, "shape", ())
    text = f"an array of shape {tuple(shape)}" if shape else repr(value)
    text = " ".join(text.split())
    return text if len(text) <= 60 else text[:57] + "..."


def _refuse(name: str, value: Any, what: str, optional: bool = False, shown: str = ""):
    raise ValueError(f"{name} must be {what}{' or None' if optional else ''}, "
                     f"got {shown or _shown(value)}")


def _real(name: str, value: Any, what: str, optional: bool) -> float | None:
    """``value`` as a float, or None when it is traced (not readable here)."""
    if isinstance(value, jax.core.Tracer):
        return None
    if isinstance(value, (bool, np.bool_, str, bytes)):   # True is an int to numpy
        _refuse(name, value, what, optional)
    try:
        array = np.asarray(value)
    except Exception:   # anything numpy cannot read is not a number
        array = None
    if array is None or array.shape != () or array.dtype.kind not in "iuf":
        _refuse(name, value, what, optional)
    return float(array)


def static(name: str, value: Any, what: str) -> None:
    """Refuses a jax Array (traced or not) for an option the program is built from:
    ``optax.inject_hyperparams`` makes every numeric argument one unless it is named
    in ``static_args``. ``what``: what the option must be, e.g. "integer >= 1"."""
    if isinstance(value, jax.Array):
        kind = "a traced Array" if isinstance(value, jax.core.Tracer) else "a jax Array"
        raise ValueError(f"{name} must be a Python {what}, got {kind}: under "
                         "optax.inject_hyperparams, name it in static_args "
                         f"(optax.inject_hyperparams(factory, static_args=({name!r},)))")


def _number(name: str, value: Any, what: str, ok, optional: bool = False) -> None:
    """Refuses ``value`` unless it is None (when ``optional``), traced, or a finite
    real number ``x`` with ``ok(x)``."""
    if value is None and optional:
        return
    x = _real(name, value, what, optional)
    if x is not None and not (math.isfinite(x) and ok(x)):
        _refuse(name, value, what, optional)


def learning_rate(value: Any, name: str = "learning_rate", optional: bool = False) -> None:
    """A finite number > 0, or a schedule (any callable; its values are not checked)."""
    if callable(value):
        return
    _number(name, value, "a finite number > 0 or a schedule (a function of the step)",
            lambda x: x > 0, optional)


def fraction(name: str, value: Any, optional: bool = False) -> None:
    """A decay rate: a number in [0, 1) (1 would never forget, > 1 diverges)."""
    _number(name, value, "a number in [0, 1)", lambda x: 0 <= x < 1, optional)


def share(name: str, value: Any, is_static: bool = False) -> None:
    """A part of a whole: a number in (0, 1]; with ``is_static``, never an array (it
    sets a shape)."""
    if is_static:
        static(name, value, "number in (0, 1]")
    _number(name, value, "a number in (0, 1]", lambda x: 0 < x <= 1)


def positive(name: str, value: Any, optional: bool = False) -> None:
    """A finite number > 0 (an eps that a zero would divide by, a scale)."""
    _number(name, value, "a finite number > 0", lambda x: x > 0, optional)


def non_negative(name: str, value: Any) -> None:
    """A finite number >= 0 (a weight decay)."""
    _number(name, value, "a finite number >= 0", lambda x: x >= 0)


def integer(name: str, value: Any, low: int, optional: bool = False) -> None:
    """A Python (or numpy) integer >= ``low``; a float such as 5.0 is refused, and so is
    a jax Array (an integer fixes the program: ``static``)."""
    if value is None and optional:
        return
    static(name, value, f"integer >= {low}")
    if (isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral)
            or value < low):
        _refuse(name, value, f"an integer >= {low}", optional)


def one_of(name: str, value: Any, options: Sequence) -> None:
    """One of ``options`` (a name such as "ema")."""
    if not isinstance(value, str) or value not in options:
        raise ValueError(f"unknown {name} {_shown(value)}; one of {tuple(options)}")


def float_dtype(name: str, value: Any, optional: bool = False) -> None:
    """A floating-point dtype (or its name, e.g. "bfloat16")."""
    if value is None and optional:
        return
    try:
        dtype = jnp.dtype(value)
    except TypeError:   # not a dtype at all
        _refuse(name, value, "a floating-point dtype", optional)
    if not jnp.issubdtype(dtype, jnp.floating):
        _refuse(name, value, "a floating-point dtype", optional, shown=dtype.name)


def matrix_leaf(who: str, path: str, x) -> None:
    """At init: a leaf routed to a matrix optimizer must be a real floating-point
    array with elements (an integer leaf would get a zero update, an empty one
    fails inside Newton-Schulz or the eigendecomposition)."""
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"{who} got {path} of dtype {x.dtype}: a matrix optimizer needs "
                         "floating-point params; route the leaf elsewhere or cast it")
    if x.size == 0:
        raise ValueError(f"{who} got {path} of shape {tuple(x.shape)}, a matrix with no "
                         "elements; leave it out of the tree the optimizer is given")
