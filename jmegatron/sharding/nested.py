"""``shard_map`` inside another ``shard_map``'s manual region (a pipeline stage),
and the fix to JAX that makes it differentiable.

When JAX differentiates a ``shard_map`` it splits the body into what it can
compute now and what it must defer (partial evaluation), and passes the values
in between (residuals) out of the map with a spec that names every mesh axis
they vary over (``ShapedArray.nospec``, jax 0.10.2). Inside a pipeline stage
those values also vary over ``stage``, which the enclosing map made manual
already; the spec names it again, and Shardy refuses the program ("operates on
axis 'stage' which is already bound by a parent manual computation"). The same
happens to the transpose of a nested map, and to a scan hoisting a nested map's
loop-invariant part out of the loop. The JAX source marks the spot with a TODO
("should use newly all_names in check_vma path?").

``fix_residual_specs`` makes that spec name only the axes the map itself makes
manual (its ``all_names``): a value's variance over the outer axes is carried
by the enclosing map, as for every other value inside it. It patches
``ShapedArray.nospec`` once, when a pipeline builds its map
(``pipeline.over_stages`` calls ``nested_maps_differentiate``), only where the
installed JAX has the bug; a JAX whose ``nospec`` is fixed or changed is left
alone, and a program without pipeline stages runs on JAX as installed.
"""

from __future__ import annotations

import functools
import types
from typing import Callable

import jax
from jax.sharding import PartitionSpec as P

from jmegatron.sharding.rules import spec_axes

try:   # the internals the fix touches; another JAX may not have them
    from jax._src.core import ManualAxisType, ShapedArray
except ImportError:   # pragma: no cover - depends on the installed JAX
    ManualAxisType = ShapedArray = None


def _names_outer_axes(nospec) -> bool:
    """Whether ``nospec`` names an axis outside ``all_names`` (the bug)."""
    mesh = jax.sharding.AbstractMesh((2, 2), ("outer", "inner"))
    # nospec reads only the value's manual axis type (an aval varying over a manual
    # axis can only be built inside a map)
    aval = types.SimpleNamespace(mat=ManualAxisType(varying=frozenset({"outer", "inner"})))
    return "outer" in spec_axes(nospec(aval, mesh, True, ("inner",))[0])


def fix_residual_specs() -> bool:
    """Patches ``ShapedArray.nospec`` to name only the map's own manual axes where the
    installed JAX names outer ones too. Returns whether nested maps now differentiate
    (True also where JAX needs no fix)."""
    try:
        original = ShapedArray.nospec
        if not _names_outer_axes(original):
            return True
    except Exception:   # another JAX's internals: leave them alone
        return False

    def nospec(self, mesh, check_vma, all_names):
        spec = original(self, mesh, check_vma, all_names)
        if not check_vma or not len(spec):
            return spec
        names = tuple(a for a in spec_axes(spec[0]) if a in all_names)
        return (P(names, unreduced=spec.unreduced, reduced=spec.reduced) if names
                else P(unreduced=spec.unreduced, reduced=spec.reduced))

    ShapedArray.nospec = nospec
    return not _names_outer_axes(ShapedArray.nospec)


@functools.cache
def nested_maps_differentiate() -> bool:
    """Whether a ``shard_map`` inside another's manual region differentiates on this
    JAX, fixing it first (``fix_residual_specs``, once per process)."""
    return fix_residual_specs()


def shard_map(body: Callable, mesh, in_specs: tuple, out_specs) -> Callable:
    """``jax.shard_map(body)`` manual over the axes of ``mesh`` that are not manual
    already (inside a pipeline stage: all but ``stage``; ``mesh`` is then the
    stage's abstract mesh)."""
    manual = set(jax.sharding.get_abstract_mesh().manual_axes)
    if manual and not nested_maps_differentiate():
        raise ValueError(f"a shard_map inside one manual over {sorted(manual)} (a pipeline "
                         f"stage) does not differentiate on jax {jax.__version__}, whose "
                         "internals jmegatron's fix does not know: train without --mesh.stage")
    return jax.shard_map(body, mesh=mesh, in_specs=tuple(in_specs), out_specs=out_specs,
                         axis_names=set(mesh.axis_names) - manual)


def varying_axes(x) -> frozenset[str]:
    """The manual mesh axes ``x`` (an array or a ``jax.ShapeDtypeStruct``) varies over
    inside a ``shard_map`` (its type's ``vma``; ``manual_axis_type.varying`` on jax
    0.10)."""
    aval = x if isinstance(x, jax.ShapeDtypeStruct) else jax.typeof(x)
    if getattr(aval, "vma", None) is not None:
        return frozenset(aval.vma)
    return frozenset(aval.manual_axis_type.varying)
