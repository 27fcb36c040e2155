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
# # Tutorial 8 — KL regularization
#
# **The question.** A trainer adds "a KL penalty to the reference policy" with a coefficient
# $\beta$. Three per-token estimators of the KL are in use (k1, k2, k3), plus verl's
# straight-through k3+, and each can be put in the reward or in the loss. Which of the eight
# combinations actually pushes the policy along
# $-\nabla \mathrm{KL}(\pi_\theta \,\|\, \pi_{\text{ref}})$, the gradient of the regularizer the
# objective names?
#
# Estimating the *value* of a KL and estimating its *gradient* are different problems. We take
# them in that order:
#
# 1. reproduce **Schulman's k1/k2/k3 table** (bias and standard deviation of each value estimate)
#    by closed form and by Monte Carlo with error bars;
# 2. build the **exact gradient table** k1/k2/k3/k3+ × in the reward / in the loss × bandit /
#    sequence, and read off which is the reverse-KL gradient, which the forward, which is zero in
#    expectation and which is a partial gradient; then see what verl's **k3+** repairs in
#    GRPO's k3 and what it leaves, and which verl and TRL options select each placement;
# 3. take k3 **off-policy** with its importance weight and see what the weight does and does
#    not repair;
# 4. break the regularizer on purpose: **k1 in the loss regularizes nothing**, and an exact
#    training run shows it.
#
# Everything is exact (float64, full enumeration) except where a Monte Carlo estimate is put
# beside the exact value.

# %% [markdown]
# ## Setup
#
# The worlds are the copy task of tutorials 1, 3 and 6 (tokens $\{0, 1, \text{EOS}\}$, two
# prompts, +1 per copied token, −1 if truncated), built by `tokenmdp.course.tutorials.t08.kl_world(L)`:
# with responses of at most $L = 1$ token it is a **bandit** (one action per prompt), with
# $L = 3$ a **sequence** task. In both, $\pi_{\text{ref}}$ is the seeded tabular policy and the
# policy being regularized is $\pi = \pi_{\text{ref}}$ moved by a step of 3 along
# $\nabla J(\pi_{\text{ref}})$, as if RL had trained it for a while; $\mu$, half-way, is an
# older policy that sampled the data in section 3.

# %%
# %matplotlib inline
import math

import matplotlib.pyplot as plt
import torch

import tokenmdp
from tokenmdp.course.display import alias_box, finish, show, table
from tokenmdp.course.setups import step_along
from tokenmdp.course.tutorials.t08 import (
    kl_gradient_table,
    kl_matches,
    kl_option_table,
    kl_placement_moments,
    kl_world,
    mean_and_sd,
)
from tokenmdp.estimators import Aggregation, Estimator, KLPenalty, Reinforce, kl_k1, kl_k3
from tokenmdp.exact import gradient, moments, objective, sequence_kl, state_visitation
from tokenmdp.exact.analysis.kl_gradients import (
    kl_gradients,
    kl_penalty_moments,
    sampled_penalty_gradients,
    state_kl,
)

# Named tolerances for the checks in this notebook.
EXACT_TOL = 1e-10  # two exact float64 computations of the same vector or number
Z_TOL = 4.0        # |Monte Carlo estimate - exact| in standard errors
BETA = 0.1         # the KL coefficient β of the gradient sections
print("tokenmdp", tokenmdp.__version__, "| torch", torch.__version__)

# Every tensor here is tiny: one CPU thread avoids the cost of synchronizing several.
torch.set_num_threads(1)

# %%
worlds = {"bandit (L = 1)": kl_world(1), "sequence (L = 3)": kl_world(3)}
rows = []
for name, (mdp, pi, ref, mu) in worlds.items():
    with torch.no_grad():
        rows.append((name, mdp.num_sequences, float(sequence_kl(mdp, pi, ref)),
                     float(sequence_kl(mdp, ref, pi)), float(sequence_kl(mdp, mu, pi))))
show(table(rows, ["world", "responses", "KL(π ‖ π_ref)", "KL(π_ref ‖ π)", "KL(μ ‖ π)"],
           fmt=".4f"))

# %% [markdown]
# ## 1. Three estimators of one number
#
# To estimate $\mathrm{KL}(q \,\|\, p) = \mathbb{E}_{x\sim q}[\log q(x) - \log p(x)]$ from
# samples $x \sim q$, write $r = p(x)/q(x)$. Schulman ("Approximating KL Divergence", 2020,
# http://joschu.net/blog/kl-approx.html; the post numbers no equations) compares
#
# $$
# k_1 = -\log r, \qquad k_2 = \tfrac12 (\log r)^2, \qquad k_3 = (r - 1) - \log r .
# $$
#
# $k_1$ is unbiased but takes both signs; $k_2$ is never negative but biased; $k_3$ adds
# $r - 1$, which has mean zero under $q$, to $k_1$: it stays unbiased and, since
# $\log r \le r - 1$, is never negative. The post's test case is two unit Gaussians,
# $p = \mathcal N(0, 1)$ and $q = \mathcal N(\mu, 1)$ with $\mu = 0.1$ and $\mu = 1$. There
# everything is closed form: $\log r = -\mu x + \mu^2/2$ with $x \sim q$ is
# $\mathcal N(-\mu^2/2, \mu^2)$, $\mathrm{KL} = \mu^2/2$, and the Gaussian moments give
#
# | | bias / KL | sd / KL |
# |---|---|---|
# | $k_1$ | 0 | $2/\mu$ |
# | $k_2$ | $\mu^2/4$ | $\sqrt{2 + \mu^2}$ |
# | $k_3$ | 0 | $\sqrt{e^{\mu^2} - 1 - \mu^2}\,/\,(\mu^2/2)$ |
#
# (for $k_2$: $\mathbb E[u^2] = m^2 + s^2$, $\mathrm{Var}[u^2] = 2s^4 + 4m^2s^2$; for $k_3$:
# $\mathbb E[e^u] = 1$, $\mathrm{Var}[e^u] = e^{\mu^2} - 1$, $\mathrm{Cov}[e^u, u] = \mu^2$).
# Swapping the roles of $p$ and $q$ gives the same distribution of $\log r$, so the table holds
# either way. Next to it, a Monte Carlo estimate from $10^6$ draws with standard errors (the
# standard deviation's by the delta method, `mean_and_sd`):

# %%
def closed_form(mu):
    # (bias / KL, sd / KL) of k1, k2, k3 for q = N(mu, 1), p = N(0, 1)
    kl = mu ** 2 / 2
    return {"k1": (0.0, mu / kl), "k2": (mu ** 4 / 8 / kl, mu ** 2 * math.sqrt(2 + mu ** 2) / 2 / kl),
            "k3": (0.0, math.sqrt(math.expm1(mu ** 2) - mu ** 2) / kl)}


def sampled(mu, n, generator):
    # the three estimators on the same n draws x ~ q
    x = mu + torch.randn(n, generator=generator, dtype=torch.float64)
    log_r = -0.5 * x ** 2 + 0.5 * (x - mu) ** 2                  # log p(x) - log q(x)
    return {"k1": -log_r, "k2": 0.5 * log_r ** 2, "k3": torch.expm1(log_r) - log_r}

# %%
generator, rows = torch.Generator().manual_seed(8), []
for mu in (0.1, 1.0):
    kl, draws = mu ** 2 / 2, sampled(mu, 10 ** 6, generator)
    for name, (bias, sd) in closed_form(mu).items():
        m, m_se, s, s_se = mean_and_sd(draws[name])
        z_bias, z_sd = (m - kl - bias * kl) / m_se, (s - sd * kl) / s_se
        assert abs(z_bias) < Z_TOL and abs(z_sd) < Z_TOL, (mu, name)
        rows.append((f"N({mu:g}, 1)", name, bias, f"{(m - kl) / kl:+.4f} ± {m_se / kl:.4f}",
                     sd, f"{s / kl:.3f} ± {s_se / kl:.3f}"))
show(table(rows, ["q", "estimator", "bias/KL exact", "bias/KL Monte Carlo", "sd/KL exact",
                  "sd/KL Monte Carlo"], fmt=".4f"))

# %% [markdown]
# At $\mu = 0.1$ the KL is 0.005 and $k_1$'s standard deviation is twenty times that, while
# $k_2$ and $k_3$ are at about 1.42 times the KL, $k_2$ with a bias of a quarter percent. At
# $\mu = 1$ $k_2$'s bias is 25% and $k_3$ is still unbiased with the smallest spread. Every Monte
# Carlo figure is within four standard errors of the closed form.
#
# ### Exercise 1 — is k3 always the better estimator?
#
# *Predict* before you compute: as the two distributions move apart (larger $\mu$), does $k_3$
# keep a smaller standard deviation than $k_2$? Record it as `spread_prediction` (`"yes"` or
# `"no"`). If not, find the mean shift $\mu^*$ at which the two standard deviations are equal
# (from the closed forms above, by bisection on $[0.5, 3]$).

# %%
# Solution
spread_prediction = "no"             # recorded before computing: "yes" or "no"


def k3_minus_k2(mu):
    return closed_form(mu)["k3"][1] - closed_form(mu)["k2"][1]


lo, hi = 0.5, 3.0
while hi - lo > 1e-13:
    mid = 0.5 * (lo + hi)
    lo, hi = (mid, hi) if k3_minus_k2(mid) < 0 else (lo, mid)
crossover = 0.5 * (lo + hi)

# %%
# Check
tokenmdp.check("tr08_predict_k3_spread_stays_below_k2", spread_prediction)
tokenmdp.check("tr08_k3_k2_crossover", crossover)

# %% [markdown]
# No: $k_3$'s $r - 1$ term has a lognormal tail, $\mathrm{Var}[r] = e^{\mu^2} - 1$, which
# overtakes $k_2$'s polynomial growth at $\mu^* \approx 1.2$ ($\mathrm{KL} \approx 0.73$). Beyond
# it the "low-variance" estimator is the noisier one; far from the reference, $r$ can be huge on
# rare tokens. The closed forms and Monte Carlo points with error bars over a range of $\mu$:

# %%
mus, points = torch.logspace(-1.3, 0.4, 60, dtype=torch.float64).tolist(), (0.1, 0.3, 0.7, 1.5)
draws = {m: sampled(m, 10 ** 5, generator) for m in points}
fig, ax = plt.subplots(figsize=(7.5, 4.4))
for (name, color) in zip(("k1", "k2", "k3"), ("C0", "C1", "C2")):
    ax.plot(mus, [closed_form(m)[name][1] for m in mus], color=color, label=f"{name} (closed form)")
    sds = [mean_and_sd(draws[m][name])[2:] for m in points]     # (sd, its standard error)
    ax.errorbar(points, [s / (m * m / 2) for m, (s, _) in zip(points, sds)],
                yerr=[2 * se / (m * m / 2) for m, (_, se) in zip(points, sds)], fmt="o",
                color=color, ms=4, capsize=3, label=f"{name} (Monte Carlo, ±2 s.e.)")
ax.axvline(crossover, color="0.5", ls="--", lw=0.8, label=f"μ* = {crossover:.3f}")
ax.set_xscale("log")
ax.set_yscale("log")
finish(ax, title="Standard deviation of each KL estimator, relative to the KL",
       xlabel="mean shift μ (q = N(μ, 1), p = N(0, 1))", ylabel="sd / KL(q ‖ p)")
plt.show()

# %% [markdown]
# ## 2. The gradient table
#
# A trainer does not need the value; it needs the gradient. The regularized objective of RLHF is
# $J(\theta) - \beta\,\mathrm{KL}(\pi_\theta \,\|\, \pi_{\text{ref}})$ over whole responses
# (InstructGPT, Ouyang et al. 2022, arXiv 2203.02155, Eq. 2), whose KL gradient over sequences is
# $\nabla\mathrm{KL} = \mathbb{E}_\pi\big[\sum_t \big(\sum_{t' \ge t} k_{1,t'}\big)
# \nabla\log\pi(y_t \mid s_t)\big]$ (a token pays for its own and all later log-ratios). With
# the samples drawn from $\pi_\theta$ itself, each placement gives, per response ($\hat A = R$,
# REINFORCE, tokens summed):
#
# * **in the reward** (detached): $R \leftarrow R - \beta\sum_t k_t$, so
#   $\hat g = -\beta \big(\sum_t k_t\big) \sum_t \nabla\log\pi(y_t\mid s_t)$;
# * **in the loss** (differentiated): $\hat g = -\beta \sum_t \nabla_\theta k_t$, with
#   $\nabla k_1 = \nabla\log\pi$, $\nabla k_2 = k_1\nabla\log\pi$ and
#   $\nabla k_3 = (1 - r)\nabla\log\pi$, $r = \pi_{\text{ref}}/\pi$.
#
# The fourth estimator is verl's `k3+` (`kl_k3_plus` here): a *straight-through* k3, whose
# value is $k_3$ (non-negative, unbiased for the KL, what the trainer logs) and whose gradient
# is $k_2$'s, $\nabla k_{3+} = k_1\nabla\log\pi$. In the reward only the value counts, so
# k3+ in the reward is k3 in the reward.
#
# Tang & Munos (arXiv 2506.09477) and Shah et al. ("A Comedy of Estimators", arXiv 2512.21852)
# work out what these deliver. We compare each placement's exact expected gradient
# $-\mathbb E[\hat g]/\beta$ (`kl_penalty_moments`: the penalty alone, on a zero-reward copy of
# the world) with four exact targets (`kl_gradients`, autograd on `sequence_kl` and on the
# per-state KLs `state_kl`):
#
# * the **reverse** KL gradient $\nabla\mathrm{KL}(\pi\,\|\,\pi_{\text{ref}})$ and the
#   **forward** one $\nabla\mathrm{KL}(\pi_{\text{ref}}\,\|\,\pi)$, over whole responses;
# * their **per-state** (partial) versions $\sum_s d^\pi(s)\,\nabla\mathrm{KL}(\pi(\cdot|s)
#   \,\|\,\pi_{\text{ref}}(\cdot|s))$ and the same with the arguments swapped, where the
#   visitation $d^\pi$ is held fixed.
#
# By the chain rule of KL, $\mathrm{KL}(\pi\,\|\,\pi_{\text{ref}}) = \sum_s d^\pi(s)\,
# \mathrm{KL}_s(\pi\,\|\,\pi_{\text{ref}})$; the partial gradient is the full one without the
# derivative of $d^\pi$, the effect of a token on the states after it. We check the chain rule
# exactly, then build the two tables.

# %%
for name, (mdp, pi, ref, _) in worlds.items():
    with torch.no_grad():
        chain = float((state_visitation(mdp, pi) * state_kl(mdp, pi, ref)).sum())
        whole = float(sequence_kl(mdp, pi, ref))
    print(f"{name}: Σ_s d(s) KL_s = {chain:.12f}, KL over responses = {whole:.12f}")
    assert abs(chain - whole) < EXACT_TOL
placements = {name: kl_placement_moments(mdp, pi, ref, coef=BETA)
              for name, (mdp, pi, ref, _) in worlds.items()}
targets = {name: kl_gradients(mdp, pi, ref).targets() for name, (mdp, pi, ref, _) in worlds.items()}

# %% [markdown]
# Each cell is $\|{-\mathbb E[\hat g]/\beta} - \text{target}\| / \|\nabla\mathrm{KL}(\pi\,\|\,
# \pi_{\text{ref}})\|$: a 0 says the placement delivers that gradient exactly, in expectation.
# The last column names the targets it equals (to $10^{-10}$), and `Var/β²` is the exact total
# variance of $\hat g/\beta$. First the bandit:

# %%
show(kl_gradient_table(placements["bandit (L = 1)"], targets["bandit (L = 1)"], coef=BETA,
                       tol=EXACT_TOL))

# %% [markdown]
# In a bandit the visitation is just the prompt distribution, so each per-state target *is* its
# sequence target. k1 in the reward, k2 in the loss and k3+ in the loss are the reverse-KL
# gradient, k3 in the loss is the **forward**-KL gradient, k1 in the loss is zero, and k2, k3
# and k3+ in the reward match nothing. Now the sequence task:

# %%
show(kl_gradient_table(placements["sequence (L = 3)"], targets["sequence (L = 3)"], coef=BETA,
                       tol=EXACT_TOL))

# %%
expected = {"k1 in reward": ("reverse KL",), "k1 in loss": ("zero",),
            "k2 in reward": (), "k2 in loss": ("per-state reverse",),
            "k3 in reward": (), "k3 in loss": ("per-state forward",),
            "k3+ in reward": (), "k3+ in loss": ("per-state reverse",)}
matches = kl_matches(placements["sequence (L = 3)"], targets["sequence (L = 3)"], coef=BETA,
                     tol=EXACT_TOL)
assert matches == expected
seq = placements["sequence (L = 3)"]
t = targets["sequence (L = 3)"]                  # k3 in the reward: reverse minus k3-in-loss
k3_reward = -seq["k3 in reward"].mean / BETA
assert (k3_reward - (t["reverse KL"] - t["per-state forward"])).norm() < EXACT_TOL
for plus, same in (("k3+ in loss", "k2 in loss"), ("k3+ in reward", "k3 in reward")):
    assert (seq[plus].mean - seq[same].mean).norm() < EXACT_TOL * BETA * t["reverse KL"].norm()
print("sequence task: every match as stated; k3 in the reward = ∇KL(π‖π_ref) − (k3 in the loss);"
      " k3+ in the loss = k2 in the loss, k3+ in the reward = k3 in the reward")

# %% [markdown]
# Read the sequence table row by row:
#
# * **k1 in the reward** is the only placement that is the reverse-KL gradient of the whole
#   response: the detached $\sum_t k_{1,t}$ multiplies every token's score, so each token pays for
#   the log-ratios after it.
# * **k1 in the loss** is zero in expectation, $\mathbb E_\pi[\nabla\log\pi] = 0$, yet its
#   variance is the largest of the table: pure noise.
# * **k2 in the loss** is the reverse KL's *partial* gradient: $k_{1,t}\nabla\log\pi_t$ has no
#   future log-ratios. Exact in a bandit, a third of the gradient's length off here.
# * **k3 in the loss** (GRPO, DeepSeekMath, arXiv 2402.03300, Eq. 4) is the per-state
#   **forward**-KL gradient: $\mathbb E_{a\sim\pi}[(1 - \pi_{\text{ref}}/\pi)\nabla\log\pi] =
#   -\sum_a \pi_{\text{ref}}(a|s)\nabla\log\pi(a|s)$, weighted by $\pi$'s visitation, not even
#   the gradient of the forward KL of responses, which weights by $d^{\pi_{\text{ref}}}$.
# * **k2 and k3 in the reward** match no target. For k3 the extra $r_t - 1$ has mean zero, so
#   the *value* of the penalty is unbiased, but it correlates with its own token's score:
#   $\mathbb E[(r_t - 1)\nabla\log\pi_t] = -\nabla\mathrm{KL}_{s_t}(\pi_{\text{ref}}\|\pi)$,
#   which is why it equals the reverse gradient minus k3's loss gradient (asserted above).
# * **k3+** is k2 in the loss and k3 in the reward, row for row (asserted above): section 2's
#   last part asks what that buys GRPO.
#
# Near $\pi = \pi_{\text{ref}}$, with $\theta - \theta_{\text{ref}} = \delta$, every KL is
# $\tfrac12 \delta^\top F \delta$ to second order, so k1 in the reward and k2, k3, k3+ in the
# loss agree to first order and part only as the policy moves away, as here. k2, k3 and k3+ in
# the reward do not: $k_2$ is itself second order, and k3's gradient in the reward (k3+'s is
# the same), the reverse minus the per-state forward one, cancels to first order, so these
# penalties start out with almost no gradient at all. At a step of 0.03 instead of 3:

# %%
mdp, _, ref, _ = worlds["sequence (L = 3)"]
near = step_along(ref, gradient(mdp, ref), 0.03)
reverse_near = kl_gradients(mdp, near, ref).reverse
distance = {name: float((-m.mean / BETA - reverse_near).norm() / reverse_near.norm())
            for name, m in kl_placement_moments(mdp, near, ref, coef=BETA).items()}
show(table(list(distance.items()), ["placement, step 0.03", "‖−E ĝ/β − ∇KL(π‖π_ref)‖ / ‖∇KL‖"],
           fmt=".4f"))
assert max(distance[f"{k} in loss"] for k in ("k2", "k3", "k3+")) < 0.01
assert min(distance[f"{k} in reward"] for k in ("k2", "k3", "k3+")) > 0.99

# %% [markdown]
# The same expectations from sampled batches run through the library's `prepare` and `loss`
# (`sampled_penalty_gradients`: 200 batches of 100 responses each), coordinate by coordinate:

# %%
mdp, pi, ref, mu = worlds["sequence (L = 3)"]
generator, rows = torch.Generator().manual_seed(80), []
for name, estimator, in_reward in (("k1 in reward", kl_k1, True), ("k1 in loss", kl_k1, False),
                                   ("k3 in loss", kl_k3, False)):
    penalty = KLPenalty(coef=BETA, in_reward=in_reward, estimator=estimator)
    g = sampled_penalty_gradients(mdp, pi, ref, penalty, num_batches=200, batch_size=100,
                                  generator=generator)
    exact_mean = placements["sequence (L = 3)"][name].mean
    z = (g.mean(0) - exact_mean) / (g.std(0) / g.shape[0] ** 0.5)
    assert z.abs().max() < Z_TOL + 0.5, name     # the largest of 42 coordinates
    rows.append((name, float(g.mean(0).norm()), float(exact_mean.norm()), float(z.abs().max())))
show(table(rows, ["placement", "‖mean of sampled ĝ‖", "‖E ĝ‖ exact", "max |z| over coordinates"],
           fmt=".4f"))

# %% [markdown]
# The sampled mean of k1-in-the-loss is small but not zero: that is sampling noise, within the
# error bars of a zero mean; every coordinate of every placement is within $4.5$ standard errors
# of the exact value (the largest $|z|$ of 42 coordinates).
#
# ### Exercise 2 — how far is GRPO's KL term from the reverse-KL gradient?
#
# *Predict* first: on the sequence task, is the relative distance
# $\|\mathbb E[\nabla k_3\text{-in-loss}] - \nabla\mathrm{KL}(\pi\,\|\,\pi_{\text{ref}})\| /
# \|\nabla\mathrm{KL}(\pi\,\|\,\pi_{\text{ref}})\|$ closer to 0, 0.3 or 1? Record it as
# `bias_prediction` (`"0"`, `"0.3"` or `"1"`), without reading it off the table above. Then
# compute it from `kl_penalty_moments` and `kl_gradients` (remember that `.mean` is $-\beta$
# times the penalty's gradient).

# %%
# Solution
bias_prediction = "0.3"              # recorded before computing: "0", "0.3" or "1"
penalty = KLPenalty(coef=BETA, in_reward=False, estimator=kl_k3)
delivered = -kl_penalty_moments(mdp, pi, ref, penalty).mean / BETA
reverse = kl_gradients(mdp, pi, ref).reverse
k3_bias = float((delivered - reverse).norm() / reverse.norm())

# %%
# Check
tokenmdp.check("tr08_predict_k3_loss_bias_size", bias_prediction)
tokenmdp.check("tr08_k3_loss_relative_bias", k3_bias)

# %% [markdown]
# About 0.31: GRPO's KL term pulls towards $\pi_{\text{ref}}$, but along a direction a third of
# the gradient's length away from the one the objective names (and 0.60 away in the bandit,
# where it is exactly the forward-KL gradient).
#
# ### verl's k3+: what it repairs in GRPO's k3, and what it leaves
#
# verl's practical fix for this bias is `kl_loss_type=k3+`: keep k3's value (non-negative,
# unbiased, low variance, what the trainer logs) and take k2's gradient,
# $k_{1,t}\nabla\log\pi(y_t|s_t)$, by a straight-through trick. The two gradient tables above
# already hold its rows; here they are beside k3's, in both worlds:

# %%
rows = []
for name in worlds:
    m, tg = placements[name], targets[name]
    scale = tg["reverse KL"].norm()
    for placement in ("k3 in loss", "k3+ in loss"):
        delivered = -m[placement].mean / BETA
        rows.append((name, placement, float((delivered - tg["reverse KL"]).norm() / scale),
                     float((delivered - tg["per-state reverse"]).norm() / scale),
                     m[placement].total_variance / BETA ** 2))
show(table(rows, ["world", "placement", "to reverse KL", "to per-state reverse", "Var/β²"],
           fmt=".3f"))
bandit_k3, bandit_plus, seq_k3, seq_plus = rows
assert bandit_plus[2] < EXACT_TOL < bandit_k3[2] and seq_plus[3] < EXACT_TOL < seq_plus[2]
assert bandit_plus[4] < bandit_k3[4] and seq_plus[4] < seq_k3[4]

# %% [markdown]
# What k3+ repairs is the **direction at each state**: forward KL becomes reverse KL. In the
# bandit, where each state's gradient is the whole gradient, that removes the bias entirely
# (0.599 → 0) and cuts the variance from 3.360 to 0.402 (β² units). What it leaves is the
# **later tokens**: like k2 in the loss, it is the *per-state* reverse gradient, blind to the
# log-ratios that follow a token. On the sequence task it is 0.334 of the gradient's length
# from $\nabla\mathrm{KL}(\pi\,\|\,\pi_{\text{ref}})$ — not closer than k3's 0.313, because
# its error is the other one: the visitation term instead of the direction. It still halves
# the variance (0.963 → 0.520). Only a penalty in the (detached) reward with k1 summed over
# the response — each token paying for the log-ratios after it — is the full reverse-KL
# gradient of whole responses; the table at the end says which options select it.
#
# ## 3. Off-policy: the importance-weighted k3
#
# With stale data, $y \sim \mu \ne \pi_\theta$, a loss-placed penalty is sampled from the wrong
# policy. `KLPenalty(importance_weighted=True)` multiplies each token's $k_t$ by the detached
# weight $\operatorname{sg}(\pi_\theta(y_t|s_t)/\mu(y_t|s_t))$, which turns
# $\mathbb E_{a\sim\mu}$ into $\mathbb E_{a\sim\pi}$ *at each state*.
#
# *Predict* before reading on: does that make the stale k3 gradient exactly the on-policy one
# in both worlds, in the bandit only, or in neither? Record it as `weight_prediction`
# (`"both"`, `"bandit"` or `"neither"`).

# %%
# Solution
weight_prediction = "bandit"         # recorded before computing: "both", "bandit" or "neither"

# %%
# Check
tokenmdp.check("tr08_predict_weight_repairs", weight_prediction)

# %% [markdown]
# The states themselves are still visited with $\mu$'s frequencies, so the weighted estimator
# delivers
# $\sum_s d^{\mu}(s)\,\nabla\mathrm{KL}_s(\pi_{\text{ref}}\,\|\,\pi)$ (`kl_gradients(...,
# visitation=μ)`), not the on-policy gradient. Exactly, in both worlds:

# %%
rows = []
for name, (mdp, pi, ref, mu) in worlds.items():
    on = kl_penalty_moments(mdp, pi, ref, KLPenalty(coef=BETA, in_reward=False)).mean
    plain = kl_penalty_moments(mdp, pi, ref, KLPenalty(coef=BETA, in_reward=False), behavior=mu).mean
    weighted = kl_penalty_moments(mdp, pi, ref, KLPenalty(coef=BETA, in_reward=False,
                                                          importance_weighted=True), behavior=mu).mean
    by_mu = kl_gradients(mdp, pi, ref, visitation=mu).forward_per_state
    assert (-weighted / BETA - by_mu).norm() < EXACT_TOL
    rows.append((name, float((plain - on).norm() / on.norm()), float((weighted - on).norm() / on.norm())))
show(table(rows, ["world", "no weight: ‖E_μ ĝ − E_π ĝ‖/‖E_π ĝ‖", "weighted: same"], fmt=".4f"))
assert rows[0][2] < EXACT_TOL               # in a bandit the weight repairs everything

# %% [markdown]
# Without the weight, the stale k3 gradient is off by more than its own length in the bandit.
# With it, the bandit is repaired exactly; in the sequence task a gap remains, the difference
# between $\mu$'s and $\pi$'s visitation. A per-token weight cannot move the states a response
# reaches; only a weight on the whole prefix could.
#
# ### Exercise 3 — what the per-token weight leaves behind
#
# The remaining relative gap of the weighted k3 on the sequence task is in the table above;
# compute it yourself from `kl_penalty_moments` (the weighted penalty with `behavior=μ`,
# against the unweighted one on-policy).

# %%
# Solution
mdp, pi, ref, mu = worlds["sequence (L = 3)"]
weighted = KLPenalty(coef=BETA, in_reward=False, importance_weighted=True)
off = kl_penalty_moments(mdp, pi, ref, weighted, behavior=mu).mean
on = kl_penalty_moments(mdp, pi, ref, KLPenalty(coef=BETA, in_reward=False)).mean
off_policy_gap = float((off - on).norm() / on.norm())

# %%
# Check
tokenmdp.check("tr08_is_k3_off_policy_gap", off_policy_gap)

# %% [markdown]
# ## 4. Failure mode: k1 in the loss regularizes nothing
#
# Put the naive estimator where GRPO puts k3: `KLPenalty(in_reward=False, estimator=kl_k1)`.
# The loss changes, the logged `kl_ref` metric (the token mean of $k_1$) still measures the
# drift, and the gradient is $-\beta\nabla\log\pi$, whose expectation is exactly zero. We train exactly on the
# sequence task, from $\pi_{\text{ref}}$, with REINFORCE on the task reward plus each penalty
# ($\beta = 1$, 40 steps of $\eta = 1$ along the exact expected gradient), and track the exact
# KL and $J$ after every step.

# %%
def train(penalty, steps=40, lr=1.0, coef=1.0):
    mdp, _, ref, _ = worlds["sequence (L = 3)"]
    policy = kl_world(3)[2]                                      # a fresh copy of π_ref
    estimator = Estimator(surrogate=Reinforce(), aggregation=Aggregation.SEQUENCE_MEAN_TOKEN_SUM,
                          kl=None if penalty is None else KLPenalty(coef=coef, **penalty))
    trace = []
    for _ in range(steps):
        step = moments(mdp, policy, estimator, group_size=1, reference=ref, method="enumeration")
        with torch.no_grad():
            torch.nn.utils.vector_to_parameters(
                torch.nn.utils.parameters_to_vector(policy.parameters()) + lr * step.mean,
                policy.parameters())
            trace.append((float(sequence_kl(mdp, policy, ref)), float(objective(mdp, policy))))
    return trace

# %%
RUNS = {"no penalty (β = 0)": None,
        "k1 in the loss": {"in_reward": False, "estimator": kl_k1},
        "k3 in the loss (GRPO)": {"in_reward": False, "estimator": kl_k3},
        "k1 in the reward": {"in_reward": True, "estimator": kl_k1}}
traces = {name: train(penalty) for name, penalty in RUNS.items()}
same = max(abs(a[0] - b[0]) for a, b in zip(traces["no penalty (β = 0)"], traces["k1 in the loss"]))
print(f"max |KL(β = 0) − KL(k1 in the loss)| over 40 steps = {same:.1e}")
assert same < EXACT_TOL
final = {name: (*trace[-1], trace[-1][1] - trace[-1][0]) for name, trace in traces.items()}
show(table([(name, *values_) for name, values_ in final.items()],
           ["run (40 steps)", "KL(π ‖ π_ref)", "J", "J − β KL (β = 1)"], fmt=".4f"))
assert max(final, key=lambda name: final[name][2]) == "k1 in the reward"

# %%
fig, (ax_kl, ax_j) = plt.subplots(1, 2, figsize=(10, 4))
for (name, trace), style in zip(traces.items(), ["k-", "C3--", "C1-", "C0-"]):
    ax_kl.plot(range(1, 41), [t[0] for t in trace], style, label=name)
    ax_j.plot(range(1, 41), [t[1] for t in trace], style, label=name)
finish(ax_kl, title="KL to the reference during training", xlabel="exact ascent steps",
       ylabel="KL(π ‖ π_ref)")
finish(ax_j, title="Task reward during training", xlabel="exact ascent steps",
       ylabel="J(π)")
fig.tight_layout()
plt.show()

# %% [markdown]
# The dashed red curve lies on the black one to rounding error: with k1 in the loss the run is
# the unregularized run, step for step. The penalty costs compute, its `kl_ref` metric goes up
# as the policy drifts, and nothing pulls back. k1 in the reward ascends the regularized
# objective $J - \beta\,\mathrm{KL}$ itself and ends with the highest value of it; GRPO's k3 in
# the loss regularizes too, along its own (per-state forward) direction, and trades a little
# more KL for more reward. A unit test that compares the expected gradient of the
# penalty with $-\beta\nabla\mathrm{KL}$, rather than the penalty's value with the KL, catches
# the slip at once.
#
# ## What verl / TRL / others call this
#
# **verl** has both placements, each with its own switch and estimator option:
#
# * in the reward: `algorithm.use_kl_in_reward=True`, the estimator `algorithm.kl_penalty`
#   (default `kl`), the coefficient `algorithm.kl_ctrl.kl_coef`; the per-token penalty
#   (computed from `old_log_prob`, detached) is subtracted from the token-level rewards, which
#   GRPO's advantage sums into $R - \beta\sum_t k_t$ and GAE or REINFORCE++ turn into a
#   reward-to-go: section 2's "in the reward", up to each advantage's own baseline and scaling;
# * in the loss: `actor_rollout_ref.actor.use_kl_loss=True`, the estimator
#   `actor_rollout_ref.actor.kl_loss_type` (default `low_var_kl`), the coefficient
#   `actor_rollout_ref.actor.kl_loss_coef` (default 0.001).
#
# Both estimator options take `kl`/`k1`, `mse`/`k2`, `low_var_kl`/`k3` (and `abs`); a `+` at
# the end (verl's docs name `k1+` and `k3+`) keeps that value and takes k2's gradient. The `+`
# options are recent: check that your verl version has them.
#
# **TRL**'s `GRPOTrainer` has one placement and one estimator: with `GRPOConfig.beta > 0`
# (default 0.0, no penalty, no reference model) its loss adds `beta` times k3 per token, so
# TRL's GRPO is k3 in the loss, and no option selects another. TRL's PPO trainer puts the
# penalty in the reward of every token with `PPOConfig.kl_coef` and `kl_estimator` (`"k1"`,
# the default, or `"k3"`; `"k2"` is refused); TRL has been moving that trainer between
# releases, so check where your version keeps it. One row per placement, beside what it
# delivers on the sequence task (from the exact table of section 2):

# %%
show(kl_option_table(matches))

# %% [markdown]
# The full reverse-KL gradient of whole responses is one row: k1 in the reward, verl's
# `use_kl_in_reward` with `kl_penalty=k1` and TRL's PPO default; GRPO's k3 in the loss (verl's
# default `kl_loss_type`, TRL's only choice) is the per-state forward gradient, and verl's
# `k3+` the per-state reverse one.
#
# The registry's aliases (the same text as the estimator cards): GRPO is the registry entry
# with a KL penalty, k3 in the loss.

# %%
show(alias_box(["grpo", "reinforce"]))

# %% [markdown]
# ## Summary
#
# * As **value** estimates (Schulman 2020): $k_1$ is unbiased and noisy, $k_2$ biased by
#   $\mu^2/4$ of the KL, $k_3$ unbiased and non-negative with the smallest spread up to a mean
#   shift $\mu^* \approx 1.2$ between two unit Gaussians, where its lognormal tail takes over.
# * As **gradients**, on-policy: k1 in the reward is the reverse-KL gradient of whole responses;
#   k1 in the loss is zero in expectation; k2 in the loss is the reverse KL's partial (per-state)
#   gradient; k3 in the loss is the per-state forward-KL gradient under $\pi$'s visitation;
#   k2 and k3 in the reward match none of these and, near $\pi_{\text{ref}}$, have almost no
#   gradient. In a bandit the partial gradients are the full ones.
# * **verl's k3+** (k3's value, k2's gradient) turns GRPO's per-state forward-KL gradient into
#   the per-state reverse one, with less variance: exact in a bandit, but on sequences it still
#   misses the later tokens' log-ratios, which only k1 in the reward carries.
# * **Off-policy**, the per-token weight $\operatorname{sg}(\pi_\theta/\mu)$ repairs the action
#   distribution at each state but not the visitation: exact in a bandit, a gap in sequences.
# * **k1 in the loss** leaves the training run exactly as without a penalty.
