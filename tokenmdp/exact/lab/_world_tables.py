"""The estimator-independent arrays of :class:`~tokenmdp.exact.MomentsWorkspace`.

At one ``θ``: the sampling probabilities, the enumeration's log-probs under the behaviour,
``π_old``, ``π_ref`` and ``π_θ`` (each distinct module once), the
:class:`~tokenmdp.exact.lab.step_gradients.PolicyTables` and the true ``∇J``; with a copy of every
parameter and buffer of the policies, so that :meth:`WorldTables.current` tells whether they
still hold (a policy trained in place, even through ``.data``, changes the copy's equality).
"""

from __future__ import annotations

import torch
from torch import nn

from tokenmdp.exact.lab.step_gradients import PolicyTables
from tokenmdp.exact.world.ground_truth import gradient, sequence_probs
from tokenmdp.exact.world.mdp import TokenMDP


def _state_tensors(modules) -> list[torch.Tensor]:
    """Every parameter and buffer of the distinct ``modules`` (what their outputs depend on)."""
    seen, out = set(), []
    for module in modules:
        if module is None or id(module) in seen:
            continue
        seen.add(id(module))
        for get in ("parameters", "buffers"):
            out.extend(getattr(module, get, tuple)())
    return out


class WorldTables:
    """The arrays of :func:`~tokenmdp.exact.moments` that no estimator changes, at one ``θ``."""

    def __init__(self, mdp: TokenMDP, policy: nn.Module, behavior: nn.Module, old: nn.Module,
                 reference: nn.Module | None, jacobian: torch.Tensor | None) -> None:
        self._modules = (policy, behavior, old, reference)
        self._snapshot = [(t, t.detach().clone()) for t in _state_tensors(self._modules)]
        enum = mdp.enumerate()
        done: dict[int, torch.Tensor] = {}

        def logprobs(module):               # once per distinct module (π_ref is often π_old)
            if id(module) not in done:
                done[id(module)] = module.token_logprobs(enum)
            return done[id(module)]

        with torch.no_grad():
            self.mu_probs = sequence_probs(mdp, behavior)
            fields = {"behavior_logprob": logprobs(behavior), "old_logprob": logprobs(old)}
            if reference is not None:
                fields["ref_logprob"] = logprobs(reference)
            pi_logprob = logprobs(policy)
        self.fields = fields
        self.steps = PolicyTables(mdp, policy, fields, jacobian, pi_logprob=pi_logprob)
        self.true_grad = gradient(mdp, policy)

    def current(self) -> bool:
        """Whether every parameter and buffer of the policies is the one copied, unchanged."""
        now = _state_tensors(self._modules)
        return len(now) == len(self._snapshot) and all(
            t is kept and torch.equal(t, copy) for t, (kept, copy) in zip(now, self._snapshot))
