"""The course's setups: the copy task, one optimizer step along a direction, PPO's exact clip share.

* :func:`copy_task` — the MDP and policy of tutorials 1, 3, 6 and 8 (and of their exercises);
* :func:`step_along` — ``π_old`` moved by a distance along a direction (one optimizer step);
* :func:`ppo_clip_fraction` — the exact expected share of PPO-clipped tokens for ``G = 2``.
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from tokenmdp.estimators import ppo_keep_mask
from tokenmdp.exact import TabularPolicy, TokenMDP, sequence_probs

__all__ = ["COPY_TASK_SEED", "copy_task", "ppo_clip_fraction", "step_along"]

#: Seed of the tabular policy of :func:`copy_task`.
COPY_TASK_SEED = 0


def _copy_reward(prompt, response):
    # +1 per response token equal to the prompt token, -1 if the response was truncated (no EOS)
    eos = 2
    return sum(token == prompt[0] for token in response) - 1.0 * (response[-1] != eos)


def copy_task(max_len: int = 3) -> tuple[TokenMDP, TabularPolicy]:
    """The course's MDP and policy, as tutorials 1, 3 and 6 build them (8 at other lengths).

    Tokens ``{0, 1, EOS = 2}``, responses of at most ``max_len`` tokens, prompts ``(0,)`` and
    ``(1,)`` with probabilities 0.6 and 0.4; reward +1 per response token that copies the prompt
    token and −1 for a truncated response. The policy is a
    :class:`~tokenmdp.exact.TabularPolicy` with ``N(0, 1)`` logits from the seed
    ``COPY_TASK_SEED`` (float64).

    Parameters
    ----------
    max_len : int, default 3
        The response-length limit ``L >= 1`` (tutorial 8 varies it).

    Returns
    -------
    (TokenMDP, TabularPolicy)
        Fresh objects on every call.
    """
    mdp = TokenMDP(3, max_len, _copy_reward, prompts=[(0,), (1,)], prompt_probs=[0.6, 0.4])
    policy = TabularPolicy(mdp, generator=torch.Generator().manual_seed(COPY_TASK_SEED),
                           init_std=1.0)
    return mdp, policy


def step_along(policy: nn.Module, direction: torch.Tensor, distance: float) -> nn.Module:
    """A copy of ``policy`` with parameters ``θ + distance · u/‖u‖`` (``u = direction``).

    With ``direction = ∇J(θ_old)`` this is one ascent step of length ``distance`` from
    ``π_old = policy``: the policy a trainer holds after its first update on a rollout.

    Parameters
    ----------
    policy : nn.Module
        ``π_old`` (not modified).
    direction : Tensor ``[num_params]``
        ``u``, in ``policy.parameters()`` order (normalized here; must be non-zero).
    distance : float
        The step length ``s`` in parameter space.

    Returns
    -------
    nn.Module
        A deep copy of ``policy`` at ``θ + s u/‖u‖``.
    """
    direction = torch.as_tensor(direction, dtype=torch.float64)
    theta = parameters_to_vector(policy.parameters()).detach()
    if direction.shape != theta.shape:
        raise ValueError(f"direction: expected shape {tuple(theta.shape)}, got "
                         f"{tuple(direction.shape)}")
    if not direction.norm() > 0:
        raise ValueError("direction: has zero norm")
    moved = copy.deepcopy(policy)
    vector_to_parameters(theta + float(distance) * direction / direction.norm(),
                         moved.parameters())
    return moved


def ppo_clip_fraction(mdp: TokenMDP, policy: nn.Module, old: nn.Module, *, eps_low: float,
                      eps_high: float, dual_clip: float | None = None) -> float:
    """The exact pooled clip fraction ``E[#clipped tokens] / E[#tokens]`` of PPO's clip.

    Groups of ``G = 2`` responses drawn from ``old`` (``μ = π_old``), leave-one-out advantage
    ``Â_1 = R_1 − R_2``; a token is clipped where the PPO mask ``M_t`` of
    :func:`~tokenmdp.estimators.ppo_keep_mask` is False (``Â > 0, r > 1 + ε_high`` or
    ``Â < 0, r < 1 − ε_low``, or with dual clip ``Â < 0, r > c``), ``r = π_θ/π_old``. Every
    response is enumerated together with every partner, with probability
    ``D(x) π_old(y_1|x) π_old(y_2|x)``. This is what a trainer's ``clip_fraction`` metric
    estimates on a large batch.

    Parameters
    ----------
    mdp : TokenMDP
    policy : nn.Module
        ``π_θ``, the policy being trained.
    old : nn.Module
        ``π_old``, which samples the responses and defines ``r``.
    eps_low, eps_high : float
        The clip range ``[1 − ε_low, 1 + ε_high]``.
    dual_clip : float, optional
        The dual-clip constant ``c > 1``, or None.

    Returns
    -------
    float
        The expected share of clipped response tokens.
    """
    enum = mdp.enumerate()
    with torch.no_grad():
        log_r = torch.where(enum.loss_mask,
                            policy.token_logprobs(enum) - old.token_logprobs(enum), 0.0)
        ratio_NC = log_r.exp()
        old_N = sequence_probs(mdp, old)
    n = mdp.responses_per_prompt
    clipped = tokens = 0.0
    for x in range(mdp.num_prompts):
        rows = slice(x * n, (x + 1) * n)
        reward = mdp.rewards[rows]
        advantage_NN = reward[:, None] - reward[None, :]      # Â of response i paired with j
        keep = ppo_keep_mask(ratio_NC[rows][:, None, :], advantage_NN[:, :, None],
                             eps_low=eps_low, eps_high=eps_high, dual_clip=dual_clip)
        clipped_NN = (~keep & enum.loss_mask[rows][:, None, :]).sum(-1).to(torch.float64)
        q = old_N[rows]
        clipped += float(mdp.prompt_probs[x] * (q[:, None] * q[None, :] * clipped_NN).sum())
        tokens += float(mdp.prompt_probs[x] * (q * enum.length[rows]).sum())
    return clipped / tokens
