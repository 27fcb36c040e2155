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
# # Tutorial 6 — Trust regions and clipping
#
# **The question.** A trainer samples one rollout at $\pi_{\text{old}}$ and then takes several
# optimizer steps on it. After the first step the data are stale: how far may the policy move
# before the token-level estimators stop following $\nabla J$, and what do PPO's clip,
# clip-higher, dual clip, CISPO and GSPO actually do to the expected gradient?
#
# Tutorial 3 showed that token-level importance sampling follows the gradient of the
# trust-region surrogate $L_{\pi_{\text{old}}}$. Here we start one level lower, at the identity
# that makes the surrogate a good approximation, and then take every clipping scheme apart on
# the same exact MDP. We will
#
# 1. check the **performance-difference lemma** and the surrogate's matched value and gradient
#    exactly;
# 2. follow the **first-order gap** $J - L$ and its trust-region bound as the policy moves;
# 3. show that **PPO's clip is masked REINFORCE** with a stop-gradient ratio $\operatorname{sg}(r)$;
# 4. compare **clip-higher**, **dual clip** and **CISPO** with PPO, token by token and in
#    expectation;
# 5. see why **GSPO's** $3\cdot10^{-4}$ band under a stale step of 0.5 points the expected
#    gradient *away* from $\nabla J$;
# 6. run **multi-epoch staleness** exactly: one rollout, $N = 1, 2, 4, 8$ updates, the exact $J$
#    and surrogate after every update;
# 7. break the stop-gradient on purpose and measure what it costs.
#
# Everything is exact (float64, full enumeration) and runs in a few seconds on one CPU thread.

# %% [markdown]
# ## Setup
#
# The MDP is the one of tutorials 1 and 3, now built by `tokenmdp.course.setups.copy_task()`: two
# prompts, tokens $\{0, 1, \text{EOS}\}$, responses of at most $L = 3$ tokens, +1 per token that
# copies the prompt and −1 for a truncated response. $\pi_{\text{old}}$ is its seeded tabular
# policy. The policy being trained is $\pi_{\text{old}}$ moved by one optimizer step of length
# $s$ along $u = \nabla J(\pi_{\text{old}})$: `step_along(pi_old, grad_old, s)`.
#
# Every estimator shares every part but the surrogate: leave-one-out advantage with $G = 2$
# ($\hat A_1 = R_1 - R_2$), loss weight $1/S$ per token (sequence-mean of token sums), no
# training–inference correction ($\mu = \pi_{\text{old}}$). That composition is
# `tokenmdp.course.exercises.tr06_estimator(surrogate)`, the same one the exercises use.

# %%
# %matplotlib inline
import copy
import dataclasses

import matplotlib.pyplot as plt
import torch
from torch.nn.utils import parameters_to_vector, vector_to_parameters

import tokenmdp
from tokenmdp.course.display import alias_box, finish, show, table
from tokenmdp.course.exercises import tr06_estimator
from tokenmdp.course.setups import copy_task, ppo_clip_fraction, step_along
from tokenmdp.estimators import (
    CISPO,
    GSPO,
    Aggregation,
    MiniRL,
    PPOClip,
    Surrogate,
    SurrogateTerms,
    TokenRatio,
    cispo_term,
    get,
    loss,
    ppo_clip_term,
    ppo_keep_mask,
    prepare,
)
from tokenmdp.exact import (
    first_order_path,
    flat_grad,
    gradient,
    moments,
    objective,
    sample,
    sequence_kl,
    sequence_logprobs,
    state_logprobs,
    state_visitation,
    surrogate,
    trust_region_bound,
    values,
)
from tokenmdp.exact.analysis.first_order import max_state_tv

# Named tolerances for the checks in this notebook.
EXACT_TOL = 1e-12  # two exact float64 computations of the same quantity
Z_TOL = 4.0        # |Monte Carlo estimate - exact| in standard errors

G = 2
METHOD = "enumeration"  # exact moments: every group of G responses, with its probability
print("tokenmdp", tokenmdp.__version__, "| torch", torch.__version__)

# Every tensor here is tiny: one CPU thread avoids the cost of synchronizing several.
torch.set_num_threads(1)

# %%
mdp, pi_old = copy_task()
grad_old = gradient(mdp, pi_old)
with torch.no_grad():
    J_old = float(objective(mdp, pi_old))
    A_old = values(mdp, pi_old).A                          # A^{π_old}(s, a), [states, V]


def probs_at_states(policy):
    # π(a|s) at every state, [states, V], in state-id order
    return torch.cat([lp.exp().reshape(-1, mdp.vocab_size) for lp in state_logprobs(mdp, policy)])


def expected_gradient(surrogate_part, policy, old=pi_old):
    # exact moments of the notebook's estimator with this surrogate, data drawn from `old`
    return moments(mdp, policy, tr06_estimator(surrogate_part), group_size=G, behavior=old,
                   method=METHOD)


print(f"{mdp.num_sequences} responses, {mdp.num_states} states, J(π_old) = {J_old:.6f}, "
      f"||∇J(π_old)|| = {float(grad_old.norm()):.6f}")

# %% [markdown]
# ## 1. The performance-difference lemma and the surrogate
#
# For any two policies, the improvement of $\pi$ over $\pi_{\text{old}}$ is the advantage of
# $\pi$'s actions *under $\pi_{\text{old}}$'s values*, accumulated along $\pi$'s own states
# (Kakade & Langford 2002, Lemma 6.1; TRPO, Schulman et al. 2015, arXiv 1502.05477, Eq. 2; here
# undiscounted, $d^\pi$ the unnormalized visitation):
#
# $$
# J(\pi) - J(\pi_{\text{old}}) = \sum_s d^{\pi}(s) \sum_a \pi(a\mid s)\,
# A^{\pi_{\text{old}}}(s, a).
# $$
#
# The trust-region surrogate (TRPO Eq. 3) keeps everything but the visitation:
# $L_{\pi_{\text{old}}}(\pi) = J(\pi_{\text{old}}) + \sum_s d^{\pi_{\text{old}}}(s) \sum_a
# \pi(a\mid s) A^{\pi_{\text{old}}}(s, a)$. It can be computed from $\pi_{\text{old}}$'s data
# alone, and it touches $J$ to first order (TRPO Eq. 4): $L_{\pi_{\text{old}}}(\pi_{\text{old}})
# = J(\pi_{\text{old}})$ and $\nabla L_{\pi_{\text{old}}}(\pi)|_{\pi = \pi_{\text{old}}} =
# \nabla J(\pi_{\text{old}})$. All three identities, exactly, at a step of length $s = 1$:

# %%
pi = step_along(pi_old, grad_old, 1.0)
with torch.no_grad():
    lemma = float((state_visitation(mdp, pi)[:, None] * probs_at_states(pi) * A_old).sum())
    improvement = float(objective(mdp, pi)) - J_old
start = copy.deepcopy(pi_old)                            # π = π_old, as a trainable copy
L_start = surrogate(mdp, start, pi_old)
rows = [("J(π) − J(π_old), lemma vs objective", lemma, improvement),
        ("L(π_old) vs J(π_old)", float(L_start.detach()), J_old),
        ("max |∇L(π_old) − ∇J(π_old)|", float((flat_grad(L_start, start) - grad_old).abs().max()),
         0.0)]
show(table([(name, a, b, a - b) for name, a, b in rows],
           ["identity", "left", "right", "difference"], fmt=".3e"))
assert all(abs(a - b) < EXACT_TOL for _, a, b in rows)

# %% [markdown]
# The lemma is exact at any distance; the surrogate is exact only in value and slope at
# $\pi_{\text{old}}$. Subtracting the two formulas, the **first-order gap** is the same sum with
# the change of visitation:
# $J(\pi) - L_{\pi_{\text{old}}}(\pi) = \sum_s \big(d^\pi(s) - d^{\pi_{\text{old}}}(s)\big)
# \sum_a \pi(a\mid s) A^{\pi_{\text{old}}}(s, a)$.
#
# ## 2. The first-order gap and its bound as the policy moves
#
# Both factors of that sum are first order in the step: $\sum_a \pi A^{\pi_{\text{old}}}$ is
# at most $2\alpha\varepsilon$ with $\alpha = \max_s \mathrm{TV}(\pi, \pi_{\text{old}})$ and
# $\varepsilon = \max |A^{\pi_{\text{old}}}|$, and the visitation at depth $t$ moves by at most
# $t\alpha$. Summed over the $L$ depths, $|J - L| \le 2\varepsilon\alpha^2 L(L - 1)$, the
# finite-horizon form of TRPO's Theorem 1 (`tokenmdp.exact.trust_region_bound`). We rebuild the
# bound from $\alpha$ and $\varepsilon$ by hand and walk the path with `first_order_path`.

# %%
STEPS = torch.logspace(-2, 1, 10, dtype=torch.float64).tolist()
path = first_order_path(mdp, pi_old, grad_old, STEPS)
eps_A, rows, loose = float(A_old.abs().max()), [], []
for p in path:
    moved = step_along(pi_old, grad_old, p.step)
    alpha = float(max_state_tv(mdp, moved, pi_old))
    by_hand = 2 * eps_A * alpha ** 2 * mdp.max_len * (mdp.max_len - 1)
    assert abs(by_hand - float(trust_region_bound(mdp, moved, pi_old))) < EXACT_TOL
    assert abs(p.gap) <= by_hand
    loose.append(by_hand / abs(p.gap))                # how loose the bound is: a factor
    rows.append((p.step, alpha, p.gap, by_hand, f"{loose[-1]:.0f}×"))
show(table(rows, ["step s", "α = max TV", "gap J − L", "bound 2εα²L(L−1)", "bound / |gap|"],
           fmt=".3e"))
print(f"the bound is {min(loose):.0f} to {max(loose):.0f} times the exact |J − L| along the path")
assert all(10 < x < 100 for x in loose)              # one to two orders of magnitude

# %%
fig, ax = plt.subplots(figsize=(7, 4.2))
ax.loglog(STEPS, [abs(r[2]) for r in rows], "o-", color="C3", label="|J − L| (exact gap)")
ax.loglog(STEPS, [r[3] for r in rows], ":", color="C3", label="bound 2εα²L(L−1)")
ax.loglog(STEPS, [abs(rows[0][2]) * (s / STEPS[0]) ** 2 for s in STEPS], "k--", lw=0.8,
          label="slope 2")
finish(ax, title="The first-order gap is second order in the step", xlabel="step s along ∇J(π_old)",
       ylabel="|J(π) − L_π_old(π)|")
plt.show()

# %% [markdown]
# The gap grows like $s^2$ and stays below the bound, which is loose by a factor of 37 to 76
# here (the line under the table), between one and two orders of magnitude, as worst-case
# bounds are. Its sign is not fixed by the bound.
#
# ### Exercise 1 — the gap at $s = 2$
#
# *Predict* before you run: at a step of length $s = 2$, is $J(\pi)$ above or below
# $L_{\pi_{\text{old}}}(\pi)$, that is, does the surrogate promise more than the policy delivers?
# Record it as `gap_prediction` (`"above"` or `"below"`). Then compute
# $J(\pi) - L_{\pi_{\text{old}}}(\pi)$ **from the performance-difference lemma** (the visitation
# difference above), not from `objective` or `surrogate`, and check both.

# %%
# Solution
gap_prediction = "below"            # recorded before computing: "above" or "below"
pi_2 = step_along(pi_old, grad_old, 2.0)
with torch.no_grad():
    d_change = state_visitation(mdp, pi_2) - state_visitation(mdp, pi_old)
    gap_answer = float((d_change[:, None] * probs_at_states(pi_2) * A_old).sum())

# %%
# Check
tokenmdp.check("tr06_first_order_gap", gap_answer)
tokenmdp.check("tr06_predict_gap_sign", gap_prediction)

# %% [markdown]
# Negative: at $s = 2$ the surrogate over-promises. The states that $\pi$ now visits more often
# are the ones where its own actions have already gained what they can: an optimizer that
# climbs $L$ far from $\pi_{\text{old}}$ is climbing a hill that $J$ does not have.
#
# ## 3. PPO's clip is masked REINFORCE with $\operatorname{sg}(r)$
#
# PPO maximizes $\min\big(r_t \hat A,\ \mathrm{clip}(r_t, 1-\varepsilon, 1+\varepsilon)\hat A\big)$
# (Schulman et al. 2017, arXiv 1707.06347, Eq. 7), $r_t = \pi_\theta/\pi_{\text{old}}$. Where
# the min picks the clipped branch it is a constant, so its gradient is
#
# $$
# \nabla_\theta\, \mathrm{PPO}_t = M_t\, \operatorname{sg}(r_t)\, \hat A\,
# \nabla_\theta \log\pi_\theta(y_t\mid s_t),
# \qquad M_t = 0 \iff (\hat A > 0,\ r_t > 1+\varepsilon) \text{ or }
# (\hat A < 0,\ r_t < 1-\varepsilon):
# $$
#
# REINFORCE with the detached weight $\operatorname{sg}(r_t)\hat A$ on unclipped tokens and 0 on
# clipped ones. We write that loss by hand on a sampled batch and compare gradients with the
# library's PPO loss, coordinate by coordinate.

# %%
STALE = 0.5
pi = step_along(pi_old, grad_old, STALE)
ppo = tr06_estimator(PPOClip(eps_low=0.2, eps_high=0.2))
batch = sample(mdp, pi_old, 400, generator=torch.Generator().manual_seed(6), group_size=G)
batch = prepare(batch.replace(old_logprob=batch.behavior_logprob), ppo)     # μ = π_old
print(batch)
with torch.no_grad():
    print(f"step {STALE}: KL(π ‖ π_old) = {float(sequence_kl(mdp, pi, pi_old)):.4f} per response")

# %%
lp = pi.token_logprobs(batch)
with torch.no_grad():
    r = (lp - batch.old_logprob).exp()
    keep = ppo_keep_mask(r, batch.advantage, eps_low=0.2, eps_high=0.2)
by_hand = -torch.where(batch.loss_mask, batch.loss_weight * keep * r * batch.advantage * lp,
                       0.0).sum()
g_hand = flat_grad(by_hand, pi)
g_ppo = flat_grad(loss(pi.token_logprobs(batch), batch, ppo)[0], pi)
print(f"clipped tokens: {int((~keep & batch.loss_mask).sum())} of {int(batch.loss_mask.sum())}; "
      f"max |∇PPO − ∇(masked REINFORCE)| = {float((g_ppo - g_hand).abs().max()):.1e}")
assert (g_ppo - g_hand).abs().max() < EXACT_TOL

# %% [markdown]
# The same identity in expectation: MiniRL (Zheng et al., arXiv 2512.01374) *is* that masked
# REINFORCE loss, $M_t \operatorname{sg}(r_t) \hat A \log\pi_\theta$, so with the same
# $\varepsilon$ its exact expected gradient and variance must be PPO's.

# %%
m_ppo, m_minirl = expected_gradient(PPOClip(eps_low=0.2, eps_high=0.2), pi), \
    expected_gradient(MiniRL(eps_low=0.2, eps_high=0.2), pi)
print(f"max |E ĝ_PPO − E ĝ_MiniRL| = {float((m_ppo.mean - m_minirl.mean).abs().max()):.1e}, "
      f"variances {m_ppo.total_variance:.6f} / {m_minirl.total_variance:.6f}")
assert (m_ppo.mean - m_minirl.mean).abs().max() < EXACT_TOL

# %% [markdown]
# ### Exercise 2 — the clip fraction
#
# The share of clipped tokens is what trainers log as `clip_fraction`. *Predict* first: at the
# same step ($s = 0.5$, the KL printed above), what share of tokens does PPO with
# $\varepsilon = 0.2$ clip — closer to 0.5%, 5% or 50%? Record it as `clip_prediction`
# (`"0.5%"`, `"5%"` or `"50%"`). Then compute the share **without** `ppo_clip_fraction`: the
# exact pooled share $\mathbb{E}[\#\text{clipped}]/\mathbb{E}[\#\text{tokens}]$ over every pair
# $(y_1, y_2)$ drawn from $\pi_{\text{old}}$, with $\hat A_1 = R_1 - R_2$.

# %%
# Solution
clip_prediction = "5%"              # recorded before computing: "0.5%", "5%" or "50%"
enum = mdp.enumerate()
with torch.no_grad():
    r_N = torch.where(enum.loss_mask, pi.token_logprobs(enum) - pi_old.token_logprobs(enum), 0.0).exp()
    w_N = mdp.prompt_probs[mdp.terminal_prompt_index] * sequence_logprobs(mdp, pi_old).exp()
    q_N = sequence_logprobs(mdp, pi_old).exp()          # π_old(y|x), the partner's probability
same = mdp.terminal_prompt_index[:, None] == mdp.terminal_prompt_index[None, :]
A_NN = mdp.rewards[:, None] - mdp.rewards[None, :]                         # Â of y_1 given y_2
up, down = r_N > 1.2, r_N < 0.8                                            # [N, C]
clipped_NN = (A_NN[:, :, None] > 0) & up[:, None] | (A_NN[:, :, None] < 0) & down[:, None]
clipped_NN = (clipped_NN & enum.loss_mask[:, None]).sum(-1) * same
clip_answer = float((w_N[:, None] * q_N[None, :] * clipped_NN).sum() / (w_N * enum.length).sum())

# %%
# Check
tokenmdp.check("tr06_clip_fraction", clip_answer)
tokenmdp.check("tr06_predict_clip_share", clip_prediction)

# %% [markdown]
# The package's `ppo_clip_fraction` computes the same exact expectation by enumerating every
# response with every partner; next to it, the metric of the library's loss on eight sampled
# batches, with its standard error.

# %%
generator, fractions = torch.Generator().manual_seed(3), []
for _ in range(8):
    b = sample(mdp, pi_old, 2000, generator=generator, group_size=G)
    b = prepare(b.replace(old_logprob=b.behavior_logprob), ppo)
    with torch.no_grad():
        fractions.append(float(loss(pi.token_logprobs(b), b, ppo)[1]["clip_fraction"]))
fractions = torch.tensor(fractions, dtype=torch.float64)
mc, se = float(fractions.mean()), float(fractions.std() / len(fractions) ** 0.5)
exact = ppo_clip_fraction(mdp, pi, pi_old, eps_low=0.2, eps_high=0.2)
print(f"clip fraction: Monte Carlo {mc:.5f} ± {se:.5f}, exact {exact:.5f}, "
      f"difference {(mc - exact) / se:+.2f} s.e.")
assert abs(mc - exact) < Z_TOL * se

# %% [markdown]
# About 5% of the tokens are clipped, yet the cosine of the expected gradient with $\nabla J$
# has already dropped to about 0.82 (section 4): the clipped tokens are exactly those that
# pushed hardest in the right direction.
#
# ## 4. Clip-higher, dual clip and CISPO
#
# Three variants change which tokens lose their gradient:
#
# * **clip-higher** (DAPO, Yu et al. 2025, arXiv 2503.14476): $\varepsilon_{\text{high}} = 0.28 >
#   \varepsilon_{\text{low}} = 0.2$, so a token with $\hat A > 0$ may rise further before it is
#   masked (against the collapse of low-probability tokens);
# * **dual clip** (Ye et al. 2020, arXiv 1912.09729): for $\hat A < 0$ the objective is also
#   bounded below by $c\hat A$, so a token with $\hat A < 0$ and $r_t > c$ is masked too;
# * **CISPO** (MiniMax-M1, arXiv 2506.13585): clip the *weight*, not the update:
#   $\operatorname{sg}(\mathrm{clip}(r_t, 1-\varepsilon_{\text{low}}, 1+\varepsilon_{\text{high}}))
#   \hat A \log\pi_\theta$. A clipped token keeps a bounded gradient instead of none.
#
# On one token, by autograd of the library's term functions: the coefficient of
# $\nabla\log\pi_\theta$ in the gradient of each term (PPO $\varepsilon = 0.2$, dual clip
# $c = 3$, CISPO with $\varepsilon_{\text{high}} = 0.2$ and no lower bound).

# %%
def coefficient(term_fn, ratio, advantage, **kw):
    # d term / d log π_θ at one token with r = ratio, Â = advantage (log π_old = log 0.5)
    old = torch.tensor([[-0.6931471805599453]], dtype=torch.float64)
    logp = (old + torch.log(torch.tensor([[ratio]], dtype=torch.float64))).requires_grad_(True)
    term = term_fn(logp, old, torch.tensor([[advantage]], dtype=torch.float64), **kw).term_RC
    return float(torch.autograd.grad(term.sum(), logp)[0])


cases = [(1.1, 1.0), (1.5, 1.0), (0.5, -1.0), (4.0, -1.0)]
show(table([(r_, a_, coefficient(ppo_clip_term, r_, a_, eps_low=0.2, eps_high=0.2),
             coefficient(ppo_clip_term, r_, a_, eps_low=0.2, eps_high=0.2, dual_clip=3.0),
             coefficient(cispo_term, r_, a_, eps_low=1.0, eps_high=0.2)) for r_, a_ in cases],
           ["r", "Â", "PPO", "PPO + dual clip c=3", "CISPO"], fmt=".3g"))

# %% [markdown]
# Inside the band all three are $r\hat A$. At $r = 1.5$, $\hat A = +1$ PPO drops the token and
# CISPO keeps it with weight $1.2$; at $r = 0.5$, $\hat A = -1$ PPO drops it and CISPO (no lower
# bound) keeps $0.5$; at $r = 4$, $\hat A = -1$ PPO's gradient is $-4$, unbounded in $r$,
# and the dual clip removes it. In expectation, along the step:

# %%
VARIANTS = {"PPO ε=0.2": PPOClip(eps_low=0.2, eps_high=0.2),
            "clip-higher 0.2/0.28": PPOClip(eps_low=0.2, eps_high=0.28),
            "dual clip c=3": PPOClip(eps_low=0.2, eps_high=0.2, dual_clip=3.0),
            "CISPO ε_high=0.2": CISPO(eps_low=1.0, eps_high=0.2), "token IS (no clip)": TokenRatio()}
SWEEP = [0.25, 0.5, 1.0, 2.0, 4.0]
policies = {s: step_along(pi_old, grad_old, s) for s in SWEEP}
cosines = {name: [expected_gradient(part, policies[s]).cosine for s in SWEEP]
           for name, part in VARIANTS.items()}
show(table([(name, *values_) for name, values_ in cosines.items()],
           ["cos(E ĝ, ∇J) at step s =", *map(str, SWEEP)], fmt="+.3f"))

# %%
fig, ax = plt.subplots(figsize=(7.5, 4.2))
for (name, values_), style in zip(cosines.items(), ["o-", "s-", "^--", "D-", "k:"]):
    ax.plot(SWEEP, values_, style, label=name)
ax.axhline(0, color="0.7", lw=0.8)
ax.set_xscale("log")
ax.minorticks_off()
ax.set_xticks(SWEEP, [str(s) for s in SWEEP])
finish(ax, title="Which clip still follows ∇J on stale data", xlabel="step s from π_old",
       ylabel="cos(E[ĝ], ∇J(π))")
plt.show()

# %% [markdown]
# PPO's expected gradient turns away from $\nabla J$ once the step is a few times the clip range;
# clip-higher delays that a little (at $s = 0.5$ it is still token IS). The dual clip changes
# nothing until ratios exceed $c = 3$, at $s = 4$. CISPO, which bounds the weights instead of
# dropping tokens, stays close to token IS throughout: its bias is the surrogate's, not the
# mask's.
#
# ## 5. GSPO: one geometric-mean ratio per sequence
#
# GSPO (Zheng et al. 2025, arXiv 2507.18071) clips a sequence ratio, the geometric mean of the
# token ratios, $s_i = \big(\pi_\theta(y_i\mid x)/\pi_{\text{old}}(y_i\mid x)\big)^{1/|y_i|}$,
# with a very narrow band, $[1 - 3\cdot10^{-4}, 1 + 4\cdot10^{-4}]$: in a real model the
# geometric mean of thousands of ratios barely moves. On our MDP after a stale step of 0.5, the
# exact distribution of $s_i - 1$ under $\pi_{\text{old}}$:

# %%
pi = step_along(pi_old, grad_old, STALE)
with torch.no_grad():
    log_s = (sequence_logprobs(mdp, pi) - sequence_logprobs(mdp, pi_old)) / mdp.terminal_lengths
weight = (mdp.prompt_probs[mdp.terminal_prompt_index] * sequence_logprobs(mdp, pi_old).exp()).detach()
inside = ((log_s.exp() - 1 >= -3e-4) & (log_s.exp() - 1 <= 4e-4)).double()
fig, ax = plt.subplots(figsize=(7, 3.8))
ax.hist((log_s.exp() - 1).numpy(), bins=30, weights=weight.numpy(), color="C0",
        label="P(s_i − 1) under π_old")
ax.axvspan(-3e-4, 4e-4, color="C3", alpha=0.4, label="GSPO band [−3e-4, 4e-4]")
finish(ax, title=f"Sequence ratios after a step of {STALE}", xlabel="s_i − 1",
       ylabel="probability")
plt.show()
print(f"P(s_i inside the band) = {float((weight * inside).sum()):.4f}")

# %% [markdown]
# No response stays in the band. So every sequence whose ratio moved *with* its advantage is
# clipped ($\hat A > 0, s_i > 1 + 4\cdot10^{-4}$ or $\hat A < 0, s_i < 1 - 3\cdot10^{-4}$), and
# only the sequences that moved *against* their advantage keep a gradient.
#
# ### Exercise 3 — where does GSPO's expected gradient point?
#
# *Predict* the sign of $\cos(\mathbb{E}[\hat g_{\text{GSPO}}], \nabla J)$ at this step and
# record it as `gspo_prediction` (`"positive"` or `"negative"`), then compute the cosine exactly
# with `moments` (the notebook's estimator with the `GSPO` surrogate and its paper band, data
# from $\pi_{\text{old}}$).

# %%
# Solution
gspo_prediction = "negative"        # recorded before computing: "positive" or "negative"
gspo_cosine = expected_gradient(GSPO(eps_low=3e-4, eps_high=4e-4), pi).cosine

# %%
# Check
tokenmdp.check("tr06_gspo_cosine", gspo_cosine)
tokenmdp.check("tr06_predict_gspo_sign", gspo_prediction)

# %% [markdown]
# Negative: the surviving gradients push the policy *back* toward $\pi_{\text{old}}$ (each
# raises a sequence that was lowered though its advantage is positive, or the reverse). GSPO's
# band is tuned for a regime where one step moves $s_i$ by less than $10^{-4}$; on stale data
# beyond that the clip is not a brake but a reverse gear. A Monte Carlo estimate with standard
# errors agrees, and a band of 0.2 behaves like PPO:

# %%
mc_gspo = moments(mdp, pi, tr06_estimator(GSPO(eps_low=3e-4, eps_high=4e-4)), group_size=G,
                  behavior=pi_old, method="monte_carlo", num_samples=4000,
                  generator=torch.Generator().manual_seed(5))
print(f"GSPO cosine: exact {gspo_cosine:+.4f}, Monte Carlo {mc_gspo.cosine:+.4f} ± "
      f"{mc_gspo.cosine_se:.4f} ({(mc_gspo.cosine - gspo_cosine) / mc_gspo.cosine_se:+.2f} s.e.)")
assert abs(mc_gspo.cosine - gspo_cosine) < Z_TOL * mc_gspo.cosine_se
bands = {"GSPO band 3e-4/4e-4": GSPO(eps_low=3e-4, eps_high=4e-4),
         "GSPO band 0.2": GSPO(eps_low=0.2, eps_high=0.2)}
show(table([(name, *[expected_gradient(part, policies[s]).cosine for s in SWEEP])
            for name, part in bands.items()], ["cos(E ĝ, ∇J) at step s =", *map(str, SWEEP)],
           fmt="+.3f"))

# %% [markdown]
# The notebook's estimator is not quite the paper's GSPO, in two parts other than the band. Its
# reducer sums GSPO's per-sequence term over the response's tokens (loss weight $1/S$ on each
# token), so a response of $|y|$ tokens counts $|y|$ times; the paper's objective is a mean over
# sequences, $\frac1G\sum_i \min\big(s_i\hat A_i, \mathrm{clip}(s_i)\hat A_i\big)$, which is the
# sequence-mean of token means. And the registry's `gspo` also divides the advantage by the
# group's standard deviation. Swapping one part at a time, at the same step:

# %%
registry_gspo = get("gspo")
ours = tr06_estimator(registry_gspo.surrogate)              # the band of exercise 3
per_sequence_mean = Aggregation.SEQUENCE_MEAN_TOKEN_MEAN    # each response's terms weigh 1/S in all
assert registry_gspo.aggregation is per_sequence_mean
reducers = {"notebook: Â = R_1 − R_2, token sum": ours,
            "Â = R_1 − R_2, per-sequence mean": dataclasses.replace(ours, aggregation=per_sequence_mean),
            "group-normalized Â, token sum": dataclasses.replace(registry_gspo,
                                                                 aggregation=ours.aggregation),
            "registry gspo: group-normalized Â, per-sequence mean": registry_gspo}
reducer_cosines = {name: moments(mdp, pi, e, group_size=G, behavior=pi_old, method=METHOD).cosine
                   for name, e in reducers.items()}
show(table(list(reducer_cosines.items()), ["GSPO estimator, step 0.5", "cos(E ĝ, ∇J)"], fmt="+.3f"))
spread = max(reducer_cosines.values()) - min(reducer_cosines.values())
print(f"the four cosines are negative and span {spread:.3f}")
assert all(c < 0 for c in reducer_cosines.values()) and spread < 0.05

# %% [markdown]
# All four point away from $\nabla J$: with the paper's per-sequence mean the cosine is −0.610
# instead of −0.623, with the registry's `gspo` −0.620. The reverse gear is the band's, not the
# reducer's or the advantage's.
#
# ## 6. Multi-epoch staleness: one rollout, $N$ updates
#
# A trainer splits one rollout into $N$ mini-batches and updates on each. We run that exactly:
# every update moves $\theta$ by $\eta\,\mathbb{E}[\hat g]$, **the exact expected gradient of the
# estimator** at the current $\theta$ with the data drawn from $\pi_{\text{old}}$ (`moments(...)
# .mean` with `behavior = old = π_old`), with $\eta = 4$. With exact expectations every
# mini-batch has the same expected gradient, so the run with $N$ updates is the first $N$ updates
# of the run with 8; what $N$ changes is how far one rollout carries the policy. After every
# update we record the exact $J$ and the surrogate $L_{\pi_{\text{old}}}$ — there is no
# evaluation noise.

# %%
LR, N_MAX = 4.0, 8


def run_updates(surrogate_part, start, updates):
    # J and L_{π_start} after each of `updates` exact expected-gradient steps on one rollout
    policy, trace = copy.deepcopy(start), []
    for _ in range(updates):
        direction = expected_gradient(surrogate_part, policy, old=start).mean
        theta = parameters_to_vector(policy.parameters()).detach()
        vector_to_parameters(theta + LR * direction, policy.parameters())
        with torch.no_grad():
            trace.append((float(objective(mdp, policy)), float(surrogate(mdp, policy, start)),
                          float(sequence_kl(mdp, policy, start))))
    return policy, trace


# %%
EPOCHS = {"PPO ε=0.2": PPOClip(eps_low=0.2, eps_high=0.2), "token IS (no clip)": TokenRatio()}
traces = {name: run_updates(part, pi_old, N_MAX)[1] for name, part in EPOCHS.items()}
rows = [(name, n, *traces[name][n - 1]) for name in EPOCHS for n in (1, 2, 4, 8)]
show(table(rows, ["estimator", "N", "J after N", "L_π_old after N", "KL(π ‖ π_old)"], fmt=".4f"))

# %%
fig, ax = plt.subplots(figsize=(7.5, 4.4))
ks = range(N_MAX + 1)
for (name, trace), color in zip(traces.items(), ["C0", "C1"]):
    ax.plot(ks, [J_old] + [t[0] for t in trace], "o-", color=color, label=f"{name}: exact J")
    ax.plot(ks, [J_old] + [t[1] for t in trace], "--", color=color,
            label=f"{name}: surrogate L_π_old")
finish(ax, title=f"One rollout, N updates (η = {LR:g}, exact expected gradients)",
       xlabel="updates on the same rollout", ylabel="objective")
plt.show()

# %% [markdown]
# Token IS climbs its surrogate, and $J$ follows less and less: after 8 updates the surrogate
# promises far more than $J$ delivers (the gap of section 2, now large). PPO's clip slows the
# climb to a crawl after two updates: once most pushing tokens are outside $[0.8, 1.2]$ the
# expected gradient is short and no longer points along $\nabla J$, so more updates on the same
# rollout buy little. Equal work, more rollouts: the same 8 updates as $8/N$ rollouts of $N$ updates.

# %%
final = {}
for name, part in EPOCHS.items():
    for n in (1, 2, 4, 8):
        policy = pi_old
        for _ in range(N_MAX // n):                      # a fresh rollout at the current policy
            policy, trace = run_updates(part, policy, n)
        final[name, n] = trace[-1][0]
show(table([(name, *[final[name, n] for n in (1, 2, 4, 8)]) for name in EPOCHS],
           ["J after 8 updates, as 8/N rollouts of N:", "N=1", "N=2", "N=4", "N=8"], fmt=".4f"))

# %% [markdown]
# With $N = 1$ every update is on-policy ($r \equiv 1$, the clip is inert) and both estimators are
# the same exact gradient ascent. The more updates share a rollout, the more staleness costs:
# token IS loses through its first-order gap, PPO through its mask. In practice the clip earns its
# keep against *noisy* steps, which the exact expectations here do not have.
#
# ## 7. Failure mode: forget the stop-gradient
#
# The masked-REINFORCE form has $\operatorname{sg}(r_t)$ for a reason. Write the same loss with a
# live ratio, $M_t\, r_t \hat A \log\pi_\theta$ — an easy slip when $r$ is computed from the same
# log-probs — and its gradient gains a term $M_t r_t \hat A \log\pi_\theta\, \nabla\log\pi_\theta$.
# That term does not vanish even **on-policy**, where $r \equiv 1$ and the correct estimator is
# exactly unbiased:

# %%
@dataclasses.dataclass(frozen=True)
class LiveRatioMiniRL(Surrogate):
    # BROKEN ON PURPOSE: M r Â log π with r = exp(log π - log π_old) NOT detached
    def __call__(self, logprobs_RC, batch):
        ratio = (logprobs_RC - self._old(batch)).exp()
        keep = ppo_keep_mask(ratio.detach(), batch.advantage, eps_low=0.2, eps_high=0.2)
        return SurrogateTerms(keep * ratio * batch.advantage * logprobs_RC, ~keep)

    def describe(self):
        return "M r A log pi (live r: broken)"


on = {"M sg(r) Â log π (MiniRL)": MiniRL(eps_low=0.2, eps_high=0.2),
      "M r Â log π (live r)": LiveRatioMiniRL()}
on_policy = {name: expected_gradient(part, pi_old) for name, part in on.items()}
show(table([(name, m.relative_bias, m.cosine) for name, m in on_policy.items()],
           ["on-policy estimator", "||E ĝ − ∇J|| / ||∇J||", "cos(E ĝ, ∇J)"], fmt=".4f"))
assert on_policy["M sg(r) Â log π (MiniRL)"].bias.norm() < EXACT_TOL

# %% [markdown]
# The correct loss is unbiased to rounding error; the live ratio biases the very first update of
# every rollout, before any staleness, by the expectation of $\hat A \log\pi\,\nabla\log\pi$ —
# a weight that grows with how unlikely the token is. A unit test that compares the gradient, not
# the loss value, catches it at once (on-policy both losses have the same value).
#
# ## What verl / TRL / others call this
#
# Generated from the registry's aliases (the same text as the estimator cards):

# %%
show(alias_box(["ppo", "dapo", "cispo", "gspo", "minirl"]))

# %% [markdown]
# ## Summary
#
# * The performance-difference lemma is exact: $J(\pi) - J(\pi_{\text{old}}) = \sum_s d^\pi(s)
#   \sum_a \pi(a\mid s) A^{\pi_{\text{old}}}(s, a)$; the surrogate swaps $d^\pi$ for
#   $d^{\pi_{\text{old}}}$ and matches $J$ in value and gradient at $\pi_{\text{old}}$.
# * The gap $J - L$ is second order in the step and below $2\varepsilon\alpha^2 L(L-1)$; far out
#   the surrogate over-promises.
# * PPO's clip is REINFORCE with the detached weight $\operatorname{sg}(r_t)\hat A$ on unclipped
#   tokens and 0 on clipped ones (MiniRL's loss, the same expected gradient).
# * Clip-higher moves the upper edge, dual clip removes the unbounded $r\hat A$ of negative
#   advantages above $c$, CISPO keeps clipped tokens with a bounded weight and stays close to
#   token IS.
# * GSPO's $3\cdot10^{-4}$ band under a stale step of 0.5 clips every sequence that moved the
#   right way: the expected gradient has a negative cosine with $\nabla J$, with the notebook's
#   token-sum reducer and with the paper's per-sequence mean (the registry's `gspo`) alike.
# * On one rollout, more updates climb the surrogate; the clip stops the climb, token IS pays the
#   gap. Forgetting $\operatorname{sg}(r)$ biases even the on-policy step.
