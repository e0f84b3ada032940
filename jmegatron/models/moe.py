"""Mixture-of-experts MLP (Qwen3-MoE / DeepSeek-V3 style) with expert parallelism.

A router scores each token against E experts (softmax, or sigmoid with an
auxiliary-loss-free bias), sends it to the top k, and combines their SwiGLU
outputs weighted by the (renormalized) top-k scores; an optional shared
expert sees every token. Expert weights are stacked per layer as
gate_up [L, E, D, 2, F] and down [L, E, F, D] (logical axes ``layers,
experts, embed, glu, mlp``), so each expert's matrices are their own Muon
matrices (a batch over L and E).

Under a mesh the layer runs in ``jax.shard_map``: experts split over the
``expert`` axis (tokens travel by all-to-all, see
``jmegatron.models.dispatch``), each expert's F split over ``tensor``
(column-parallel gate/up, row-parallel down: one all-reduce of the combined
output forward, one of the input gradient backward), expert weights split
over ``fsdp`` along D gathered per layer (their gradients reduce-scattered
back), and the batch split over the data axes. The load statistics and
losses are sums over the whole batch: [E]-sized all-reduces.

Losses (means over MoE layers): load balancing E * sum_i f_i P_i with f_i
the share of the N = S * k assignments routed to expert i and P_i the mean
router probability of expert i (1 when balanced; Switch, Megatron), and the
router z-loss mean_s logsumexp(logits_s)^2 (ST-MoE).

References:
  Yang et al., "Qwen3 Technical Report", arXiv:2505.09388, 2025.
  DeepSeek-AI, "DeepSeek-V3 Technical Report", arXiv:2412.19437, 2024.
  Wang et al., "Auxiliary-Loss-Free Load Balancing Strategy for
    Mixture-of-Experts", arXiv:2408.15664, 2024.
  Fedus et al., "Switch Transformers", arXiv:2101.03961, 2021.
  Zoph et al., "ST-MoE: Designing Stable and Transferable Sparse Expert
    Models", arXiv:2202.08906, 2022.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax
from jax.sharding import PartitionSpec as P

from jmegatron.models import dispatch
from jmegatron.models.config import GPTConfig, MoEConfig
from jmegatron.models.layers import Attention, SwiGLU, param, rms_norm
from jmegatron.sharding import nested, rules as ax
from jmegatron.sharding.rules import (active_mesh_and_rules, axis_roles, constrain,
                                     logical_to_spec, mesh_axes_of)
from jmegatron.sharding.stacks import stack_of

# Per-layer statistics: "load" [E] (share of assignments per expert), "dropped"
# (share dropped), "aux_loss", "z_loss"; stacked [L_moe, ...] by the model. Each
# is over the whole batch, the same on every rank.
Stats = dict[str, jax.Array]
STATS = ("load", "dropped", "aux_loss", "z_loss")


class ExpertBias(nnx.Variable):
    """Per-expert routing bias of auxiliary-loss-free balancing. It only picks the
    experts (never weights them) and is set by ``balance_expert_bias`` after each
    step, not by gradients: a variable of its own type, not an ``nnx.Param``, so
    the optimizer never sees it."""


class Routed(NamedTuple):
    experts: jax.Array    # [S, k] int32 expert ids
    weights: jax.Array    # [S, k] fp32 combine weights
    probs: jax.Array      # [S, E] fp32 scores normalized over experts (for the aux loss)
    log_z: jax.Array      # [S] logsumexp of the router logits (for the z-loss)


def route(x: jax.Array, router: jax.Array, bias: jax.Array | None, cfg: MoEConfig) -> Routed:
    """Top-k routing of tokens x [S, D] with router [D, E], in fp32."""
    logits = x.astype(jnp.float32) @ router.astype(jnp.float32)          # [S, E]
    if cfg.scoring == "softmax":
        scores = jax.nn.softmax(logits, axis=-1)
    elif cfg.scoring == "sigmoid":
        scores = jax.nn.sigmoid(logits)
    else:
        raise ValueError(f"unknown router scoring {cfg.scoring!r}; softmax or sigmoid")
    choice = scores if bias is None else scores + bias
    experts = lax.top_k(lax.stop_gradient(choice), cfg.top_k)[1]
    weights = jnp.take_along_axis(scores, experts, axis=-1)
    if cfg.normalize_top_k:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    probs = scores / jnp.sum(scores, axis=-1, keepdims=True)
    return Routed(experts, weights, probs, jax.nn.logsumexp(logits, axis=-1))


def moe_mlp(x: jax.Array, router: jax.Array, bias: jax.Array | None, gate_up: jax.Array,
            down: jax.Array, cfg: MoEConfig, grad_dtype=None) -> tuple[jax.Array, Stats]:
    """The routed experts on x [B, T, D]: (output [B, T, D], stats of this layer).

    Without an active mesh (``activation_sharding``) it runs as it is; with one,
    in ``jax.shard_map`` over the whole mesh (see the module docstring); inside one
    manual over the batch axes already (``rules.run_gathered``; only where no
    other mesh axis is live: ``rules.only_batch_axes_live``), on the local blocks;
    inside a pipeline stage (manual over ``stage``), over the other axes
    (``sharding.nested``). The experts' weight gradients are computed in
    ``grad_dtype`` (None: the compute dtype; ``models.products``).
    """
    active = active_mesh_and_rules()
    if active is None:
        y, sums = _local(x.reshape(-1, x.shape[-1]), router, bias,
                         dispatch.ExpertWeights(gate_up, down, grad_dtype), cfg)
        return y.reshape(x.shape), _finish(sums, cfg)
    mesh, rules = active
    # Manual already: over the batch axes (rules.run_gathered: the body runs on the
    # local blocks), or over pipeline stages (the layer maps over the other axes).
    stages = mesh_axes_of(ax.STAGES, rules)
    manual = tuple(a for a in jax.sharding.get_abstract_mesh().manual_axes if a not in stages)
    live = lambda name: tuple(a for a in mesh_axes_of(name, rules) if mesh.shape[a] > 1)
    # A layer's weights are split as a layer of the stack is: where `layers` takes
    # mesh axes (the owner layout), they no longer split the other dims.
    stacked = mesh_axes_of(ax.LAYERS, rules)
    ep, embed = live(ax.EXPERTS), tuple(a for a in live(ax.EMBED) if a not in stacked)
    # Sums run over size-1 axes too: the specs name them, so values vary over them.
    # Inside a manual region the other axes are all of size 1 and not manual.
    # The routing statistics are sums over every token: over the batch's and the
    # sequence's axes (context parallelism routes each rank's own tokens).
    tokens, tp = (manual, ()) if manual else (axis_roles(rules).tokens,
                                              mesh_axes_of(ax.MLP, rules))
    batch = manual or mesh_axes_of(ax.BATCH, rules)
    if not set(ep) <= set(batch):
        raise ValueError(f"experts are split over {ep}, which must also split the batch "
                         f"(batch axes {batch}): tokens reach experts by all-to-all over them")
    spec = lambda *names: logical_to_spec(names, rules, exclude=stacked)
    x_spec = logical_to_spec((ax.BATCH, ax.SEQ, ax.ACT_EMBED), rules)
    w_specs = (spec(ax.EMBED, None), P(), spec(ax.EXPERTS, ax.EMBED, ax.GLU, ax.MLP),
               spec(ax.EXPERTS, ax.MLP, ax.EMBED))

    def body(x_block, router, bias, gate_up, down):   # [B/batch, T, D], local weights
        whole = lambda w, dim: lax.all_gather(w, embed, axis=dim, tiled=True) if embed else w
        y, sums = _local(x_block.reshape(-1, x_block.shape[-1]), whole(router, 0),
                         None if bias.size == 0 else bias,
                         dispatch.ExpertWeights(whole(gate_up, 1), whole(down, 2), grad_dtype),
                         cfg, ep)
        if tp:   # row-parallel down projection: sum the partial outputs once, after combining
            y = lax.psum(y, tp)
        sums = jax.tree.map(lambda v: lax.psum(v, tokens) if tokens else v, sums)
        return y.reshape(x_block.shape), _finish(sums, cfg)

    no_bias = jnp.zeros((0,), jnp.float32) if bias is None else bias
    if manual:
        return body(x, router, no_bias, gate_up, down)
    return nested.shard_map(body, mesh, (x_spec, *w_specs),
                            (x_spec, {k: P() for k in STATS}))(x, router, no_bias, gate_up, down)


def _local(x, router, bias, ffn: dispatch.ExpertWeights, cfg: MoEConfig, ep_axes=()):
    """Routed experts on one device's tokens x [S, D]: (output [S, D], batch sums)."""
    s, k = x.shape[0], cfg.top_k
    r = route(x, router, bias, cfg)
    if cfg.dispatch == "dropless":
        out = dispatch.dropless(x, r.experts, ffn, ep_axes, cfg.exchange)
        dropped = jnp.zeros((), jnp.float32)
    elif cfg.dispatch == "capacity":
        out, dropped = dispatch.capacity(x, r.experts, ffn, cfg.capacity_factor,
                                         ep_axes)
    else:
        raise ValueError(f"unknown dispatch {cfg.dispatch!r}; dropless or capacity")
    y = jnp.einsum("skd,sk->sd", out.reshape(s, k, -1).astype(jnp.float32), r.weights)
    counts = jnp.zeros(cfg.n_experts, jnp.float32).at[r.experts.reshape(-1)].add(1.0)
    sums = {"tokens": jnp.asarray(s, jnp.float32), "counts": counts,
            "probs": r.probs.sum(0), "z": jnp.sum(jnp.square(r.log_z)),
            "dropped": dropped.astype(jnp.float32)}
    return y.astype(x.dtype), sums


def _finish(sums: dict, cfg: MoEConfig) -> Stats:
    """Per-layer stats from sums over the batch."""
    n, k = sums["tokens"], cfg.top_k
    load = sums["counts"] / (n * k)                                       # f_i, sums to 1
    return {"load": load, "dropped": sums["dropped"] / (n * k),
            "aux_loss": cfg.n_experts * jnp.sum(load * sums["probs"] / n),
            "z_loss": sums["z"] / n}


class MoE(nnx.Module):
    """Router, E SwiGLU experts and an optional shared expert.

    Called on x [B, T, D], it returns (output [B, T, D], this layer's stats).

    Args:
      cfg: the model's ``GPTConfig``; ``cfg.moe`` sizes the layer: router [D, E],
        gate_up [E, D, 2, F], down [E, F, D], an ``ExpertBias`` [E] when
        ``bias_rate`` is set and a shared SwiGLU when ``shared_d_ff`` is.
      rngs: the random streams of the initialization.
    """

    def __init__(self, cfg: GPTConfig, rngs: nnx.Rngs):
        m, d = cfg.moe, cfg.d_model
        out_std = cfg.init_std / (2 * cfg.n_layers) ** 0.5
        self.router = param(rngs, (d, m.n_experts), (ax.EMBED, None), cfg.init_std)
        if m.bias_rate:
            self.expert_bias = ExpertBias(jnp.zeros((m.n_experts,), jnp.float32),
                                          out_sharding=(None,), eager_sharding=False,
                                          rate=m.bias_rate)
        self.wide = cfg.weight_grad_dtype
        self.gate_up = param(rngs, (m.n_experts, d, 2, m.d_ff),
                             (ax.EXPERTS, ax.EMBED, ax.GLU, ax.MLP), cfg.init_std, cfg.dtype,
                             self.wide)
        self.down = param(rngs, (m.n_experts, m.d_ff, d), (ax.EXPERTS, ax.MLP, ax.EMBED), out_std,
                          cfg.dtype, self.wide)
        if m.shared_d_ff:
            self.shared = SwiGLU(dataclasses.replace(cfg, d_ff=m.shared_d_ff), rngs)
        self.cfg = m

    def __call__(self, x: jax.Array) -> tuple[jax.Array, Stats]:
        bias = self.expert_bias[...] if self.cfg.bias_rate else None
        y, stats = moe_mlp(x, self.router[...], bias, self.gate_up[...], self.down[...],
                           self.cfg, self.wide)
        if self.cfg.shared_d_ff:
            y = y + self.shared(x)
        return y, stats


class MoEBlock(nnx.Module):
    """Pre-norm decoder block whose MLP is a mixture of experts.

    Called on (x [B, T, D], positions [T]), it returns (x, stats): the MoE stats
    and the attention's largest logits ("max_logit" [B, N]).

    Args:
      cfg: the model's ``GPTConfig`` (``cfg.moe`` sizes the MoE).
      rngs: the random streams of the initialization.
    """

    def __init__(self, cfg: GPTConfig, rngs: nnx.Rngs):
        self.attn_norm = param(rngs, (cfg.d_model,), (ax.NORM,), None)
        self.attn = Attention(cfg, rngs)
        self.mlp_norm = param(rngs, (cfg.d_model,), (ax.NORM,), None)
        self.moe = MoE(cfg, rngs)
        self.eps = cfg.norm_eps

    def __call__(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, Stats]:
        y, max_logit = self.attn(rms_norm(x, self.attn_norm[...], self.eps), positions)
        x = constrain(x + y, (ax.BATCH, ax.SEQ, ax.ACT_EMBED))
        y, stats = self.moe(rms_norm(x, self.mlp_norm[...], self.eps))
        return constrain(x + y, (ax.BATCH, ax.SEQ, ax.ACT_EMBED)), {**stats, "max_logit": max_logit}


def moe_losses(stats: Stats, cfg: MoEConfig) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The weighted MoE losses and their metrics, from the model's stacked stats.

    Metrics: moe_aux_loss, moe_z_loss (unweighted, means over MoE layers),
    moe_load [L_moe, E] (share of routed tokens per expert), moe_max_load
    (max_i E * load_i, mean over layers; 1 is balanced) and moe_dropped (share of
    assignments dropped).

    Args:
      stats: the forward's ``Aux.moe``, per-layer stats stacked [L_moe, ...];
        {} for a dense model.
      cfg: the ``MoEConfig``; its ``aux_loss`` and ``z_loss`` weigh the losses.

    Returns:
      (aux_loss * mean aux + z_loss * mean z, metrics); (0, {}) for a dense model.
    """
    if not stats:
        return jnp.zeros((), jnp.float32), {}
    aux, z = stats["aux_loss"].mean(), stats["z_loss"].mean()
    load = stats["load"]
    metrics = {"moe_aux_loss": aux, "moe_z_loss": z, "moe_load": load,
               "moe_max_load": (load.max(-1) * load.shape[-1]).mean(),
               "moe_dropped": stats["dropped"].mean()}
    return cfg.aux_loss * aux + cfg.z_loss * z, metrics


def balance_expert_bias(variables: nnx.State, metrics: dict[str, jax.Array]) -> nnx.State:
    """``variables`` with each ExpertBias moved against its experts' load error.

    Each moves by rate * sign(1/E - load), rate its ``MoEConfig.bias_rate``
    (DeepSeek-V3: an overloaded expert becomes less likely to be picked);
    unchanged without MoE.

    Args:
      variables: an nnx.State holding the model's ``ExpertBias`` variables (the
        train step passes its part that is not trained); other variables pass
        unchanged.
      metrics: the step's metrics; their "moe_load" [L_moe, E] (``moe_losses``)
        is the load. Without it nothing moves.

    Returns:
      ``variables`` with the biases moved.
    """
    if "moe_load" not in metrics:
        return variables
    load = lax.stop_gradient(metrics["moe_load"])                        # [L_moe, E]

    def step(var):
        if not isinstance(var, ExpertBias):
            return var
        error, stack = 1.0 / load.shape[-1] - load, stack_of(var)
        if stack is not None:   # stacked in groups or stages: padding slots get no error
            error = stack.to_live(error)   # and stay zero
        return var.replace(var[...] + var.get_metadata()["rate"] * jnp.sign(error))

    return jax.tree.map(step, variables, is_leaf=lambda v: isinstance(v, nnx.Variable))
