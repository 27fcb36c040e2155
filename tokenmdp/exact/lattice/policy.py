"""Policies tabular over ``(t, z)``: one free logit vector per lattice node, float64.

:class:`LatticePolicy` holds logits ``[T, K, V]``; ``π(a | t, z) = softmax(logits[t, z])[a]``.
The score of position ``t`` lives in the block ``logits[t]``, so the scores of different
positions are on disjoint parameters (what makes the second moments per-position sums in
:mod:`~tokenmdp.exact.lattice.moments`). A time-homogeneous policy (one table over ``z`` shared
by all positions) is not offered: its scores overlap across positions and its second moments
would need vector-valued messages.

Stale and engine-like copies are in :mod:`~tokenmdp.exact.lattice.behavior`.
:func:`as_prefix_policy` views a lattice policy as a
:class:`~tokenmdp.exact.PrefixPolicy` of :func:`~tokenmdp.exact.lattice.to_token_mdp`'s twin,
sharing its parameter, so the enumeration engine's gradients are in the same coordinates.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenmdp.exact.lattice.mdp import LatticeMDP
from tokenmdp.exact.world.mdp import TokenMDP
from tokenmdp.exact.world.policies import PrefixPolicy, check_number

__all__ = ["LatticePolicy", "check_lattice_policy", "as_prefix_policy"]


class LatticePolicy(nn.Module):
    """``π(a | t, z) = softmax(logits[t, z])[a]`` with a free float64 table ``[T, K, V]``.

    Parameters
    ----------
    mdp : LatticeMDP
        The lattice the policy acts on.
    generator : torch.Generator, optional
        Source of the initial logits ``N(0, init_std²)`` (required unless ``logits`` is given).
    init_std : float, default 1.0
        Their standard deviation (0: the uniform policy).
    logits : Tensor ``[T, K, V]``, optional
        Initial logits instead (copied, float64).
    """

    def __init__(self, mdp: LatticeMDP, *, generator: torch.Generator | None = None,
                 init_std: float = 1.0, logits: torch.Tensor | None = None) -> None:
        super().__init__()
        if not isinstance(mdp, LatticeMDP):
            raise TypeError(f"mdp: expected a LatticeMDP, got {type(mdp).__name__}")
        self.mdp = mdp
        if logits is None:
            if not isinstance(generator, torch.Generator):
                raise TypeError("generator: a torch.Generator is required unless logits is given")
            std = check_number("init_std", init_std)
            table = torch.randn(mdp.shape, generator=generator, dtype=torch.float64) * std
        else:
            table = torch.as_tensor(logits, dtype=torch.float64).detach().clone()
            if tuple(table.shape) != mdp.shape:
                raise ValueError(f"logits: expected shape {mdp.shape} (T, K, V), got "
                                 f"{tuple(table.shape)}")
            if not torch.isfinite(table).all():
                raise ValueError("logits: must be finite")
        self.logits = nn.Parameter(table)

    def logprobs(self) -> torch.Tensor:
        """``log π(· | t, z)`` at every node, float64 ``[T, K, V]`` (differentiable).

        Returns
        -------
        Tensor ``[T, K, V]``
            Log-probabilities; each ``[t, z]`` row sums (in probability) to 1.
        """
        return torch.log_softmax(self.logits, dim=-1)


def check_lattice_policy(mdp: LatticeMDP, policy, *, name: str = "policy") -> None:
    """Raise unless ``policy`` is a :class:`LatticePolicy` of a lattice of ``mdp``'s shape.

    Parameters
    ----------
    mdp : LatticeMDP
        The lattice it is about to be used with.
    policy : object
        The policy to check.
    name : str, default "policy"
        The argument's name in the messages.

    Raises
    ------
    TypeError
        Not a LatticePolicy.
    ValueError
        Built for a lattice of another shape.
    """
    if not isinstance(policy, LatticePolicy):
        raise TypeError(f"{name}: expected a LatticePolicy, got {type(policy).__name__}")
    if tuple(policy.logits.shape) != mdp.shape:
        raise ValueError(f"{name}: built for a lattice of shape {tuple(policy.logits.shape)}, "
                         f"used with {mdp!r}")


class _LatticePrefixPolicy(PrefixPolicy):
    """A lattice policy seen by the enumeration engine: ``logits(prefix) = table[k, z(prefix)]``,
    the table shared with the lattice policy (so gradients are in its coordinates)."""

    def __init__(self, token_mdp: TokenMDP, policy: LatticePolicy) -> None:
        super().__init__(token_mdp)
        self.logits_table = policy.logits
        self.register_buffer("delta", policy.mdp.transitions.clone(), persistent=False)
        self.start = policy.mdp.automaton.start

    def logits(self, prompt_index: torch.Tensor, prefix: torch.Tensor) -> torch.Tensor:
        """``table[k, z]`` with ``z`` the automaton state after each prefix.

        Parameters
        ----------
        prompt_index : LongTensor ``[N]``
            The prompt of each state (the twin has one).
        prefix : LongTensor ``[N, k]``
            Non-EOS response tokens so far.

        Returns
        -------
        Tensor ``[N, V]``
            Float64 logits.
        """
        z = torch.full((prefix.shape[0],), self.start, dtype=torch.long)
        for j in range(prefix.shape[1]):
            z = self.delta[z, prefix[:, j]]
        return self.logits_table[prefix.shape[1], z]


def as_prefix_policy(token_mdp: TokenMDP, policy: LatticePolicy) -> PrefixPolicy:
    """``policy`` as a :class:`~tokenmdp.exact.PrefixPolicy` of its enumerable twin.

    Parameters
    ----------
    token_mdp : TokenMDP
        :func:`~tokenmdp.exact.lattice.to_token_mdp` of the policy's lattice.
    policy : LatticePolicy
        The lattice policy; its ``logits`` parameter is shared, not copied.

    Returns
    -------
    PrefixPolicy
        One parameter, the ``[T, K, V]`` table: flat gradients agree coordinate by coordinate.
    """
    if not isinstance(policy, LatticePolicy):
        raise TypeError(f"policy: expected a LatticePolicy, got {type(policy).__name__}")
    mdp = policy.mdp
    if (token_mdp.vocab_size, token_mdp.max_len, token_mdp.num_prompts) != (
            mdp.vocab_size, mdp.max_len, 1):
        raise ValueError(f"token_mdp: {token_mdp!r} is not the twin of {mdp!r}")
    return _LatticePrefixPolicy(token_mdp, policy)
