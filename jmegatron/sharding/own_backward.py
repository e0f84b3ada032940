"""Pipeline schedules (``gpipe``, ``circular``, ``1f1b``, ``interleaved-1f1b``): one
interpreter of their tables, one ``custom_vjp`` whose forward already computes
the gradients.

GPipe (Huang et al., 2019) runs every forward, then every backward, so every
stage keeps what all M microbatches' forwards keep. 1F1B (Narayanan et al.,
2021, "PipeDream-Flush") starts each microbatch's backward as soon as its
forward has left the last stage, so a stage keeps a bounded number of
microbatches in flight whatever M. An SPMD program can only interleave the two
with its own backward, so here the whole model runs as one
``custom_vjp``. At each tick, each stage runs the work its schedule's tables
give it (``sharding.schedules``: ``Schedule.forward``, ``backward``; item
i = r M + k is microbatch k through the stage's chunk r):

  forward   of item i: its input is microbatch k's embedding (chunk 0 of stage
            0) or the activation that arrived from the stage before (the last
            stage's chunk r - 1 for stage 0), kept in a slot until its backward
            (``Schedule.buffers``), with what the chunk's ``jax.vjp`` keeps for its
            backward (``Stash``: the residuals the layers' remat policy keeps,
            ``Pieces.kept``, and the output); the output goes on to the next
            stage, around the ring where the chunks wrap (V > 1).
  backward  of item j: the chunk's vjp rebuilt from what its forward kept (no
            forward runs twice unless the layers' remat recomputes it, as in
            JAX's own backward and Megatron's 1F1B); on the last stage's last
            chunk, the head and the loss on the kept output start the backward,
            elsewhere the input gradient that arrived from the next stage; the
            chunk's input gradient goes back to the stage before.

A model of two stacks (dense layers, then MoE ones) runs as one pipeline: chunk c
of the table is chunk c % V of stack c // V (``make_schedule(..., stacks=2)``), and
a stage runs its chunk's stack by ``lax.switch`` (``_chunks``), so one bubble, not
one per stack.

A tick runs only the kinds of work its phase has (``Schedule.phases``): 1F1B's
first S - 1 ticks run forwards only, its last S - 1 backwards only, so its
step takes (M + S - 1) (T_F + T_B), Megatron's, and the interleaved schedule
(V chunks a stage) (V M + S - 1) (T_F + T_B) / V.

The loss of a microbatch is its own mean token loss; the step's loss is the
mean over the M microbatches plus the layers' stats loss (MoE), which is
linear in the stats: each layer's stats get the constant cotangent
``grad(stats_loss) / M`` in the backward, times the batch ranks where the stage
runs manual over the batch axes (``Layout.pipeline_batch_axes``): there the
layers sum the stats over those ranks, every rank's loss carries the stats loss
and the step takes the ranks' mean, so each rank seeds the whole sum's share.
The gradients of the embedding and head (computed on the first and last
stage) are summed over the stages once, at the end of the step: the
weight-sized all-reduce Megatron also makes for tied embeddings.

References:
  Huang et al., "GPipe: Efficient Training of Giant Neural Networks using
    Pipeline Parallelism", arXiv:1811.06965, 2019.
  Narayanan et al., "Efficient Large-Scale Language Model Training on GPU
    Clusters Using Megatron-LM", arXiv:2104.04473, 2021.
  Narayanan et al., "Memory-Efficient Pipeline-Parallel DNN Training"
    (PipeDream-2BW/Flush), arXiv:2006.09503, 2021.
"""

from __future__ import annotations

import functools
import math
from typing import Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jmegatron.sharding import nested
from jmegatron.sharding.pipeline import at, keep, varying
from jmegatron.sharding.rules import ACT_EMBED, BATCH, SEQ, constrain
from jmegatron.sharding.runners import Stack
from jmegatron.sharding.stacks import StackShape


class Pieces(NamedTuple):
    """A model cut for a schedule with its own backward, as functions of its weights:
    ``rest`` (the leaves outside the pipeline's stacks: embedding, head) and
    ``staged`` (this stage's blocks, [1, ...] each)."""

    front: Callable   # (rest, staged, tokens [b, T+1]) -> x [b, T, D]: the embedding
    chunk: Callable   # (rest, staged, x, r, kind) -> (y, stats [c, ...]): this stage's
                      # chunk r of the stack ``kind`` (its index in model order)
    tail: Callable    # (rest, staged, y, tokens) -> (loss, aux): head and mean loss
    stats_loss: Callable   # a stack's stats [L, ...] -> their loss; linear
    kept: Callable         # the jax.checkpoint policy of what a chunk's forward keeps for
                           # its backward (``models.gpt.kept_for_backward``)


def run_own_backward(runner, stacks: Sequence[Stack], pieces: Pieces, axis, rest, staged,
                     tokens):
    """(loss, aux, stats) of a batch ``tokens`` [B, T+1] through the model ``pieces``
    of ``stacks`` (in model order: dense layers, then MoE ones) under the schedule of
    ``runner`` (a ``PipelineRunner``), manual over the
    stage ``axis``; the gradients of ``rest`` and ``staged`` are the schedule's own.

    ``aux`` is the tail's, averaged over the microbatches; ``stats`` each stack's in
    model order (``PipelineRunner.in_model_order``), on every stage."""

    @jax.custom_vjp
    def run(rest, staged, tokens):   # not differentiated (eval): the forwards only
        return _interpret(runner, stacks, pieces, axis, rest, staged, tokens, train=False)

    def forward(rest, staged, tokens):   # (out, residuals: the gradients)
        return _interpret(runner, stacks, pieces, axis, rest, staged, tokens, train=True)

    def backward(grads, cotangents):   # only the loss is differentiable
        scale = cotangents[0]
        return (*jax.tree.map(lambda g: (scale * g).astype(g.dtype), grads), None)

    run.defvjp(forward, backward)
    return run(rest, staged, tokens)


def _interpret(runner, stacks: Sequence[Stack], pieces: Pieces, axis, rest, staged, tokens,
               train: bool):
    """((loss, aux, stats), (d rest, d staged)): the ticks of the module docstring; not
    ``train``: (loss, aux, stats) of the forward ticks alone, the loss taken at each
    microbatch's last forward, nothing kept for a backward."""
    table = runner.table_for(len(stacks))
    m, s_count, v = runner.microbatches, runner.stages, table.repeats   # v: all chunks
    stage = jax.lax.axis_index(axis)
    first, last = stage == 0, stage == s_count - 1
    # [ticks + 1, S] (the row after the last tick: nothing arrives), -1 where idle.
    rows = lambda a: jnp.asarray(np.concatenate([a, np.full((1, s_count), -1)]))
    buffers = table.buffers
    work = {"forward": rows(table.forward), "backward": rows(table.backward),
            **{k: rows(getattr(buffers, k)) for k in
               ("arrive", "forward_slot", "backward_slot", "grad_arrive", "grad_slot")}}
    b = tokens.shape[0] // m
    micro = tokens.reshape(b, m, tokens.shape[1]).swapaxes(0, 1)   # rows k, k + M, ...
    masked = lambda tree, ok: jax.tree.map(lambda g: jnp.where(ok, g, 0).astype(g.dtype), tree)
    add = lambda a, b: jax.tree.map(jnp.add, a, b)
    activations = lambda x: constrain(x, (BATCH, SEQ, ACT_EMBED))
    ring = lambda step: [(i, (i + step) % s_count) for i in range(s_count)
                         if v > 1 or 0 <= i + step < s_count]

    # Each stage differentiates its own copy of the embedding and head: their gradients
    # are summed over the stages once, after the ticks.
    rest = varying(rest)
    front = lambda r, tok: pieces.front(r, staged, tok)
    embedded = lambda: front(rest, micro[0])   # (eval_shape of closures: the traced types)
    chunk, stats_cotangent, stats_shape, stats_like = _chunks(runner, stacks, pieces, rest,
                                                              staged, embedded, m, axis)

    def linearize(x, r):   # ((y, stats), the backward) of chunk r on x
        return jax.vjp(jax.checkpoint(lambda st, x: chunk(st, x, r), policy=pieces.kept),
                       staged, x)

    x_shape, aux_shape = jax.eval_shape(lambda: (embedded(), pieces.tail(
        rest, staged, chunk(staged, embedded(), 0)[0], micro[0])[1]))
    zeros = lambda tree: jax.tree.map(lambda a: varying(jnp.zeros(a.shape, a.dtype)), tree)
    slots = lambda n: varying(jnp.zeros((n, *x_shape.shape), x_shape.dtype))
    item = lambda t, kind: (work[kind][t, stage] >= 0, *divmod(jnp.maximum(
        work[kind][t, stage], 0), m))   # (whether there is one, its chunk, microbatch)
    stash = Stash.of(lambda x, r: linearize(x, r)[1],
                     lambda: (embedded(), item(0, "forward")[1]), staged) if train else None

    def forward(t, inputs, kept, stats):
        """Item i's forward, its input and what its backward needs kept: (inputs, kept,
        stats, the output)."""
        ok, r, k = item(t, "forward")
        slot = work["forward_slot"][t, stage]
        x = jnp.where(first & (r == 0), front(rest, at(micro, k)), at(inputs, slot))
        inputs = keep(inputs, x, ok, slot)   # a first chunk's input is kept from here
        if train:
            (y, st), pull = linearize(x, r)
            kept = [keep(buf, new, ok, slot) for buf, new in zip(kept, [y, *stash.keep(pull)])]
        else:
            y, st = chunk(staged, x, r)
        stats = jax.tree.map(lambda buf, new: keep(buf, new, ok, r * m + k), stats, st)
        return inputs, kept, stats, y

    def evaluated(t, y):
        """The loss and aux of the microbatch whose last forward gave ``y``; zeros
        where this tick ran none."""
        ok, r, k = item(t, "forward")
        ends = last & (r == v - 1) & ok
        loss_k, aux_k = pieces.tail(rest, staged, y, at(micro, k))
        return jnp.where(ends, loss_k, 0), masked(aux_k, ends)

    def backward(t, inputs, kept, grads_in, y):
        """Item j's backward from what its forward kept (read after this tick's forward output
        ``y``, if any: XLA:CPU may run two layer loops that do not depend on each
        other in either order on each device, and two devices then wait for each
        other at different collectives); (the input gradient, loss, aux, gradients)."""
        ok, r, k = item(t, "backward")
        slot = work["backward_slot"][t, stage]
        slot = slot if y is None else after(y, slot)   # every read waits for y
        y_k, *kept = [at(buf, slot) for buf in kept]
        pull_chunk = stash.rebuild(kept, at(inputs, slot))
        # The last chunk on the last stage: the loss of k, and its gradient.
        ends = last & (r == v - 1) & ok
        loss_k, pull_tail, aux_k = jax.vjp(
            lambda rs, y: pieces.tail(rs, staged, y, at(micro, k)), rest, y_k, has_aux=True)
        d_rest_tail, dy_tail = pull_tail(jnp.ones_like(loss_k) / m)
        dy = jnp.where(last & (r == v - 1), dy_tail,
                       at(grads_in, work["grad_slot"][t, stage]))
        d_staged, dx = pull_chunk((dy, stats_cotangent(ok, stats_like, r)))
        _, pull_front = jax.vjp(front, rest, at(micro, k))
        d_rest_front, _ = pull_front(dx)
        grads = (add(masked(d_rest_tail, ends), masked(d_rest_front, first & (r == 0) & ok)),
                 masked(d_staged, ok))
        return dx, jnp.where(ends, loss_k, 0), masked(aux_k, ends), grads

    def arrive(buffer, kind, sent, t):   # kept where the table says it arrives
        slot = work[kind][t + 1, stage]
        return keep(buffer, activations(sent), slot >= 0, slot)

    def tick(has_forward, has_backward, carry, t):
        """One tick of a phase: the work it has; what it sends arrives at the next,
        kept after this tick's backward has read the slots freed by it. The output is
        sent after the input gradient (the same XLA:CPU hazard as ``backward``'s)."""
        inputs, kept, grads_in, stats, loss, aux, grads = carry
        y = None
        if has_forward:
            inputs, kept, stats, y = forward(t, inputs, kept, stats)
        if has_forward and not train:
            loss_k, aux_k = evaluated(t, y)
            loss, aux = loss + loss_k, add(aux, aux_k)
        if has_backward:
            dx, loss_k, aux_k, d = backward(t, inputs, kept, grads_in, y)
            loss, aux, grads = loss + loss_k, add(aux, aux_k), add(grads, d)
            dx = jax.lax.ppermute(dx, axis, ring(-1))
            grads_in = arrive(grads_in, "grad_arrive", dx, t)
            y = y if y is None else after(dx, y)
        if has_forward:
            inputs = arrive(inputs, "arrive", jax.lax.ppermute(y, axis, ring(1)), t)
        inputs = constrain(inputs, (None, BATCH, SEQ, ACT_EMBED))
        grads_in = grads_in if grads_in is None else constrain(grads_in,
                                                               (None, BATCH, SEQ, ACT_EMBED))
        return (inputs, kept, grads_in, stats, loss, aux, grads), None

    carry = (slots(buffers.inputs),   # then the chunks' outputs and stashes, as they
             [varying(jnp.zeros((buffers.inputs, *a.shape), a.dtype))   # the inputs' slots
              for a in [x_shape, *stash.shapes]] if train else [],
             slots(max(buffers.grads, 1)) if train else None,
             jax.tree.map(lambda a: varying(jnp.zeros((v * m, *a.shape), a.dtype)),
                          stats_shape),
             varying(jnp.zeros((), jnp.float32)), zeros(aux_shape),
             (zeros(rest), zeros(staged)) if train else None)
    for start, end, has_forward, has_backward in table.phases:
        if has_forward or train:
            carry, _ = jax.lax.scan(functools.partial(tick, has_forward, has_backward and train),
                                    carry, jnp.arange(start, end))
    _, _, _, stats, loss, aux, grads = carry
    # Items c M + k, stack after stack: stack i's [1, V, M, ...] in model order.
    stats = [runner.in_model_order(jax.tree.map(
        lambda a: a.reshape(len(stacks), runner.repeats, m, *a.shape[1:])[i][None], stats[i]),
        stack, axis) for i, stack in enumerate(stacks)]
    loss = jax.lax.psum(loss, axis) / m + sum(pieces.stats_loss(
        {k: a for k, a in st.items() if k in stack.summed}) for st, stack in zip(stats, stacks))
    aux = jax.tree.map(lambda a: jax.lax.psum(a, axis) / m, aux)
    if not train:
        return loss, aux, stats
    # Embedding and head gradients from the first and last stage: summed once.
    d_rest, d_staged = grads
    return (loss, aux, stats), (jax.lax.psum(d_rest, axis), d_staged)


class Stash(NamedTuple):
    """What a chunk's forward keeps for its backward: the residuals of its ``jax.vjp``
    (``Pieces.kept`` chooses them) but the weights and the chunk's input, which the
    backward has anyway. Each has a buffer of the input's slots (``Schedule.buffers``):
    kept from the forward until the backward rebuilds the vjp from them."""

    treedef: jax.tree_util.PyTreeDef   # of the vjp function
    sources: tuple                     # each residual's: a weight's index, -1: the
                                       # chunk's input, None: kept
    shapes: tuple                      # the kept residuals' (jax.ShapeDtypeStruct)
    weights: list                      # this stage's blocks, as the vjp took them

    @classmethod
    def of(cls, backward_of: Callable, like: Callable, weights) -> "Stash":
        """The stash of ``backward_of(x, r)`` (chunk r's vjp function at input x,
        linearized at ``weights``) for arguments like ``like()`` (traced as the ticks
        trace theirs: the vjp function is rebuilt from this trace's structure)."""
        found = {}

        def kept(x, r):
            leaves, found["treedef"] = jax.tree.flatten(backward_of(x, r))
            ids = {id(a): i for i, a in enumerate(jax.tree.leaves(weights))}
            found["sources"] = tuple(-1 if a is x else ids.get(id(a)) for a in leaves)
            return [a for a, source in zip(leaves, found["sources"]) if source is None]

        shapes = jax.eval_shape(lambda: kept(*like()))
        return cls(found["treedef"], found["sources"], tuple(shapes), weights)

    def keep(self, backward) -> list:
        """The residuals of ``backward`` to keep."""
        leaves = jax.tree.leaves(backward)
        kept = [a for a, source in zip(leaves, self.sources) if source is None]
        if len(leaves) != len(self.sources) or [a.shape for a in kept] != [
                a.shape for a in self.shapes]:
            raise ValueError("a chunk's vjp changed its residuals between two traces")
        return kept

    def rebuild(self, kept: Sequence[jax.Array], x) -> Callable:
        """The vjp function from its ``kept`` residuals and its input ``x``."""
        weights, kept = jax.tree.leaves(self.weights), iter(kept)
        return jax.tree.unflatten(self.treedef, [
            next(kept) if source is None else x if source == -1 else weights[source]
            for source in self.sources])


def _chunks(runner, stacks: Sequence[Stack], pieces: Pieces, rest, staged, embedded, m: int,
            axis):
    """(chunk, stats_cotangent, stats shapes, stats zeros) of ``stacks`` run as one
    pipeline, on inputs like ``embedded()``: chunk c of the table is chunk c % V of
    stack c // V. ``chunk(staged, x, c)`` -> (y, each stack's stats: zeros but for
    c's); ``stats_cotangent(ok, stats, c)`` their cotangents in its backward
    (``_stats_cotangents``; ``stats`` typed as the chunk's, as the zeros are). With
    several stacks a stage runs c's stack by ``lax.switch``: at a tick, stages may
    run different ones."""
    v = runner.repeats
    shapes = [jax.eval_shape(lambda: pieces.chunk(rest, staged, embedded(), 0, i)[1])
              for i in range(len(stacks))]
    cotangents = [_stats_cotangents(stack, runner, shape, pieces.stats_loss, m, axis)
                  for stack, shape in zip(stacks, shapes)]

    def zeros(shape):   # typed as the stats are (a branch's outputs must match the others')
        cast = lambda a, axes: jax.lax.pcast(a, tuple(axes), to="varying") if axes else a
        return jax.tree.map(lambda a: cast(jnp.zeros(a.shape, a.dtype),
                                           nested.varying_axes(a)), shape)

    def one(i, staged, x, r):   # stack i's chunk r, every stack's stats
        y, stats = pieces.chunk(rest, staged, x, r, i)
        return y, [stats if j == i else zeros(shape) for j, shape in enumerate(shapes)]

    def chunk(staged, x, c):
        if len(stacks) == 1:
            return one(0, staged, x, c)
        return jax.lax.switch(c // v, [functools.partial(one, i) for i in range(len(stacks))],
                              staged, x, c % v)

    def stats_cotangent(ok, stats, c):
        return [f(ok & (c // v == i), st, c % v)
                for i, (f, st) in enumerate(zip(cotangents, stats))]

    return chunk, stats_cotangent, shapes, [zeros(shape) for shape in shapes]


def after(first: jax.Array, then: jax.Array) -> jax.Array:
    """``then``, made to depend on ``first``: plus 0 times one of its elements, which
    XLA does not fold (0 * x is not 0 for an inf or a nan; where ``first`` holds
    one, the step's loss or gradients do too, and the step is skipped anyway)."""
    return then + (0 * first.ravel()[0]).astype(then.dtype)


def _stats_cotangents(stack: Stack, runner, stats_shape: dict, stats_loss, m: int, axis):
    """(ok, stats, r) -> the cotangents of chunk r's ``stats`` [c, ...] in a backward: for each stat
    the layers sum over the batch, the gradient of ``stats_loss`` (linear, so
    taken once) of the chunk's layers over M (the loss takes their mean over the
    microbatches), times the batch ranks the stage runs manual over (each rank's loss
    carries the stats loss of the whole batch, and the step takes their mean); zero
    for the padding slots, the per-example stats, and when ``ok`` is False."""
    whole = {k: jnp.zeros((stack.n, *a.shape[1:]), a.dtype)
             for k, a in stats_shape.items() if k in stack.summed}
    grad = jax.grad(stats_loss)(whole) if whole else {}
    mesh = jax.sharding.get_abstract_mesh()
    batch_ranks = math.prod(mesh.shape[a] for a in mesh.manual_axes if a not in axis)
    chunk = runner.chunk_size(stack)
    local = stack.shape   # this stage's [1, ...]: the whole stack has S of them
    whole_stack = StackShape(local.layers, (runner.stages, *local.dims[1:]), True, runner.repeats)
    layer_at = jnp.asarray(whole_stack.layer_at().reshape(runner.stages, runner.repeats, -1)[
        :, :, :chunk])[jax.lax.axis_index(axis)]   # [V, c]: each slot's layer, -1: padding

    def cotangents(ok, stats, r):
        real = layer_at[r] >= 0

        def one(k, a):
            # A stat the same on every stage (a constant) depends on nothing it runs.
            if k not in grad or not set(axis) <= nested.varying_axes(a):
                return jnp.zeros_like(a)
            g = grad[k][jnp.maximum(layer_at[r], 0)] * batch_ranks / m
            return jnp.where(ok & real.reshape(-1, *[1] * (a.ndim - 1)), g, 0).astype(a.dtype)
        return {k: one(k, a) for k, a in stats.items()}
    return cotangents
