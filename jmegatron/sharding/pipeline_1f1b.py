"""The ``1f1b`` pipeline schedule: one forward and one backward each tick, so a
stage keeps a bounded number of microbatches in flight whatever M.

GPipe differentiates its tick loop as a whole: the backward starts after the
last forward, and every stage keeps the activations of all M microbatches.
1F1B (Narayanan et al., 2021, "PipeDream-Flush") starts each microbatch's
backward as soon as its forward has left the last stage. An SPMD program can
only do that with its own backward, so here the whole model runs as one
``custom_vjp`` whose forward already computes the gradients:

  tick t, stage s:  forward   of microbatch f = t - s          (0 <= f < M)
                    backward  of microbatch k = t - (2S - 2 - s) (0 <= k < M)

(the tables of ``sharding.schedules``, which the ticks read).

Stage 0 embeds microbatch f; the last stage runs the head and the loss on it
and, in the same tick, starts its backward (k = f there). Activations go to
the next stage and input gradients to the previous one, one
``collective-permute`` each per tick. A stage keeps the input of each
microbatch in flight (at most 2(S - s) - 1 of them, in 2S - 1 slots:
``Schedule.slots``)
and recomputes its layers from it in the backward, as Megatron's 1F1B with
full recomputation of a stage: one extra forward, and temporaries that grow
with S, not with M. M + 2S - 2 ticks; the F and B waves travel one stage a
tick each, so the bubble is (2S - 2) / (M + 2S - 2), about twice GPipe's.

The loss of a microbatch is its own mean token loss; the step's loss is the
mean over the M microbatches plus the layers' stats loss (MoE), which is
linear in the stats: each layer's stats get the constant cotangent
``grad(stats_loss) / M`` in the backward, times the batch ranks where the stage
runs manual over the batch axes (``Layout.pipeline_batch_axes``): there the
layers sum the stats over those ranks, every rank's loss carries the stats loss
and the step takes the ranks' mean, so each rank seeds the whole sum's share. The gradients of the embedding and
head (computed on the first and last stage) are summed over the stages once,
at the end of the step: the weight-sized all-reduce Megatron also makes for
tied embeddings.

References:
  Narayanan et al., "Efficient Large-Scale Language Model Training on GPU
    Clusters Using Megatron-LM", arXiv:2104.04473, 2021.
  Narayanan et al., "Memory-Efficient Pipeline-Parallel DNN Training"
    (PipeDream-2BW/Flush), arXiv:2006.09503, 2021.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jmegatron.sharding import nested
from jmegatron.sharding.pipeline import at, keep, varying
from jmegatron.sharding.rules import ACT_EMBED, BATCH, SEQ, constrain
from jmegatron.sharding.runners import Stack
from jmegatron.sharding.stacks import StackShape


class Pieces(NamedTuple):
    """A model cut for the 1F1B schedule, as functions of its weights: ``rest`` (the
    leaves outside the pipeline's stack: embedding, head) and ``staged`` (this
    stage's blocks, [1, ...] each)."""

    front: Callable   # (rest, staged, tokens [b, T+1]) -> x [b, T, D]: the embedding
    chunk: Callable   # (rest, staged, x) -> (y, stats [c, ...]): this stage's layers
    tail: Callable    # (rest, staged, y, tokens) -> (loss, aux): head and mean loss
    stats_loss: Callable   # the stack's stats [L, ...] -> their loss; linear


def one_f_one_b(runner, stack: Stack, pieces: Pieces, axis, rest, staged, tokens):
    """(loss, aux, stats) of a batch ``tokens`` [B, T+1] through the model ``pieces``
    under the 1F1B schedule of ``runner`` (a ``PipelineRunner``), manual over the
    stage ``axis``; the gradients of ``rest`` and ``staged`` are the schedule's own.

    ``aux`` is the tail's, averaged over the microbatches; ``stats`` the stack's
    in model order (``PipelineRunner.in_model_order``), on every stage."""

    @jax.custom_vjp
    def run(rest, staged, tokens):
        return _schedule(runner, stack, pieces, axis, rest, staged, tokens)[0]

    def forward(rest, staged, tokens):   # (out, residuals: the gradients)
        return _schedule(runner, stack, pieces, axis, rest, staged, tokens)

    def backward(grads, cotangents):   # only the loss is differentiable
        scale = cotangents[0]
        return (*jax.tree.map(lambda g: (scale * g).astype(g.dtype), grads), None)

    run.defvjp(forward, backward)
    return run(rest, staged, tokens)


def _schedule(runner, stack: Stack, pieces: Pieces, axis, rest, staged, tokens):
    """((loss, aux, stats), (d rest, d staged)): the ticks of the module docstring."""
    table = runner.table
    m, s_count = runner.microbatches, runner.stages
    stage = jax.lax.axis_index(axis)
    forward, backward = jnp.asarray(table.forward), jnp.asarray(table.backward)
    write, read, ring = table.slots   # where each stage keeps its inputs in flight
    write, read = jnp.asarray(np.maximum(write, 0)), jnp.asarray(np.maximum(read, 0))
    b = tokens.shape[0] // m
    micro = tokens.reshape(b, m, tokens.shape[1]).swapaxes(0, 1)   # rows k, k + M, ...
    masked = lambda tree, ok: jax.tree.map(lambda g: jnp.where(ok, g, 0).astype(g.dtype), tree)
    add = lambda a, b: jax.tree.map(jnp.add, a, b)
    activations = lambda x: constrain(x, (BATCH, SEQ, ACT_EMBED))

    # Each stage differentiates its own copy of the embedding and head: their gradients
    # are summed over the stages once, after the ticks.
    rest = varying(rest)
    front = lambda r, tok: pieces.front(r, staged, tok)
    chunk = lambda st, x: pieces.chunk(rest, st, x)

    def shapes():
        x = front(rest, micro[0])
        y, stats = chunk(staged, x)
        return x, stats, pieces.tail(rest, staged, y, micro[0])[1]

    x_shape, stats_shape, aux_shape = jax.eval_shape(shapes)
    stats_cotangent = _stats_cotangents(stack, runner, stats_shape, pieces.stats_loss, m, axis)
    zeros = lambda tree: jax.tree.map(lambda a: varying(jnp.zeros(a.shape, a.dtype)), tree)

    def tick(carry, t):
        y_prev, bwd_in, inputs, stats, loss, aux, grads = carry
        f, k = forward[t, stage], backward[t, stage]   # this tick's work (-1: none)
        f_ok, k_ok = f >= 0, k >= 0
        f, k = jnp.maximum(f, 0), jnp.maximum(k, 0)
        first, last = stage == 0, stage == s_count - 1
        # Forward of microbatch f (the last tick's output reaches the next stage first);
        # its stage input kept until its backward.
        fwd_in = activations(jax.lax.ppermute(y_prev, axis,
                                              [(i, i + 1) for i in range(s_count - 1)]))
        x = jnp.where(first, front(rest, at(micro, f)), fwd_in)
        inputs = keep(inputs, x, f_ok, write[t, stage])
        y, st = chunk(staged, x)
        stats = jax.tree.map(lambda buf, new: keep(buf, new, f_ok, f), stats, st)
        # The last stage: the loss of f, and its gradient to start f's backward now.
        loss_f, pull_tail, aux_f = jax.vjp(lambda r, y: pieces.tail(r, staged, y, at(micro, f)),
                                           rest, y, has_aux=True)
        d_rest_tail, dy_tail = pull_tail(jnp.ones_like(loss_f) / m)
        ends = last & f_ok
        loss = loss + jnp.where(ends, loss_f, 0)
        aux = add(aux, masked(aux_f, ends))
        # Backward of microbatch k from its kept input (the layers recomputed), after the
        # forward and the head: XLA:CPU may run two layer loops that do not depend on
        # each other in either order on each device, and two devices then wait for
        # each other at different collectives.
        dy = jnp.where(last, dy_tail, bwd_in)
        (_, st_k), pull_chunk = jax.vjp(chunk, staged, after(dy, at(inputs, read[t, stage])))
        d_staged, dx = pull_chunk((dy, stats_cotangent(k_ok, st_k)))
        _, pull_front = jax.vjp(front, rest, at(micro, k))
        d_rest_front, _ = pull_front(dx)
        grads = add(grads, (add(masked(d_rest_tail, ends), masked(d_rest_front, first & k_ok)),
                            masked(d_staged, k_ok)))
        bwd_in = activations(jax.lax.ppermute(dx, axis, [(i + 1, i) for i in range(s_count - 1)]))
        inputs = constrain(inputs, (None, BATCH, SEQ, ACT_EMBED))
        return (y, bwd_in, inputs, stats, loss, aux, grads), None

    start = (zeros(x_shape), zeros(x_shape),
             varying(jnp.zeros((ring, *x_shape.shape), x_shape.dtype)),
             jax.tree.map(lambda a: varying(jnp.zeros((m, *a.shape), a.dtype)), stats_shape),
             varying(jnp.zeros((), jnp.float32)), zeros(aux_shape),
             (zeros(rest), zeros(staged)))
    (_, _, _, stats, loss, aux, (d_rest, d_staged)), _ = jax.lax.scan(
        tick, start, jnp.arange(table.ticks))
    # Embedding and head gradients from the first and last stage: summed once.
    d_rest = jax.lax.psum(d_rest, axis)
    stats = runner.in_model_order(jax.tree.map(lambda a: a[None, None], stats), stack, axis)
    loss = jax.lax.psum(loss, axis) / m + pieces.stats_loss(
        {k: v for k, v in stats.items() if k in stack.summed})
    aux = jax.tree.map(lambda a: jax.lax.psum(a, axis) / m, aux)
    return (loss, aux, stats), (d_rest, d_staged)


def after(first: jax.Array, then: jax.Array) -> jax.Array:
    """``then``, made to depend on ``first``: plus 0 times one of its elements, which
    XLA does not fold (0 * x is not 0 for an inf or a nan; where ``first`` holds
    one, the step's loss or gradients do too, and the step is skipped anyway)."""
    return then + (0 * first.ravel()[0]).astype(then.dtype)


def _stats_cotangents(stack: Stack, runner, stats_shape: dict, stats_loss, m: int, axis):
    """(ok, stats) -> the cotangents of one chunk's ``stats`` [c, ...] in a backward: for each stat
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
    whole_stack = StackShape(local.layers, (runner.stages, *local.dims[1:]), True)
    layer_at = jnp.asarray(whole_stack.layer_at().reshape(runner.stages, -1)[:, :chunk])[
        jax.lax.axis_index(axis)]   # the layer in each of this stage's slots, -1: padding
    real = layer_at >= 0

    def cotangents(ok, stats):
        def one(k, a):
            # A stat the same on every stage (a constant) depends on nothing it runs.
            if k not in grad or not set(axis) <= nested.varying_axes(a):
                return jnp.zeros_like(a)
            g = grad[k][jnp.maximum(layer_at, 0)] * batch_ranks / m
            return jnp.where(ok & real.reshape(-1, *[1] * (a.ndim - 1)), g, 0).astype(a.dtype)
        return {k: one(k, a) for k, a in stats.items()}
    return cotangents
