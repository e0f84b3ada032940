"""Train and eval steps: accumulation, mixed precision, clipping, skip on non-finite."""

from __future__ import annotations

import functools
import itertools
from typing import Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding

from jmegatron.models import context
from jmegatron.models.config import GPTConfig
from jmegatron.models.gpt import kept_for_backward
from jmegatron.models.loss import cross_entropy
from jmegatron.models.moe import balance_expert_bias, moe_losses
from jmegatron.models.qk_clip import Clip
from jmegatron.optim.plan import ShardingPlan
from jmegatron.sharding import rules as ax
from jmegatron.sharding.layouts import Layout
from jmegatron.sharding.pipeline import over_stages, staged_leaves
from jmegatron.sharding.own_backward import Pieces, run_own_backward
from jmegatron.sharding.rules import Rules, activation_sharding, logical_to_spec, without_axes
from jmegatron.sharding.runners import running
from jmegatron.train.optimizer import Optimizer, group_update_rms
from jmegatron.train.state import TrainState, split_trained

# loss_fn(params, tokens [B, T+1]) -> (loss, {"nll": ..., "z_loss": ..., MoE metrics,
# "max_attention_logit": [L, N]}); the entries of PEAKS are maxima, the others means.
LossFn = Callable[[nnx.State, jax.Array], tuple[jax.Array, dict[str, jax.Array]]]
PEAKS = ("max_attention_logit",)


def make_loss_fn(graphdef: nnx.GraphDef, model_cfg: GPTConfig, mesh: jax.sharding.Mesh,
                 layout: Layout, z_loss: float = 0.0, microbatches: int = 1) -> LossFn:
    """Next-token loss of the model; activations pinned by the ``layout``'s rules, its
    layer stacks run by the layout's runner (``Layout.runner``: with pipeline stages,
    over ``microbatches`` inside the pipeline), vocab-parallel loss; plus the weighted
    MoE losses, with the MoE metrics (``moe_losses``), for MoE models; and the largest
    attention logit per layer and head."""
    runner = layout.runner(model_cfg.prefetch, model_cfg.keep_gathered, microbatches)
    if layout.stages == 1:
        return functools.partial(plain_loss(graphdef, model_cfg, runner, layout.rules, z_loss),
                                 mesh)
    # Each stage runs its own blocks (sharding.pipeline), manual over the batch axes too
    # where the layout sums a stage's gradients once a step: its weights are then whole
    # on every batch rank for the step (gathered once where the layout splits them).
    batch_axes = layout.pipeline_batch_axes(model_cfg, mesh.shape)
    rules = without_axes(layout.rules, batch_axes)
    loss_on = own_backward_loss(graphdef, model_cfg, runner, rules, z_loss)
    return over_stages(loss_on, mesh, rules, batch_axes,
                       functools.partial(same_on_every_rank, axes=batch_axes), layout.param_spec,
                       layout.pipeline_gradient_spec)


def plain_loss(graphdef: nnx.GraphDef, cfg: GPTConfig, runner, rules: Rules, z_loss: float):
    """``loss_on(mesh, params, tokens)`` of make_loss_fn: the model run by ``runner``
    (JAX differentiates it), its activations pinned by ``rules`` on ``mesh``."""

    def loss_on(mesh, params, tokens):
        # Where a context axis splits the sequence, inputs and targets alike are dealt.
        order = context.sequence_order(tokens.shape[1] - 1, mesh.shape, rules,
                                       cfg.context_order)
        inputs, targets = (context.deal(a, order) for a in (tokens[:, :-1], tokens[:, 1:]))
        with activation_sharding(mesh, rules), running(runner):
            logits, model_aux = nnx.merge(graphdef, params)(inputs, return_aux=True,
                                                            positions=order)
        loss, aux = cross_entropy(logits, targets, cfg.vocab_size, z_loss=z_loss,
                                  mesh=mesh, rules=rules)
        moe_loss, moe_metrics = moe_losses(model_aux.moe, cfg.moe)
        return loss + moe_loss, {**aux, **moe_metrics,
                                 "max_attention_logit": model_aux.max_logit}

    return loss_on


def same_on_every_rank(out, axes: tuple[str, ...]):
    """A loss function's (loss, aux) on one batch rank's rows -> those of the whole
    batch, on every rank of ``axes``: the mean over the ranks (each holds as many
    tokens), the PEAKS' maximum (aux, not differentiated)."""
    if not axes:
        return out
    loss, aux = out
    over = lambda k, v: (jax.lax.pmax if k in PEAKS else jax.lax.pmean)(
        jax.lax.stop_gradient(v), axes)
    return jax.lax.pmean(loss, axes), {k: over(k, v) for k, v in aux.items()}


def own_backward_loss(graphdef: nnx.GraphDef, cfg: GPTConfig, runner, rules: Rules,
                      z_loss: float):
    """``loss_on(mesh, params, tokens)`` of make_loss_fn under a pipeline schedule
    (``runner``): the model cut into its embedding, this stage's chunks of layers
    (of each stack in model order: dense layers, then MoE ones, as one pipeline) and
    its head with the loss, run and differentiated by ``sharding.own_backward``."""
    kinds = [moe for moe, _ in itertools.groupby(cfg.moe_layers)]   # one stack each

    def loss_on(mesh, params, tokens):
        rest, staged, rebuild = staged_leaves(params)
        model = lambda rest, staged: nnx.merge(graphdef, rebuild(rest, staged))
        positions = jnp.arange(tokens.shape[1] - 1)

        def chunk(rest, staged, x, r, kind):
            stack = model(rest, staged).layer_stack(kinds[kind], positions)
            return runner.run_chunk(stack, [leaf[0] for leaf in stack.leaves], x, r)

        def tail(rest, staged, y, tokens):
            return cross_entropy(model(rest, staged).logits_of(y), tokens[:, 1:],
                                 cfg.vocab_size, z_loss=z_loss, mesh=mesh, rules=rules)

        pieces = Pieces(lambda rest, staged, tokens: model(rest, staged).embed_tokens(
            tokens[:, :-1]), chunk, tail, lambda stats: moe_losses(stats, cfg.moe)[0],
            kept_for_backward(cfg.remat))
        with activation_sharding(mesh, rules):
            stacks = [model(rest, staged).layer_stack(moe, positions) for moe in kinds]
            axis = [runner.check(stack) for stack in stacks][0]
            loss, aux, stats = run_own_backward(runner, stacks, pieces, axis, rest, staged,
                                                tokens)
        max_logit = jnp.concatenate([st.pop("max_logit") for st in stats]).max(axis=1)
        _, moe_metrics = moe_losses(stats[kinds.index(True)] if True in kinds else {}, cfg.moe)
        return loss, {**aux, **moe_metrics, "max_attention_logit": max_logit}

    return loss_on


def split_microbatches(tokens: jax.Array, n: int, mesh: jax.sharding.Mesh,
                       rules: Rules) -> jax.Array:
    """[B, T+1] -> [n, B/n, T+1] such that each device keeps its own rows.

    Microbatch m takes rows m, m+n, m+2n, ...: a device's contiguous block of
    B/dp rows splits evenly over the n microbatches without moving.
    """
    b, t = tokens.shape
    micro = tokens.reshape(b // n, n, t).swapaxes(0, 1)
    spec = logical_to_spec((None, ax.BATCH, None), rules)   # windows whole: the loss deals them
    return jax.lax.with_sharding_constraint(micro, NamedSharding(mesh, spec))


def accumulate_grads(loss_fn: LossFn, params: nnx.State, micro: jax.Array):
    """Mean loss, aux and gradients over microbatches [n, b, T+1], summed in fp32
    (the aux entries of PEAKS: maxima)."""
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def one(tokens):
        (loss, aux), grads = grad_fn(params, tokens)
        peaks = {k: aux.pop(k) for k in PEAKS if k in aux}
        return jax.tree.map(lambda x: x.astype(jnp.float32), (loss, aux, grads)), peaks

    def add(carry, tokens):
        total, peaks = one(tokens)
        return (jax.tree.map(jnp.add, carry[0], total),
                jax.tree.map(jnp.maximum, carry[1], peaks)), None

    (total, peaks), _ = jax.lax.scan(add, one(micro[0]), micro[1:])
    loss, aux, grads = jax.tree.map(lambda x: x / micro.shape[0], total)
    return loss, {**aux, **peaks}, grads


def make_train_step(loss_fn: LossFn, optimizer: Optimizer, microbatches: int,
                    mesh: jax.sharding.Mesh, rules: Rules, qk_clip: Clip | None = None,
                    ) -> Callable[[TrainState, jax.Array], tuple[TrainState, dict]]:
    """A jitted step (state donated). A step whose loss, gradients, new params or new
    optimizer state are not all finite leaves params and optimizer state bitwise
    unchanged and is counted as skipped. ``qk_clip`` (``models.qk_clipper``) rescales
    the updated attention weights for the step's largest logits."""

    def train_step(state: TrainState, tokens: jax.Array):
        micro = split_microbatches(tokens, microbatches, mesh, rules)
        trained, fixed = split_trained(state.params)   # only nnx.Params reach the optimizer
        # Masters kept on their owners are gathered for the model once, before the
        # microbatches: its gradients are the masters' (ShardingPlan.model_weights).
        weights = optimizer.plan.for_optimizer().model_weights(trained)
        loss, aux, grads = accumulate_grads(
            lambda p, t: loss_fn(nnx.merge_state(p, fixed), t), weights, micro)
        grad_norm = optax.tree.norm(grads)
        updates, opt_state = optimizer.tx.update(grads, state.opt_state, trained)
        fixed = balance_expert_bias(fixed, aux)   # MoE only: set by the step, not trained
        trained, logit_metrics = watch_logits(optax.apply_updates(trained, updates), aux,
                                              qk_clip)
        params = nnx.merge_state(trained, fixed)
        finite = (jnp.isfinite(loss) & jnp.isfinite(grad_norm) & all_finite(params)
                  & all_finite(opt_state))
        keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)
        new_state = TrainState(state.step + 1, keep(params, state.params),
                               keep(opt_state, state.opt_state),
                               state.skipped + (~finite).astype(jnp.int32))
        metrics = {"loss": loss, **aux, **logit_metrics, "grad_norm": grad_norm,
                   # Skipped steps rolled the optimizer's own count back too.
                   "lr": optimizer.schedule(state.step - state.skipped), "skipped": ~finite,
                   **group_update_rms(updates, optimizer.leaf_groups)}
        return new_state, metrics

    return jax.jit(train_step, donate_argnums=0)


def watch_logits(trained: nnx.State, aux: dict, qk_clip: Clip | None):
    """Takes the step's largest attention logits [L, N] out of ``aux``: (``trained``,
    clipped by ``qk_clip`` when given; their metrics: the max overall and per layer,
    and the clip's)."""
    max_logit = aux.pop("max_attention_logit", None)
    if max_logit is None:
        if qk_clip is not None:
            raise ValueError("qk_clip needs the loss function's max_attention_logit "
                             "(make_loss_fn reports it)")
        return trained, {}
    metrics = {"max_attention_logit": max_logit.max(),
               "max_attention_logit_per_layer": max_logit.max(axis=-1)}
    if qk_clip is not None:
        trained, clip_metrics = qk_clip(trained, max_logit)
        metrics.update(clip_metrics)
    return trained, metrics


def all_finite(tree) -> jax.Array:
    """True when no floating-point leaf of ``tree`` holds a NaN or an inf."""
    flags = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)
             if jnp.issubdtype(x.dtype, jnp.inexact)]
    return jnp.all(jnp.stack(flags)) if flags else jnp.bool_(True)


def make_eval_step(loss_fn: LossFn, plan: ShardingPlan | None = None
                   ) -> Callable[[nnx.State, jax.Array], jax.Array]:
    """Jitted mean next-token loss (without z-loss) of one batch, on the weights the
    model computes with (``plan.model_weights``)."""
    weights = plan.model_weights if plan is not None else lambda params: params
    return jax.jit(lambda params, tokens: loss_fn(weights(params), tokens)[1]["nll"])
