"""MuonBP against an independent float64 NumPy implementation of the paper's update
(Khaled et al. 2025, Algorithm 1): Muon's momentum; on full steps (t a multiple of
P) the whole matrix orthogonalized, on block steps each device's block of it,
scaled by its own shape and by the block step size. The blocks are cut here from
the mesh (which mesh axes split which matrix dim), not by the optimizer's code.

Mutated references (the period skipped, every step full, the period shifted by
one) must miss the optimizer's params by far more than the tolerance, so the
comparison that passes could not have passed for them.
"""

import dataclasses
import functools
import itertools
import math

import jax
import numpy as np
import pytest
from flax import nnx

from helpers import grads_of, ns_roundoff, optimizer_step, relative_miss, three_steps
from jmegatron.analysis import hlo_collectives
from jmegatron.analysis.hlo import branch_collectives, periodic_bytes_per_device
from jmegatron.models import GPT, GPTConfig
from jmegatron.optim import make_plan, muon, muon_bp, trainable_params
from jmegatron.sharding import MeshConfig, make_mesh
from jmegatron.sharding.layouts import make_layout
from jmegatron.sharding.rules import spec_axes
from jmegatron.train import create_train_state

MODEL = GPTConfig(vocab_size=259, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2,
                  d_ff=64).pad_vocab(2)
LR, PERIOD, RATIO, BETA = 0.02, 2, 0.5, 0.95
# Muon's "quintic" set, written out again (not imported: no shared typo).
QUINTIC = [(4.0848, -6.8946, 2.9270), (3.9505, -6.3029, 2.6377), (3.7418, -5.5913, 2.3037),
           (2.8769, -3.1427, 1.2046), (2.8366, -3.0525, 1.2012)]
# fp32 Newton-Schulz against float64, relative to the largest entry of a leaf's
# summed update: the quintic's round-off bound (helpers.ns_roundoff, 2.9e-5); measured
# at most 1.3e-6 under XLA:CPU's fusion emitters, 1.04e-5 under its LLVM IR emitters
# (layerwise_tensor2), which the tests compile with (tests/conftest.py).
TOL = ns_roundoff()
CASES = {   # layout, mesh: fsdp splits embed; tensor splits heads and mlp; owner and
            # layerwise hold whole matrices (tensor shards) on each device
    "fsdp8": ("fsdp", MeshConfig(fsdp=8)),
    "fsdp4_tensor2": ("fsdp", MeshConfig(fsdp=4, tensor=2)),
    "owner8": ("owner", MeshConfig(fsdp=8)),
    "layerwise_tensor2": ("layerwise", MeshConfig(data=4, tensor=2)),
}


def ns64(x):
    """Newton-Schulz in float64 on the short side, unit-Frobenius start (eps 1e-7)."""
    tall = x.shape[-2] > x.shape[-1]
    x = np.swapaxes(x, -1, -2) if tall else x
    x = x / (np.linalg.norm(x, axis=(-2, -1), keepdims=True) + 1e-7)
    for a, b, c in QUINTIC:
        gram = x @ np.swapaxes(x, -1, -2)
        x = a * x + (b * gram + c * gram @ gram) @ x
    return np.swapaxes(x, -1, -2) if tall else x


def orthogonal64(x, spec):
    """Every matrix of a leaf (or a block of one) orthogonalized, times 0.2 sqrt(max
    side) of its own shape; fused blocks (``spec.split_axis``) each on their own."""
    cuts = np.cumsum(spec.split_sizes)[:-1] if spec.split_axis is not None else []
    parts = np.split(x, cuts, axis=spec.split_axis) if len(cuts) else [x]
    batch = [a for a in range(x.ndim) if a not in spec.in_axes + spec.out_axes]
    order = batch + list(spec.in_axes) + list(spec.out_axes)
    out = []
    for part in parts:
        moved = part.transpose(order)
        fan_in = math.prod(part.shape[a] for a in spec.in_axes)
        fan_out = math.prod(part.shape[a] for a in spec.out_axes)
        m = moved.reshape(*moved.shape[:len(batch)], fan_in, fan_out)
        o = ns64(m) * 0.2 * math.sqrt(max(fan_in, fan_out))
        out.append(o.reshape(moved.shape).transpose(np.argsort(order)))
    return np.concatenate(out, axis=spec.split_axis) if len(out) > 1 else out[0]


def by_blocks64(x, spec, grid):
    """``orthogonal64`` of each block of ``x``, dim d cut into ``grid[d]`` equal parts."""
    out = np.empty_like(x)
    sizes = [n // k for n, k in zip(x.shape, grid)]
    for index in itertools.product(*(range(k) for k in grid)):
        where = tuple(slice(i * s, (i + 1) * s) for i, s in zip(index, sizes))
        out[where] = orthogonal64(x[where], spec)
    return out


def block_grid(leaf, mesh):
    """How many blocks each matrix dim of ``leaf`` is cut into: the product of the mesh
    axes its held state splits it over (stack dims stay whole: each matrix is cut alike)."""
    held = tuple(leaf.held) + (None,) * len(leaf.shape)
    matrix_dims = leaf.route.spec.in_axes + leaf.route.spec.out_axes
    return [math.prod(mesh.shape[a] for a in spec_axes(held[d])) if d in matrix_dims else 1
            for d in range(len(leaf.shape))]


def muon_bp64(params, grads, plan, mesh, full_at=lambda t: t % PERIOD == 0):
    """The matrices after ``len(grads)`` MuonBP steps, float64, by path."""
    out = {}
    for leaf in plan.leaves:
        if not leaf.is_matrix:
            continue
        p = np.asarray(params[leaf.path], np.float64)
        m = np.zeros_like(p)
        grid = block_grid(leaf, mesh)
        for t, g in enumerate(grads, start=1):
            g = np.asarray(g[leaf.path], np.float64)
            m = BETA * m + (1 - BETA) * g
            d = BETA * m + (1 - BETA) * g
            update = orthogonal64(d, leaf.route.spec) if full_at(t) else \
                RATIO * by_blocks64(d, leaf.route.spec, grid)
            p = p - LR * update
        out[leaf.path] = p
    return out


def by_path(tree):
    return {jax.tree_util.keystr(path).removesuffix(".value"): np.asarray(x)
            for path, x in jax.tree.leaves_with_path(jax.device_get(tree))}


@functools.cache
def built(case):
    """(mesh, plan, MuonBP, its train state) of a case."""
    layout_name, mesh_cfg = CASES[case]
    mesh = make_mesh(mesh_cfg)
    layout = make_layout(layout_name, mesh.shape)
    cfg = dataclasses.replace(MODEL, **layout.stack_fields)
    make_model = lambda: GPT(cfg, nnx.Rngs(0))
    plan = make_plan(nnx.split(nnx.eval_shape(make_model))[1], mesh, layout)
    tx = muon_bp(LR, period=PERIOD, block_lr_ratio=RATIO, plan=plan, matmul_dtype="float32")
    _, state = create_train_state(make_model, tx, plan)
    return mesh, plan, tx, state


def misses(got, want, start):
    """The largest miss of any matrix leaf's summed update, relative to its largest entry."""
    return max(relative_miss(got[k], want[k], start[k]) for k in want)


@pytest.mark.parametrize("case", CASES)
def test_three_steps_equal_the_float64_reference(case):
    """Steps 1 and 3 are block steps, step 2 full; the params after them equal the
    float64 reference's to fp32 Newton-Schulz round-off, and the mutated references
    miss by orders of magnitude more."""
    mesh, plan, tx, state = built(case)
    start = by_path(trainable_params(state.params))
    grads = [by_path(grads_of(state.params, seed)) for seed in range(3)]   # three_steps'

    got = by_path(trainable_params(three_steps(tx, state.params, state.opt_state)))
    miss = misses(got, muon_bp64(start, grads, plan, mesh), start)
    assert miss < TOL, miss
    mutants = {"period skipped": lambda t: False, "every step full": lambda t: True,
               "period shifted": lambda t: t % PERIOD == 1}
    for name, full_at in mutants.items():
        mutant = misses(got, muon_bp64(start, grads, plan, mesh, full_at), start)
        assert mutant > 100 * TOL, (name, mutant)


def test_block_steps_have_no_collective_and_full_steps_move_muons_bytes():
    """fsdp 4 x tensor 2: each matrix's step is one conditional; its block branch has no
    collective, its full branch moves what Muon's optimizer step moves, and nothing
    communicates outside them. Averaged over a period: 1/P of Muon's bytes."""
    mesh, plan, tx, state = built("fsdp4_tensor2")
    args = (state.params, state.opt_state, grads_of(state.params, 0))
    text = jax.jit(optimizer_step(tx)).lower(*args).compile().as_text()
    branches = branch_collectives(text, mesh)
    assert len(branches) == sum(leaf.is_matrix for leaf in plan.leaves)
    for block, full in branches:            # lax.cond: the false branch first
        assert block.collectives == () and full.count() > 0, (block.table(), full.table())
    whole = hlo_collectives(jax.jit(optimizer_step(tx)), *args)
    full_bytes = sum(full.bytes_per_device() for _, full in branches)
    assert whole.bytes_per_device() == full_bytes        # nothing outside the conditionals

    reference = muon(LR, plan=plan, matmul_dtype="float32")
    _, muon_state = create_train_state(lambda: GPT(MODEL, nnx.Rngs(0)), reference, plan)
    muon_bytes = hlo_collectives(jax.jit(optimizer_step(reference)), muon_state.params,
                                 muon_state.opt_state, grads_of(muon_state.params, 0))
    assert full_bytes == muon_bytes.bytes_per_device() > 0
    assert periodic_bytes_per_device(text, mesh, PERIOD) == pytest.approx(full_bytes / PERIOD)
