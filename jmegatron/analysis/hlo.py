"""What a compiled program communicates, read from its optimized HLO.

``hlo_collectives(fn, *args)`` compiles ``fn`` and lists every collective
(all-reduce, all-gather, reduce-scatter, all-to-all, collective-permute) with
the buffer it moves, the bytes each device sends, the mesh axes its device
groups span, and how many times it runs per call (loop trip counts applied).

Bytes per device follow the bandwidth-optimal (ring) algorithms, for a group
of g devices and a buffer of N bytes (the full, unsharded buffer):

  all-reduce           2 (g-1)/g N
  all-gather           (g-1)/g N      N = gathered output
  reduce-scatter       (g-1)/g N      N = input before scattering
  all-to-all           (g-1)/g N
  collective-permute   N

N counts what the program sends, as an accelerator runs it: a buffer of
16-bit floats that XLA:CPU widened to f32 for the collective (its float
normalization for gathers, AllReducePromotion for sums: the operand is a
convert from bf16 or f16, perhaps fused with copies and bitcasts) counts at
its own 2 bytes an element (``Collective.widened``).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import re
from typing import Any, Callable, Sequence

import jax
import numpy as np

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all",
         "collective-permute", "ragged-all-to-all")

_DTYPE_BYTES = {
    "pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2,
    "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8,
    "f64": 8, "c64": 8, "c128": 16,
}
_OPS = "|".join(sorted((k + s for k in KINDS for s in ("", "-start")), key=len, reverse=True))
_INSTR = re.compile(rf"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+) = (?P<shape>.*?) (?P<op>{_OPS})\((?P<rest>.*)$")
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?(?P<name>[\w.\-]+) \(.*\{\s*$")
_ARRAY = re.compile(r"(?P<dtype>[a-z]+\d*(?:e\d+m\d+\w*)?)\[(?P<dims>[\d,]*)\]")
_CALLEE = re.compile(r"(?:body|condition|to_apply|calls|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_DEFINITION = re.compile(r"^\s*(?P<root>ROOT\s+)?%?(?P<name>[\w.\-]+) = (?P<shape>\S+) "
                         r"(?P<op>[\w\-]+)\((?P<rest>.*)$")
_OPERAND = re.compile(r"%([\w.\-]+)")
_MOVES_ONLY = ("bitcast", "copy", "transpose", "reshape")
_NARROW = ("bf16", "f16")


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective instruction of the optimized HLO."""

    kind: str                    # one of KINDS
    name: str                    # HLO instruction name
    computation: str             # HLO computation holding it
    shape: str                   # HLO result type
    buffer_bytes: int            # N in the module docstring (all buffers together)
    buffers: int                 # arrays moved; XLA combines several into one instruction
    group_size: int              # g
    axes: tuple[str, ...] | None  # mesh axes the groups span (None: not derivable)
    executions: int              # runs per call of the program (loop trip counts)
    widened: int = 0             # of the buffers, 16-bit floats XLA:CPU widened to f32

    @property
    def bytes_per_device(self) -> float:
        """Bytes one device sends per execution (ring algorithms)."""
        g, n = self.group_size, self.buffer_bytes
        if g <= 1:
            return 0.0
        if self.kind == "all-reduce":
            return 2 * (g - 1) / g * n
        if self.kind == "collective-permute":
            return float(n)
        return (g - 1) / g * n


@dataclasses.dataclass(frozen=True)
class CollectiveReport:
    """All collectives of one compiled program."""

    collectives: tuple[Collective, ...]
    unknown_trip_counts: bool = False   # some loop had no static trip count (counted once)

    def select(self, kind: str | None = None,
               axes: Sequence[str] | None = None) -> list[Collective]:
        """Collectives of ``kind`` (e.g. "all-reduce") spanning exactly ``axes``."""
        if kind is not None and kind not in KINDS:
            raise ValueError(f"unknown collective kind {kind!r}; one of {KINDS}")
        want = None if axes is None else tuple(sorted(axes))
        return [c for c in self.collectives
                if (kind is None or c.kind == kind)
                and (want is None or (c.axes is not None and tuple(sorted(c.axes)) == want))]

    def count(self, kind: str | None = None, axes: Sequence[str] | None = None) -> int:
        """Buffers moved per call by the matching collectives.

        This is the count a paper quotes ("2 all-reduces per layer"): an
        instruction into which XLA combined k all-reduces counts k times.
        """
        return sum(c.buffers * c.executions for c in self.select(kind, axes))

    def launches(self, kind: str | None = None, axes: Sequence[str] | None = None) -> int:
        """Collective instructions executed per call (combined ones count once)."""
        return sum(c.executions for c in self.select(kind, axes))

    def bytes_per_device(self, kind: str | None = None,
                         axes: Sequence[str] | None = None) -> float:
        """Bytes one device sends per call through the matching collectives."""
        return sum(c.bytes_per_device * c.executions for c in self.select(kind, axes))

    def table(self) -> str:
        """A printable summary grouped by kind and mesh axes."""
        rows: dict[tuple[str, str], list[float]] = {}
        for c in self.collectives:
            key = (c.kind, ",".join(c.axes) if c.axes is not None else "?")
            row = rows.setdefault(key, [0, 0.0])
            row[0] += c.buffers * c.executions
            row[1] += c.bytes_per_device * c.executions
        lines = [f"{'collective':<20} {'mesh axes':<22} {'count':>6} {'bytes/device':>14}"]
        for (kind, axes), (n, b) in sorted(rows.items()):
            lines.append(f"{kind:<20} {axes:<22} {n:>6} {b:>14,.0f}")
        if not rows:
            lines.append("(no collectives)")
        if self.unknown_trip_counts:
            lines.append("(some loop had no static trip count: its collectives count once)")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def hlo_collectives(fn: Callable[..., Any], *args: Any,
                    mesh: jax.sharding.Mesh | None = None, **kwargs: Any) -> CollectiveReport:
    """Compiles ``fn(*args, **kwargs)`` and reports the collectives of its optimized HLO.

    ``fn`` may be jitted already. Mesh axes are derived from ``mesh``, or from
    the first NamedSharding found among the arguments.
    """
    jitted = fn if hasattr(fn, "lower") else jax.jit(fn)
    compiled = jitted.lower(*args, **kwargs).compile()
    if mesh is None:
        mesh = _mesh_of(args, kwargs)
    return parse_collectives(compiled.as_text(), mesh)


def parse_collectives(hlo_text: str, mesh: jax.sharding.Mesh | None = None) -> CollectiveReport:
    """Collectives of an optimized HLO module given as text."""
    computations, entry = _split_computations(hlo_text)
    if entry is None:
        raise ValueError("no ENTRY computation found: is this an HLO module's text?")
    runs, unknown = _executions(computations, entry)
    partitions = re.search(r"num_partitions=(\d+)", hlo_text)
    n_devices = mesh.size if mesh is not None else int(partitions[1]) if partitions else 1
    found = []
    for comp, lines in computations.items():
        defined = {d["name"]: d for d in map(_DEFINITION.match, lines) if d}
        for line in lines:
            m = _INSTR.match(line)
            if m:
                narrow = [_narrowed_from(name, defined, computations)
                          for name in _OPERAND.findall(m["rest"].split(")")[0])]
                found.append(_collective(m, comp, runs.get(comp, 0), mesh, n_devices, narrow))
    # A newer XLA may print a form this parser does not know: fail, never report zero.
    opcodes = len(re.findall(rf" (?:{_OPS})\(", hlo_text))
    if opcodes != len(found):
        raise ValueError(f"the HLO has {opcodes} collective instructions but only {len(found)} "
                         "were parsed; the HLO text format may have changed")
    return CollectiveReport(tuple(c for c in found if c.executions), unknown)


def _mesh_of(args, kwargs) -> jax.sharding.Mesh | None:
    for leaf in jax.tree.leaves((args, kwargs)):
        sharding = getattr(leaf, "sharding", None)
        if isinstance(sharding, jax.sharding.NamedSharding):
            return sharding.mesh
    return None


def _split_computations(text: str) -> tuple[dict[str, list[str]], str | None]:
    computations: dict[str, list[str]] = {}
    current, entry = None, None
    for line in text.splitlines():
        header = _COMPUTATION.match(line)
        if header and not line.startswith(" "):
            current = header["name"]
            computations[current] = []
            if line.startswith("ENTRY"):
                entry = current
        elif current is not None:
            computations[current].append(line)
    return computations, entry


def _executions(computations: dict[str, list[str]], entry: str | None):
    """Times each computation runs per call, multiplying loop trip counts."""
    runs: dict[str, int] = {}
    unknown = False

    def visit(comp: str, times: int) -> None:
        nonlocal unknown
        runs[comp] = runs.get(comp, 0) + times
        for line in computations.get(comp, ()):
            callees = _CALLEE.findall(line)
            for group in _BRANCHES.findall(line):
                callees += [c.strip().lstrip("%") for c in group.split(",")]
            if not callees:
                continue
            trips = 1
            if " while(" in line:
                trip = _TRIP.search(line)
                unknown |= trip is None
                trips = int(trip[1]) if trip else 1
            for callee in callees:
                if callee in computations and callee != comp:
                    visit(callee, times * trips)

    if entry is not None:
        visit(entry, 1)
    return runs, unknown


def _narrowed_from(name: str, defined: dict[str, re.Match],
                   computations: dict[str, list[str]]) -> float:
    """The bytes per element of the 16-bit float that ``name`` widens (a convert of one,
    or a fusion ending in such a convert, then only copies, bitcasts, transposes or
    reshapes), or 0."""
    d = defined.get(name)
    if d is None:
        return 0
    if d["op"] == "fusion":
        callee = _CALLEE.search(d["rest"])
        body = computations.get(callee[1], []) if callee else []
        inner = {i["name"]: i for i in map(_DEFINITION.match, body) if i}
        root = next((i for i in map(_DEFINITION.match, body) if i and i["root"]), None)
        return 0 if root is None else _narrowed_from(root["name"], inner, computations)
    if d["op"] in _MOVES_ONLY:
        operand = _OPERAND.search(d["rest"])
        return _narrowed_from(operand[1], defined, computations) if operand else 0
    if d["op"] == "convert":
        operand = _OPERAND.search(d["rest"])
        source = defined.get(operand[1]) if operand else None
        kind = _ARRAY.match(source["shape"]) if source else None
        return _DTYPE_BYTES[kind["dtype"]] if kind and kind["dtype"] in _NARROW else 0
    return 0


def _collective(m: re.Match, comp: str, runs: int, mesh, n_devices: int,
                narrow: Sequence[float] = ()) -> Collective:
    kind = m["op"].removesuffix("-start")
    rest = m["rest"]
    shapes = list(_ARRAY.finditer(m["shape"]))
    if m["op"] == "all-gather-start":     # ((operands...), (results...)): keep the results
        shapes = shapes[len(shapes) // 2:]
    elif m["op"] == "collective-permute-start":   # (operand, result, contexts...)
        shapes = shapes[:1]
    arrays = [_array_bytes(a) for a in shapes]
    widened = 0
    for i, width in enumerate(narrow[:len(arrays)]):
        if width and shapes[i]["dtype"] == "f32":   # sent at its own width, not f32's
            arrays[i] *= width / 4
            widened += 1
    buffers = 1 if kind.endswith("all-to-all") else len(arrays)
    groups = _groups(rest)
    size = len(groups[0]) if groups else n_devices
    nbytes = int(sum(arrays))
    if kind == "reduce-scatter":
        nbytes *= size
    if kind == "collective-permute":
        pairs = _pairs(rest)
        axes = _permute_axes(pairs, mesh) if mesh is not None else None
        size = 2 if pairs else 1
    else:
        axes = _group_axes(groups, mesh) if mesh is not None else None
    return Collective(kind, m["name"], comp, m["shape"], nbytes, buffers, size, axes, runs,
                      widened)


def _array_bytes(match: re.Match) -> float:
    dims = [int(d) for d in match["dims"].split(",") if d]
    dtype = match["dtype"]
    width = _DTYPE_BYTES.get(dtype, 1 if dtype.startswith("f8") else 4)
    return width * int(np.prod(dims, dtype=np.int64))


def _groups(rest: str) -> list[list[int]]:
    """Replica groups, in any of XLA's printed forms: explicit ``{{0,1},{2,3}}``,
    iota ``[2,2]<=[4]``, or mesh axes ``mesh['a'=2,'b'=2] {'b'}``."""
    m = re.search(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}", rest)
    if m:
        return [[int(x) for x in g.split(",") if x]
                for g in re.findall(r"\{([\d,]*)\}", m[1])]
    m = re.search(r"replica_groups=(\[[\d,]+\]<=\[[\d,]+\](?:T\([\d,]+\))?)", rest)
    if m:
        return _iota(m[1]).tolist()
    m = re.search(r"replica_groups=mesh\[([^\]]*)\](?:, device_ids=\((.*?)\))? \{([^}]*)\}", rest)
    if m:
        return _mesh_groups(m[1], m[2], m[3])
    return []


def _iota(text: str) -> np.ndarray:
    """Device ids of XLA's iota forms ``[shape]<=[dims]T(perm)`` or ``[dims]T(perm)``."""
    m = re.fullmatch(r"\[([\d,]+)\](?:<=\[([\d,]+)\])?(?:T\(([\d,]+)\))?", text.strip())
    shape = [int(x) for x in m[1].split(",")]
    dims = [int(x) for x in m[2].split(",")] if m[2] else shape
    ids = np.arange(int(np.prod(dims))).reshape(dims)
    if m[3]:
        ids = ids.transpose([int(x) for x in m[3].split(",")])
    return ids.reshape(shape)


def _mesh_groups(axes_text: str, device_text: str | None, group_text: str) -> list[list[int]]:
    """Groups of ``mesh['x'=4,'y'=2] {'y'}``: devices that differ only along the
    listed axes (a sub-axis ``'x':(pre)size`` selects part of one axis)."""
    axes = [(n.strip("'\""), int(s)) for n, s in
            (a.rsplit("=", 1) for a in axes_text.split(",") if a)]
    sizes = [s for _, s in axes]
    if device_text and ("<=" in device_text or "T(" in device_text):
        ids = _iota(device_text).reshape(sizes)
    elif device_text:
        ids = np.array([int(x) for x in re.findall(r"\d+", device_text)]).reshape(sizes)
    else:
        ids = np.arange(int(np.prod(sizes))).reshape(sizes)
    picked = {}
    for name, pre, sub in re.findall(r"'?([\w.\-]+)'?(?::\((\d+)\)(\d+))?", group_text):
        picked[name] = (int(pre), int(sub)) if pre else None
    # Split every axis into (major, selected, minor) parts; groups vary the selected ones.
    split, keep = [], []
    for i, (name, size) in enumerate(axes):
        pre, sub = picked.get(name) or (1, size)
        split += [pre, sub, size // (pre * sub)]
        if name in picked:
            keep.append(3 * i + 1)
    ids = np.moveaxis(ids.reshape(split), keep, range(len(split) - len(keep), len(split)))
    return ids.reshape(-1, int(np.prod([split[k] for k in keep]))).tolist()


def _pairs(rest: str) -> list[tuple[int, int]]:
    m = re.search(r"source_target_pairs=\{(.*?)\}\}", rest)
    if not m:
        return []
    return [(int(a), int(b)) for a, b in re.findall(r"\{(\d+),(\d+)", m[1] + "}")]


def _group_axes(groups: list[list[int]], mesh) -> tuple[str, ...] | None:
    """The smallest set of mesh axes whose device groups equal ``groups``."""
    ids = np.arange(mesh.size).reshape(tuple(mesh.shape.values()))
    names = list(mesh.shape)
    if not groups:
        return tuple(n for n in names if mesh.shape[n] > 1)
    want = {frozenset(g) for g in groups}
    live = [i for i, n in enumerate(names) if mesh.shape[n] > 1]
    for r in range(len(live) + 1):
        for subset in itertools.combinations(live, r):
            moved = np.moveaxis(ids, subset, range(len(names) - r, len(names)))
            got = {frozenset(g) for g in moved.reshape(-1, max(1, int(np.prod(
                [ids.shape[i] for i in subset])))).tolist()}
            if got == want:
                return tuple(names[i] for i in subset)
    return None


def _permute_axes(pairs: list[tuple[int, int]], mesh) -> tuple[str, ...] | None:
    shape = tuple(mesh.shape.values())
    differ: set[int] = set()
    for src, dst in pairs:
        a, b = np.unravel_index(src, shape), np.unravel_index(dst, shape)
        differ |= {i for i in range(len(shape)) if a[i] != b[i]}
    return tuple(n for i, n in enumerate(mesh.shape) if i in differ)


@dataclasses.dataclass(frozen=True)
class LoopCollective:
    """A collective inside a loop body, and how it relates to the body's compute
    (its matmuls and nested loops: a group of layers)."""

    kind: str
    computation: str
    after_compute: bool    # some matmul or nested loop of the body computes an operand of it
    before_compute: bool   # some matmul or nested loop of the body takes its result


_ANY = re.compile(r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+) = (?P<shape>.*?) "
                  r"(?P<op>[a-z][\w\-]*)\((?P<rest>.*)$")
_BODY = re.compile(r"body=%?([\w.\-]+)")


def loop_collectives(hlo_text: str, kind: str) -> list[LoopCollective]:
    """Every ``kind`` collective in a while-loop body of an optimized HLO module,
    with whether it waits for, or feeds, the body's compute. A prefetch issued
    one iteration ahead is neither: its result leaves for the next iteration."""
    computations, _ = _split_computations(hlo_text)
    bodies = {b for lines in computations.values() for line in lines
              for b in _BODY.findall(line) if " while(" in line}
    found = []
    for body in sorted(bodies):
        graph = {m["name"]: (m["op"], _operands(m["rest"]))
                 for m in map(_ANY.match, computations.get(body, ())) if m}
        users: dict[str, set[str]] = {}
        for name, (_, operands) in graph.items():
            for o in operands:
                users.setdefault(o, set()).add(name)
        compute = {n for n, (op, _) in graph.items() if op in ("dot", "while", "convolution")}
        for name, (op, operands) in graph.items():
            if op.removesuffix("-start") != kind:
                continue
            before = _reach(name, lambda n: users.get(n, ()))
            after = _reach(name, lambda n: graph.get(n, (None, ()))[1])
            found.append(LoopCollective(kind, body, bool(after & compute),
                                        bool(before & compute)))
    return found


def _operands(rest: str) -> list[str]:
    """Instruction names in an argument list (up to its closing parenthesis)."""
    depth, end = 1, len(rest)
    for i, ch in enumerate(rest):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth == 0:
            end = i
            break
    return re.findall(r"%([\w.\-]+)", rest[:end])


def _reach(start: str, step: Callable[[str], Sequence[str]]) -> set[str]:
    seen, todo = set(), list(step(start))
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            todo.extend(step(n))
    return seen


def branch_collectives(hlo_text: str, mesh: jax.sharding.Mesh | None = None
                       ) -> list[tuple[CollectiveReport, ...]]:
    """Per ``conditional`` of an optimized HLO module (a ``lax.cond`` or ``switch``),
    one report per branch, in branch order (``lax.cond``: false, then true): the
    collectives of the computations that branch calls, at their counts per call of
    the branch. A collective outside every conditional is in none of them."""
    computations, _ = _split_computations(hlo_text)
    report = parse_collectives(hlo_text, mesh)
    out = []
    for lines in computations.values():
        for line in lines:
            if " conditional(" not in line:
                continue
            out.append(tuple(_within(computations, branch, report) for branch in _branches(line)))
    return out


def _branches(line: str) -> list[str]:
    """The branch computations of a conditional instruction, in branch order (the
    boolean form's false branch first, as ``lax.cond`` orders them)."""
    branches = [c.strip().lstrip("%") for group in _BRANCHES.findall(line)
                for c in group.split(",")]
    if not branches:   # the boolean form: true_computation=, false_computation=
        branches = [re.search(rf"{side}_computation=%?([\w.\-]+)", line)[1]
                    for side in ("false", "true")]
    return branches


def period_weights(hlo_text: str, period: int) -> dict[str, float]:
    """The share of calls each computation inside a conditional runs in, for a program
    whose two-branch conditionals take their true branch once in ``period`` calls and
    their false branch otherwise (MuonBP's full and block steps): 1 / period for the
    true branch's computations, (period - 1) / period for the false one's. The
    collectives of computations not listed run every call."""
    computations, _ = _split_computations(hlo_text)
    weights: dict[str, float] = {}
    for lines in computations.values():
        for line in lines:
            if " conditional(" not in line:
                continue
            branches = _branches(line)
            if len(branches) != 2:
                raise ValueError(f"a conditional of {len(branches)} branches: no true/false "
                                 "period")
            for branch, share in zip(branches, ((period - 1) / period, 1 / period)):
                for comp in _executions(computations, branch)[0]:
                    weights[comp] = share
    return weights


def periodic_bytes_per_device(hlo_text: str, mesh: jax.sharding.Mesh | None,
                              period: int) -> float:
    """Bytes one device sends per call, averaged over ``period`` calls of a program whose
    conditionals run as ``period_weights`` says."""
    weights = period_weights(hlo_text, period)
    return sum(c.bytes_per_device * c.executions * weights.get(c.computation, 1.0)
               for c in parse_collectives(hlo_text, mesh).collectives)


_SHAPED = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+) = (\w+)\[([\d,]*)\]")
# The lhs operand's name (after its shape, where the text prints operand shapes).
_DOT = re.compile(r" dot\((?:[^\s%]+\s)?%?([\w.\-]+).*lhs_contracting_dims=\{([\d,]*)\}")


def _dot_flops(lines: list[str]) -> float:
    """2 * output elements * contracted size of every dot of one computation (operand
    shapes from the computation's own instructions and parameters)."""
    shapes, flops = {}, 0.0
    for line in lines:
        m = _SHAPED.match(line)
        if m:
            shapes[m[1]] = [int(d) for d in m[3].split(",") if d]
        if " dot(" not in line:
            continue
        dot = _DOT.search(line)
        if m is None or dot is None or dot[1] not in shapes:   # fail, never count zero
            raise ValueError(f"unparsed dot (has the HLO text format changed?): {line.strip()}")
        contracted = [shapes[dot[1]][int(i)] for i in dot[2].split(",") if i]
        flops += 2.0 * math.prod(shapes[m[1]]) * math.prod(contracted)
    return flops


def period_excess_flops(hlo_text: str, period: int) -> float:
    """What XLA's cost analysis counts above the period's average: it charges each
    two-branch conditional its costlier branch's FLOPs, where one call in ``period``
    runs the true branch and the others the false one (``hlo.period_weights``). Counts
    the matmul FLOPs (dots) of each branch and the computations it calls."""
    computations, _ = _split_computations(hlo_text)
    per_comp = {name: _dot_flops(lines) for name, lines in computations.items()}
    excess = 0.0
    for lines in computations.values():
        for line in lines:
            if " conditional(" not in line:
                continue
            false, true = (sum(per_comp[c] * runs for c, runs in
                               _executions(computations, branch)[0].items())
                           for branch in _branches(line))
            excess += max(false, true) - (true + (period - 1) * false) / period
    return excess


def _within(computations: dict[str, list[str]], branch: str,
            report: CollectiveReport) -> CollectiveReport:
    """The collectives of ``report`` in ``branch`` and the computations it calls,
    each at its runs per call of the branch."""
    runs, unknown = _executions(computations, branch)
    return CollectiveReport(tuple(dataclasses.replace(c, executions=runs[c.computation])
                                  for c in report.collectives if c.computation in runs), unknown)
