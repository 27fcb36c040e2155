"""Shared builders for the lattice tests: a lattice, its policies and their enumerable twins."""

import torch

from tokenmdp.exact import lattice as L


def policies(mdp, seed=0, *, noise=0.3, distance=0.2):
    """``π_θ``, an engine copy ``μ`` (fixed logit noise) and a stale ``π_old`` of a lattice."""
    g = torch.Generator().manual_seed(seed)
    pi = L.LatticePolicy(mdp, generator=g)
    mu = L.inference_copy(pi, noise_std=noise, generator=g)
    direction = torch.randn(pi.logits.numel(), generator=g, dtype=torch.float64)
    old = L.stale_copy(mdp, pi, direction=direction, distance=distance)
    return pi, mu, old


def twin(mdp, *pols):
    """The enumerable TokenMDP of ``mdp`` and each policy as its prefix policy."""
    tm = L.to_token_mdp(mdp)
    return (tm, *[L.as_prefix_policy(tm, p) for p in pols])
