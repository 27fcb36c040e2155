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
# # Tutorial 10 — Capstone: the zoo on one exact MDP
#
# **The question.** Give every estimator of the registry the same budget — the same number of
# sampled updates, the same batches, the same optimizer and seed — on one exact MDP. Which ones
# raise $J$ the most, which ones break when the rollouts are stale or drawn by a mismatched
# inference engine, and do the exact moments *at the start* (the cosine of $\mathbb{E}[\hat g]$
# with $\nabla J$, the variance) say so in advance? And when a new paper proposes an objective,
# how do we read it, compose it from the registry's parts and measure it the same way?
#
# Tutorials 1–9 took the parts apart one at a time. Here they all run at once. We will
#
# 1. write out the **training loop with the exact $J$ after every update**
#    (`tokenmdp.exact.train_exact`), check one update by hand, and see what an evaluation by
#    sampling would have added to the curve;
# 2. train **every registry entry** on-policy, with rollouts **stale by $k = 3$ updates**, and
#    with an **engine $\mu \ne \pi_{\text{old}}$**;
# 3. put the **exact moments at the start** beside the training outcome in one summary table;
# 4. read a **new paper's objective** with a checklist (ProRL, arXiv 2505.24864), compose it,
#    measure its exact bias and variance and its layout invariance; failure mode: the same loss
#    normalized per micro-batch.
#
# The registry grows while this notebook is read: it iterates over `estimators.names()` at run
# time, so a new entry appears in every table below without an edit.

# %% [markdown]
# ## Setup
#
# The course's MDP (`tokenmdp.course.setups.copy_task()`: two prompts, tokens $\{0, 1,
# \text{EOS}\}$, at most 3 response tokens, +1 per token that copies the prompt, −1 for a
# truncated response) and its seeded tabular policy $\pi_0$, which is also the reference policy
# of every KL penalty. The best policy copies the prompt three times and stops:
# $J^* = \sum_x D(x) \max_y R(x, y)$.

# %%
# %matplotlib inline
import copy
import time

import matplotlib.pyplot as plt
import scipy.stats
import torch
from torch.nn.utils import parameters_to_vector, vector_to_parameters

import tokenmdp
from tokenmdp import estimators, testing
from tokenmdp.course.display import alias_box, show, table
from tokenmdp.course.setups import copy_task, step_along
from tokenmdp.course.tutorials.t10 import (
    Budget,
    correction_twin,
    curves_figure,
    monte_carlo_figure,
    monte_carlo_objective,
    part_differences,
    prediction_figure,
    summary_rows,
    zoo_moments,
    zoo_runs,
)
from tokenmdp.estimators import (
    Aggregation,
    Estimator,
    GroupNormalized,
    KLPenalty,
    PPOClip,
    kl_k3,
    loss,
    prepare,
)
from tokenmdp.exact import (
    flat_grad,
    gradient,
    inference_copy,
    moments,
    objective,
    sample,
    sequence_kl,
    sequence_probs,
    train_exact,
)

# Named tolerances for the checks in this notebook.
EXACT_TOL = 1e-12  # two exact float64 computations of the same quantity
Z_TOL = 4.0        # |Monte Carlo estimate - exact| in standard errors

G, GROUPS = 4, 2                   # responses per prompt, groups per update
print("tokenmdp", tokenmdp.__version__, "| torch", torch.__version__)
torch.set_num_threads(1)           # tiny tensors: one thread is fastest

# %%
mdp, pi0 = copy_task()
with torch.no_grad():
    J0 = float(objective(mdp, pi0))
J_MAX = float(sum(mdp.prompt_probs[x] * mdp.rewards[mdp.terminal_prompt_index == x].max()
                  for x in range(mdp.num_prompts)))
names = estimators.names()
print(f"{mdp.num_sequences} responses, J(π_0) = {J0:.4f}, J* = {J_MAX:.4f}; "
      f"{len(names)} registry entries")

# %% [markdown]
# ## 1. The loop, with the exact $J$ after every update
#
# `train_exact(mdp, policy, estimator, ...)` is a trainer in miniature. Update $t$:
#
# 1. $\pi_{\text{old}} = \pi_{\theta_{t-k}}$ (on-policy $k = 0$; `staleness=k` for an
#    asynchronous pipeline whose rollouts lag $k$ updates), and the sampler $\mu =
#    \texttt{engine}(\pi_{\text{old}})$ or $\pi_{\text{old}}$ itself;
# 2. a batch of `groups_per_update` groups of $G$ responses from $\mu$:
#    `sample(mdp, μ, groups·G, generator=generator, group_size=G)`, with `old_logprob`
#    $= \log\pi_{\text{old}}$ (and `ref_logprob` for a KL penalty);
# 3. the estimator's own `prepare` and `loss`, $\hat g_t = -\nabla_\theta\,\text{loss}$, one
#    optimizer step ($\theta \leftarrow \theta + \eta\,\hat g_t$ with `lr=η`);
# 4. the exact $J(\theta_{t+1})$, $\lVert\nabla J\rVert$, $\cos(\hat g_t, \nabla J)$ and
#    $\mathrm{KL}(\pi_\theta \Vert \mu)$: no evaluation noise.
#
# ### Exercise 1 — one update by hand
#
# *Predict* first: after one update of plain gradient ascent with RLOO from two groups of
# four responses, does $J$ move by more or less than after the *expected* update
# $\theta + \eta\nabla J$ (RLOO is unbiased)? Then write update 0 of `train_exact(mdp, pi0,
# estimators.get("rloo"), updates=1, group_size=4, groups_per_update=2, lr=1.0,
# generator=torch.Generator().manual_seed(10))` out by hand, with `sample`, `prepare`, `loss`
# and `flat_grad`, and compute the exact $J$ after it.

# %%
# Solution
rloo = estimators.get("rloo")
batch = sample(mdp, pi0, 2 * 4, generator=torch.Generator().manual_seed(10), group_size=4)
batch = prepare(batch.replace(old_logprob=batch.behavior_logprob), rloo, max_len=mdp.max_len)
pi1 = copy.deepcopy(pi0)
g_hat = -flat_grad(loss(pi1.token_logprobs(batch), batch, rloo)[0], pi1)
theta = parameters_to_vector(pi1.parameters()).detach()
vector_to_parameters(theta + 1.0 * g_hat, pi1.parameters())
with torch.no_grad():
    one_update_J = float(objective(mdp, pi1))

# %%
# Check
tokenmdp.check("tr10_one_update_J", one_update_J)

# %% [markdown]
# Less: the sampled step moves $J$ from 0.068 to 0.076, the expected step to 0.097. A batch of
# eight responses sees a few of the thirty, and its step has a sizeable component orthogonal to
# $\nabla J$. The loop reproduces the hand-written update exactly:

# %%
run1 = train_exact(mdp, pi0, rloo, updates=1, group_size=4, groups_per_update=2, lr=1.0,
                   generator=torch.Generator().manual_seed(10))
true = gradient(mdp, pi0)
assert abs(run1.objective[1] - one_update_J) < EXACT_TOL
assert abs(run1.gradient_norm[0] - g_hat.norm()) < EXACT_TOL
assert abs(run1.cosine[0] - g_hat @ true / (g_hat.norm() * true.norm())) < EXACT_TOL
print(f"J: {run1.objective[0]:.6f} -> {run1.objective[1]:.6f}; ‖ĝ‖ = {run1.gradient_norm[0]:.4f}, "
      f"‖∇J‖ = {run1.true_gradient_norm[0]:.4f}, cos(ĝ, ∇J) = {run1.cosine[0]:+.4f}")

# %% [markdown]
# ### Exact $J$ beside an evaluation by sampling
#
# The budget of every run below: 12 updates of Adam (learning rate 0.15, what LLM trainers use;
# its per-coordinate normalization removes most of the scale differences between aggregations,
# so the comparison is about directions and noise), two groups of four responses per update,
# the same seed. One RLOO run, its exact $J$ after every update, and what an evaluation on 200
# sampled responses per point would have shown:

# %%
budget = Budget(updates=12, group_size=G, groups_per_update=GROUPS, lr=0.15, seed=0)
run = budget.run(mdp, pi0, rloo, reference=pi0)
evaluations = [monte_carlo_objective(mdp, run.policy_at(t), 200, torch.Generator().manual_seed(t))
               for t in range(run.updates + 1)]
z = [(m - float(j)) / s for (m, s), j in zip(evaluations, run.objective)]
print(f"largest |Monte Carlo − exact| = {max(map(abs, z)):.2f} s.e.; typical 2 s.e. = "
      f"{2 * sum(s for _, s in evaluations) / len(evaluations):.3f}")
assert max(map(abs, z)) < Z_TOL
fig = monte_carlo_figure(run.objective, evaluations, "200 responses per point")
plt.show()

# %% [markdown]
# The sampled evaluation agrees within its error bars, and its bars (about ±0.09) are as
# wide as many of the differences between estimators that we are about to compare: curves
# evaluated this way would need thousands of responses per point. The exact curve has no evaluation noise;
# what remains is the noise of the *training* itself, which we measure with a few seeds:

# %%
finals = torch.tensor([Budget(**{**vars(budget), "seed": s}).run(mdp, pi0, rloo, pi0)
                       .final_objective for s in range(4)], dtype=torch.float64)
SEED_SD = float(finals.std())
print(f"RLOO's final J over 4 seeds: {finals.numpy().round(3)}, sd {SEED_SD:.3f}")

# %% [markdown]
# So differences of final $J$ below about $2 \times$ that standard deviation are not
# differences between estimators. With the same seed, two estimators see the same first batch,
# and later batches only as far as their policies agree.
#
# ## 2. The zoo: every entry, three scenarios, one budget
#
# * **on-policy**: $\mu = \pi_{\text{old}} = \pi_\theta$ at the start of every update;
# * **stale by 3**: $\pi_{\text{old}} = \mu = \pi_{\theta_{t-3}}$, the lag of an asynchronous
#   pipeline;
# * **engine σ = 0.8**: $\mu$ sees $\pi_{\text{old}}$'s logits plus a fixed $N(0, 0.8^2)$
#   perturbation (tutorial 7's engine, larger), a systematic training–inference mismatch.
#
# Entries are grouped in **families**: `grpo_tis`, `grpo_mis`, ... belong to `grpo`. A variant
# that differs from its base only in the training–inference correction is its base's *twin*
# wherever $\mu = \pi_{\text{old}}$: every correction is a function of $\pi_{\text{old}}/\mu$
# that equals 1 there, so its run is the base's, bit for bit. The zoo reuses those runs (it
# trains each twin only with the engine), which keeps this notebook within its time budget as
# the registry grows.

# %%
def engine(policy):
    # μ: a fixed N(0, 0.8²) perturbation of π_old's logits (the same noise at every update)
    return inference_copy(policy, noise_std=0.8, generator=torch.Generator().manual_seed(1))


SCENARIOS = {"on-policy": {}, "stale by 3": {"staleness": 3}, "engine σ = 0.8": {"engine": engine}}
started = time.perf_counter()
runs = zoo_runs(mdp, pi0, names, SCENARIOS, budget, reference=pi0)
print(f"{len(names)} entries × {len(SCENARIOS)} scenarios: {len({id(r) for r in runs.values()})} "
      f"distinct runs of {budget.updates} updates in {time.perf_counter() - started:.1f} s")

# %% [markdown]
# The twin rule, checked on one twin: trained on its own, stale, it gives its base's curve
# exactly.

# %%
twins = {name: correction_twin(name, names) for name in names}
twin = next(name for name, base in twins.items() if base is not None)
direct = budget.run(mdp, pi0, estimators.get(twin), pi0, staleness=3)
assert torch.equal(direct.objective, runs[twins[twin], "stale by 3"].objective)
print(f"{twin} trained stale: the same J curve as {twins[twin]}, bit for bit; "
      f"{sum(b is not None for b in twins.values())} twins in the registry")

# %%
classic = [n for n in ("reinforce", "rloo", "ppo", "grpo", "dr_grpo", "dapo", "gspo", "cispo",
                       "minirl") if n in names]
fig = curves_figure(runs, classic, list(SCENARIOS))
plt.show()

# %% [markdown]
# On-policy every classic estimator climbs, and several of them climb *identically*. With one
# update per batch the ratio is 1 whenever the gradient is taken, so the clip is inert, and the
# on-policy gradients of RLOO, token IS, sequence IS, Dr. GRPO and MiniRL on a batch are the
# same vector up to a constant factor (the group mean is $\frac{G-1}{G}$ × leave-one-out,
# Dr. GRPO divides by $L_{\max}$). Adam divides constant factors out, so the same budget gives
# them the same run, up to Adam's $\epsilon$:

# %%
same = [n for n in ("token_is", "sequence_is", "dr_grpo", "minirl") if n in names]
gap = max((runs[n, "on-policy"].objective - runs["rloo", "on-policy"].objective).abs().max()
          for n in same)
print(f"on-policy J curves of {', '.join(same)} against RLOO's: largest difference {gap:.1e}")
assert gap < 1e-6
on_final = {n: runs[n, "on-policy"].final_objective for n in classic}
print("final J on-policy: " + ", ".join(f"{n} {j:.3f}" for n, j in on_final.items()))

# %% [markdown]
# Stale rollouts separate them: GSPO, whose sequence-ratio band of $3\cdot10^{-4}$ the policy
# leaves after one update, falls far behind. Under the engine the final $J$ moves by a few
# hundredths either way, with corrected and uncorrected variants on both sides: at this
# mismatch ($\mathrm{KL}(\pi_{\text{old}} \Vert \mu) \approx 0.13$ per response) the bias of
# ignoring $\pi_{\text{old}}/\mu$ is small against the noise of two groups per update
# (tutorial 7 measured it exactly).
#
# ## 3. The exact moments at the start, beside the outcome
#
# For each scenario we take one pair of policies and compute the exact $\mathbb{E}[\hat g]$ of
# every entry, for a batch of one group of $G = 4$: on-policy at $\pi_0$; stale with
# $\pi_{\text{old}} = \pi_0$ and $\pi_\theta$ the RLOO run's policy after 3 updates (a real lag of
# three updates); with the engine at $\pi_\theta = \pi_{\text{old}} = \pi_0$ and $\mu =
# \text{engine}(\pi_0)$.

# %%
pi3 = run.policy_at(3)
PAIRS = {"on-policy": {"policy": pi0}, "stale by 3": {"policy": pi3, "behavior": pi0},
         "engine σ = 0.8": {"policy": pi0, "old": pi0, "behavior": engine(pi0)}}
with torch.no_grad():
    print(f"KL(π_3 ‖ π_0) = {float(sequence_kl(mdp, pi3, pi0)):.4f}, KL(π_0 ‖ μ) = "
          f"{float(sequence_kl(mdp, pi0, engine(pi0))):.4f} per response")
exact = zoo_moments(mdp, names, PAIRS, G, reference=pi0)
rows = summary_rows(names, runs, exact, list(SCENARIOS))
order = sorted(range(len(rows)), key=lambda i: (names.index(rows[i][0]), i))
show(table([rows[i] for i in order],
           ["family", "estimator", "cos on-policy", "cos stale", "cos engine", "tr Var on-policy",
            "final J on-policy", "ΔJ stale", "ΔJ engine"], fmt="+.3f",
           title=f"Identical budgets; seed sd of the final J ≈ {SEED_SD:.3f}"))

# %% [markdown]
# How to read it: the three cosines are exact properties of the estimator at the start; the
# trace variance is that of one group's $\hat g$ (a batch of $B$ groups divides it by $B$);
# final $J$ is after 12 updates, and the two $\Delta J$ columns are the final $J$ of the stale
# and engine runs minus the on-policy one. On-policy every cosine is positive and every entry
# improves. The entries whose expected gradient points *away* from $\nabla J$ under staleness
# (a negative stale cosine: clips of sequence or prefix ratios whose band the policy has left)
# are those that lose the most when the rollouts lag:

# %%
stale_cos, stale_drop = [r[3] for r in rows], [r[7] for r in rows]
away = [d for c, d in zip(stale_cos, stale_drop) if c < 0]
along = sorted(d for c, d in zip(stale_cos, stale_drop) if c >= 0)
print(f"{len(away)} entries with cos < 0 when stale: ΔJ stale {min(away):+.3f} … {max(away):+.3f}; "
      f"the others: median {along[len(along) // 2]:+.3f}")
assert all(r[6] > J0 for r in rows)                     # on-policy, every entry improves
assert not away or max(away) < along[len(along) // 2]   # pointing away costs
rho = scipy.stats.spearmanr(stale_cos, stale_drop).statistic
print(f"Spearman rank correlation of the stale cosine with ΔJ stale: {rho:+.2f}")

# %%
fig = prediction_figure(rows, list(SCENARIOS))
plt.show()

# %% [markdown]
# One number computed before any training, the exact cosine, orders the stale outcomes. The
# on-policy and engine cosines of the classic estimators are all above 0.85, so in those
# scenarios the final $J$ is decided by the scale of the loss and the noise of the updates
# rather than by the direction: to separate estimators there, a study needs more seeds, or
# larger batches.

# %%
low = min(exact[n, s].cosine for n in classic for s in ("on-policy", "engine σ = 0.8"))
print(f"smallest on-policy or engine cosine of the classic nine: {low:.3f}")
assert low > 0.85

# %% [markdown]
# ## 4. How to read a new paper's objective
#
# A paper states its loss in its own notation. Six questions turn it into a composition of
# parts, each of which earlier tutorials measured:
#
# 1. **Sampling distribution.** Who draws the responses, and are groups filtered? A sampler
#    $\mu \ne \pi_{\text{old}}$ is tutorial 7's bias; filtering changes the expectation.
#    Part: `behavior=` and `filter_groups=` of `moments`.
# 2. **Ratio.** $\pi_\theta/\pi_{\text{old}}$ per token, per sequence, as a geometric mean?
#    Tutorials 3 and 6: it decides what the surrogate's gradient is. Part: the surrogate.
# 3. **Mask or clip.** Which tokens lose their gradient, and where is the band? Tutorial 6: the
#    stale bias. Part: the surrogate's $\varepsilon$.
# 4. **Advantage.** Which baseline, a std, leave-one-out? Tutorial 2: the scale and the
#    re-weighting of prompts. Part: `advantage`.
# 5. **Reducer.** Token mean, sequence mean, a constant? Tutorial 4: which objective it
#    ascends. Part: `aggregation`.
# 6. **KL placement.** Which estimator, in the reward or in the loss, against which policy?
#    Tutorial 8: which divergence its gradient descends. Part: `kl`.
#
# Applied to **ProRL** (Liu et al. 2025, arXiv 2505.24864, §3), which no earlier notebook
# covered: (1) rollouts of the current policy (sampled at temperature 1.2: an engine that scores
# them at another temperature has $\mu \ne \pi_{\text{old}}$) with DAPO's **dynamic sampling**
# (groups whose rewards are all equal are dropped); (2) the token ratio; (3) PPO's clip with
# the **decoupled band** $\varepsilon_{\text{low}} = 0.2$, $\varepsilon_{\text{high}} = 0.4$;
# (4) GRPO's group-normalized advantage; (5) DAPO's **token mean** over the step; (6) a
# **KL penalty in the loss**, $L_{\text{GRPO}} - \beta D_{\mathrm{KL}}(\pi_\theta \Vert
# \pi_{\text{ref}})$, here GRPO's k3 with GRPO's $\beta = 0.04$ (not ProRL's own coefficient,
# which would be the input of a faithful reproduction), with $\pi_{\text{ref}}$ reset to the
# current policy from time to time. Composed, and compared part by part with its two nearest
# registry entries:

# %%
BETA = 0.04
prorl = Estimator(name="prorl", surrogate=PPOClip(eps_low=0.2, eps_high=0.4),
                  advantage=GroupNormalized(ddof=1, eps=1e-6), aggregation=Aggregation.TOKEN_MEAN,
                  kl=KLPenalty(coef=BETA, in_reward=False, estimator=kl_k3))
for entry in ("dapo", "grpo"):
    show(table(part_differences(prorl, estimators.get(entry)), ["part", "prorl", entry],
               title=f"prorl against {entry}: only these parts differ"))

# %% [markdown]
# ### Exercise 2 — what dynamic sampling keeps
#
# *Predict*: at $\pi_0$ with $G = 4$, what share of groups does dynamic sampling keep — a
# quarter, a half, three quarters? Compute it **without `moments`**: a group is dropped when its
# four rewards are equal, so $P(\text{keep}) = 1 - \sum_x D(x) \sum_r P(R = r \mid x)^G$, with
# $P(R = r \mid x)$ summed from the exact response probabilities.

# %%
# Solution
with torch.no_grad():
    p_y = sequence_probs(mdp, pi0)                          # π_0(y | x) of every response
drop = 0.0
for x in range(mdp.num_prompts):
    mine = mdp.terminal_prompt_index == x
    for r in mdp.rewards[mine].unique():
        p_r = float(p_y[mine & (mdp.rewards == r)].sum())   # P(R = r | x)
        drop += float(mdp.prompt_probs[x]) * p_r ** G
keep_answer = 1.0 - drop

# %%
# Check
tokenmdp.check("tr10_keep_probability", keep_answer)

# %% [markdown]
# About 78%: one group in five is all-equal and would carry no reward signal, only the KL
# term. With one group per batch, dropping them rescales the expected gradient by
# $1/P(\text{keep})$; with several groups per batch it also changes the token mean's
# normalizer.
#
# ### Exercise 3 — the decoupled band on stale data
#
# *Predict*: one step of length 1 along $\nabla J$ from $\pi_{\text{old}} = \pi_{\text{ref}} =
# \pi_0$ (a stale policy; data from $\pi_0$), does ProRL's wider band ($\varepsilon_{\text{high}}
# = 0.4$) keep its expected gradient closer to $\nabla J$ than DAPO's 0.28? Compute the exact
# $\cos(\mathbb{E}[\hat g], \nabla J)$ of `prorl` with dynamic sampling.

# %%
# Solution
pi_stale = step_along(pi0, gradient(mdp, pi0), 1.0)
prorl_stale_cosine = moments(mdp, pi_stale, prorl, group_size=G, behavior=pi0, reference=pi0,
                             filter_groups=True).cosine

# %%
# Check
tokenmdp.check("tr10_prorl_stale_cosine", prorl_stale_cosine)

# %% [markdown]
# Yes: about 0.49, against about 0.36 with DAPO's band and no KL (tests/course/exercises/answers_10.py
# computes both by stacking every multiset of a group in one batch). Tokens with $\hat A > 0$
# may rise to $1.4\,\pi_{\text{old}}$ before their gradient is masked. The full exact picture,
# with a Monte Carlo estimate beside one of the exact values:

# %%
CASES = {"on-policy": dict(policy=pi0), "stale step 1": dict(policy=pi_stale, behavior=pi0),
         "engine σ = 0.8": dict(policy=pi0, old=pi0, behavior=engine(pi0))}
measured = {(case, f): moments(mdp, kw["policy"], prorl, group_size=G, behavior=kw.get("behavior"),
                               old=kw.get("old"), reference=pi0, filter_groups=f)
            for case, kw in CASES.items() for f in (False, True)}
show(table([(case, "yes" if f else "no", m.cosine, m.relative_bias, m.total_variance,
             m.keep_probability) for (case, f), m in measured.items()],
           ["scenario", "dynamic sampling", "cos(E ĝ, ∇J)", "‖bias‖/‖∇J‖", "tr Var",
            "P(keep)"], fmt=".4f", title="prorl, exact (G = 4, one group per batch)"))
mc = moments(mdp, pi_stale, prorl, group_size=G, behavior=pi0, reference=pi0, filter_groups=True,
             method="monte_carlo", num_samples=4000, generator=torch.Generator().manual_seed(2))
print(f"Monte Carlo cosine {mc.cosine:+.4f} ± {mc.cosine_se:.4f} against exact "
      f"{prorl_stale_cosine:+.4f} ({(mc.cosine - prorl_stale_cosine) / mc.cosine_se:+.2f} s.e.)")
assert abs(mc.cosine - prorl_stale_cosine) < Z_TOL * mc.cosine_se

# %% [markdown]
# On-policy the clip is inert ($r \equiv 1$) and the KL penalty's gradient vanishes at
# $\pi_\theta = \pi_{\text{ref}}$; what remains is the std normalization and the token mean
# (tutorials 2 and 4), mostly a change of scale (cosine 0.97). The stale step adds the mask's
# bias; the engine adds the uncorrected $\pi_{\text{old}}/\mu$ (ProRL has no correction: the
# checklist's first line says when it would need one). On-policy, a dropped group has
# $\hat A = 0$ and a zero KL gradient, so dynamic sampling divides $\mathbb{E}[\hat g]$ by
# $P(\text{keep})$ exactly, and leaves its direction:

# %%
kept, every = measured["on-policy", True], measured["on-policy", False]
ratio = float(kept.mean.norm() / every.mean.norm())
print(f"‖E ĝ | kept‖ / ‖E ĝ‖ = {ratio:.12f}, 1 / P(keep) = {1 / kept.keep_probability:.12f}")
assert abs(ratio - 1 / kept.keep_probability) < EXACT_TOL
assert abs(kept.cosine - every.cosine) < EXACT_TOL

# %% [markdown]
# ### Layout invariance, and the failure mode
#
# The last question about any loss: does it give the same value and gradient however the step
# is laid out (padded, flat, packed) and however it is cut into micro-batches
# (`tokenmdp.testing`)? ProRL's token mean is a step-wide normalizer, so it passes only if the
# count is decided once per step, as `prepare`'s `loss_weight` does. The same loss with each
# micro-batch normalized by its own token count — the way frameworks once accumulated it —
# is the failure mode:

# %%
step_batch = sample(mdp, pi0, 4 * G, generator=torch.Generator().manual_seed(3), group_size=G)
with torch.no_grad():
    step_batch = step_batch.replace(old_logprob=step_batch.behavior_logprob,
                                    ref_logprob=pi0.token_logprobs(step_batch))
LAYOUTS = [testing.Layout("padded"), testing.Layout("flat"),
           testing.Layout("first_fit_decreasing", 2, permutation_seed=1)]
SPLITS = [testing.MicroBatchSplit(2, True, None, 0), testing.MicroBatchSplit(3, False, None, 1)]
kw = dict(prepare=testing.estimator_prepare(prorl, max_len=mdp.max_len), mdp=mdp)
reports = {"layouts, prorl": testing.check_layout_invariance(
               testing.estimator_loss(prorl), step_batch, LAYOUTS, **kw),
           "micro-batches, prorl": testing.check_micro_batch_invariance(
               testing.estimator_loss(prorl), step_batch, SPLITS, **kw),
           "micro-batches, per-micro-batch token mean": testing.check_micro_batch_invariance(
               testing.per_micro_batch_token_mean(prorl), step_batch, SPLITS, **kw,
               average_micro_batches=True)}

# %%
show(table([(check, "pass" if r.ok else "FAIL", r.loss_difference, r.gradient_difference,
             r.gradient_tolerance) for check, r in reports.items()],
           ["check", "verdict", "max |Δ loss|", "max |Δ grad|", "grad tolerance"], fmt=".2e"))
assert reports["layouts, prorl"].ok and reports["micro-batches, prorl"].ok
assert not reports["micro-batches, per-micro-batch token mean"].ok

# %% [markdown]
# The composition passes both checks to rounding error. The per-micro-batch version gives each
# micro-batch's tokens the weight $1/N_{\text{micro}}$ instead of $1/N_{\text{step}}$: tokens of
# short micro-batches count more, so its gradient differs from the step's by far more than the
# tolerance, although on one micro-batch the two are the same loss. A unit test that splits one
# step in two finds it at once.
#
# Finally, the composition trained with the zoo's budget in the zoo's three scenarios, beside
# the two entries it borrows from:

# %%
own = {**{(name, s): runs[name, s] for name in ("dapo", "grpo") for s in SCENARIOS},
       **{("prorl", s): budget.run(mdp, pi0, prorl, pi0, **kw) for s, kw in SCENARIOS.items()}}
show(table([(name, *[own[name, s].final_objective for s in SCENARIOS])
            for name in ("prorl", "dapo", "grpo")],
           ["estimator", *[f"final J, {s}" for s in SCENARIOS]], fmt=".3f",
           title=f"the same budget (seed sd ≈ {SEED_SD:.3f})"))
assert own["prorl", "stale by 3"].final_objective > own["grpo", "stale by 3"].final_objective

# %% [markdown]
# The wider band and the token mean keep more of ProRL's progress under staleness than GRPO's,
# as exercise 3's cosine said they would; on-policy and under the engine the three are within
# the noise of one another.

# %% [markdown]
# ## What verl / TRL / others call this
#
# ProRL's parts come from these registry entries (generated from the registry's aliases, the
# same text as the estimator cards):

# %%
show(alias_box(["dapo", "grpo"]))

# %% [markdown]
# ## Summary
#
# * `tokenmdp.exact.train_exact` trains any composition by sampled updates — on-policy, with
#   rollouts stale by $k$ updates, or drawn by an engine $\mu$ — through the estimator's own
#   `prepare` and `loss`, and records the exact $J$ after every update: the curves carry the
#   noise of training, not of evaluation.
# * With identical budgets, on-policy, the registry's estimators end within a few seed standard
#   deviations of each other: Adam removes their scale differences, and their directions agree.
# * Staleness separates them, and the exact cosine of $\mathbb{E}[\hat g]$ with $\nabla J$ at
#   the start predicts how: estimators whose clip band the policy leaves after one update point
#   away from $\nabla J$ and lose the most (rank correlation about 0.8 here).
# * Correction-only variants are their bases' twins wherever $\mu = \pi_{\text{old}}$; they
#   matter only with an engine.
# * Reading a new objective: sampling distribution, ratio, mask or clip, advantage, reducer,
#   KL placement — then compose it, take its exact bias and variance with `moments`, check its
#   layout and micro-batch invariance with `tokenmdp.testing`, and train it with
#   `train_exact`.
