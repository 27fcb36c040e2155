# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Tutorial 3 — Off-policy and the first-order approximation
#
# **The question.** The responses a trainer learns from were sampled by another policy: an
# inference engine with other numerics, at weights a few updates old. Which importance weights
# make the gradient right again, what does each one cost in variance, and what does the common
# token-level shortcut estimate instead?
#
# In tutorial 1 every sample came from the policy we differentiate. A real RL trainer for language
# models never has that luxury. The responses of a batch were written by an **inference engine**
# at the weights of the last rollout, and the trainer takes several optimizer steps on them. Three
# policies are involved (the notation of Zheng et al. 2025, arXiv 2512.01374):
#
# * $\pi_\theta$ — the policy being trained, whose gradient $\nabla J(\theta)$ we want;
# * $\pi_{\text{old}}$ — the *training* engine at the rollout weights $\theta_{\text{old}}$;
# * $\mu$ — the *inference* engine that actually sampled the tokens: the same weights as
#   $\pi_{\text{old}}$, other numerics (low-precision logits, other kernels, other MoE routing).
#
# The token weight that corrects for all of it factors exactly into two ratios (Zheng et al.,
# Eq. 5):
#
# $$
# \rho_t = \frac{\pi_\theta(y_t\mid s_t)}{\mu(y_t\mid s_t)}
# = \underbrace{\frac{\pi_{\text{old}}(y_t\mid s_t)}{\mu(y_t\mid s_t)}}_{\text{train–inference gap}}
# \cdot
# \underbrace{\frac{\pi_\theta(y_t\mid s_t)}{\pi_{\text{old}}(y_t\mid s_t)}}_{\text{staleness } r_t} .
# $$
#
# There are two ways to use it. **Sequence-level** importance sampling (Zheng et al., Sec. 2.2)
# multiplies the whole response's score by $\rho(y) = \prod_t \rho_t$: exactly unbiased, at a
# price in variance that we will compute. **Token-level** importance sampling weights each
# token by its own $\rho_t$ (their Sec. 2.3, Eq. 3, the token-level surrogate objective): low
# variance, but it estimates the gradient of a different objective, the trust-region surrogate
# $L_\mu(\pi_\theta)$ — a first-order approximation of $J$ around $\mu$. In this notebook we
#
# 1. show that sequence-level IS is unbiased and watch its variance grow with the distance between
#    $\pi_\theta$ and $\mu$ and, geometrically, with the response length;
# 2. prove numerically that token-level IS has expectation *exactly* $\nabla L_\mu(\pi_\theta)$, and
#    measure how far that is from $\nabla J$: the gap $J - L$ is second order, the gradient error
#    first order, and both are governed by the KL divergence;
# 3. see what PPO's clip does to the expected gradient once the policy is stale;
# 4. separate out the training–inference discrepancy and compare no correction, IS, truncated IS
#    and masked IS, with their exact bias and variance;
# 5. leave the sequence ratio attached to the graph on purpose and compute what it costs.
#
# Everything is exact (enumeration, float64) on the tiny MDP of tutorial 1, and runs in seconds.

# %% [markdown]
# ## Setup
#
# The MDP is the one of tutorial 1: two prompts, tokens $\{0, 1, \text{EOS}\}$, responses of at most
# 3 tokens, reward +1 per token that copies the prompt and −1 for a truncated response. The policy
# $\pi_\theta$ is a seeded tabular softmax.
#
# All estimators in this notebook share every part except the one under study:
#
# * **advantage**: leave-one-out with groups of $G = 2$, $\hat A_1 = R_1 - R_2$ (RLOO). It is an
#   unbiased baseline on-policy, and, as we will see, off-policy too when the weights are exact;
# * **aggregation**: sequence-mean of token sums, loss weight $1/S$ per token. The expected
#   gradient is then directly comparable with $\nabla J$ (no length normalization, no random
#   normalizer);
# * **surrogate** and **correction**: what each section varies.
#
# `moments(mdp, policy, estimator, group_size=G, behavior=μ, old=π_old, method="enumeration")`
# enumerates every group of $G$ responses drawn from $\mu$ (each multiset once, with its
# probability), runs the library's own `prepare` and `loss` on each, and returns the exact mean
# $\mathbb{E}[\hat g]$, the total variance $\operatorname{tr}\operatorname{Cov}[\hat g]$, and the
# true $\nabla J$ at $\pi_\theta$. On this MDP that is 240 groups per call, a fraction of a second.

# %%
# %matplotlib inline
import math

import matplotlib.pyplot as plt
import torch

import tokenmdp
from tokenmdp.course.display import alias_box, show, table
from tokenmdp.course.setups import copy_task, ppo_clip_fraction
from tokenmdp.course.tutorials import t03, t03_figures, t03_tables
from tokenmdp.course.tutorials.t03 import one_sample, response_scores, rloo
from tokenmdp.estimators import (
    ImportanceSampling,
    Level,
    MaskedIS,
    NoCorrection,
    PPOClip,
    Reinforce,
    SequenceRatio,
    TokenRatio,
    TruncatedIS,
)
from tokenmdp.exact import (
    first_order_path,
    flat_grad,
    gradient,
    inference_copy,
    moments,
    sequence_kl,
    sequence_logprobs,
    sequence_probs,
    stale_copy,
    surrogate,
    values,
)

# Named tolerances for the checks in this notebook.
EXACT_TOL = 1e-12  # two exact float64 computations of the same quantity
SLOPE_TOL = 0.05   # a fitted log-log slope against its theoretical value
Z_TOL = 4.0        # |Monte Carlo estimate - exact| in standard errors

G = 2              # responses per prompt
METHOD = "enumeration"  # exact moments: every group of G responses, with its probability
print("tokenmdp", tokenmdp.__version__, "| torch", torch.__version__)

# Every tensor here is tiny: one CPU thread avoids the cost of synchronizing several.
torch.set_num_threads(1)

# %%
mdp, pi = copy_task()                      # tutorial 1's copy task and its seeded policy
V, L = mdp.vocab_size, mdp.max_len
EOS = V - 1
grad_J = gradient(mdp, pi)

# t03.rloo(surrogate, correction): leave-one-out advantage, loss weight 1/S per token, and the
# surrogate (and training-inference correction) under study
on_policy = moments(mdp, pi, rloo(Reinforce()), group_size=G, method=METHOD)
print(f"{mdp.num_sequences} responses, {mdp.num_states} states, "
      f"{grad_J.numel()} parameters, ||∇J|| = {float(grad_J.norm()):.4f}")
print(f"on-policy RLOO (G = {G}): ||E[ĝ] - ∇J|| = {float(on_policy.bias.norm()):.1e}, "
      f"total variance = {on_policy.total_variance:.4f}")
assert on_policy.bias.norm() < EXACT_TOL

# %% [markdown]
# ## 1. Sequence-level importance sampling: unbiased, and expensive
#
# Sample from $\mu$, want an expectation under $\pi_\theta$. For any function $f$ of the response,
#
# $$
# \mathbb{E}_{y\sim\mu}\big[\rho(y)\, f(y)\big] = \sum_y \mu(y)\,\frac{\pi_\theta(y)}{\mu(y)}\, f(y)
# = \mathbb{E}_{y\sim\pi_\theta}[f(y)],
# \qquad \rho(y) = \frac{\pi_\theta(y\mid x)}{\mu(y\mid x)} = \prod_{t} \rho_t ,
# $$
#
# as long as $\mu$ puts mass wherever $\pi_\theta$ does. With $f = \hat A\, \nabla \log \pi_\theta(y)$
# this gives an unbiased off-policy policy gradient (Precup et al. 2000 for the RL form). The price
# is in the second moment. For the same $f$,
#
# $$
# \mathbb{E}_{\mu}\big[\rho^2 f^2\big] = \sum_y \frac{\pi_\theta(y)^2}{\mu(y)}\, f(y)^2
# = \big(1 + \chi^2(\pi_\theta\,\|\,\mu)\big)\; \mathbb{E}_{y\sim q}\big[f(y)^2\big],
# \qquad
# \chi^2(\pi\,\|\,\mu) = \sum_y \frac{\pi(y)^2}{\mu(y)} - 1 = \operatorname{Var}_\mu[\rho],
# $$
#
# where $q \propto \pi_\theta^2/\mu$ is another distribution over responses. The factor
# $1 + \chi^2$ is what importance sampling costs, and it is computed *exactly* from the sequence
# probabilities.
#
# ### Two compositions of one estimator
#
# `tokenmdp` can write sequence-level IS in two ways, and they must agree:
#
# * the `SequenceRatio` surrogate, $\rho(y)\hat A$ with $\rho = \prod_t \pi_\theta/\pi_{\text{old}}$,
#   sampling from $\mu = \pi_{\text{old}}$ (pure staleness);
# * the plain `Reinforce` surrogate times an `ImportanceSampling` correction at `Level.SEQUENCE`,
#   which multiplies by the detached product $\prod_t \pi_{\text{old}}/\mu$; tell it that the
#   "training engine" is $\pi_\theta$ itself (`old=pi`), and the factor becomes $\rho(y)$.
#
# The same holds at the token level (`TokenRatio` against `Reinforce` times token-level
# `ImportanceSampling`). We build a stale behaviour policy with `stale_copy`, which moves the
# parameters back a distance $d$ along $\nabla J$, so that $\pi_\theta$ is $\pi_{\text{old}}$ after
# one ascent step of length $d$.

# %%
pi_old = stale_copy(mdp, pi, distance=1.0)


def from_pi_old(estimator, **kwargs):
    return moments(mdp, pi, estimator, group_size=G, behavior=pi_old, method=METHOD, **kwargs)


pairs = {
    "sequence IS": (from_pi_old(rloo(SequenceRatio())),
                    from_pi_old(rloo(Reinforce(), ImportanceSampling(level=Level.SEQUENCE)), old=pi)),
    "token IS": (from_pi_old(rloo(TokenRatio())),
                 from_pi_old(rloo(Reinforce(), ImportanceSampling(level=Level.TOKEN)), old=pi)),
}
compositions = t03_tables.composition_table(pairs)
print(compositions)
assert all(diff < EXACT_TOL and abs(dvar) < EXACT_TOL for *_, diff, dvar in compositions.rows)


# %% [markdown]
# Same mean, same variance: the split of $\rho_t$ into a surrogate ratio and a correction factor is
# bookkeeping, which is why `tokenmdp` keeps the two as separate parts.
#
# ### Bias and variance as the behaviour policy goes stale
#
# Now a sweep over the stale distance $d$. At each $d$ we compute the sequence KL
# $\mathrm{KL}(\pi_\theta\,\|\,\mu)$, the exact $\chi^2(\pi_\theta\,\|\,\mu)$ (averaged over prompts
# with $D(x)$), and the exact moments of sequence-level and token-level IS. Jensen's inequality
# gives $\log(1+\chi^2) \ge \mathrm{KL}$ ($\log \mathbb{E}_\pi[\rho] \ge
# \mathbb{E}_\pi[\log\rho]$), so $1 + \chi^2$ grows at least like $e^{\mathrm{KL}}$.

# %%
def chi_square(mdp, p, q):
    # χ²(p‖q) = Σ_x D(x) Σ_y p(y|x)² / q(y|x) − 1, from the exact sequence log-probs
    with torch.no_grad():
        log_p, log_q = sequence_logprobs(mdp, p), sequence_logprobs(mdp, q)
        prompt_weights_N = mdp.prompt_probs[mdp.terminal_prompt_index]
        return float((prompt_weights_N * (2 * log_p - log_q).exp()).sum()) - 1.0


# %%
DISTANCES = [0.0, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 6.0]
sweep = []
for d in DISTANCES:
    stale = stale_copy(mdp, pi, distance=d)
    with torch.no_grad():
        kl = float(sequence_kl(mdp, pi, stale))
    sweep.append(dict(
        distance=d, old=stale, kl=kl, chi2=chi_square(mdp, pi, stale),
        grad_L=flat_grad(surrogate(mdp, pi, stale), pi),          # ∇L_μ(π), used in section 2
        seq=moments(mdp, pi, rloo(SequenceRatio()), group_size=G, behavior=stale, method=METHOD),
        tok=moments(mdp, pi, rloo(TokenRatio()), group_size=G, behavior=stale, method=METHOD)))

print(t03_tables.sweep_table(sweep))
assert all(row["seq"].bias.norm() < EXACT_TOL for row in sweep)   # unbiased at every distance
assert all(math.exp(row["kl"]) <= 1 + row["chi2"] + EXACT_TOL for row in sweep)

# %% [markdown]
# Sequence-level IS is unbiased to rounding error at every distance, while its variance climbs
# with the divergence. Token-level IS keeps its variance lower (three times lower at $d = 6$) but
# drifts away from $\nabla J$.
# On a plot against the KL, with the multiplier $1 + \chi^2$ beside it:

# %%
t03_figures.plot_sweep_variance(sweep, on_policy.total_variance, group_size=G)
plt.show()


# %% [markdown]
# The variance multiplier of sequence-level IS follows $1 + \chi^2$ (it even overshoots it: the
# second factor $\mathbb{E}_q[f^2]$ also grows, because $q \propto \pi_\theta^2/\mu$ leans further
# toward the responses that $\pi_\theta$ has learned to like). And $1 + \chi^2$ itself grows much
# faster than $e^{\mathrm{KL}}$ once the policies are far apart.
#
# ### Variance against length: $(1 + \chi^2)^T$
#
# The worst part is the dependence on the response length. If every state contributes the same
# per-token divergence $\chi^2_{\text{tok}}$ and every response has exactly $T$ tokens, the
# sequence ratio is a product of $T$ independent factors and
#
# $$
# 1 + \chi^2_{\text{seq}} = \mathbb{E}_\mu\Big[\prod_{t=1}^T \rho_t^2\Big]
# = (1 + \chi^2_{\text{tok}})^T .
# $$
#
# We build exactly that case: MDPs with $T = 1, \dots, 6$, a behaviour policy $\mu$ that is uniform
# over tokens 0 and 1, and a policy $\pi_\theta$ that prefers token 0 (logit
# $\delta = 1.5$) in every state. Both give EOS a logit of −40 (probability $\sim 10^{-17}$), so
# every response has exactly $T$ tokens. The reward is the fraction of zeros. To make the identity
# of the second moment exact we use one response per step ($G = 1$) and the reward as advantage:
# then $\hat g = \rho(y)\, R\, \nabla\log\pi_\theta(y)$ and
#
# $$
# \mathbb{E}\|\hat g\|^2 = (1 + \chi^2_{\text{seq}})\; \mathbb{E}_{y\sim q}\big[R(y)^2\,
# \|\nabla \log\pi_\theta(y)\|^2\big].
# $$
#
# The right-hand side needs the score $\nabla\log\pi_\theta(y)$ of every response; we take it by
# autograd, as in tutorial 1, with the backward passes of all responses batched.

# %%
DELTA, NO_EOS = 1.5, -40.0
LENGTHS = range(1, 7)
# t03.response_scores(mdp, policy): [N, num_params], ∇ log π(y|x) of every response in canonical
# order, one vector-Jacobian product per response, batched (is_grads_batched)
# t03.fixed_length_pair(T, ...): (mdp, π, μ), every response T tokens, reward = fraction of zeros

with torch.no_grad():
    p_tok = torch.softmax(torch.tensor([DELTA, 0.0, NO_EOS], dtype=torch.float64), -1)
    q_tok = torch.softmax(torch.tensor([0.0, 0.0, NO_EOS], dtype=torch.float64), -1)
    chi2_tok = float((p_tok ** 2 / q_tok).sum()) - 1
print(f"per-token χ² = {chi2_tok:.6f}\n")


# %%
def second_moment(mdp_T, pi_T, mu_T, seq_T):
    # E||ĝ||² from the exact moments, and (1 + χ²_seq) E_q[R² ||σ||²] with q ∝ π²/μ
    scores = response_scores(mdp_T, pi_T)
    with torch.no_grad():
        tilted = (2 * sequence_logprobs(mdp_T, pi_T) - sequence_logprobs(mdp_T, mu_T)).exp()
        tilted = tilted / tilted.sum()                                # q ∝ π²/μ
        tilted_second = (tilted * mdp_T.rewards ** 2 * scores.pow(2).sum(1)).sum()
    predicted = (1 + chi_square(mdp_T, pi_T, mu_T)) * float(tilted_second)
    return seq_T.total_variance + float(seq_T.mean @ seq_T.mean), predicted


# %%
by_length, identities = [], []
for T in LENGTHS:
    mdp_T, pi_T, mu_T = t03.fixed_length_pair(T, delta=DELTA, no_eos=NO_EOS)
    row = {name: moments(mdp_T, pi_T, one_sample(part), group_size=1, method=METHOD,
                         behavior=None if name == "on" else mu_T)
           for name, part in [("seq", SequenceRatio()), ("tok", TokenRatio()), ("on", Reinforce())]}
    by_length.append(dict(T=T, **row))
    identities.append((T, 1 + chi_square(mdp_T, pi_T, mu_T), (1 + chi2_tok) ** T,
                       *second_moment(mdp_T, pi_T, mu_T, row["seq"])))
print(t03_tables.length_identity_table(identities))
assert all(abs(seq_side - power) < EXACT_TOL for _, seq_side, power, _, _ in identities)
assert all(abs(second - pred) < EXACT_TOL * max(1.0, pred) for *_, second, pred in identities)

# %% [markdown]
# Both identities hold to rounding error. Now the variances themselves against $T$, on a log scale.
# On-policy REINFORCE grows slowly (the score is a sum of $T$ terms); sequence-level IS carries the
# extra factor $(1 + \chi^2_{\text{tok}})^T$, a straight line on this scale. The right panel divides
# out the on-policy variance (from $T = 2$: with a single token the on-policy variance is tiny and
# the ratio is not yet in its regime); the successive ratios approach $1 + \chi^2_{\text{tok}}$.

# %%
t03_figures.plot_length_variance(by_length, chi2_tok)
plt.show()
print(t03_tables.length_ratio_table(by_length, chi2_tok))

# %% [markdown]
# A per-token $\chi^2$ of 0.4 is large; in a real model it is tiny per token, but responses have
# thousands of tokens, and $(1 + 10^{-3})^{4000} \approx 55$. This is why nobody trains a language
# model with plain sequence-level importance weights. Notice also the last two columns: token-level
# IS has a constant low variance but a bias that grows with $T$. The rest of the notebook is about
# that bias.

# %% [markdown]
# ## 2. Token-level IS is the gradient of the trust-region surrogate
#
# Weight every token by its own ratio instead: $\hat g_{\text{tok}} = \frac1G\sum_i \hat A_i
# \sum_t \rho_{i,t}\, \nabla\log\pi_\theta(y_{i,t}\mid s_{i,t})$, and group its expectation by state.
# A state $s$ is reached with probability $d^\mu(s)$ under $\mu$ (summed over depths; this is
# `state_visitation`), its token is drawn from $\mu(\cdot\mid s)$, and the expected reward after
# $(s, a)$ is $Q^\mu(s, a)$. The baseline $R_2$ is independent of $y_1$, and it multiplies
# $\sum_t \rho_t \nabla\log\pi_\theta$, whose expectation
# $\sum_s d^\mu(s)\sum_a \pi_\theta(a\mid s)\nabla\log\pi_\theta(a\mid s)$ is zero; for the same
# reason $Q^\mu$ may be replaced by the advantage $A^\mu(s, a) = Q^\mu(s, a) - V^\mu(s)$. So
#
# $$
# \mathbb{E}[\hat g_{\text{tok}}] = \sum_s d^\mu(s) \sum_a \mu(a\mid s)
# \frac{\pi_\theta(a\mid s)}{\mu(a\mid s)}\, A^\mu(s, a)\, \nabla\log\pi_\theta(a\mid s)
# = \nabla_\theta \underbrace{\Big[J(\mu) + \sum_s d^\mu(s) \sum_a \pi_\theta(a\mid s)\,
# A^\mu(s, a)\Big]}_{L_\mu(\pi_\theta)} .
# $$
#
# $L_\mu$ is the surrogate of conservative policy iteration (Kakade & Langford 2002, whose
# Lemma 6.1 is the exact identity it approximates, tutorial 6) and TRPO (Schulman et al. 2015,
# arXiv 1502.05477, Eq. 3): it keeps $\mu$'s state distribution and advantages, and
# swaps in $\pi_\theta$'s action probabilities. It agrees with $J$ to first order at
# $\pi_\theta = \mu$. `surrogate(mdp, policy, behavior)` computes it in closed form, so we can check
# the identity at every distance of the sweep, for every coordinate.

# %%
print(f"{'d':>5} {'||E ĝ_tok - ∇L_μ||':>19} {'||E ĝ_tok - ∇J||':>17} {'||∇L_μ - ∇J||':>14} "
      f"{'difference':>11}")
for row in sweep:
    m = row["tok"]
    to_L = float((m.mean - row["grad_L"]).norm())
    bias = float(m.bias.norm())
    surrogate_error = float((row["grad_L"] - grad_J).norm())
    print(f"{row['distance']:>5.2f} {to_L:>19.1e} {bias:>17.6f} {surrogate_error:>14.6f} "
          f"{bias - surrogate_error:>11.1e}")
    assert to_L < EXACT_TOL

# %% [markdown]
# To rounding error, the token-level estimator is an unbiased estimator of $\nabla L_\mu(\pi_\theta)$,
# and its bias as an estimator of $\nabla J$ **is** the surrogate's gradient error
# $\nabla L_\mu - \nabla J$. (Also a check of `surrogate` itself: two independent computations, one
# through the estimator library on every enumerated group, one through value tables.)
#
# ### Exercise 1 — token-level IS at a distance the sweep skipped
#
# *Predict* the relative bias $\|\mathbb{E}[\hat g_{\text{tok}}] - \nabla J\| / \|\nabla J\|$ of
# token-level IS with data from `stale_copy(mdp, pi, distance=1.5)`: between the sweep's values at
# $d = 1$ and $d = 2$, closer to which? Record it as `bias_prediction` (`"a"` for the value at
# $d = 1$, `"b"` for the value at $d = 2$). Then compute it **without** `moments`, from
# `surrogate` and `gradient` alone, and store it in `token_is_answer`.

# %%
# Solution
bias_prediction = "b"               # recorded before computing: "a" (d = 1) or "b" (d = 2)
# E[ĝ_tok] = ∇L_μ(π) exactly, so the bias is the surrogate's gradient error ∇L_μ − ∇J
stale_15 = stale_copy(mdp, pi, distance=1.5)
surrogate_error = flat_grad(surrogate(mdp, pi, stale_15), pi) - grad_J
token_is_answer = float(surrogate_error.norm() / grad_J.norm())

# %%
# Check
tokenmdp.check("tr03_token_is_relative_bias", token_is_answer)
tokenmdp.check("tr03_predict_token_is_bias", bias_prediction)

# %% [markdown]
# Closer to $d = 2$: 0.31 between 0.22 and 0.39. The bias grows more slowly than in proportion to
# the distance, so the value in the middle lies above the chord.
#
# ### How good is the first-order approximation?
#
# `first_order_path(mdp, old, direction, steps)` walks
# $\theta(s) = \theta_{\text{old}} + s\, u/\|u\|$ and returns, at each step, the true improvement
# $J(\theta) - J(\theta_{\text{old}})$, the surrogate's $L_{\pi_{\text{old}}}(\pi_\theta) -
# J(\theta_{\text{old}})$, the sequence-IS objective's, the gap $J - L$, the trust-region bound
# $2\varepsilon\alpha^2 L(L-1)$ with $\alpha = \max_s \mathrm{TV}(\pi_\theta(\cdot\mid s),
# \pi_{\text{old}}(\cdot\mid s))$ and $\varepsilon = \max_{s,a}|A^{\pi_{\text{old}}}(s, a)|$
# (the finite-horizon form of TRPO's Theorem 1), and the gradient error
# $\|\nabla L - \nabla J\|$. We start at $\theta_{\text{old}} = \theta$ of our policy and follow
# $\nabla J(\theta_{\text{old}})$, the direction an optimizer would take.
#
# First a consistency check: the token-IS bias at stale distance $d$ from the sweep must be the
# gradient error of the path at step $s = d$ from that stale policy, because `stale_copy` moved
# back along exactly that direction.

# %%
row = sweep[DISTANCES.index(1.0)]
(point,) = first_order_path(mdp, row["old"], grad_J, [row["distance"]])
bias_norm = float(row["tok"].bias.norm())
print(f"d = {row['distance']}: token-IS ||bias|| from moments = {bias_norm:.12f}   "
      f"gradient error of the path = {point.gradient_error:.12f}   "
      f"difference = {bias_norm - point.gradient_error:.1e}")
assert abs(bias_norm - point.gradient_error) < EXACT_TOL

# %%
STEPS = torch.logspace(-3, 1, 13, dtype=torch.float64).tolist()
direction = gradient(mdp, pi)
path = first_order_path(mdp, pi, direction, STEPS)
# KL(π_θ(s) ‖ π_old) along the same path: the sequence KL and the largest per-state KL
path_kl, path_max_state_kl = t03.path_kls(mdp, pi, direction, STEPS)

print(t03_tables.path_table(path, path_kl))
assert all(abs(p.sequence_is_improvement - p.true_improvement) < EXACT_TOL for p in path)
assert all(abs(p.gap) <= p.bound for p in path)


# %% [markdown]
# The sequence-IS objective reproduces the true improvement at every step (it is exact, whatever the
# distance), and $|J - L|$ stays under the trust-region bound (loose here by about two orders of
# magnitude, as worst-case bounds are). The orders follow from a log-log fit on the small steps:
# the gap should have slope 2 and the gradient error slope 1.

# %%
def loglog_slope(xs, ys):
    # least-squares slope of log y against log x
    lx = torch.log(torch.tensor(xs, dtype=torch.float64))
    ly = torch.log(torch.tensor(ys, dtype=torch.float64))
    lx, ly = lx - lx.mean(), ly - ly.mean()
    return float((lx * ly).sum() / (lx * lx).sum())


small = [p for p in path if p.step <= 0.1]
fits = [("|J - L| (gap)", loglog_slope([p.step for p in small], [abs(p.gap) for p in small]), 2.0),
        ("||∇L - ∇J||", loglog_slope([p.step for p in small], [p.gradient_error for p in small]),
         1.0),
        ("KL(π_θ ‖ π_old)", loglog_slope([p.step for p in small], path_kl[:len(small)]), 2.0)]
print(f"{'quantity':>16} {'fitted slope':>13} {'theory':>7} {'difference':>11}")
for name, slope, theory in fits:
    print(f"{name:>16} {slope:>13.4f} {theory:>7.1f} {slope - theory:>+11.4f}")
    assert abs(slope - theory) < SLOPE_TOL

# %% [markdown]
# Since the KL between nearby policies is itself second order in the step
# ($\mathrm{KL} \approx \tfrac12 s^2\, u^\top F u$ with $F$ the Fisher information), the gap is
# **first order in the KL**: the ratio gap/KL in the table above settles to a constant for small
# steps. Pinsker's inequality, $\mathrm{TV} \le \sqrt{\mathrm{KL}/2}$ at every state, turns the
# trust-region bound into a KL bound,
# $|J - L| \le 2\varepsilon\alpha^2 L(L-1) \le \varepsilon\, L(L-1)\max_s
# \mathrm{KL}\big(\pi_{\text{old}}(\cdot\mid s)\,\|\,\pi_\theta(\cdot\mid s)\big)$ — the form TRPO
# constrains.

# %%
with torch.no_grad():
    eps_A = float(values(mdp, pi).A.abs().max())        # ε = max |A^{π_old}(s, a)|
kl_bound = [eps_A * L * (L - 1) * k for k in path_max_state_kl]

t03_figures.plot_gap_orders(path, path_kl, kl_bound, anchor=small[0])
plt.show()

assert all(p.bound <= b * (1 + EXACT_TOL) for p, b in zip(path, kl_bound))
print(f"gap / KL at the three smallest steps: "
      f"{[round(p.gap / k, 5) for p, k in zip(path[:3], path_kl[:3])]}")


# %% [markdown]
# That is the whole case for token-level estimators: their bias is the error of a first-order
# approximation, small exactly when $\pi_\theta$ stays KL-close to the policy that produced the
# data. Keeping it close is what clipping is for.

# %% [markdown]
# ## 3. PPO's clip under staleness
#
# PPO (Schulman et al. 2017, arXiv 1707.06347, Eq. 7) replaces the token term $r_t \hat A$ by
# $\min\big(r_t \hat A,\ \mathrm{clip}(r_t, 1-\varepsilon, 1+\varepsilon)\hat A\big)$. Its gradient is
# the token-IS gradient with a mask: $M_t\, r_t \hat A\, \nabla\log\pi_\theta$, where $M_t = 0$
# exactly when the ratio has already moved past the clip range in the direction the advantage pushes
# ($\hat A > 0,\ r_t > 1+\varepsilon$ or $\hat A < 0,\ r_t < 1-\varepsilon$). So:
#
# * if no token is clipped, PPO's expected gradient is **exactly** $\nabla L_\mu(\pi_\theta)$;
# * clipped tokens lose their gradient entirely; the tokens that keep it include those that moved
#   the "wrong" way, whose gradient pulls $\pi_\theta$ back toward $\pi_{\text{old}}$.
#
# The **clip fraction** that trainers log is the share of tokens with $M_t = 0$. For $G = 2$ and the
# leave-one-out advantage $\hat A_1 = R_1 - R_2$ we can compute its exact expectation by enumerating
# every response together with its partner. We report the pooled fraction
# $\mathbb{E}[\#\text{clipped tokens}] / \mathbb{E}[\#\text{tokens}]$, what a large batch measures,
# using the library's own `ppo_keep_mask`.

# %%
def exact_clip_fraction(mdp, pi, pi_old, eps):
    # E[#clipped tokens] / E[#tokens] for G = 2, Â_1 = R_1 - R_2, both responses drawn from π_old:
    # every response with every partner, probability D(x) π_old(y_1|x) π_old(y_2|x), a token
    # clipped where ppo_keep_mask is False (tokenmdp.course.setups.ppo_clip_fraction)
    return ppo_clip_fraction(mdp, pi, pi_old, eps_low=eps, eps_high=eps)


# %% [markdown]
# Before using it, a Monte Carlo check of this function against the trainer's code path: sample
# groups from $\pi_{\text{old}}$ with `sample`, run `prepare` and `loss` of the PPO estimator, and
# read `metrics["clip_fraction"]`. Eight independent batches of 2000 responses give a mean and a
# standard error.

# %%
EPS_CHECK, d_check = 0.1, 0.5
stale = sweep[DISTANCES.index(d_check)]["old"]
ppo_check = rloo(PPOClip(eps_low=EPS_CHECK, eps_high=EPS_CHECK))
# sample 2000 responses from π_old = μ, prepare, loss, read metrics["clip_fraction"]; 8 times
fractions = t03.monte_carlo_clip_fraction(mdp, pi, stale, ppo_check, batches=8, size=2000,
                                          group_size=G, generator=torch.Generator().manual_seed(3))
estimate, se = float(fractions.mean()), float(fractions.std() / len(fractions) ** 0.5)
exact = exact_clip_fraction(mdp, pi, stale, EPS_CHECK)
print(f"ε = {EPS_CHECK}, d = {d_check}: clip fraction Monte Carlo = {estimate:.5f} ± {se:.5f}   "
      f"exact = {exact:.5f}   difference = {estimate - exact:+.5f} "
      f"({(estimate - exact) / se:+.2f} s.e.)")
assert abs(estimate - exact) < Z_TOL * se

# %% [markdown]
# Now the exact moments of PPO for a few clip ranges and stale distances (the token-IS column is
# $\varepsilon = \infty$). We report the cosine of $\mathbb{E}[\hat g]$ with $\nabla J$, its distance
# to $\nabla L_\mu$ (zero when nothing is clipped), its norm, and the clip fraction.

# %%
EPSILONS = [0.05, 0.1, 0.2]
PPO_DISTANCES = [0.1, 0.25, 0.5, 1.0]
ppo = {}
for d in PPO_DISTANCES:
    row = sweep[DISTANCES.index(d)]
    for eps in EPSILONS:
        m = moments(mdp, pi, rloo(PPOClip(eps_low=eps, eps_high=eps)), group_size=G,
                    behavior=row["old"], method=METHOD)
        ppo[d, eps] = dict(m=m, clip=exact_clip_fraction(mdp, pi, row["old"], eps))
    ppo[d, math.inf] = dict(m=row["tok"], clip=0.0)                  # ε = ∞: token IS
ppo_rows = t03_tables.ppo_table(ppo, {row["distance"]: row["grad_L"] for row in sweep}, grad_J)
print(ppo_rows)
# nothing clipped: PPO is token IS, mean ∇L exactly
assert all(to_L < EXACT_TOL for _, _, clip, _, to_L, *_ in ppo_rows.rows if clip == 0.0)

# %%
t03_figures.plot_ppo(ppo, PPO_DISTANCES, EPSILONS + [math.inf])
plt.show()

# %% [markdown]
# Three regimes are visible. While the ratios stay inside $[1-\varepsilon, 1+\varepsilon]$, PPO *is*
# token-level IS, mean $\nabla L_\mu$ to the last digit. Once the policy has moved about as far as
# $\varepsilon$ allows, the clip removes the gradient of exactly those tokens that already got what
# the advantage asked for; the expected gradient shrinks and turns away from $\nabla J$. Far past
# the clip range almost every token that pushes further is masked, and what remains are the tokens
# that moved against their advantage: the mean gradient now points *back* toward $\pi_{\text{old}}$
# (a negative cosine for the smallest $\varepsilon$). Clipping is not an estimator of $\nabla J$; it
# is a brake that keeps the first-order approximation valid by stopping the step.

# %% [markdown]
# ## 4. The training–inference discrepancy
#
# Now freeze staleness: $\pi_\theta = \pi_{\text{old}}$ (the first mini-batch of a step), and let
# the sampler be an inference engine with other numerics, built with `inference_copy`: the same
# logits plus a fixed Gaussian perturbation (standard deviation 0.5 per state and token), rounded to
# 3 mantissa bits — exaggerated so that the effects are visible on a tiny MDP. Four corrections act
# on the detached factor $w_t = \pi_{\text{old}}/\mu$ (the surrogate's own ratio $r_t$ is 1 here):
#
# * **no correction** — treat $\mu$'s samples as if $\pi_{\text{old}}$ had drawn them;
# * **IS** — multiply by $w$;
# * **truncated IS** (TIS; Yao et al. 2025, "Your efficient RL framework secretly brings you
#   off-policy RL training") — multiply by $\min(w, C)$;
# * **masked IS** (MIS) — multiply by $w\,\mathbf 1\{w \le C\}$, dropping the samples whose ratio
#   is too large; we keep masked tokens in the normalizer. The sweep below masks **one-sided, at
#   the sequence level**: a whole response goes when $W > C$. IcePop (arXiv 2510.18855) is another
#   member of the family, a **two-sided token mask**: a token keeps its gradient only when
#   $\alpha \le w_t \le \beta$ ($\alpha = 0.5$, $\beta = 5$; the registry's `ppo_mis`,
#   `MaskedIS(low=0.5, high=5, level=Level.TOKEN)`), and it is shown beside the sweep.
#
# Each at the token level ($w_t$) or the sequence level ($W = \prod_t w_t$). From sections 1 and 2
# we already know two answers: sequence-level IS is unbiased, and token-level IS has mean
# $\nabla L_\mu(\pi_{\text{old}})$.

# %%
mu = inference_copy(pi, rounding=3, noise_std=0.5, generator=torch.Generator().manual_seed(1))
enum = mdp.enumerate()
with torch.no_grad():
    log_w = torch.where(enum.loss_mask, pi.token_logprobs(enum) - mu.token_logprobs(enum), 0.0)
    w_tok = log_w[enum.loss_mask].exp()                      # every token's π_old/μ
    w_seq = enum.sequence_sum(log_w).exp()                   # every response's Π_t π_old/μ
    kl_train_inference = float(sequence_kl(mdp, mu, pi))
print(f"KL(μ ‖ π_old) = {kl_train_inference:.4f} per response;  token ratio w in "
      f"[{float(w_tok.min()):.3f}, {float(w_tok.max()):.3f}],  sequence ratio W in "
      f"[{float(w_seq.min()):.3f}, {float(w_seq.max()):.3f}]")


# %%
def with_correction(correction):
    return moments(mdp, pi, rloo(TokenRatio(), correction), group_size=G, behavior=mu, old=pi,
                   method=METHOD)


none = with_correction(NoCorrection())
is_tok = with_correction(ImportanceSampling(level=Level.TOKEN))
is_seq = with_correction(ImportanceSampling(level=Level.SEQUENCE))
grad_L_mu = flat_grad(surrogate(mdp, pi, mu), pi)
print(f"\nsequence IS: ||E ĝ - ∇J|| = {float(is_seq.bias.norm()):.1e};   token IS: "
      f"||E ĝ - ∇L_μ(π_old)|| = {float((is_tok.mean - grad_L_mu).norm()):.1e}")
assert is_seq.bias.norm() < EXACT_TOL and (is_tok.mean - grad_L_mu).norm() < EXACT_TOL

# %% [markdown]
# ### A cap above every ratio changes nothing
#
# $\min(w, C) = w$ and $\mathbf 1\{w \le C\} = 1$ whenever $C$ exceeds every ratio $\mu$ can
# produce, so TIS and MIS with such a cap must *be* IS — the same numbers, not approximately. We
# take $C$ just above the largest ratio at each level.

# %%
above_tok, above_seq = 1.01 * float(w_tok.max()), 1.01 * float(w_seq.max())
SEQ = Level.SEQUENCE
caps_above = {
    f"TIS token C={above_tok:.2f}": (TruncatedIS(cap=above_tok), is_tok),
    f"MIS token C={above_tok:.2f}": (MaskedIS(high=above_tok, masked_in_normalizer=True), is_tok),
    f"TIS seq.  C={above_seq:.2f}": (TruncatedIS(cap=above_seq, level=SEQ), is_seq),
    f"MIS seq.  C={above_seq:.2f}": (MaskedIS(high=above_seq, masked_in_normalizer=True,
                                              level=SEQ), is_seq),
}
same = {name: (with_correction(c), reference) for name, (c, reference) in caps_above.items()}
print(t03_tables.cap_table(same))
assert all((m.mean - reference.mean).abs().max() < EXACT_TOL
           and abs(m.total_variance - reference.total_variance) < EXACT_TOL
           for m, reference in same.values())

# %% [markdown]
# ### The bias–variance trade-off of the cap
#
# Lowering $C$ below the largest ratio trades bias for variance. A step averages $B$ independent
# groups, so its mean squared error is exactly
#
# $$
# \mathrm{MSE}_B = \|\mathbb{E}[\hat g] - \nabla J\|^2
# + \tfrac1B \operatorname{tr}\operatorname{Cov}[\hat g],
# $$
#
# and which cap is best depends on $B$: with few groups the variance dominates, with many the bias
# does. We sweep $C$ for token-level TIS, sequence-level TIS and sequence-level MIS, with
# no correction and the two IS estimators as reference lines.

# %%
CAPS = [2.0, 1.5, 1.25, 1.1, 0.9]
B = 64
families = {
    "TIS token": lambda c: TruncatedIS(cap=c),
    "TIS sequence": lambda c: TruncatedIS(cap=c, level=Level.SEQUENCE),
    "MIS sequence": lambda c: MaskedIS(high=c, masked_in_normalizer=True, level=Level.SEQUENCE),
}
curves = {name: [with_correction(make(c)) for c in CAPS] for name, make in families.items()}
icepop = with_correction(MaskedIS(low=0.5, high=5.0, masked_in_normalizer=True))
references = {"no correction": none, "IS token": is_tok, "IS sequence": is_seq,
              "IcePop (token, [0.5, 5])": icepop}
assert float(w_tok.min()) >= 0.5 and float(w_tok.max()) <= 5.0       # IcePop's band masks nothing
assert (icepop.mean - is_tok.mean).abs().max() < EXACT_TOL
# t03.mse(m, B) = ||E ĝ - ∇J||² + tr Cov[ĝ] / B
print(t03_tables.mse_table(references, curves, CAPS, B))

# %%
t03_figures.plot_cap_tradeoff(curves, references, CAPS, B, tol=EXACT_TOL)
plt.show()

best = {name: CAPS[min(range(len(CAPS)), key=lambda i: t03.mse(ms[i], B))]
        for name, ms in curves.items()}
print(f"cap with the lowest MSE_{B}: {best}")

# %% [markdown]
# What the exact numbers say:
#
# * **No correction** is biased, and so is **token-level IS**, only somewhat less: a token-level
#   factor repairs the action probabilities at each visited state but not the state distribution or
#   the values, which differ between $\mu$ and $\pi_{\text{old}}$ too. It is again the first-order
#   surrogate, now around $\mu$.
# * **Sequence-level IS** is unbiased but has the largest variance. Truncating it (TIS) is the
#   gentlest way down: the bias grows smoothly as $C$ drops, the variance falls, and for a step of
#   $B = 64$ groups the MSE is lowest at an intermediate cap.
# * **Masking** at the sequence level (one-sided MIS) throws away whole responses whose ratio
#   exceeds $C$, so its bias grows much faster once $C$ cuts into the bulk of the ratios; it is a
#   tool against rare, huge ratios (a cap well above 1), not a variance dial. IcePop's two-sided
#   token band $[0.5, 5]$ contains every token ratio of this engine (printed at the start of the
#   section), so here it masks nothing and *is* token-level IS: its lines lie on IS token's.
# * A cap below 1 cuts into the ratios near 1, the bulk of the distribution: every response is
#   down-weighted, and bias takes over for every method.
#
# Real discrepancies are far smaller per token than ours, but responses are thousands of tokens
# long, so the sequence ratio has the $(1+\chi^2)^T$ problem of section 1. That is why practice
# combines token-level estimators (first order, low variance) with a truncated or masked factor
# against the few tokens where the engines disagree badly.

# %% [markdown]
# ## 5. Exercise 2: the bias of truncated IS, in closed form
#
# Take sequence-level TIS with cap $C = 1.25$ in the setting of section 4 ($\pi_\theta =
# \pi_{\text{old}}$, sampler $\mu$, $G = 2$, $\hat A_1 = R_1 - R_2$, loss weight $1/2$). Write its
# expected gradient as a sum over single responses, compute it **without** `moments`, using only
# `sequence_probs`, `sequence_logprobs`, `mdp.rewards`, `mdp.prompt_probs` and `response_scores`,
# as the bias $\mathbb{E}[\hat g] - \nabla J$ (a flat vector), and store its norm in
# `tis_bias_norm`. *Predict* first: is it larger or smaller than the bias of no correction?
# Record it as `tis_prediction` (`"larger"` or `"smaller"`).
#
# *Hints.* By symmetry the expected gradient is the expectation of the first sample's term,
# $\min(W_1, C)\,(R_1 - R_2)\,\nabla\log\pi(y_1)$, with $y_1, y_2$ independent draws from
# $\mu(\cdot\mid x)$. Split it into a term with $R_1$ and a term with $R_2$. Why does the second
# term not vanish, although with $C = \infty$ it would?

# %%
# Solution
tis_prediction = "smaller"          # recorded before computing: "larger" or "smaller"
C_EXERCISE = 1.25


def tis_sequence_bias(mdp, pi, mu, cap):
    # E[ĝ] = Σ_x D(x) ( E_μ[min(W, C) R σ] − E_μ[R] E_μ[min(W, C) σ] ),  W = π/μ of the response,
    # σ = ∇ log π(y|x). The second (baseline) term vanishes for C = ∞, since E_μ[W σ] = E_π[σ] = 0,
    # but a truncated weight no longer averages the score to zero.
    scores = response_scores(mdp, pi)
    with torch.no_grad():
        mu_N = sequence_probs(mdp, mu)
        weight_N = (sequence_logprobs(mdp, pi) - sequence_logprobs(mdp, mu)).exp().clamp(max=cap)
    n = mdp.responses_per_prompt
    mean = torch.zeros(scores.shape[1], dtype=torch.float64)
    for x in range(mdp.num_prompts):
        rows = slice(x * n, (x + 1) * n)
        m, w, r = mu_N[rows], weight_N[rows], mdp.rewards[rows]
        direct = (m * w * r) @ scores[rows]                  # E_μ[min(W, C) R σ]
        baseline = (m @ r) * ((m * w) @ scores[rows])        # E_μ[R] E_μ[min(W, C) σ]
        mean += mdp.prompt_probs[x] * (direct - baseline)
    return mean - gradient(mdp, pi)


tis_bias_norm = float(tis_sequence_bias(mdp, pi, mu, C_EXERCISE).norm())

# %%
# Check
tokenmdp.check("tr03_tis_sequence_bias_norm", tis_bias_norm)
tokenmdp.check("tr03_predict_tis_vs_no_correction", tis_prediction)

# %% [markdown]
# Smaller, about half the bias of no correction (0.025 against 0.050): the cap keeps the exact
# weight on every response with $W \le C$. But not zero. The truncated weight biases the
# estimator twice: directly, through $-\mathbb{E}_\mu[(W - C)^+ R\,
# \sigma]$, and through the baseline, because $\mathbb{E}_\mu[\min(W, C)\,\sigma] \ne 0$ once
# responses are truncated. A baseline is free only under exact importance weights.
#
# ## 6. Failure mode: a sequence ratio left in the graph
#
# Sequence IS has two correct spellings. The ratio form $\rho(y)\hat A$ (`SequenceRatio`)
# differentiates the ratio itself, $\nabla\rho = \rho\,\nabla\log\pi_\theta(y)$; the
# log-prob form $\operatorname{sg}(\rho)\,\hat A\log\pi_\theta(y)$ (`Reinforce` with a
# sequence `ImportanceSampling` correction) detaches it. Mixing them, $\rho\,\hat A
# \log\pi_\theta(y)$ with $\rho$ still attached, adds by the product rule
# $\hat A\log\pi_\theta(y)\,\nabla\rho$:
#
# $$
# \hat g_{\text{broken}} = \rho(y)\,\hat A\,\big(1 + \log\pi_\theta(y\mid x)\big)\,
# \nabla\log\pi_\theta(y\mid x),
# $$
#
# which flips the sign for every response with $\pi_\theta(y\mid x) < 1/e$. We write both as
# loss callables (the exact lab takes any `loss_fn(logprobs, batch)`; `prepare` fills the
# leave-one-out advantage and the $1/S$ weights), with data from the stale policy at $d = 1$.

# %%
def sequence_is_loss(detach_ratio):
    def loss_fn(logprobs_RC, batch):
        rho_S = batch.sequence_sum(logprobs_RC - batch.behavior_logprob).exp()  # π_θ(y|x)/μ(y|x)
        rho_RC = batch.to_tokens(rho_S.detach() if detach_ratio else rho_S)     # on every token
        return -(batch.loss_weight * batch.advantage * rho_RC * logprobs_RC).sum()
    return loss_fn


def lab(loss_fn):
    return moments(mdp, pi, loss_fn, group_size=G, behavior=pi_old, method=METHOD,
                   prepare=rloo(Reinforce(), ImportanceSampling(level=Level.SEQUENCE)))


right, broken = lab(sequence_is_loss(True)), lab(sequence_is_loss(False))

# %% [markdown]
# The predicted error is $\mathbb{E}[\operatorname{sg}(\rho)\,\hat A\,\log\pi_\theta(y)\,
# \nabla\log\pi_\theta(y)]$, a third loss callable with everything but the last factor detached;
# by linearity of the expectation, `broken − right` must equal it exactly.

# %%
def extra_term_loss(logprobs_RC, batch):
    seq_logprob_S = batch.sequence_sum(logprobs_RC)
    rho_S = (seq_logprob_S - batch.sequence_sum(batch.behavior_logprob)).exp()
    factor_RC = batch.to_tokens((rho_S * seq_logprob_S).detach())             # sg(ρ log π(y))
    return -(batch.loss_weight * batch.advantage * factor_RC * logprobs_RC).sum()


predicted = lab(extra_term_loss).mean
show(table([(name, float(m.bias.norm()), m.relative_bias, m.cosine) for name, m in
            (("detached ρ (right)", right), ("ρ left in the graph", broken))],
           ["sequence IS", "‖E ĝ − ∇J‖", "relative bias", "cos(E ĝ, ∇J)"]))
gap = float((broken.mean - right.mean - predicted).abs().max())
print(f"max |(broken − right) − predicted| = {gap:.1e}")
assert right.bias.norm() < EXACT_TOL
assert torch.allclose(broken.mean - right.mean, predicted, rtol=0, atol=EXACT_TOL)

# %% [markdown]
# The detached version is unbiased, as section 1 showed. Left in the graph, the ratio turns the
# expected step against $\nabla J$: in this MDP every response has $\pi_\theta(y\mid x) < 1/e$
# (the likeliest has 0.35), so the factor $1 + \log\pi_\theta(y)$ is negative on every
# response, and largest in size on the unlikely ones. The loss *value* is the same in both
# spellings; only the gradient tells them apart.
#
# ## What verl / TRL / others call this
#
# Generated from the estimator registry's aliases; the registry's TIS and MIS variants put the
# correction of section 4 under PPO's clip:

# %%
show(alias_box(["token_is", "sequence_is", "ppo", "ppo_tis", "ppo_mis"]))

# %% [markdown]
# ## Summary
#
# * $\rho_t = \pi_\theta/\mu$ factors exactly into training–inference discrepancy
#   $\pi_{\text{old}}/\mu$ times staleness $\pi_\theta/\pi_{\text{old}}$; surrogate ratios and
#   correction factors are two halves of the same weight.
# * **Sequence-level IS** is unbiased for $\nabla J$ at any distance; its second moment carries the
#   factor $1 + \chi^2(\pi_\theta\|\mu) \ge e^{\mathrm{KL}}$, which is $(1 + \chi^2_{\text{tok}})^T$
#   for responses of $T$ tokens.
# * **Token-level IS** has expectation exactly $\nabla L_\mu(\pi_\theta)$, the gradient of the
#   trust-region surrogate. Its bias is that surrogate's gradient error: first order in the step,
#   while the objective gap $J - L$ is second order, first order in the KL, and below the
#   trust-region bound.
# * **PPO's clip** leaves token IS untouched inside the clip range and removes the gradient of
#   tokens outside it; far from $\pi_{\text{old}}$ its mean gradient stops following $\nabla J$.
# * Against the **training–inference discrepancy**: TIS or MIS with a cap above every ratio is IS;
#   lowering the cap trades bias for variance, and the best cap depends on the batch size.
# * A sequence ratio must be either differentiated alone ($\rho\hat A$) or detached
#   ($\operatorname{sg}(\rho)\hat A\log\pi_\theta$); left attached in front of $\log\pi_\theta$
#   it multiplies each response's term by $1 + \log\pi_\theta(y\mid x)$.
