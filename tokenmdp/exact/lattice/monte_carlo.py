"""Monte Carlo on the lattice: sampled groups through the library's ``prepare`` and ``loss``.

The fallback of :func:`~tokenmdp.exact.lattice.moments` where an estimator is not exactly
computable on the lattice (a sequence-level ratio or clip, the token mean's random normalizer
at ``G >= 2``, ...). Each step draws ``G`` responses from ``μ`` (:func:`sample`), builds their
:class:`~tokenmdp.TokenBatch` (:func:`group_batch`, with the three log-probs of every token),
runs :func:`~tokenmdp.estimators.prepare` (many steps stacked with ``step``) and
:func:`~tokenmdp.estimators.loss`, and maps ``−∂ loss / ∂ log π`` of each token to the logits
through the softmax score ``e_a − π(·|t,z)``. The moments are streamed (the lattice may have a
million parameters): sums of ``ĝ`` and ``ĝ²`` per coordinate give the mean and its standard
errors, per-step ``‖ĝ‖²`` and ``‖ĝ − ∇J‖²`` the total variance and MSE, and batch means over
``NUM_BLOCKS`` blocks the delta-method standard errors of the cosine and relative bias.
"""

from __future__ import annotations

import torch

from tokenmdp.batch import TokenBatch
from tokenmdp.estimators import Estimator, loss, prepare
from tokenmdp.exact.lab.moments_result import Moments
from tokenmdp.exact.lattice.mdp import LatticeMDP

__all__ = ["sample", "group_batch", "step_gradients", "monte_carlo_moments"]

#: Default number of sampled steps.
DEFAULT_NUM_SAMPLES = 2048
#: Seed of the generator when none is given.
DEFAULT_SEED = 0
#: Batch-means blocks for the delta-method standard errors.
NUM_BLOCKS = 16
#: Tokens per prepare/loss call, and floats of per-step gradients held at once.
TOKENS_PER_CALL = 1 << 20
FLOATS_PER_CALL = 1 << 23


def sample(mdp: LatticeMDP, logprobs: torch.Tensor, num: int, generator: torch.Generator
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Draw ``num`` responses on the lattice.

    Parameters
    ----------
    mdp : LatticeMDP
        The lattice.
    logprobs : Tensor ``[T, K, V]``
        The sampler's log-probabilities.
    num : int
        Responses to draw.
    generator : torch.Generator
        The source of randomness.

    Returns
    -------
    tokens : LongTensor ``[num, T]``
        Response tokens, EOS after the end.
    states : LongTensor ``[num, T]``
        The automaton state each token was drawn in (the last state after the end).
    lengths : LongTensor ``[num]``
        ``|y|`` (EOS included; ``T`` when truncated).
    rewards : Tensor ``[num]``
        ``R(y)``.
    """
    T, K, V = mdp.shape
    cdf = logprobs.exp().cumsum(-1)
    cdf = cdf / cdf[..., -1:]                        # exactly 1 at the last token
    u = torch.rand(T, num, 1, generator=generator, dtype=torch.float64)
    z = torch.full((num,), mdp.automaton.start, dtype=torch.long)
    alive = torch.ones(num, dtype=torch.bool)
    tokens = torch.full((num, T), V - 1, dtype=torch.long)
    states = torch.empty(num, T, dtype=torch.long)
    lengths = torch.full((num,), T, dtype=torch.long)
    rewards = torch.zeros(num, dtype=torch.float64)
    for t in range(T):
        states[:, t] = z
        a = torch.searchsorted(cdf[t, z], u[t]).squeeze(1).clamp(max=V - 1)
        a = torch.where(alive, a, V - 1)
        tokens[:, t] = a
        ends = alive & (a == V - 1)
        lengths[ends] = t + 1
        rewards[ends] = mdp.eos_rewards[t, z[ends]]
        z = torch.where(alive & (a < V - 1), mdp.transitions[z, a.clamp(max=V - 2)], z)
        alive &= ~ends
    rewards[alive] = mdp.truncation_rewards[z[alive]]
    return tokens, states, lengths, rewards


def group_batch(mdp: LatticeMDP, tokens, states, lengths, rewards, group_size: int,
                logp: dict[str, torch.Tensor]) -> tuple[TokenBatch, torch.Tensor]:
    """Responses as a padded :class:`~tokenmdp.TokenBatch` (prompt ``(0,)``, one per row), with
    ``behavior_logprob``, ``old_logprob`` (and ``ref_logprob``) per token.

    Parameters
    ----------
    mdp : LatticeMDP
        The lattice.
    tokens, states, lengths, rewards : Tensor
        From :func:`sample` (``S`` responses, ``S`` a multiple of ``group_size``).
    group_size : int
        ``G``: consecutive responses form a group (and a step).
    logp : dict of str to Tensor ``[T, K, V]``
        ``policy``, ``behavior_logprob``, ``old_logprob`` (optionally ``ref_logprob``).

    Returns
    -------
    batch : TokenBatch
        ``group`` is the step of each response.
    policy_logprob : Tensor ``[S, 1 + L]``
        ``log π_θ`` of each token (0 on the prompt and padding).
    """
    S = tokens.shape[0]
    width = int(lengths.max())
    cols = torch.arange(width + 1)
    resp = (cols[None, 1:] <= lengths[:, None])                          # [S, width]
    mask = torch.cat([torch.zeros(S, 1, dtype=torch.bool), resp], dim=1)
    real = mask.clone()
    real[:, 0] = True
    t_idx = torch.arange(width).expand(S, width)
    tok, st = tokens[:, :width], states[:, :width]

    def per_token(table):
        vals = torch.where(resp, table[t_idx, st, tok], 0.0)
        return torch.cat([vals.new_zeros(S, 1), vals], dim=1)

    maskf = mask.to(torch.float64)
    batch = TokenBatch(
        tokens=torch.cat([torch.zeros(S, 1, dtype=torch.long), torch.where(resp, tok, 0)], 1),
        sequence_id=torch.where(real, torch.arange(S)[:, None], -1),
        position=torch.where(real, cols[None, :], 0), loss_mask=mask, advantage=maskf,
        loss_weight=maskf.clone(), reward=rewards.clone(),
        group=torch.arange(S) // group_size, length=lengths.clone(),
        prompt_index=torch.zeros(S, dtype=torch.long),
        **{k: per_token(v) for k, v in logp.items() if k != "policy"})
    return batch, per_token(logp["policy"])


def step_gradients(mdp: LatticeMDP, batch: TokenBatch, policy_logprob: torch.Tensor,
                   states: torch.Tensor, estimator: Estimator, pi: torch.Tensor) -> torch.Tensor:
    """``ĝ`` of every step of ``batch`` (its ``group`` ids), flat ``[steps, T·K·V]``.

    Parameters
    ----------
    mdp : LatticeMDP
        The lattice.
    batch : TokenBatch
        From :func:`group_batch`.
    policy_logprob : Tensor ``[S, C]``
        ``log π_θ`` per token.
    states : LongTensor ``[S, T]``
        The state of each token.
    estimator : Estimator
        The estimator.
    pi : Tensor ``[T, K, V]``
        ``π_θ``'s probabilities (for the score ``e_a − π``).

    Returns
    -------
    Tensor ``[steps, T·K·V]``
        ``−∇ loss`` of each step in the logits.
    """
    T, K, V = mdp.shape
    steps = int(batch.group.max()) + 1
    prepared = prepare(batch, estimator, max_len=T, step=batch.group)
    lp = policy_logprob.detach().requires_grad_(True)
    with torch.enable_grad():
        value, _ = loss(lp, prepared, estimator, metrics=False)
        (grad,) = torch.autograd.grad(value, lp)
    rows, cols = batch.loss_mask.nonzero(as_tuple=True)
    t = cols - 1
    z = states[rows, t]
    a = batch.tokens[rows, cols]
    coef = -grad[rows, cols]
    score = torch.nn.functional.one_hot(a, V).to(torch.float64) - pi[t, z]     # [n, V]
    d = T * K * V
    base = batch.group[rows] * d + (t * K + z) * V
    out = torch.zeros(steps * d, dtype=torch.float64)
    out.index_add_(0, (base[:, None] + torch.arange(V)).reshape(-1),
                   (coef[:, None] * score).reshape(-1))
    return out.view(steps, d)


def monte_carlo_moments(mdp: LatticeMDP, logp: dict[str, torch.Tensor], estimator: Estimator,
                        group_size: int, true_grad: torch.Tensor, *,
                        num_samples: int | None = None,
                        generator: torch.Generator | None = None,
                        features: torch.Tensor | None = None) -> Moments:
    """Sample moments of ``ĝ`` over ``num_samples`` steps of one group each, with standard errors.

    Parameters
    ----------
    mdp : LatticeMDP
        The lattice.
    logp : dict of str to Tensor ``[T, K, V]``
        ``policy``, ``behavior_logprob``, ``old_logprob`` (optionally ``ref_logprob``).
    estimator : Estimator
        The estimator.
    group_size : int
        ``G``.
    true_grad : Tensor ``[p]``
        ``∇J`` in the policy's parameter (``[T·K·V]`` for the tabular policy).
    num_samples : int, optional
        Steps (default ``DEFAULT_NUM_SAMPLES`` = 2048; at least ``2 · NUM_BLOCKS`` = 32).
    generator : torch.Generator, optional
        Default: seeded with ``DEFAULT_SEED`` (0).
    features : Tensor ``[T, K, F]``, optional
        A shared policy's feature map: each step's gradient is mapped to its parameter
        (``Dᵀ ĝ``).

    Returns
    -------
    Moments
        ``method="monte_carlo"``; ``covariance`` None; standard errors filled.
    """
    N = DEFAULT_NUM_SAMPLES if num_samples is None else num_samples
    if isinstance(N, bool) or not isinstance(N, int) or N < 2 * NUM_BLOCKS:
        raise ValueError(f"num_samples: expected an int >= {2 * NUM_BLOCKS}, got {N!r}")
    if generator is None:
        generator = torch.Generator().manual_seed(DEFAULT_SEED)
    if not isinstance(generator, torch.Generator):
        raise TypeError(f"generator: expected a torch.Generator, got {type(generator).__name__}")
    T, K, V = mdp.shape
    d = true_grad.numel()
    pi = logp["policy"].exp()
    G = group_size
    per_call = max(1, min(TOKENS_PER_CALL // (G * (T + 1)), FLOATS_PER_CALL // (T * K * V)))
    total = torch.zeros(d, dtype=torch.float64)
    total_sq = torch.zeros(d, dtype=torch.float64)
    blocks = torch.zeros(NUM_BLOCKS, d, dtype=torch.float64)
    block_sq = torch.zeros(NUM_BLOCKS, dtype=torch.float64)
    norms, errs = [], []
    block_of = torch.arange(N) * NUM_BLOCKS // N
    done = 0
    while done < N:
        n = min(per_call, N - done)
        tokens, states, lengths, rewards = sample(mdp, logp["behavior_logprob"], n * G, generator)
        batch, lp = group_batch(mdp, tokens, states, lengths, rewards, G, logp)
        g = step_gradients(mdp, batch, lp, states, estimator, pi)
        if features is not None:
            g = torch.einsum("ntkv,tkf->nfv", g.view(-1, T, K, V), features).reshape(n, d)
        total += g.sum(0)
        total_sq += (g * g).sum(0)
        sq = (g * g).sum(1)
        norms.append(sq)
        errs.append(((g - true_grad) ** 2).sum(1))
        b = block_of[done:done + n]
        blocks.index_add_(0, b, g)
        block_sq.index_add_(0, b, sq)
        done += n
    mean = total / N
    sq = torch.cat(norms)
    total_var = float((sq.sum() - N * (mean @ mean)) / (N - 1))
    per_block = torch.bincount(block_of, minlength=NUM_BLOCKS).to(torch.float64)
    block_means = blocks / per_block[:, None]
    block_var = (block_sq - per_block * (block_means * block_means).sum(1)) / (per_block - 1)
    coord_var = (total_sq - N * mean * mean).clamp(min=0) / (N - 1)

    def delta_se(direction: torch.Tensor) -> float:
        proj = block_means @ direction
        return float(proj.std() / NUM_BLOCKS ** 0.5)

    bias = mean - true_grad
    gn, bn, mn = true_grad.norm(), bias.norm(), mean.norm()
    rel_se = (delta_se(bias / bn) / float(gn) if bn > 0 else 0.0) if gn > 0 else None
    cos_se = None
    if gn > 0 and mn > 0:
        cos = mean @ true_grad / (mn * gn)
        cos_se = delta_se((true_grad / gn - cos * mean / mn) / mn)
    err = torch.cat(errs)
    return Moments(mean=mean, true_gradient=true_grad, total_variance=max(total_var, 0.0),
                   covariance=None, method="monte_carlo", num_draws=N,
                   mean_se=(coord_var / N).sqrt(),
                   total_variance_se=float(block_var.std() / NUM_BLOCKS ** 0.5),
                   mse_se=float(err.std() / N ** 0.5), relative_bias_se=rel_se,
                   cosine_se=cos_se)
