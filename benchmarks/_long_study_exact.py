"""The exact world at the long-answer study's mismatch and length: exact gradient moments of
``minirl``, ``minirl_no_is`` and ``minirl_len_norm`` on an exact-match lattice shaped like the
trainer's task (used by ``long_study.py``'s report and ``lattice.py --trainer-match``).

The world (:func:`trainer_world`): the reward is 1 iff the response is a fixed ``L``-digit
target and then EOS (:func:`tokenmdp.exact.lattice.exact_match`, the trainer's vocabulary of
17 tokens), ``T = L + 1``; ``π`` puts the logit ``margin`` on the right token of every state
that is still on the target (and, in the dead state after a mistake, on one digit per
position: the trained model keeps answering confidently after an error) and 0 on the others;
``margin`` is chosen so that ``π``'s per-token entropy is the trainer's.

The engine: the trainer's dial draws fresh noise ``σ ε`` (``ε ~ N(0, I)``) on the logits at
every token of every response, and records the perturbed ``μ_ε``. Since ``ε_t`` is independent
of the rest of the response, the mean gradient of an estimator without correction is its mean
under the marginal sampler ``μ̄ = E_ε softmax(z + σ ε)``, and the mean of token-level IS
``π/μ_ε`` is that of IS with the marginal weight ``π/μ̄`` (both weigh token ``a`` by ``π(a)``
in expectation), as long as the truncation at 5 does not bind (its probability is reported:
below 1e-4 at ``σ <= 2``). So the lattice with ``μ = μ̄`` gives the **exact mean gradient**
of the trainer's ``minirl`` and ``minirl_no_is`` at its ``σ`` (the variances differ: the
fresh-noise weight varies given the token). ``noise="fixed"`` instead draws one perturbation per
(state, position), a systematic bias (the model of ``benchmarks/lattice.py``).

The engine mismatch modes (issue 31; :func:`engine_row`): ``μ`` is the lattice's engine copy
(:func:`tokenmdp.exact.lattice.inference_copy` with a ``fixed``, ``heavy`` or ``growing``
:class:`~tokenmdp.exact.EngineMismatch`) of the same ``π``, its dial (the scale of
``fixed`` and ``growing``, the fraction of ``heavy`` at the trainer's offset) set by bisection so
that the per-token ``KL(μ ‖ π)`` under ``μ`` is the trainer's measured one. The dial cannot be
copied as it is: the trainer's contexts differ in every prompt, so a share ``p`` of perturbed
pairs is a share ``p`` of the tokens, while the lattice models one prompt, whose ``L + 2``
reachable states hold a handful of pairs. ``minirl_seq_tis`` has no lattice form (its weight is a
product over the response) and is computed by the lattice's Monte Carlo (``method``).

Reported per (L, σ): ``E_ε KL(μ_ε ‖ π)`` per token (what the trainer's k3 estimates),
``J(π)`` and ``J(μ̄)``, and per estimator the cosine of the exact mean gradient with ``∇J``, its
projection on ``∇J`` relative to ``‖∇J‖²`` (the first-order progress per unit learning rate,
relative to exact gradient ascent) and the signal-to-noise ratio ``‖E ĝ‖² / tr Cov ĝ``.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from tokenmdp import estimators
from tokenmdp.exact import lattice as L

VOCAB = 17
"""The trainer's tokenizer: 10 digits, ``+ = >``, ``a b``, padding and EOS (``V = 17``)."""
ESTIMATORS = ("minirl", "minirl_no_is", "minirl_len_norm")
TRUNCATION = 5.0
"""MiniRL's cap of the token weight ``π_old/μ`` (and of the sequence weight of ``sequence_tis``)."""
STUDY_ESTIMATORS = ("minirl", "minirl_no_is", "minirl_len_norm", "minirl_seq_tis")
"""What :func:`engine_row` computes (the study's on-policy estimators)."""
FRESH_ESTIMATORS = ("minirl", "minirl_no_is", "sequence_tis")
"""What :func:`fresh_noise_moments` samples (``sequence_tis``: MiniRL, sequence-level weight)."""


def margin_for_entropy(entropy: float, vocab: int = VOCAB) -> float:
    """The logit margin ``m`` whose softmax ``[m, 0, ..., 0]`` has entropy ``entropy`` (nats)."""
    def h(m):
        p = torch.softmax(torch.tensor([m] + [0.0] * (vocab - 1), dtype=torch.float64), 0)
        return float(-(p * p.log()).sum())
    lo, hi = 0.0, 50.0
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if h(mid) > entropy else (lo, mid)
    return (lo + hi) / 2


def noise_statistics(margin: float, sigma: float, *, draws: int = 400_000, seed: int = 0,
                     vocab: int = VOCAB) -> dict[str, float]:
    """Monte Carlo over the fresh noise, for one row ``[margin, 0, ..., 0]``: the marginal
    probability of the top token under ``μ_ε``, ``E_ε KL(μ_ε ‖ π)``, and the probability that
    the sampled token's ``π/μ_ε`` exceeds MiniRL's cap."""
    z = torch.zeros(vocab, dtype=torch.float64)
    z[0] = margin
    logp = torch.log_softmax(z, 0)
    g = torch.Generator().manual_seed(seed)
    eps = torch.randn(draws, vocab, generator=g, dtype=torch.float64)
    logq = torch.log_softmax(z + sigma * eps, -1)
    q = logq.exp()
    kl = (q * (logq - logp)).sum(-1)
    truncated = (q * ((logp - logq) > math.log(TRUNCATION))).sum(-1)
    return {"top": float(q[:, 0].mean()), "kl_fresh": float(kl.mean()),
            "truncated": float(truncated.mean())}


def trainer_world(length: int, margin: float, sigma: float, *, noise: str = "fresh",
                  seed: int = 0, draws: int = 400_000):
    """The exact-match lattice, ``π`` and the engine ``μ`` (see the module docstring).

    Returns ``(mdp, pi, mu, stats)`` with ``stats`` of :func:`noise_statistics` (fresh noise)."""
    rng = np.random.default_rng(seed)
    target = rng.integers(0, 10, size=length).tolist()
    mdp = L.LatticeMDP(L.exact_match(target, VOCAB), length + 1)
    T, K, V = mdp.shape
    dead = length + 1
    right = torch.zeros(T, K, dtype=torch.long)
    right[:, :length] = torch.tensor(target)              # on the target: its next digit
    right[:, length] = V - 1                              # the whole target: EOS
    right[:, dead] = torch.from_numpy(rng.integers(0, 10, size=T))   # after a mistake
    top = torch.nn.functional.one_hot(right, V).bool()
    base = torch.where(top, margin, 0.0).double()
    pi = L.LatticePolicy(mdp, logits=base)
    stats = noise_statistics(margin, sigma, draws=draws, vocab=V)
    if noise == "fresh":
        # μ̄: the top token's marginal probability, the rest shared equally (exchangeable)
        p_top = stats["top"]
        mu_logits = torch.where(top, math.log(p_top), math.log((1 - p_top) / (V - 1)))
    elif noise == "fixed":
        g = torch.Generator().manual_seed(seed + 1)
        mu_logits = base + sigma * torch.randn(T, K, V, generator=g, dtype=torch.float64)
    else:
        raise ValueError(f"noise: expected 'fresh' or 'fixed', got {noise!r}")
    mu = L.LatticePolicy(mdp, logits=mu_logits.double()).requires_grad_(False)
    return mdp, pi, mu, stats


def exact_row(length: int, sigma: float, *, entropy: float = 0.08, group_size: int = 4,
              noise: str = "fresh") -> dict:
    """One (L, σ) row: the mismatch, ``J`` of ``π`` and of ``μ``, and per estimator the cosine,
    the relative projection on ``∇J`` and the signal-to-noise ratio of the exact mean gradient."""
    mdp, pi, mu, stats = trainer_world(length, margin_for_entropy(entropy), sigma, noise=noise)
    with torch.no_grad():
        row = {"L": length, "sigma": sigma, "noise": noise, "kl_fresh": stats["kl_fresh"],
               "kl_marginal": float(L.sequence_kl(mdp, mu, pi)) /
               float(L.expected_length(mdp, mu)),
               "truncated": stats["truncated"], "J_pi": float(L.objective(mdp, pi)),
               "J_mu": float(L.objective(mdp, mu))}
    for name in ESTIMATORS:
        m = L.moments(mdp, pi, estimators.get(name), group_size=group_size, behavior=mu, old=pi)
        g, mean = m.true_gradient, m.mean
        row[name] = {"cosine": float(m.cosine),
                     "progress": float(mean @ g / (g @ g)),
                     "snr": float(mean @ mean / max(m.total_variance, 1e-300)),
                     "method": m.method}
    return row


def matched_copy(mdp, pi, mode: str, scale: float, kl_target: float, *, iterations: int = 30,
                 seeds: int = 8):
    """The lattice's engine copy of ``pi`` in ``mode`` whose per-token ``KL(μ ‖ π)`` (under
    ``μ``) is ``kl_target``: bisection in log space on the scale (``fixed``, ``growing``; pattern
    seed 0) or on the fraction at offset ``scale`` (``heavy``, whose KL jumps as pairs join the
    pattern: the side of the jump nearest the target, over pattern seeds ``0 .. seeds - 1``).

    Returns
    -------
    (LatticePolicy, EngineMismatch, float)
        ``μ``, its mismatch and its per-token KL.
    """
    from tokenmdp.exact import EngineMismatch

    def copy(x, seed):
        mm = (EngineMismatch(mode, scale, min(x, 1.0), seed) if mode == "heavy"
              else EngineMismatch(mode, x, 1.0, seed))
        mu = L.inference_copy(pi, mismatch=mm)
        with torch.no_grad():
            kl = float(L.sequence_kl(mdp, mu, pi)) / float(L.expected_length(mdp, mu))
        return mu, mm, kl

    best = None
    for seed in range(seeds if mode == "heavy" else 1):
        lo, hi = (1e-6, 1.0) if mode == "heavy" else (1e-4, 10.0)
        for _ in range(iterations):
            mid = math.sqrt(lo * hi)
            lo, hi = (mid, hi) if copy(mid, seed)[2] < kl_target else (lo, mid)
        for side in (copy(lo, seed), copy(hi, seed)):
            gap = abs(math.log(max(side[2], 1e-300) / kl_target))
            if best is None or gap < best[0]:
                best = (gap, side)
    return best[1]


def engine_row(length: int, mode: str, scale: float, kl_target: float, *,
               entropy: float = 0.08, group_size: int = 16,
               names: tuple[str, ...] = STUDY_ESTIMATORS) -> dict:
    """The exact world at one of the study's engines (module docstring): ``μ`` from
    :func:`matched_copy` at ``kl_target``; ``J`` of ``π`` and ``μ``; per estimator the cosine with
    ``∇J``, the relative progress along it and the signal-to-noise ratio of its mean gradient
    (on-policy, ``θ = θ_old``), and how they were computed (``method``)."""
    mdp, pi, _, _ = trainer_world(length, margin_for_entropy(entropy), 0.0, draws=1000)
    mu, mm, kl = matched_copy(mdp, pi, mode, scale, kl_target)
    with torch.no_grad():
        row = {"L": length, "mode": mode, "scale": mm.scale, "fraction": mm.fraction,
               "kl_target": kl_target, "kl": kl, "J_pi": float(L.objective(mdp, pi)),
               "J_mu": float(L.objective(mdp, mu))}
    for name in names:
        m = L.moments(mdp, pi, estimators.get(name), group_size=group_size, behavior=mu, old=pi)
        g, mean = m.true_gradient, m.mean
        row[name] = {"cosine": float(m.cosine), "progress": float(mean @ g / (g @ g)),
                     "snr": float(mean @ mean / max(m.total_variance, 1e-300)),
                     "method": m.method}
    return row


def exact_table(lengths=(16, 64), sigmas=(0.0, 0.25, 0.5, 1.0, 2.0), *, entropy: float = 0.08,
                group_size: int = 4, noise: str = "fresh") -> tuple[list[dict], str]:
    """Rows of :func:`exact_row` over ``lengths`` x ``sigmas`` and their markdown table."""
    rows = [exact_row(n, s, entropy=entropy, group_size=group_size, noise=noise)
            for n in lengths for s in sigmas]
    return rows, exact_markdown_table(rows)


def exact_markdown_table(rows: list[dict]) -> str:
    """The markdown table of rows of :func:`exact_row`."""
    head = ("| L | σ | E KL(μ_ε‖π)/token | J(π) → J(μ̄) | " +
            " | ".join(f"{e}: cos / progress / SNR" for e in ESTIMATORS) + " |")
    lines = [head, "|" + "---|" * (4 + len(ESTIMATORS))]
    for r in rows:
        cells = [f"{r[e]['cosine']:.4f} / {r[e]['progress']:.3f} / {r[e]['snr']:.2e}"
                 for e in ESTIMATORS]
        lines.append(f"| {r['L']} | {r['sigma']:g} | {r['kl_fresh']:.4f} | {r['J_pi']:.3f} → "
                     f"{r['J_mu']:.3f} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def fresh_noise_moments(length: int, sigma: float, estimator: str, *, weights: str = "fresh",
                        entropy: float = 0.08, group_size: int = 4, groups: int = 20_000,
                        chunk: int = 100, seed: int = 0) -> dict:
    """Monte Carlo over groups of the trainer's engine on :func:`trainer_world`: the cosine,
    relative progress and signal-to-noise ratio of ``estimator``'s gradient (``minirl`` or
    ``minirl_no_is``, on-policy, ``θ = θ_old``) with the noise drawn fresh at every token;
    ``sequence_tis`` is MiniRL with the sequence-level weight ``min(Π_t π/μ_t, 5)`` on every token
    of a response instead of the token-level one.

    ``weights="fresh"`` weighs a token by ``min(π/μ_ε, 5)`` (the trainer's MiniRL: the realized
    ``μ_ε`` of that draw); ``"marginal"`` by ``π/μ̄`` (the lattice's model of the same engine,
    whose exact moments :func:`exact_row` computes: the check of this sampler). The gradient of
    one group, with respect to the tabular logits: ``(1/G) Σ_i Σ_t φ_it (e_{a_it} − π(·|t, z_it))``
    with ``φ_it = w_it (R_i − mean_g R)`` (MiniRL's surrogate at ratio 1, sequence-mean of token
    sums). ``‖E ĝ‖²`` is the unbiased ``‖ḡ‖² − tr Cov / N``.
    """
    if estimator not in FRESH_ESTIMATORS or weights not in ("fresh", "marginal"):
        raise ValueError(f"estimator, weights: got {estimator!r}, {weights!r}")
    margin = margin_for_entropy(entropy)
    mdp, pi, mu, _ = trainer_world(length, margin, sigma, noise="fresh")
    T, K, V = mdp.shape
    table = torch.as_tensor(mdp.automaton.transitions, dtype=torch.long)
    eos_reward = torch.as_tensor(mdp.automaton.eos_reward, dtype=torch.float64)
    logits = pi.logits.detach()
    probs = logits.softmax(-1)
    log_mu_bar = mu.logprobs().detach()
    grad_j = L.gradient(mdp, pi).detach().reshape(T * K, V)
    gen = torch.Generator().manual_seed(seed)
    totals, sq_norms = [], []
    for start in range(0, groups, chunk):
        B = min(chunk, groups - start)
        n = B * group_size
        z = torch.full((n,), mdp.automaton.start, dtype=torch.long)
        alive = torch.ones(n, dtype=torch.bool)
        reward = torch.zeros(n, dtype=torch.float64)
        rows, toks, ws, seq, logws = [], [], [], [], []
        for t in range(T):
            idx = alive.nonzero().squeeze(1)
            if not len(idx):
                break
            zt = z[idx]
            if weights == "fresh":
                noisy = logits[t, zt] + sigma * torch.randn(len(idx), V, generator=gen,
                                                            dtype=torch.float64)
                log_q = torch.log_softmax(noisy, -1)
            else:
                log_q = log_mu_bar[t, zt]
            a = torch.multinomial(log_q.exp(), 1, generator=gen).squeeze(1)
            log_w = torch.log_softmax(logits[t, zt], -1).gather(1, a[:, None]).squeeze(1) - \
                log_q.gather(1, a[:, None]).squeeze(1)
            w = log_w.exp()
            logws.append(log_w)
            if weights == "fresh":
                w = w.clamp(max=TRUNCATION)
            rows.append(t * K + zt)
            toks.append(a)
            ws.append(w)
            seq.append(idx)
            eos = a == V - 1
            reward[idx[eos]] = eos_reward[zt[eos]]
            alive[idx[eos]] = False
            cont = ~eos
            z[idx[cont]] = table[zt[cont], a[cont]]
        adv = reward.view(B, group_size) - reward.view(B, group_size).mean(1, keepdim=True)
        adv = adv.reshape(n)
        node, tok, w, who = (torch.cat(x) for x in (rows, toks, ws, seq))
        if estimator == "sequence_tis":  # every token of response i weighed by min(Π_t w_it, 5)
            log_seq = torch.zeros(n, dtype=torch.float64).index_add_(0, who, torch.cat(logws))
            w = log_seq.clamp(max=math.log(TRUNCATION)).exp()[who]
        phi = (torch.ones_like(w) if estimator == "minirl_no_is" else w) * adv[who] / group_size
        contrib = -probs.reshape(T * K, V)[node] * phi[:, None]
        contrib[torch.arange(len(tok)), tok] += phi
        buf = torch.zeros(B * T * K, V, dtype=torch.float64)
        buf.index_add_(0, (who // group_size) * (T * K) + node, contrib)
        buf = buf.view(B, T * K, V)
        totals.append(buf.sum(0))
        sq_norms.append(float((buf ** 2).sum()))
    # the statistics from every chunk, and leaving each block of chunks out (jackknife SE)
    totals, sq_norms = torch.stack(totals), torch.tensor(sq_norms, dtype=torch.float64)
    sizes = torch.tensor([min(chunk, groups - s) for s in range(0, groups, chunk)],
                         dtype=torch.float64)
    full = _statistics(totals.sum(0), float(sq_norms.sum()), float(sizes.sum()), grad_j)
    blocks = torch.arange(len(sizes)) % JACKKNIFE_BLOCKS
    leave = [_statistics(totals[blocks != b].sum(0), float(sq_norms[blocks != b].sum()),
                         float(sizes[blocks != b].sum()), grad_j)
             for b in range(min(JACKKNIFE_BLOCKS, len(sizes))) if (blocks != b).any()]
    out = {"L": length, "sigma": sigma, "estimator": estimator, "weights": weights,
           "groups": groups, **full}
    k = len(leave)
    for key in full:
        vals = np.array([x[key] for x in leave])
        out[f"{key}_se"] = (float(np.sqrt((k - 1) / k * ((vals - vals.mean()) ** 2).sum()))
                            if k > 1 else float("nan"))
    return out


JACKKNIFE_BLOCKS = 10
"""Blocks of chunks left out in turn for the Monte Carlo standard errors."""


def _statistics(total: torch.Tensor, sq_norm: float, n: float, grad_j: torch.Tensor) -> dict:
    """Cosine, relative progress and SNR from the sum and square-norm sum of ``n`` group
    gradients (NaN where there is no signal: every reward of every group equal)."""
    mean = total / n
    tr_cov = (sq_norm / n - float((mean ** 2).sum())) * n / max(n - 1, 1)
    if tr_cov <= 0 or float(mean.norm()) == 0:
        return {"cosine": float("nan"), "progress": float("nan"), "snr": float("nan")}
    signal = float((mean ** 2).sum()) - tr_cov / n
    return {"cosine": float((mean * grad_j).sum() / (mean.norm() * grad_j.norm())),
            "progress": float((mean * grad_j).sum() / (grad_j * grad_j).sum()),
            "snr": signal / tr_cov}
