"""Exact bias and variance of any registry estimator: enumerate the group draws, or sample them.

The convention. One optimizer step's batch is ``prompts_per_batch`` groups; each group draws a
prompt ``x ~ D`` and ``G`` responses ``y_1..y_G ~ μ(·|x)`` i.i.d. The estimator's gradient on the
batch is the ascent direction ``ĝ = −∇_θ loss(prepare(batch))``, with the aggregation's counts
those of the batch. Its expectation (with one prompt per batch) is ``Σ_x D(x) E[ĝ | x]`` and is
compared with ``∇J`` of :func:`~tokenmdp.exact.gradient`.

How it is computed. ``loss`` depends on ``θ`` only through the token log-probs, so on one batch
``ĝ = Σ_tokens c_t ∇_θ log π(y_t|s_t)`` with ``c_t = −∂loss/∂ log π(y_t|s_t)``, and
``∇_θ log π(a|s)`` is one row of the Jacobian of the state-action log-probs. Many batches are
stacked as independent steps of one big batch (``prepare(..., step=...)`` keeps their counts and
statistics apart), one backward pass gives every ``c``, and a sparse-dense product gives every
``ĝ``. The estimator code is the library's own: nothing here re-derives a formula.

* ``method="exact"``: every multiset of ``G`` responses per prompt, with its multinomial
  probability ``D(x) G!/Π_j c_j! Π_j μ(y_j|x)^{c_j}`` (ordered draws are exchangeable, so each
  multiset stands for all its orderings); with several prompts per batch, their product.
* ``method="monte_carlo"``: ``num_samples`` i.i.d. batches, with standard errors.
* ``method="auto"``: exact when the number of draws is at most ``max_exact_draws``.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch
from torch import nn

from tokenmdp.batch import TokenBatch
from tokenmdp.estimators import Estimator, loss, prepare
from tokenmdp.exact.ground_truth import gradient, sequence_probs, state_logprobs
from tokenmdp.exact.mdp import TokenMDP
from tokenmdp.exact.policies import TabularPolicy, check_policy

__all__ = ["Moments", "moments", "state_action_jacobian", "count_draws"]

#: Above this many draws ``method="auto"`` switches to Monte Carlo.
MAX_EXACT_DRAWS = 200_000
#: The full covariance matrix is kept when the policy has at most this many parameters.
MAX_COVARIANCE_DIM = 512
#: Draws per stacked batch (memory bound of one prepare/loss/backward pass).
CHUNK_DRAWS = 8192


@dataclass(frozen=True)
class Moments:
    """The first two moments of an estimator's gradient ``ĝ`` against the true ``∇J``."""

    mean: torch.Tensor
    """``E[ĝ]``, flat in ``policy.parameters()`` order (an estimate of the ascent direction)."""
    true_gradient: torch.Tensor
    """``∇J`` at the same parameters."""
    total_variance: float
    """``tr Cov[ĝ] = E‖ĝ − E ĝ‖²``."""
    covariance: torch.Tensor | None
    """``Cov[ĝ]`` when the policy has at most ``MAX_COVARIANCE_DIM`` parameters."""
    method: str
    """``"exact"`` or ``"monte_carlo"``."""
    num_draws: int
    """Batches enumerated (exact) or sampled (Monte Carlo)."""
    mean_se: torch.Tensor | None = None
    """Monte Carlo: standard error of each coordinate of ``mean``."""
    total_variance_se: float | None = None
    """Monte Carlo: standard error of ``total_variance``."""
    mse_se: float | None = None
    """Monte Carlo: standard error of ``mse``."""
    relative_bias_se: float | None = None
    """Monte Carlo: standard error of ``relative_bias`` (delta method)."""
    cosine_se: float | None = None
    """Monte Carlo: standard error of ``cosine`` (delta method)."""
    keep_probability: float = 1.0
    """With ``filter_groups``: the probability that a drawn group is kept."""

    @property
    def bias(self) -> torch.Tensor:
        """``E[ĝ] − ∇J``."""
        return self.mean - self.true_gradient

    @property
    def relative_bias(self) -> float:
        """``‖E[ĝ] − ∇J‖ / ‖∇J‖``."""
        return float(self.bias.norm() / self.true_gradient.norm())

    @property
    def cosine(self) -> float:
        """Cosine between ``E[ĝ]`` and ``∇J``."""
        return float(self.mean @ self.true_gradient
                     / (self.mean.norm() * self.true_gradient.norm()).clamp(min=1e-300))

    @property
    def scale(self) -> float:
        """The best positive rescaling ``c* = max(0, <E ĝ, ∇J> / ‖E ĝ‖²)``."""
        denom = float(self.mean @ self.mean)
        return max(0.0, float(self.mean @ self.true_gradient) / denom) if denom > 0 else 0.0

    @property
    def directional_bias(self) -> float:
        """``‖c* E[ĝ] − ∇J‖ / ‖∇J‖``: the bias left after the best positive rescaling
        (``sqrt(1 − cos²)`` when the cosine is positive, 1 otherwise)."""
        return float((self.scale * self.mean - self.true_gradient).norm()
                     / self.true_gradient.norm())

    @property
    def mse(self) -> float:
        """``E‖ĝ − ∇J‖² = tr Cov + ‖bias‖²``."""
        return self.total_variance + float(self.bias @ self.bias)

    def summary(self) -> dict[str, float]:
        """The scalar figures as a dict (for tables, CSV and JSON)."""
        out = {"relative_bias": self.relative_bias, "cosine": self.cosine,
               "directional_bias": self.directional_bias, "scale": self.scale,
               "total_variance": self.total_variance, "mse": self.mse,
               "mean_norm": float(self.mean.norm()),
               "true_gradient_norm": float(self.true_gradient.norm()),
               "num_draws": self.num_draws}
        for name in ("relative_bias_se", "cosine_se", "total_variance_se", "mse_se"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        return out


def state_action_jacobian(mdp: TokenMDP, policy: nn.Module, *, chunk: int = 256) -> torch.Tensor:
    """``∇_θ log π(a|s)`` for every state-action pair: ``[num_states * V, num_params]``.

    Row ``s * V + a``; columns in ``policy.parameters()`` order. For a :class:`TabularPolicy` it
    is the closed form ``∂ log π(a|s) / ∂ z_{s', b} = 1[s = s'] (1[a = b] − π(b|s))``; for any
    other policy it is computed with batched vector-Jacobian products (``chunk`` rows at a time).
    """
    check_policy(mdp, policy)
    if type(policy) is TabularPolicy:
        with torch.no_grad():
            probs = torch.cat([x.exp().reshape(-1, mdp.vocab_size)
                               for x in state_logprobs(mdp, policy)])       # [num_states, V]
            V = mdp.vocab_size
            block = torch.eye(V, dtype=torch.float64)[None] - probs[:, None, :]  # [S, a, b]
            return _block_diag(block)
    params = [p for p in policy.parameters()]
    with torch.enable_grad():
        lp = torch.cat([x.reshape(-1) for x in state_logprobs(mdp, policy)])
        rows = []
        for start in range(0, lp.numel(), chunk):
            stop = min(start + chunk, lp.numel())
            eye = torch.zeros(stop - start, lp.numel(), dtype=lp.dtype)
            eye[torch.arange(stop - start), torch.arange(start, stop)] = 1.0
            grads = torch.autograd.grad(lp, params, grad_outputs=eye, retain_graph=True,
                                        is_grads_batched=True, allow_unused=True)
            rows.append(torch.cat([(torch.zeros(stop - start, p.numel(), dtype=lp.dtype)
                                    if g is None else g.reshape(stop - start, -1))
                                   for p, g in zip(params, grads)], dim=1))
    return torch.cat(rows)


def _block_diag(blocks: torch.Tensor) -> torch.Tensor:
    """Block-diagonal matrix of ``[n, V, V]`` blocks, built with one index_put."""
    n, V, _ = blocks.shape
    out = torch.zeros(n * V, n * V, dtype=blocks.dtype)
    base = (torch.arange(n) * V)[:, None, None]
    rows = base + torch.arange(V)[None, :, None]
    cols = base + torch.arange(V)[None, None, :]
    out[rows.expand(n, V, V), cols.expand(n, V, V)] = blocks
    return out


def count_draws(mdp: TokenMDP, group_size: int, prompts_per_batch: int = 1) -> int:
    """Number of distinct batches the exact method enumerates (zero-probability ones included)."""
    per_group = mdp.num_prompts * math.comb(mdp.responses_per_prompt + group_size - 1, group_size)
    return per_group ** prompts_per_batch


def _group_draws(mdp: TokenMDP, probs_N: torch.Tensor, group_size: int):
    """Every (prompt, multiset of G responses) with its probability: ``[D, G]`` ids, ``[D]``."""
    n = mdp.responses_per_prompt
    combos = torch.tensor(list(itertools.combinations_with_replacement(range(n), group_size)),
                          dtype=torch.long).view(-1, group_size)
    # multinomial coefficient G!/Π c_j! from the run lengths of each sorted tuple
    run = torch.ones_like(combos)
    for j in range(1, group_size):
        run[:, j] = torch.where(combos[:, j] == combos[:, j - 1], run[:, j - 1] + 1, 1)
    log_coef = math.lgamma(group_size + 1) - torch.log(run.to(torch.float64)).sum(1)
    ids, logp = [], []
    for x in range(mdp.num_prompts):
        seq = x * n + combos
        with torch.no_grad():
            lp = (mdp.prompt_probs[x].log() + log_coef
                  + probs_N[seq].log().sum(1))
        ids.append(seq)
        logp.append(lp)
    ids, prob = torch.cat(ids), torch.cat(logp).exp()
    keep = prob > 0
    return ids[keep], prob[keep]


def _filter(mdp: TokenMDP, ids: torch.Tensor, prob: torch.Tensor):
    """DAPO's dynamic sampling: drop groups whose rewards are all equal, renormalize."""
    rewards = mdp.rewards[ids]
    kept = (rewards != rewards[:, :1]).any(1)
    p_keep = float(prob[kept].sum())
    if p_keep <= 0:
        raise ValueError("filter_groups: every group has equal rewards (nothing to keep)")
    return ids[kept], prob[kept] / p_keep, p_keep


def _exact_draws(mdp, probs_N, group_size, prompts_per_batch, filter_groups):
    ids, prob = _group_draws(mdp, probs_N, group_size)
    p_keep = 1.0
    if filter_groups:
        ids, prob, p_keep = _filter(mdp, ids, prob)
    all_ids, all_prob = ids, prob
    for _ in range(prompts_per_batch - 1):
        d1, d2 = all_ids.shape[0], ids.shape[0]
        all_ids = torch.cat([all_ids.repeat_interleave(d2, 0), ids.repeat(d1, 1)], dim=1)
        all_prob = all_prob.repeat_interleave(d2) * prob.repeat(d1)
    return all_ids, all_prob, p_keep


def _sampled_draws(mdp, probs_N, group_size, prompts_per_batch, num_samples, generator,
                   filter_groups):
    n = mdp.responses_per_prompt
    needed = num_samples * prompts_per_batch
    per_prompt = probs_N.view(mdp.num_prompts, n)
    kept_groups, drawn, kept_count = [], 0, 0
    while kept_count < needed:  # rejection sampling when groups are filtered
        prompts = torch.multinomial(mdp.prompt_probs, needed, replacement=True,
                                    generator=generator)
        resp = torch.multinomial(per_prompt[prompts], group_size, replacement=True,
                                 generator=generator)                              # [groups, G]
        groups = prompts[:, None] * n + resp
        drawn += needed
        if filter_groups:
            rewards = mdp.rewards[groups]
            groups = groups[(rewards != rewards[:, :1]).any(1)]
            if drawn > 1000 * needed and kept_count == 0:
                raise ValueError("filter_groups: no group with distinct rewards was drawn")
        kept_groups.append(groups)
        kept_count += groups.shape[0]
    ids = torch.cat(kept_groups)[:needed].reshape(num_samples, prompts_per_batch * group_size)
    p_keep = kept_count / drawn
    return ids, torch.full((num_samples,), 1.0 / num_samples, dtype=torch.float64), p_keep


def _stacked_batch(enum: TokenBatch, ids: torch.Tensor, group_size: int,
                   logprob_fields: dict[str, torch.Tensor]) -> tuple[TokenBatch, torch.Tensor]:
    """Draws ``[D, k*G]`` of enumeration rows as one batch of ``D`` independent steps."""
    D, width = ids.shape
    rows = ids.reshape(-1)
    S = rows.numel()
    real = enum.sequence_id[rows] >= 0
    seq = torch.arange(S)
    batch = TokenBatch(
        tokens=enum.tokens[rows], sequence_id=torch.where(real, seq[:, None], -1),
        position=enum.position[rows], loss_mask=enum.loss_mask[rows],
        advantage=enum.advantage[rows], loss_weight=enum.loss_weight[rows],
        reward=enum.reward[rows], group=seq // group_size, length=enum.length[rows],
        prompt_index=enum.prompt_index[rows],
        **{name: lp[rows] for name, lp in logprob_fields.items()})
    return batch, seq // width


def moments(mdp: TokenMDP, policy: nn.Module, estimator: Estimator, *, group_size: int,
            behavior: nn.Module | None = None, old: nn.Module | None = None,
            reference: nn.Module | None = None, prompts_per_batch: int = 1,
            method: str = "auto", num_samples: int | None = None,
            generator: torch.Generator | None = None, filter_groups: bool = False,
            max_exact_draws: int = MAX_EXACT_DRAWS,
            jacobian: torch.Tensor | None = None) -> Moments:
    """Mean, variance and bias of ``estimator``'s gradient against the true ``∇J``.

    Parameters
    ----------
    mdp : TokenMDP
    policy : policy module
        ``π_θ``, whose gradient is estimated (float64).
    estimator : Estimator
        Any composition, e.g. ``tokenmdp.estimators.get("grpo")``.
    group_size : int
        ``G``, responses per prompt.
    behavior : policy module, optional
        ``μ``, the engine that samples (default ``π_θ``: on-policy).
    old : policy module, optional
        ``π_old``, the training engine at the rollout weights, for clipping ratios (default
        ``behavior``).
    reference : policy module, optional
        ``π_ref`` for a KL penalty (required when the estimator has one).
    prompts_per_batch : int
        Groups per batch; the aggregation's counts are those of the whole batch.
    method : {"auto", "exact", "monte_carlo"}
    num_samples : int, optional
        Monte Carlo batches (default 4096).
    generator : torch.Generator, optional
        Required for Monte Carlo.
    filter_groups : bool
        DAPO's dynamic sampling (Yu et al. 2025, arXiv 2503.14476, Eq. 11): groups whose rewards
        are all equal are dropped and redrawn, so every group of the batch is drawn from the
        conditional distribution given "rewards not all equal"; ``keep_probability`` reports
        ``P(kept)`` (estimated by the acceptance rate under Monte Carlo).
    max_exact_draws : int
        ``"auto"`` picks exact when :func:`count_draws` is at most this.
    jacobian : Tensor, optional
        :func:`state_action_jacobian` of ``policy`` at its current parameters, when the caller
        compares many estimators at one ``θ`` and wants to compute it once.

    Returns
    -------
    Moments
        ``mean`` is ``E[ĝ] = Σ_batches P(batch) ĝ(batch)``; with one prompt per batch that is
        ``Σ_x D(x) E[ĝ | x]``.
    """
    check_policy(mdp, policy)
    behavior = policy if behavior is None else behavior
    old = behavior if old is None else old
    check_policy(mdp, behavior, name="behavior")
    check_policy(mdp, old, name="old")
    if not isinstance(estimator, Estimator):
        raise TypeError(f"estimator: expected an Estimator, got {type(estimator).__name__}")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size: expected an int >= 1, got {group_size!r}")
    if isinstance(prompts_per_batch, bool) or not isinstance(prompts_per_batch, int) \
            or prompts_per_batch < 1:
        raise ValueError(f"prompts_per_batch: expected an int >= 1, got {prompts_per_batch!r}")
    if method not in ("auto", "exact", "monte_carlo"):
        raise ValueError(f"method: expected 'auto', 'exact' or 'monte_carlo', got {method!r}")
    needs_ref = "ref_logprob" in estimator.requires("prepare") + estimator.requires("loss")
    if needs_ref and reference is None:
        raise ValueError(f"reference: estimator {estimator.name!r} has a KL penalty and needs a "
                         "reference policy")
    if reference is not None:
        check_policy(mdp, reference, name="reference")
    if method == "auto":
        method = "exact" if count_draws(mdp, group_size, prompts_per_batch) <= max_exact_draws \
            else "monte_carlo"

    enum = mdp.enumerate()
    with torch.no_grad():
        mu_probs = sequence_probs(mdp, behavior)
        fields = {"behavior_logprob": behavior.token_logprobs(enum),
                  "old_logprob": old.token_logprobs(enum)}
        if reference is not None:
            fields["ref_logprob"] = reference.token_logprobs(enum)
        pi_logprob = policy.token_logprobs(enum)
    if method == "exact":
        ids, prob, p_keep = _exact_draws(mdp, mu_probs, group_size, prompts_per_batch,
                                         filter_groups)
    else:
        if not isinstance(generator, torch.Generator):
            raise TypeError("generator: a torch.Generator is required for Monte Carlo")
        num_samples = 4096 if num_samples is None else num_samples
        if num_samples < 2:
            raise ValueError(f"num_samples: need at least 2, got {num_samples}")
        ids, prob, p_keep = _sampled_draws(mdp, mu_probs, group_size, prompts_per_batch,
                                           num_samples, generator, filter_groups)

    jac = state_action_jacobian(mdp, policy) if jacobian is None else jacobian   # [M, d]
    num_params = sum(p.numel() for p in policy.parameters())
    if jac.shape != (mdp.num_states * mdp.vocab_size, num_params):
        raise ValueError(f"jacobian: expected shape ({mdp.num_states * mdp.vocab_size}, "
                         f"{num_params}), got {tuple(jac.shape)}")
    sa_index = mdp.token_state_index(enum) * mdp.vocab_size + enum.tokens
    sa_index = torch.where(enum.response_mask, sa_index, -1)
    d = jac.shape[1]
    keep_cov = d <= MAX_COVARIANCE_DIM
    sum_g = torch.zeros(d, dtype=torch.float64)
    sum_gg = torch.zeros(d, d, dtype=torch.float64) if keep_cov else None
    sum_sq = torch.zeros((), dtype=torch.float64)
    per_draw = [] if method == "monte_carlo" else None
    max_len = mdp.max_len
    for start in range(0, ids.shape[0], CHUNK_DRAWS):
        chunk_ids, chunk_p = ids[start:start + CHUNK_DRAWS], prob[start:start + CHUNK_DRAWS]
        batch, step = _stacked_batch(enum, chunk_ids, group_size, fields)
        batch = prepare(batch, estimator, step=step, max_len=max_len)
        rows = chunk_ids.reshape(-1)
        lp = pi_logprob[rows].clone().requires_grad_(True)
        value, _ = loss(lp, batch, estimator)
        (coef,) = torch.autograd.grad(-value, lp)            # c_t = -∂loss/∂log π
        # per-draw coefficient vectors over state-action pairs, then ĝ = C @ J
        sa = sa_index[rows]
        on = sa >= 0
        draw_of_token = step[:, None].expand_as(sa)[on]
        C = torch.zeros(chunk_ids.shape[0], jac.shape[0], dtype=torch.float64)
        C.index_put_((draw_of_token, sa[on]), coef[on], accumulate=True)
        g = C @ jac                                            # [chunk, d]
        sum_g += chunk_p @ g
        sum_sq += chunk_p @ (g * g).sum(1)
        if keep_cov:
            sum_gg += (g * chunk_p[:, None]).T @ g
        if per_draw is not None:
            per_draw.append(g)
    true_grad = gradient(mdp, policy)
    mean = sum_g
    total_var = float(sum_sq - mean @ mean)
    cov = (sum_gg - torch.outer(mean, mean)) if keep_cov else None
    if method == "exact":
        return Moments(mean=mean, true_gradient=true_grad, total_variance=max(total_var, 0.0),
                       covariance=cov, method="exact", num_draws=int(ids.shape[0]),
                       keep_probability=p_keep)
    return _monte_carlo_moments(torch.cat(per_draw), true_grad, keep_cov, p_keep)


def _monte_carlo_moments(g: torch.Tensor, true_grad: torch.Tensor, keep_cov: bool,
                         p_keep: float) -> Moments:
    """Sample mean, unbiased sample covariance and standard errors from per-batch gradients."""
    N = g.shape[0]
    mean = g.mean(0)
    centered = g - mean
    sq = (centered * centered).sum(1)                       # ‖ĝ − ḡ‖²
    total_var = float(sq.sum() / (N - 1))
    cov = centered.T @ centered / (N - 1) if keep_cov else None
    err = ((g - true_grad) ** 2).sum(1)                     # ‖ĝ − ∇J‖²
    bias = mean - true_grad
    gn = true_grad.norm()
    # delta method: SE of f(mean) = sqrt(∇f^T Cov ∇f / N)
    def delta_se(direction: torch.Tensor) -> float:
        return float(((centered @ direction) ** 2).sum() / (N - 1) / N) ** 0.5
    b_norm = bias.norm()
    rel_se = delta_se(bias / b_norm) / float(gn) if b_norm > 0 else 0.0
    m_norm = mean.norm()
    cos = mean @ true_grad / (m_norm * gn)
    cos_dir = (true_grad / gn - cos * mean / m_norm) / m_norm
    return Moments(mean=mean, true_gradient=true_grad, total_variance=total_var, covariance=cov,
                   method="monte_carlo", num_draws=N,
                   mean_se=centered.std(0, unbiased=True) / N ** 0.5 if N > 1 else None,
                   total_variance_se=float(sq.std() / N ** 0.5),
                   mse_se=float(err.std() / N ** 0.5),
                   relative_bias_se=rel_se, cosine_se=delta_se(cos_dir), keep_probability=p_keep)
