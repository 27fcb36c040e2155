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
# # Tutorial 2 — Baselines and groups
#
# **The question.** Without a value function, GRPO-style trainers judge each response against
# the other responses to the same prompt. Which of these group baselines leave the gradient
# unbiased, which ones shrink or turn it, and by exactly how much?
#
# Tutorial 1 ended with a Monte Carlo REINFORCE estimate that was pure noise: every reward was the
# same constant $c$, so $\nabla J = 0$, yet each sample contributed $c\,\nabla\log\pi(y\mid x)$.
# Subtracting a **baseline** removes that noise. LLM trainers almost never have a learned value
# function, so they build the baseline from the **group**: $G$ responses to the same prompt, each
# judged against the others. The choices differ in small details (include the sample itself in the
# mean or not? divide by the group's standard deviation? which standard deviation?) and each detail
# changes what the estimator estimates.
#
# On an MDP small enough to enumerate we compute every estimator's **exact** mean and variance and
# compare them with closed forms:
#
# 1. REINFORCE without a baseline: unbiased, with a variance that depends on where the reward's zero
#    is; a fixed baseline (a constant, or the per-prompt value $V(x)$) keeps it unbiased;
# 2. leave-one-out (RLOO): unbiased, because sample $i$'s baseline never sees sample $i$;
# 3. the group mean: exactly $\frac{G-1}{G}$ times leave-one-out, sample by sample, so its expected
#    gradient is $\frac{G-1}{G}\nabla J$;
# 4. GRPO's division by the group std: for 0/1 rewards and $G = 2$ it gives $\nabla J$ (population
#    std) or $\nabla J/\sqrt 2$ (sample std); beyond that it re-weights prompts and responses and
#    turns the gradient away from $\nabla J$;
# 5. baselines that peek at their own sample, and the exact bias that peeking costs;
# 6. bias and variance of every estimator against $G$.
#
# Everything runs on a CPU in float64 in well under a minute.

# %% [markdown]
# ## Setup
#
# All randomness comes from explicitly seeded `torch.Generator`s. The tolerances are named: two
# exact float64 computations of the same number must agree to rounding error.

# %%
# %matplotlib inline
import dataclasses
import itertools
import math

import matplotlib.pyplot as plt
import torch

import tokenmdp
from tokenmdp.course.display import alias_box, show
from tokenmdp.course.tutorials import t02, t02_figures
from tokenmdp.estimators import (
    Advantage,
    GroupMean,
    GroupNormalized,
    get,
    loss,
    prepare,
)
from tokenmdp.exact import (
    TabularPolicy,
    TokenMDP,
    flat_grad,
    gradient,
    moments,
    sample,
    sequence_logprobs,
    sequence_probs,
)

# Named tolerances for the checks in this notebook.
EXACT_TOL = 1e-12      # two exact float64 computations of the same O(1) quantity (absolute)
VAR_RTOL = 1e-10       # closed-form vs exact-moment variances (relative)
DIRECTION_GAP = 1e-3   # a cosine below 1 - DIRECTION_GAP counts as a change of direction
Z_TOL = 4.0            # |Monte Carlo estimate - exact| in standard errors

# Every tensor here is tiny: one CPU thread avoids the cost of synchronizing several (on a busy
# machine that cost can dominate by a factor of ten).
torch.set_num_threads(1)

print("tokenmdp", tokenmdp.__version__, "| torch", torch.__version__)

# %% [markdown]
# ## 1. The setting: two prompts, a 0/1 reward, one group per step
#
# The MDP of tutorial 1, made smaller: tokens 0, 1 and EOS ($V = 3$), responses of at most $L = 2$
# tokens, so each prompt has $1 + 2 + 4 = 7$ responses. There are two prompts, $x = (0,)$ and
# $x = (1,)$, each with probability ½. The reward is **binary**, like a verifier's: 1 if the response
# contains the prompt's token, else 0.
#
# The policy is tabular with random logits. With this seed one prompt is **hard** (the policy solves
# it about 11% of the time) and the other is **medium** (about 50%); that difference will matter for
# GRPO.

# %%
V, L = 3, 2


def contains_prompt_token(prompt, response):
    return float(prompt[0] in response)


mdp = TokenMDP(V, L, contains_prompt_token, prompts=[(0,), (1,)], prompt_probs=[0.5, 0.5])
policy = TabularPolicy(mdp, generator=torch.Generator().manual_seed(33), init_std=1.5)

N, P = mdp.num_sequences, mdp.num_prompts
probs_N = sequence_probs(mdp, policy).detach()         # π(y|x) of every response
prompt_N = mdp.terminal_prompt_index                   # which prompt each response answers
R_N, D_P = mdp.rewards, mdp.prompt_probs
w_N = D_P[prompt_N] * probs_N                          # P(x, y) = D(x) π(y|x)
J_P = torch.zeros(P, dtype=torch.float64).index_add(0, prompt_N, probs_N * R_N)  # J_x = V(x)
J = float(D_P @ J_P)
show(t02.response_table(mdp, probs_N, J_P, J))

# %% [markdown]
# Every estimator in this notebook is a function of the **score** of each response,
# $\sigma(y) = \nabla_\theta \log\pi_\theta(y\mid x)$. The MDP has only 14 responses, so we compute
# all 14 score vectors once, with autograd, and write every closed form below as a weighted sum over
# them. Two facts from tutorial 1 hold exactly:
#
# $$
# \sum_y \pi(y\mid x)\,\sigma(y) = 0 \quad\text{for every prompt } x,
# \qquad
# \nabla J = \sum_{x, y} D(x)\,\pi(y\mid x)\, R(x, y)\, \sigma(y).
# $$
#
# We also need the per-prompt gradient $g_x = \nabla J_x = \sum_y \pi(y\mid x) R(x,y)\sigma(y)$
# (so $\nabla J = \sum_x D(x) g_x$). A tabular policy has separate logits for the states of each
# prompt, so $g_x$ lives on its own block of coordinates; `prompt_of_param` records which block is
# which.

# %%
score_N = torch.stack([flat_grad(sequence_logprobs(mdp, policy)[n], policy) for n in range(N)])
true_grad = gradient(mdp, policy)
g_P = torch.zeros(P, score_N.shape[1], dtype=torch.float64).index_add(
    0, prompt_N, (probs_N * R_N)[:, None] * score_N)                     # g_x, one row per prompt

# the prompt that owns each logit: states are numbered level by level, prompt-major
prompt_of_state = torch.cat([mdp.level_prefixes(k)[0] for k in range(L)])
prompt_of_param = prompt_of_state.repeat_interleave(V)

mean_score_P = torch.zeros_like(g_P).index_add(0, prompt_N, probs_N[:, None] * score_N)
grad_from_scores = w_N @ (R_N[:, None] * score_N)
show(t02.score_report({"Σ_y π(y|x) σ(y)": mean_score_P,
                       "Σ D π R σ − ∇J (autograd)": grad_from_scores - true_grad,
                       "Σ_x D(x) g_x − ∇J": D_P @ g_P - true_grad},
                      g_P, prompt_of_param, mdp.prompts))
assert float(mean_score_P.abs().max()) < EXACT_TOL
assert torch.allclose(grad_from_scores, true_grad, rtol=0, atol=EXACT_TOL)

# %% [markdown]
# ### The estimators, as the library defines them
#
# One optimizer step here is **one group**: draw a prompt $x \sim D$, then $G$ responses
# $y_1, \dots, y_G \sim \pi(\cdot\mid x)$, independently. Every estimator is the library's
# `reinforce` estimator with a different **advantage** part: the loss is
# $-\frac1G \sum_i A_i \sum_t \log\pi(y_{i,t}\mid s_{i,t})$ (weighted NLL, one weight $1/G$ per
# sequence, `seq-mean-token-sum` aggregation), so its ascent direction is
#
# $$
# \hat g = \frac1G \sum_{i=1}^{G} A_i\, \sigma(y_i).
# $$
#
# Only $A_i$ changes from estimator to estimator. Clipping, ratios and per-token averaging are kept
# out on purpose; later tutorials add them. `get("rloo")` is exactly this estimator with the
# leave-one-out advantage.
#
# `moments(mdp, policy, estimator, group_size=G)` computes $\mathbb{E}[\hat g]$ and
# $\operatorname{tr}\operatorname{Cov}[\hat g]$ **exactly**: it enumerates every group draw with its
# probability and runs the library's own `prepare` and `loss` on it. We cache the results, since
# several sections look at the same (estimator, $G$) pairs.

# %%
reinforce = get("reinforce")
print("reinforce:", reinforce.advantage.describe(), "|", reinforce.aggregation.value)
print("rloo:     ", get("rloo").advantage.describe(), "|", get("rloo").aggregation.value)

ESTIMATORS = {
    "REINFORCE": reinforce,
    "RLOO": get("rloo"),
    "group mean": reinforce.replace(advantage=GroupMean(), name="group mean"),
    "GRPO, sample std": reinforce.replace(advantage=GroupNormalized(ddof=1, eps=0.0),
                                          name="GRPO, sample std"),
    "GRPO, population std": reinforce.replace(advantage=GroupNormalized(ddof=0, eps=0.0),
                                              name="GRPO, population std"),
}
exact = t02.ExactCache(mdp, policy, ESTIMATORS)   # exact(name, G): moments, computed once


# %% [markdown]
# ## 2. REINFORCE, with and without a fixed baseline
#
# With $A_i = R_i - b(x)$ for a baseline that depends on the prompt only (the constant $b = 0$ is
# plain REINFORCE; the reinforcement baseline $b$ is Williams 1992's, *Machine Learning*
# 8:229–256, whose REINFORCE update is $\alpha\,(r - b)$ times the eligibility
# $\nabla\log\pi$), the estimator is **unbiased** for every choice of $b$:
# $\mathbb{E}[(R - b(x))\,\sigma \mid x] = g_x - b(x)\,\mathbb{E}[\sigma\mid x] = g_x$.
#
# Its variance has a closed form. Given $x$, the $G$ terms are i.i.d. with mean $g_x$, so
# $\mathbb{E}[\|\hat g\|^2 \mid x] = \frac1G \mathbb{E}[(R-b)^2\|\sigma\|^2 \mid x] +
# \left(1 - \frac1G\right)\|g_x\|^2$, and averaging over prompts,
#
# $$
# \operatorname{tr}\operatorname{Cov}[\hat g]
# = \frac1G\,\mathbb{E}\big[(R - b(x))^2\,\|\sigma\|^2\big]
# + \Big(1 - \frac1G\Big)\,\mathbb{E}_x\|g_x\|^2 - \|\nabla J\|^2 .
# $$
#
# The first term shrinks like $1/G$ and is the only one the baseline touches. The rest,
# $\operatorname{Cov}_x(g_x)$ summed over coordinates, is the noise of drawing one prompt per step;
# no group size or baseline removes it (more prompts per step would).

# %%
def reinforce_variance(baseline_N, G):
    # closed-form tr Cov of (1/G) Σ_i (R_i - b(x)) σ(y_i); baseline_N[n] = b(x) of response n
    within = w_N @ ((R_N - baseline_N) ** 2 * score_N.pow(2).sum(1))   # E[(R - b)^2 ‖σ‖^2]
    between = D_P @ g_P.pow(2).sum(1)                                  # E_x ‖g_x‖^2
    return float(within / G + (1 - 1 / G) * between - true_grad @ true_grad)


zero_N = torch.zeros(N, dtype=torch.float64)
rows = []
for G in range(1, 5):
    m = exact("REINFORCE", G)
    closed = reinforce_variance(zero_N, G)
    rows.append((G, float(m.bias.norm()), m.total_variance, closed))
    assert float(m.bias.norm()) < EXACT_TOL
    assert abs(m.total_variance - closed) <= VAR_RTOL * closed
show(t02.variance_table(rows, label="G", label_width=2))

# %% [markdown]
# **Where is zero?** The rewards $R$ and $R + c$ define the same learning problem: $J$ moves by $c$,
# $\nabla J$ does not move at all. REINFORCE's variance does move, because "no baseline" is the
# baseline $b = 0$, and adding $c$ to every reward is the same as using the baseline $b = -c$.
# So we implement a fixed baseline $b(x)$ the honest way, by **shifting the reward** in a new MDP,
# $R'(x, y) = R(x, y) - b(x)$, and run plain REINFORCE on it:
#
# * $b = -1$: a reward of 1 for answering and 2 for a correct answer (never negative);
# * $b = 0$: plain REINFORCE on the 0/1 reward;
# * $b = J$: the average reward (a constant);
# * $b = V(x) = J_x$: the per-prompt value (the value function at the prompt), the usual choice of
#   a baseline that depends on $x$. A trainer does not know it; section 3 estimates it from the
#   group.
#
# Each row prints the exact moments next to the closed form, with $G = 4$.

# %%
G_BASELINE = 4


def shifted_mdp(baseline_of_prompt):
    # the same MDP with reward R(x, y) - b(x): same ∇J, REINFORCE with baseline b
    b = dict(zip(mdp.prompts, baseline_of_prompt, strict=True))
    return TokenMDP(V, L, lambda x, y: contains_prompt_token(x, y) - b[tuple(x)],
                    prompts=mdp.prompts, prompt_probs=D_P.tolist())


baselines = {"b = -1": [-1.0] * P, "b = 0": [0.0] * P, "b = J": [J] * P,
             "b = V(x)": J_P.tolist()}

# %%
baseline_variance, rows = {}, []
for label, b in baselines.items():
    m = moments(shifted_mdp(b), policy, reinforce, group_size=G_BASELINE, method="exact")
    closed = reinforce_variance(torch.tensor(b, dtype=torch.float64)[prompt_N], G_BASELINE)
    baseline_variance[label] = m.total_variance
    rows.append((label, float((m.mean - true_grad).norm()), m.total_variance, closed))
    assert torch.allclose(m.true_gradient, true_grad, rtol=0, atol=EXACT_TOL)  # same ∇J
    assert float((m.mean - true_grad).norm()) < EXACT_TOL                         # unbiased
    assert abs(m.total_variance - closed) <= VAR_RTOL * closed
show(t02.variance_table(rows, label="baseline", label_width=9))

# %% [markdown]
# All four are unbiased to rounding error, and their variances differ. As a function of a constant
# $b$, the variance is a parabola (the closed form is quadratic in $b$); the dots are the exact
# moments above.

# %%
b_grid = torch.linspace(-2.0, 2.5, 91, dtype=torch.float64)
curve = [reinforce_variance(torch.full((N,), float(b), dtype=torch.float64), G_BASELINE)
         for b in b_grid]
points = {label: (b, baseline_variance[label]) for label, b in
          [("b = -1", -1.0), ("b = 0", 0.0), ("b = J", J)]}
t02_figures.baseline_parabola_figure(b_grid.tolist(), curve, points, baseline_variance["b = V(x)"],
                             G_BASELINE)
plt.show()


# %% [markdown]
# Two things to notice. Without a baseline, the variance depends on an arbitrary choice, where the
# reward's zero is: plain REINFORCE ($b = 0$) is about 60% noisier than $b = J$ here, and the
# "never negative" reward ($b = -1$) about seven times. And the minimum of the parabola is *not* at
# $b = J$: the variance-minimizing constant weights each response by the squared norm of its score,
# $\|\sigma\|^2$ (Weaver and Tao 2001, arXiv 1301.2315; Greensmith, Bartlett and Baxter 2004,
# JMLR 5). You will derive it in the exercise. The per-prompt value $V(x)$ beats $b = J$, because it
# knows each prompt's difficulty, but it is not the minimum-variance baseline either.

# %% [markdown]
# ## 3. Leave-one-out: a baseline from the other samples
#
# A trainer does not know $V(x)$. But it has $G$ samples of the same prompt, and the other $G-1$
# rewards estimate $V(x)$ without bias. **RLOO** (Kool et al. 2019, ICLR workshop
# "Buy 4 REINFORCE samples, get a baseline for free!"; Ahmadian et al. 2024, arXiv 2402.14740) uses
#
# $$
# A_i = R_i - \frac{1}{G-1}\sum_{j\ne i} R_j .
# $$
#
# It is unbiased because the baseline of sample $i$ is built from samples that are independent of
# $y_i$ given $x$:
# $\mathbb{E}[b_i\,\sigma(y_i)\mid x] = \mathbb{E}[b_i\mid x]\,\mathbb{E}[\sigma(y_i)\mid x] = 0$.
#
# A tool we will use for every group advantage: since the samples are exchangeable,
# $\mathbb{E}[\hat g] = \mathbb{E}[A_1\,\sigma(y_1)]$, and conditioning on $y_1$,
#
# $$
# \mathbb{E}[\hat g] = \sum_{x,y} D(x)\,\pi(y\mid x)\; h(y)\;\sigma(y),
# \qquad h(y) = \mathbb{E}\big[A_1 \,\big|\, y_1 = y\big],
# $$
#
# the **effective reward**: the expected advantage of a response, averaged over the $G-1$ other
# samples of its group. Every group estimator is REINFORCE on its effective reward. We compute $h$
# by brute force, enumerating every ordered tuple of the other $G-1$ responses and calling the
# library's advantage function on each group. For RLOO, $h(y) = R(y) - V(x)$ exactly: the oracle
# baseline of section 2, on average.

# %%
def effective_reward(advantage, G, mdp=mdp, probs_N=probs_N):
    # h(y) = E[A_1 | y_1 = y]: average sample 1's advantage over every tuple of G-1 other responses
    n = mdp.responses_per_prompt
    h = torch.zeros(mdp.num_sequences, dtype=torch.float64)
    for x in range(mdp.num_prompts):
        mine = torch.arange(x * n, (x + 1) * n)
        others = torch.tensor(list(itertools.product(mine.tolist(), repeat=G - 1)),
                              dtype=torch.long).view(-1, G - 1)              # [M, G-1]
        M = others.shape[0]
        groups = torch.cat([mine.repeat_interleave(M)[:, None], others.repeat(n, 1)], dim=1)
        reward_S = mdp.rewards[groups].reshape(-1)                           # [n*M*G]
        group_S = torch.arange(n * M).repeat_interleave(G)
        A_first = advantage(reward_S, group_S).view(n, M, G)[:, :, 0]        # [n, M]
        h[mine] = A_first @ probs_N[others].prod(1)                          # p of the others
    return h


# %%
G = 3
h_rloo = effective_reward(ESTIMATORS["RLOO"].advantage, G)
print(f"RLOO, G = {G}: max |h(y) − (R(y) − V(x))| = "
      f"{float((h_rloo - (R_N - J_P[prompt_N])).abs().max()):.1e}")
assert torch.allclose(h_rloo, R_N - J_P[prompt_N], rtol=0, atol=EXACT_TOL)

# %% [markdown]
# Now the exact moments for $G = 2, \dots, 5$: the bias, the variance, and the variance of the
# oracle $V(x)$ baseline (closed form) and of plain REINFORCE at the same $G$.

# %%
GS = [2, 3, 4, 5]
vx_N = J_P[prompt_N]
print(f"{'G':>2} {'‖E ĝ − ∇J‖':>11} {'RLOO tr Cov':>12} {'V(x) baseline':>14} {'no baseline':>12}"
      f" {'RLOO / V(x)':>12}")
for G in GS:
    m = exact("RLOO", G)
    oracle = reinforce_variance(vx_N, G)
    print(f"{G:>2} {float(m.bias.norm()):>11.1e} {m.total_variance:>12.6f} {oracle:>14.6f} "
          f"{exact('REINFORCE', G).total_variance:>12.6f} {m.total_variance / oracle:>12.4f}")
    assert float(m.bias.norm()) < EXACT_TOL

# %% [markdown]
# RLOO is unbiased at every $G$. It pays for estimating the baseline from only $G - 1$ samples: at
# $G = 2$ its variance is about twice the oracle's (here even a little above no baseline at all: a
# baseline made of a single other reward is itself noisy), and the gap closes as $G$ grows, because
# the leave-one-out mean converges to $V(x)$.
#
# The exact moments next to a Monte Carlo estimate of the same quantities: 4000 groups of $G = 4$
# drawn with `sample`, each run through the library's `prepare` and `loss`
# (`method="monte_carlo"`), with standard errors.

# %%
mc = moments(mdp, policy, ESTIMATORS["RLOO"], group_size=4, method="monte_carlo",
             num_samples=4000, generator=torch.Generator().manual_seed(8))
ex4 = exact("RLOO", 4)
z_var = (mc.total_variance - ex4.total_variance) / mc.total_variance_se
z_cos = (mc.cosine - ex4.cosine) / mc.cosine_se
print(f"RLOO, G = 4: tr Cov  Monte Carlo {mc.total_variance:.5f} ± {mc.total_variance_se:.5f}, "
      f"exact {ex4.total_variance:.5f} ({z_var:+.2f} s.e.)")
print(f"             cosine  Monte Carlo {mc.cosine:.4f} ± {mc.cosine_se:.4f}, "
      f"exact {ex4.cosine:.4f} ({z_cos:+.2f} s.e.)")
assert abs(z_var) < Z_TOL and abs(z_cos) < Z_TOL

# %% [markdown]
# ## 4. The group mean is leave-one-out, scaled by $(G-1)/G$
#
# Dr. GRPO (Liu et al. 2025, arXiv 2503.20783) and MiniRL (Zheng et al. 2025, arXiv 2512.01374) use
# the plain group mean, *including* the sample itself: $A_i = R_i - \bar R$ with
# $\bar R = \frac1G\sum_j R_j$. Splitting the mean,
#
# $$
# R_i - \bar R = R_i - \tfrac1G R_i - \tfrac{G-1}{G}\,\tfrac{1}{G-1}\sum_{j\ne i} R_j
# = \frac{G-1}{G}\Big(R_i - \frac{1}{G-1}\sum_{j\ne i}R_j\Big).
# $$
#
# It is an identity for every group, not an average. We check it on sampled groups: draw 3 groups of
# $G = 4$ with `sample`, run `prepare` of both estimators on the same batch, and read the advantage
# of each sequence. Then the gradients of the two losses on that batch.

# %%
G = 4
batch = sample(mdp, policy, 3 * G, generator=torch.Generator().manual_seed(7), group_size=G)


def sequence_advantages(prepared):
    # the advantage is constant over a sequence's loss tokens: read it back as a mean
    return prepared.sequence_sum(prepared.advantage) / prepared.length.to(torch.float64)


prepared_gm = prepare(batch, ESTIMATORS["group mean"])
prepared_loo = prepare(batch, ESTIMATORS["RLOO"])
a_gm, a_loo = sequence_advantages(prepared_gm), sequence_advantages(prepared_loo)
show(t02.advantage_table(batch, {"A group mean": a_gm, "A leave-one-out": a_loo},
                         scaled="A leave-one-out", scale=(G - 1) / G, header="(G-1)/G · A_loo",
                         compare="A group mean"))
assert torch.allclose(a_gm, (G - 1) / G * a_loo, rtol=0, atol=EXACT_TOL)

# %%
g_gm = -flat_grad(loss(policy.token_logprobs(prepared_gm), prepared_gm,
                       ESTIMATORS["group mean"])[0], policy)
g_loo = -flat_grad(loss(policy.token_logprobs(prepared_loo), prepared_loo,
                        ESTIMATORS["RLOO"])[0], policy)
print(f"\non this batch: ‖ĝ_group mean − (G-1)/G ĝ_loo‖ = "
      f"{float((g_gm - (G - 1) / G * g_loo).norm()):.1e}  (‖ĝ_loo‖ = {float(g_loo.norm()):.4f})")
assert torch.allclose(g_gm, (G - 1) / G * g_loo, rtol=0, atol=EXACT_TOL)

# %% [markdown]
# (A group whose rewards are all equal gets advantage 0 under both.) Since the two estimators are
# proportional draw by draw, their moments are too:
#
# $$
# \mathbb{E}[\hat g] = \frac{G-1}{G}\nabla J,
# \qquad
# \operatorname{tr}\operatorname{Cov}[\hat g]
# = \Big(\frac{G-1}{G}\Big)^2 \operatorname{tr}\operatorname{Cov}[\hat g_{\text{RLOO}}].
# $$
#
# The cosine with $\nabla J$ is exactly 1: a $G$-dependent shrinkage that a learning rate absorbs,
# so Dr. GRPO's choice is harmless in direction. We check with the exact moments.

# %%
print(f"{'G':>2} {'scale <E ĝ,∇J>/‖∇J‖²':>21} {'(G-1)/G':>8} {'max|E ĝ − (G-1)/G ∇J|':>23} "
      f"{'var ratio':>10} {'((G-1)/G)²':>11} {'cosine':>8}")
for G in GS:
    m, m_loo = exact("group mean", G), exact("RLOO", G)
    scale = float(m.mean @ true_grad / (true_grad @ true_grad))
    ratio = m.total_variance / m_loo.total_variance
    print(f"{G:>2} {scale:>21.12f} {(G - 1) / G:>8.4f} "
          f"{float((m.mean - (G - 1) / G * true_grad).abs().max()):>23.1e} {ratio:>10.6f} "
          f"{((G - 1) / G) ** 2:>11.6f} {m.cosine:>8.5f}")
    assert torch.allclose(m.mean, (G - 1) / G * true_grad, rtol=0, atol=EXACT_TOL)
    assert abs(ratio - ((G - 1) / G) ** 2) <= VAR_RTOL

# %% [markdown]
# ## 5. GRPO: dividing by the group's standard deviation
#
# GRPO (Shao et al. 2024, arXiv 2402.03300) maximizes the PPO-clipped surrogate of its Eq. 3,
# averaged over the $G$ responses of a group and over each response's tokens, minus a KL term;
# with outcome rewards (its Sec. 4.1.2) every token of response $i$ gets the normalized
# group-mean advantage
#
# $$
# A_i = \frac{R_i - \bar R}{\operatorname{std}(R_1..R_G) + \varepsilon},
# \qquad
# \operatorname{std} = \sqrt{\tfrac{1}{G - \text{ddof}}\textstyle\sum_j (R_j - \bar R)^2}.
# $$
#
# TRL and verl use the **sample** std (`ddof=1`, what `torch.std` computes); the **population**
# std is `ddof=0`. We set $\varepsilon = 0$ so that the identities are exact (a group whose rewards
# are all equal gets advantage 0, as in the library); the registry's `grpo` uses
# $\varepsilon = 10^{-6}$ and adds clipping, per-token averaging and a KL term, which we leave out
# to isolate the advantage.
#
# One relation is immediate: the two stds differ by the constant factor $\sqrt{(G-1)/G}$, so
# `ddof=0` is `ddof=1` times $\sqrt{G/(G-1)}$, sample by sample.
#
# ### 5a. $G = 2$ and 0/1 rewards
#
# With two samples there are four reward pairs. If $R_1 = R_2$ the advantage is 0, for every
# estimator here. If they differ, say $(1, 0)$: the mean is ½, the deviations are $\pm\frac12$,
# the population std is ½. So
#
# | advantage of the sample with $R = 1$ | value |
# |---|---|
# | leave-one-out, $R_1 - R_2$ | $1$ |
# | group mean | $\tfrac12$ |
# | GRPO, population std | $\tfrac{1/2}{1/2} = 1$ |
# | GRPO, sample std | ? |
#
# and the opposite signs for the other sample. GRPO with the population std **is** RLOO at $G=2$,
# draw by draw, so its expected gradient is exactly $\nabla J$.
#
# ### Exercise 1 — GRPO with the sample std at $G = 2$
#
# *Predict*, then compute: with the sample std (`ddof=1`, TRL's and verl's), the expected gradient
# is $c\,\nabla J$. Is $c$ smaller than 1, equal to 1 or larger than 1? Record it as
# `scale_prediction` (`"smaller"`, `"equal"` or `"larger"`). Then store $c$ in
# `grpo_scale_answer`, from the reward pair $(1, 0)$ alone, without `moments`.

# %%
# Solution
scale_prediction = "smaller"        # recorded before computing: "smaller", "equal" or "larger"
# the pair (1, 0) has mean ½ and sample std √((½² + ½²)/(2 − 1)) = 1/√2: the advantage is
# ±½ / (1/√2) = ±1/√2, leave-one-out's ±1 times 1/√2 in every group, so c = 1/√2
grpo_scale_answer = 0.5 / math.sqrt((0.5 ** 2 + 0.5 ** 2) / (2 - 1))

# %%
# Check
tokenmdp.check("tr02_grpo_scale_g2", grpo_scale_answer)
tokenmdp.check("tr02_predict_grpo_scale_g2", scale_prediction)

# %% [markdown]
# With the sample std the expected gradient is $\nabla J/\sqrt 2$: the direction is right, the
# step shorter. First on a sampled batch, then exactly.

# %%
G = 2
batch2 = sample(mdp, policy, 6 * G, generator=torch.Generator().manual_seed(3), group_size=G)
adv = {name: sequence_advantages(prepare(batch2, ESTIMATORS[name]))
       for name in ("RLOO", "GRPO, population std", "GRPO, sample std")}
show(t02.advantage_table(batch2, {"RLOO": adv["RLOO"], "GRPO pop.": adv["GRPO, population std"],
                                  "GRPO sample": adv["GRPO, sample std"]},
                         scaled="GRPO sample", scale=math.sqrt(2), header="sample·√2",
                         fmt=[".3f", ".3f", ".6f"]))
assert torch.allclose(adv["GRPO, population std"], adv["RLOO"], rtol=0, atol=EXACT_TOL)
assert torch.allclose(adv["GRPO, sample std"] * math.sqrt(2), adv["RLOO"], rtol=0, atol=EXACT_TOL)

predicted = [("RLOO", 1.0), ("GRPO, population std", 1.0), ("GRPO, sample std", 1 / math.sqrt(2))]
for name, c in predicted:
    assert torch.allclose(exact(name, 2).mean, c * true_grad, rtol=0, atol=EXACT_TOL)
show(t02.scaled_mean_table([(name, c, exact(name, 2)) for name, c in predicted], true_grad,
                           title="estimator (G = 2)"))


# %% [markdown]
# ### 5b. $G > 2$ with 0/1 rewards: prompts are re-weighted by about 1/std
#
# Use the effective reward. With 0/1 rewards $h(y)$ depends on $y$ only through $R(y) \in \{0, 1\}$,
# so it is an affine function of the reward, $h = h_x(0) + c_x R$, and
#
# $$
# \mathbb{E}[\hat g \mid x] = \mathbb{E}[(h_x(0) + c_x R)\,\sigma \mid x] = c_x\, g_x,
# \qquad c_x = h_x(1) - h_x(0).
# $$
#
# Within a prompt the direction is right. But $c_x$ depends on the prompt's success probability
# $p_x$, and it has a closed form: given $R_1 = r$, the number $k$ of successes among the other
# $G - 1$ samples is Binomial$(G-1, p)$, the group has $s = r + k$ successes, mean $m = s/G$ and
# $\sum_j (R_j - m)^2 = G\,m(1-m)$, so
#
# $$
# h(r) = \sum_{k=0}^{G-1} \binom{G-1}{k} p^k (1-p)^{G-1-k}\;
# \frac{r - m}{\sqrt{G\,m(1-m)/(G - \text{ddof})}}\;\mathbb{1}[0 < s < G].
# $$
#
# As $G$ grows, $m \to p$ and $c(p) \to 1/\sqrt{p(1-p)}$: **each prompt's gradient is multiplied by
# one over its reward std**. RLOO has $c = 1$ for every prompt. Two small cases are special: at
# $G = 2$ and $G = 3$, $m(1-m)$ takes a single value over the groups that are not constant
# ($\frac14$, and $\frac29$), so $c$ does not depend on $p$ and GRPO is exactly a multiple of RLOO,
# draw by draw ($1/\sqrt2$ and $2/\sqrt3$ with the sample std, $1$ and $\sqrt2$ with the
# population std).
#
# We compare the closed form with the exact moments: on prompt $x$'s block of coordinates,
# $\mathbb{E}[\hat g]$ must be $c(p_x)$ times $\nabla J$.

# %%
def grpo_binary_scale(p, G, ddof):
    # c(p) = h(1) - h(0) for 0/1 rewards with success probability p, groups of G, eps = 0
    def h(r):
        total = 0.0
        for k in range(G):
            s = r + k
            if 0 < s < G:
                m = s / G
                std = math.sqrt(G * m * (1 - m) / (G - ddof))
                total += math.comb(G - 1, k) * p ** k * (1 - p) ** (G - 1 - k) * (r - m) / std
        return total
    return h(1) - h(0)


# %%
def per_prompt_scale(mean):
    # <E ĝ, ∇J> / ‖∇J‖² on each prompt's block of coordinates
    return [float(mean[prompt_of_param == x] @ true_grad[prompt_of_param == x]
                  / true_grad[prompt_of_param == x].pow(2).sum()) for x in range(P)]


# %%
G_LARGE = 16
rows = []
for name, ddof in [("GRPO, sample std", 1), ("GRPO, population std", 0)]:
    for G in GS + ([G_LARGE] if ddof == 1 else []):
        m = exact(name, G)
        for x, c_moments in enumerate(per_prompt_scale(m.mean)):
            c_closed = grpo_binary_scale(float(J_P[x]), G, ddof)
            rows.append((name, G, str(mdp.prompts[x]), float(J_P[x]), c_moments, c_closed,
                         m.cosine if x == 0 else None))
            assert abs(c_moments - c_closed) < EXACT_TOL
            block = prompt_of_param == x   # the whole block is c · ∇J, not only its projection
            assert torch.allclose(m.mean[block], c_closed * true_grad[block], rtol=0, atol=EXACT_TOL)
        if G in (2, 3) and ddof == 1:
            assert m.cosine > 1 - EXACT_TOL
show(t02.grpo_scale_table(rows))

# %% [markdown]
# The closed form matches the exact moments on every prompt. The cosines tell the consequence: at
# $G = 2, 3$ the direction is exactly right (both GRPO variants are multiples of RLOO); from
# $G = 4$ on, the hard prompt gets a larger factor than the medium one and the expected gradient
# turns away from $\nabla J$: by about 1° at $G = 4$, by about 8° at $G = 16$, where the hard
# prompt's gradient counts 1.45 times as much as the medium one's.
#
# So GRPO's expected step is the gradient of a **re-weighted objective**
# $\sum_x D(x)\, c(p_x)\, J_x$ (with the weights $c(p_x)$ frozen at the current policy), in which
# prompts the policy almost always fails, or almost always solves, weigh more than prompts it solves
# half of the time. This is the question-level difficulty bias that Dr. GRPO (arXiv 2503.20783)
# removes by dropping the std. The curves:

# %%
p_grid = torch.linspace(0.01, 0.99, 197, dtype=torch.float64).tolist()
curves = {G: [grpo_binary_scale(p, G, 1) for p in p_grid] for G in [2, 3, 4, 8, 16, 64]}
dots = {f"prompt {mdp.prompts[x]}": (float(J_P[x]), {
    G: per_prompt_scale(exact("GRPO, sample std", G).mean)[x] for G in (4, G_LARGE)})
    for x in range(P)}
t02_figures.grpo_scale_figure(p_grid, curves, dots)
plt.show()


# %% [markdown]
# ### 5c. Non-binary rewards: the direction changes even within one prompt
#
# With more than two reward values, $h$ is no longer an affine function of $R$: dividing by the std
# squashes the rewards non-linearly, so responses *within* a prompt are re-weighted too, and the
# expected gradient is not parallel to $\nabla J$ even with a single prompt. We take one prompt and
# a partial-credit reward, the fraction of response tokens that copy the prompt token
# ($R \in \{0, \frac12, 1\}$), and compare three routes: the exact moments, the effective-reward
# formula $\sum_y \pi\, h\, \sigma$, and $\nabla J$.
#
# At $G = 2$ with the population std the advantage becomes $\operatorname{sign}(R_1 - R_2)$, a pairwise
# comparison; with 0/1 rewards that was exactly $R_1 - R_2$, here it is not.

# %%
def partial_credit(prompt, response):
    return sum(token == prompt[0] for token in response) / L


mdp_pc = TokenMDP(V, L, partial_credit, prompts=[(0,)])
policy_pc = TabularPolicy(mdp_pc, generator=torch.Generator().manual_seed(0), init_std=1.0)
with torch.no_grad():
    probs_pc = sequence_probs(mdp_pc, policy_pc)
score_pc = torch.stack([flat_grad(sequence_logprobs(mdp_pc, policy_pc)[n], policy_pc)
                        for n in range(mdp_pc.num_sequences)])
grad_pc = gradient(mdp_pc, policy_pc)
J_pc = float(probs_pc @ mdp_pc.rewards)
print("rewards of the 7 responses:", mdp_pc.rewards.tolist(), f"  J = {J_pc:.4f}")

# %%
cosines_pc, entries = {}, []
for name, G in [("RLOO", 3), ("GRPO, sample std", 3), ("GRPO, population std", 2)]:
    est = ESTIMATORS[name]
    m = moments(mdp_pc, policy_pc, est, group_size=G, method="exact")
    h_pc = effective_reward(est.advantage, G, mdp=mdp_pc, probs_N=probs_pc)
    via_h = (probs_pc * h_pc) @ score_pc
    cosines_pc[name] = m.cosine
    entries.append((name, G, m, via_h))
    assert torch.allclose(m.mean, via_h, rtol=0, atol=EXACT_TOL)
    assert torch.allclose(m.true_gradient, grad_pc, rtol=0, atol=EXACT_TOL)
show(t02.effective_reward_table(entries))
assert abs(cosines_pc["RLOO"] - 1) < EXACT_TOL
assert cosines_pc["GRPO, sample std"] < 1 - DIRECTION_GAP
assert cosines_pc["GRPO, population std"] < 1 - DIRECTION_GAP

# %%
G = 3
h_pc = effective_reward(ESTIMATORS["GRPO, sample std"].advantage, G, mdp=mdp_pc, probs_N=probs_pc)
h_of = {r: float(h_pc[mdp_pc.rewards == r][0]) for r in sorted(set(mdp_pc.rewards.tolist()))}
line = h_of[0.0] + (h_of[1.0] - h_of[0.0]) * 0.5
print(f"\nGRPO (sample std), G = {G}: effective reward h(r) = {h_of}")
print(f"the line through h(0) and h(1) at r = 0.5: {line:.6f}  vs  h(0.5) = {h_of[0.5]:.6f}  "
      f"difference {h_of[0.5] - line:+.4f}")


# %% [markdown]
# RLOO's effective reward is $R - V(x)$ whatever the reward values, so its cosine is 1. GRPO's
# effective reward bends: at this policy (most responses earn at least half credit) the half-credit
# responses are pushed down much harder than a straight line through $h(0)$ and $h(1)$ would put
# them, so partial and full credit get different relative weights than in $\nabla J$. The cosine is
# below 1 with a single prompt.

# %% [markdown]
# ## 6. Failure mode: a baseline that peeks at its own sample
#
# Why is leave-one-out unbiased and the group mean not? Write any group advantage as
# $A_i = R_i - b_i$. Then
#
# $$
# \mathbb{E}[\hat g] - \nabla J = -\,\mathbb{E}[b_i\,\sigma(y_i)]
# = -\sum_{x,y} D(x)\,\pi(y\mid x)\;\mathbb{E}[b_i \mid y_i = y]\;\sigma(y).
# $$
#
# The bias vanishes exactly when $\mathbb{E}[b_i \mid y_i]$ does not depend on $y_i$ (given $x$),
# because then it factors out against $\mathbb{E}[\sigma\mid x] = 0$. A baseline that **peeks** at
# its own sample is biased by how much it peeks:
#
# * **the group mean including itself**, $b_i = \frac1G R_i + \frac{G-1}{G}\cdot$(leave-one-out mean):
#   $\mathbb{E}[b_i\mid y_i] = \frac1G R(y_i) + \text{const}$, so the bias is exactly
#   $-\frac1G\nabla J$ (the $\frac{G-1}{G}$ of section 4, seen from the other side);
# * **half its own reward**, $b_i = R_i/2$: the bias is $-\frac12\nabla J$ for every $G$;
# * **the best reward of the group**, $b_i = \max_j R_j$ (it includes $R_i$): for 0/1 rewards,
#   $\mathbb{E}[\max_j R_j \mid R_i = 1] = 1$ and $\mathbb{E}[\max_j R_j \mid R_i = 0]
#   = 1 - (1-p_x)^{G-1}$, so $\mathbb{E}[b_i\mid y_i] = \text{const} + (1-p_x)^{G-1} R_i$ and
#   $\mathbb{E}[\hat g \mid x] = \big(1 - (1-p_x)^{G-1}\big)\, g_x$.
#
# The last one is a prompt re-weighting in the *opposite* direction to GRPO: on a hard prompt the
# others rarely succeed, $\max_j R_j$ is usually 0, and the prompt's gradient nearly vanishes.
#
# The library lets us write these as advantage parts: a frozen dataclass with `__call__(reward_S,
# group_S, step_S=None)`. They plug into `Estimator` and `moments` like the built-in ones.

# %%
@dataclasses.dataclass(frozen=True)
class GroupMaxBaseline(Advantage):
    # A_i = R_i - max_j R_j over the group of i (the max includes R_i itself)

    def __call__(self, reward_S, group_S, step_S=None):
        _, index = torch.unique(group_S, return_inverse=True)
        best = torch.full((int(index.max()) + 1,), -math.inf, dtype=reward_S.dtype)
        best = best.scatter_reduce(0, index, reward_S, "amax")
        return reward_S - best[index]

    def describe(self):
        return "R - group max (peeks)"


# %%
@dataclasses.dataclass(frozen=True)
class HalfOwnReward(Advantage):
    # A_i = R_i - R_i / 2: a "baseline" made of the sample's own reward

    def __call__(self, reward_S, group_S, step_S=None):
        return reward_S - reward_S / 2

    def describe(self):
        return "R - R/2 (peeks)"


ESTIMATORS["group max (peeks)"] = reinforce.replace(advantage=GroupMaxBaseline(),
                                                    name="group max (peeks)")
ESTIMATORS["R/2 (peeks)"] = reinforce.replace(advantage=HalfOwnReward(), name="R/2 (peeks)")


# %%
def max_baseline_mean(G):
    # closed form: E[ĝ] = Σ_x D(x) (1 - (1 - p_x)^(G-1)) g_x
    return sum(float(D_P[x]) * (1 - (1 - float(J_P[x])) ** (G - 1)) * g_P[x] for x in range(P))


entries = []
for G in GS:
    rows = [("group mean", -true_grad / G, "−∇J/G"),
            ("group max (peeks)", max_baseline_mean(G) - true_grad, "(1−(1−p)^(G−1))g − ∇J")]
    if G == 4:
        rows.append(("R/2 (peeks)", -true_grad / 2, "−∇J/2"))
    for name, predicted, label in rows:
        entries.append((name, G, label, exact(name, G), predicted))
        assert torch.allclose(exact(name, G).bias, predicted, rtol=0, atol=EXACT_TOL)
show(t02.peeking_bias_table(entries))

# %% [markdown]
# Each predicted bias matches the exact one to rounding error. The group mean and $R_i/2$ only
# shrink the gradient (cosine 1); the group max turns it (cosine below 1), because it multiplies the
# hard prompt's gradient by $1 - (1-p)^{G-1}$, much less than the medium prompt's. Its only nonzero
# advantages are $-1$ on failed responses in groups where someone else succeeded: it pushes failures
# down only where success was observed.

# %% [markdown]
# ## 7. Bias and variance against the group size
#
# All estimators at $G = 2, \dots, 5$, from the cached exact moments: the relative bias
# $\|\mathbb{E}\hat g - \nabla J\| / \|\nabla J\|$ (crosses mark the closed forms derived above) and
# the total variance (the oracle $V(x)$ baseline from its closed form, as a reference).
#
# Raw variances are not comparable across estimators whose means differ by a scale: the group mean
# looks quieter than RLOO only because it is RLOO times $\frac{G-1}{G}$, and a learning rate undoes
# that. So the third panel rescales each estimator by the factor $c^\star$ that best matches its
# mean to $\nabla J$ (`Moments.scale`) and shows $c^{\star 2}\operatorname{tr}\operatorname{Cov}$:
# the noise per unit of progress along $\nabla J$. The bias that no learning rate removes is the
# **direction** (the cosine).

# %%
NAMES = ["REINFORCE", "RLOO", "group mean", "GRPO, sample std", "GRPO, population std",
         "group max (peeks)"]


def grpo_binary_bias(G, ddof):
    # closed form: E[ĝ] = Σ_x D(x) c(p_x) g_x
    mean = sum(float(D_P[x]) * grpo_binary_scale(float(J_P[x]), G, ddof) * g_P[x]
               for x in range(P))
    return float((mean - true_grad).norm() / true_grad.norm())


predicted_bias = {
    "group mean": [1 / G for G in GS],
    "GRPO, sample std": [grpo_binary_bias(G, 1) for G in GS],
    "GRPO, population std": [grpo_binary_bias(G, 0) for G in GS],
    "group max (peeks)": [float((max_baseline_mean(G) - true_grad).norm() / true_grad.norm())
                          for G in GS],
}

# %%
ms = {name: [exact(name, G) for G in GS] for name in NAMES}
show(t02.group_size_table(ms, GS))
for name, want in predicted_bias.items():
    for got, G in zip(want, GS, strict=True):
        assert abs(exact(name, G).relative_bias - got) < EXACT_TOL
# rescaled, the group mean is RLOO exactly
for G in GS:
    gm, loo = exact("group mean", G), exact("RLOO", G)
    assert abs(gm.scale ** 2 * gm.total_variance - loo.total_variance) <= VAR_RTOL * loo.total_variance

# %%
oracle = [reinforce_variance(vx_N, G) for G in GS]
t02_figures.bias_variance_figure(ms, GS, predicted_bias, oracle)
plt.show()


# %% [markdown]
# Reading the plot:
#
# * REINFORCE and RLOO are unbiased at every $G$. RLOO starts above REINFORCE at $G = 2$, falls
#   faster, and approaches the oracle $V(x)$ baseline.
# * The group mean's bias is exactly $1/G$ and points along $\nabla J$. Its small raw variance is
#   only its smaller scale: rescaled, it *is* RLOO (the curves coincide in the third panel).
# * GRPO's bias is mostly scale: $1 - 1/\sqrt2$ at $G = 2$ with the sample std, then it grows with
#   $G$ because $c(p)$ grows towards $1/\sqrt{p(1-p)} \ge 2$. Rescaled, its variance equals RLOO's
#   at $G = 2, 3$ (it is a multiple of RLOO there) and is within about 1.5% of it at $G = 4, 5$: on
#   0/1 rewards, dividing by the std buys no variance reduction here. What it changes is the
#   direction (section 5).
# * The peeking max baseline has a small raw variance because it leaves most advantages at zero, but
#   rescaled it is noisier than RLOO at every $G$, and it points the wrong way (cosine 0.96 to 0.98).

# %% [markdown]
# ## 8. Exercise 2: the variance-minimizing constant baseline
#
# Section 2 showed that $b = J$ is not the best constant baseline. *Predict* first: is $b^\star$
# above or below $J$? Record it as `baseline_prediction` (`"above"` or `"below"`). Then, using the
# closed form of the variance, find the constant $b^\star$ that minimizes
# $\operatorname{tr}\operatorname{Cov}[\hat g]$ for REINFORCE with $A_i = R_i - b$. Write it as a
# function of the arrays above (`w_N`, `R_N`, `score_N`), without calling `moments` or
# `reinforce_variance`, and store it in `b_star`.
#
# *Hint:* only the term $\frac1G\,\mathbb{E}[(R - b)^2\|\sigma\|^2]$ depends on $b$. Does the
# answer depend on $G$?

# %%
# Solution
baseline_prediction = "above"       # recorded before computing: "above" or "below"


def optimal_constant_baseline(w_N, R_N, score_N):
    # d/db E[(R - b)^2 ‖σ‖^2] = -2 E[(R - b) ‖σ‖^2] = 0  =>  b* = E[R ‖σ‖^2] / E[‖σ‖^2],
    # the average reward weighted by the squared norm of each response's score (any G).
    sq_norm_N = score_N.pow(2).sum(1)
    return float((w_N * sq_norm_N) @ R_N / (w_N @ sq_norm_N))


b_star = optimal_constant_baseline(w_N, R_N, score_N)

# %%
# Check
tokenmdp.check("tr02_optimal_constant_baseline", b_star)
tokenmdp.check("tr02_predict_baseline_vs_j", baseline_prediction)

# %% [markdown]
# Above: $b^\star \approx 0.53$ against $J \approx 0.30$, because the rewarded responses have the
# larger scores here ($\mathbb{E}[\|\sigma\|^2 \mid R = 1] \approx 1.2$ against $0.46$ for
# $R = 0$). The check compares $b^\star$ with the vertex of the exact variance parabola (three
# exact `moments` calls). The exact variances at $b^\star$ and around it, next to $b = J$ and $V(x)$:

# %%
DELTA = 0.05
print(f"\n{'baseline':>12} {'tr Cov (exact moments)':>23} {'vs b*':>10}")
at = {}
for label, b in [("b*", b_star), ("b* - 0.05", b_star - DELTA), ("b* + 0.05", b_star + DELTA)]:
    at[label] = moments(shifted_mdp([b] * P), policy, reinforce, group_size=G_BASELINE,
                        method="exact").total_variance
at["b = J"] = baseline_variance["b = J"]
at["b = V(x)"] = baseline_variance["b = V(x)"]   # per prompt, for comparison
for label, v in at.items():
    print(f"{label:>12} {v:>23.10f} {v - at['b*']:>+10.2e}")
assert all(v > at["b*"] for label, v in at.items() if label != "b*")

# %% [markdown]
# The optimal constant weights each response's reward by how large its score is: responses whose
# log-probability is most sensitive to $\theta$ contribute the most variance, so the baseline should
# be closest to *their* rewards. Here this single constant even beats the per-prompt value $V(x)$
# (0.0562 against 0.0639). The same argument, per prompt, gives
# $b^\star(x) = \mathbb{E}[R\|\sigma\|^2 \mid x] / \mathbb{E}[\|\sigma\|^2 \mid x]$, better still. In a
# real model the score norm of every sampled sequence costs a backward pass of its own, which is why
# trainers settle for $V(x)$ or its leave-one-out estimate.
#
# ## What verl / TRL / others call this
#
# Generated from the estimator registry's aliases (the registry's `grpo` and `dr_grpo` add the
# clip and their own aggregation to the advantages studied here):

# %%
show(alias_box(["reinforce", "rloo", "grpo", "dr_grpo"]))

# %% [markdown]
# ## Summary
#
# * Any baseline that depends on the prompt only keeps REINFORCE unbiased; the variance is
#   quadratic in the baseline, and "no baseline" is the arbitrary choice $b = 0$.
# * Leave-one-out (RLOO) is unbiased: sample $i$'s baseline never sees $y_i$. Its variance
#   approaches the oracle $V(x)$ baseline as $G$ grows.
# * The group mean equals $\frac{G-1}{G}$ × leave-one-out, sample by sample: expected gradient
#   $\frac{G-1}{G}\nabla J$, the right direction.
# * GRPO's std: for 0/1 rewards and $G = 2$, exactly $\nabla J$ with the population std and
#   $\nabla J/\sqrt2$ with the sample std. Beyond that it multiplies each prompt's gradient by
#   $c(p_x) \approx 1/\operatorname{std}$, favouring the hardest and easiest prompts, and with
#   non-binary rewards it re-weights responses within a prompt: the cosine with $\nabla J$ drops
#   below 1.
# * Every group estimator is REINFORCE on its effective reward $h(y) = \mathbb{E}[A_1 \mid y_1 = y]$;
#   a baseline that peeks at its own sample is biased by $-\mathbb{E}[b_i\sigma(y_i)]$, which is
#   $-\frac1G\nabla J$ for the group mean and a prompt re-weighting for the group max.
