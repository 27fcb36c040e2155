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
# # Tutorial 7 — The training–inference mismatch
#
# **The question.** The responses of a batch are sampled by an inference engine $\mu$ (vLLM,
# SGLang) that runs the *same weights* as the trainer's $\pi_{\text{old}}$ through other numerics:
# low-precision logits, other kernels. How large is the bias of pretending that $\pi_{\text{old}}$
# drew them, what do the corrections (IS, truncated IS, masked IS, at the token, sequence and
# geometric levels) buy against it, and which logged number tells a practitioner that the
# mismatch has become a problem?
#
# Tutorial 3 introduced the three policies and compared the corrections at one mismatch. Here we
# dial the mismatch and watch the bias grow. We will
#
# 1. build $\mu$ as a **quantized or noisy copy** of $\pi_{\text{old}}$ and measure the gap with
#    the KL and the exact $\chi^2$;
# 2. check the decomposition $\rho_t = (\pi_{\text{old}}/\mu)_t\,(\pi_\theta/\pi_{\text{old}})_t$
#    exactly;
# 3. compute the **exact bias of ignoring the first factor** as the mismatch grows, and bound it
#    by $\sqrt{\chi^2}$;
# 4. compare **MiniRL** with its "without the train–inference IS" and "+ length normalization"
#    ablations, as exact tables of cosine to $\nabla J$ and variance;
# 5. trace **truncated and masked IS** at the token, sequence and geometric levels against the
#    cap (IcePop is a two-sided token mask);
# 6. read the diagnostics practitioners ask for, the **effective sample size and $\chi^2$** of the
#    correction weights, as the estimator and the trainer log them, and see them predict the bias;
# 7. invert the weight on purpose and measure what it costs.
#
# Everything is exact (float64, full enumeration) except where a Monte Carlo estimate stands
# beside the exact value with its standard error.

# %% [markdown]
# ## Setup
#
# The MDP and $\pi_{\text{old}}$ are the course's (`tokenmdp.course.setups.copy_task()`: two prompts,
# tokens $\{0, 1, \text{EOS}\}$, at most 3 response tokens, +1 per token that copies the prompt,
# −1 for a truncated response). The trainer is at its first mini-batch, so $\pi_\theta =
# \pi_{\text{old}}$ (section 4 adds a stale step). Groups have $G = 2$ responses. The notebook's
# estimator for the correction studies is RLOO with the token ratio: leave-one-out advantage
# $\hat A_1 = R_1 - R_2$, loss weight $1/S$ per token, and the correction under study; on
# $\pi_{\text{old}}$'s own samples it is exactly unbiased.

# %%
# %matplotlib inline
import dataclasses
import math

import matplotlib.pyplot as plt
import torch

import tokenmdp
from tokenmdp.course.display import alias_box, finish, show, table
from tokenmdp.course.setups import copy_task, step_along
from tokenmdp.estimators import (
    Aggregation,
    Correction,
    CorrectionFactor,
    Estimator,
    ImportanceSampling,
    LeaveOneOut,
    Level,
    MaskedIS,
    NoCorrection,
    SequenceRatio,
    TokenRatio,
    TruncatedIS,
    get,
    importance_weight,
    loss,
    prepare,
)
from tokenmdp.exact import (
    gradient,
    inference_copy,
    moments,
    sample,
    sequence_kl,
    sequence_logprobs,
    state_logprobs,
    state_visitation,
)
from tokenmdp.exact.world.chi_square import chi_square

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
grad_J = gradient(mdp, pi_old)


def engine(noise_std=0.0, rounding=None, seed=1):
    # μ: π_old's logits + a fixed N(0, noise_std²) perturbation, rounded to `rounding`
    return inference_copy(pi_old, noise_std=noise_std, rounding=rounding,
                          generator=torch.Generator().manual_seed(seed))


def rloo(correction, surrogate_part=None):
    return Estimator(surrogate=surrogate_part or TokenRatio(), advantage=LeaveOneOut(),
                     correction=correction, aggregation=Aggregation.SEQUENCE_MEAN_TOKEN_SUM)


def expected(estimator, mu, policy=pi_old):
    # exact moments of `estimator` at π_θ = policy, data drawn from μ, ratios against π_old
    return moments(mdp, policy, estimator, group_size=G, behavior=mu, old=pi_old, method=METHOD)


print(f"{mdp.num_sequences} responses, {mdp.num_states} states, ||∇J(π_old)|| = "
      f"{float(grad_J.norm()):.4f}")

# %% [markdown]
# ## 1. The inference engine as a quantized or noisy copy
#
# `inference_copy` builds $\mu$ from $\pi_{\text{old}}$'s weights: its logits are rounded to a
# lower-precision grid (bf16, fp8-e4m3, or $b$ mantissa bits) and/or perturbed by a fixed Gaussian
# noise per state and token (a stand-in for kernel and batch-order differences). Two numbers
# measure the gap. The KL, $\mathrm{KL}(\mu\,\|\,\pi_{\text{old}})$ per response, is what trainers
# log as `train_infer_kl`. The **$\chi^2$ divergence** of the weights $w = \pi_{\text{old}}/\mu$,
#
# $$
# \chi^2(\pi_{\text{old}}\,\|\,\mu) = \mathbb{E}_\mu[w^2] - 1 = \operatorname{Var}_\mu[w],
# $$
#
# is what importance sampling pays (tutorial 3, section 1). `tokenmdp.exact.world.chi_square.chi_square`
# gives it per response, $\sum_x D(x)\sum_y \pi_{\text{old}}(y|x)^2/\mu(y|x) - 1$, and per token,
# the per-state $\chi^2_s$ averaged over the states $\mu$ visits. Jensen's inequality bounds it
# below by the KL the other way round: $\log(1 + \chi^2(p\|q)) \ge \mathrm{KL}(p\|q)$.

# %%
ENGINES = {"bf16 logits": dict(rounding="bf16"), "fp8-e4m3 logits": dict(rounding="fp8_e4m3"),
           "3 mantissa bits": dict(rounding=3), "2 mantissa bits": dict(rounding=2),
           "noise σ = 0.1": dict(noise_std=0.1), "noise σ = 0.4": dict(noise_std=0.4),
           "noise σ = 0.8": dict(noise_std=0.8)}
rows = []
for name, kw in ENGINES.items():
    mu = engine(**kw)
    with torch.no_grad():
        kl_mu_old, kl_old_mu = float(sequence_kl(mdp, mu, pi_old)), float(sequence_kl(mdp, pi_old, mu))
    chi2_tok, chi2_seq = float(chi_square(mdp, pi_old, mu, level="token")), float(chi_square(mdp, pi_old, mu))
    assert math.log1p(chi2_seq) >= kl_old_mu - EXACT_TOL          # Jensen
    rows.append((name, kl_mu_old, chi2_tok, chi2_seq))
show(table(rows, ["engine μ", "KL(μ ‖ π_old)", "χ² per token", "χ² per response"], fmt=".3e"))
mu = engine(noise_std=0.4)          # the engine of the exercises and of sections 2, 4, 6 and 7

# %% [markdown]
# bf16 rounding of the logits is invisible here ($\chi^2 \sim 10^{-6}$ per token); what makes it
# matter in a real model is length. If the per-token factors were independent, a response of $T$
# tokens would have $1 + \chi^2_{\text{seq}} = (1 + \chi^2_{\text{tok}})^T$, and
# $(1 + 10^{-6})^{4000}$ is still 1.004, but $(1 + 10^{-3})^{4000} \approx 55$. From now on the
# noisy copies, whose mismatch we can dial, stand in for engines that disagree badly.
#
# ### Exercise 1 — the per-token $\chi^2$ by hand
#
# *Predict* before you run: for the engine with noise $\sigma = 0.4$, is the per-token $\chi^2$
# larger or smaller than the per-response one? Record it as `chi2_prediction` (`"larger"` or
# `"smaller"`), and think about the factor: a response has between one and three tokens. Then
# compute the per-token value **without** `chi_square`: $\chi^2_s = \sum_a
# \pi_{\text{old}}(a|s)^2/\mu(a|s) - 1$ at every state, averaged with the weights
# $d^\mu(s)/\sum_s d^\mu(s)$ (`state_visitation` of $\mu$).

# %%
# Solution
chi2_prediction = "smaller"         # recorded before computing: "larger" or "smaller"
with torch.no_grad():
    per_state = torch.cat([(2 * lp - lq).exp().sum(-1).reshape(-1) - 1
                           for lp, lq in zip(state_logprobs(mdp, pi_old), state_logprobs(mdp, mu))])
    d_mu = state_visitation(mdp, mu)
token_chi2_answer = float((d_mu * per_state).sum() / d_mu.sum())

# %%
# Check
tokenmdp.check("tr07_token_chi2", token_chi2_answer)
tokenmdp.check("tr07_predict_token_chi2", chi2_prediction)

# %% [markdown]
# Smaller, by about the expected length: a response's weight is the product of its tokens'
# weights, so $1 + \chi^2_{\text{seq}} \approx (1 + \chi^2_{\text{tok}})^{\mathbb{E}|y|}$. With
# $\mathbb{E}_\mu|y| = \sum_s d^\mu(s)$:

# %%
with torch.no_grad():
    mean_length = float(state_visitation(mdp, mu).sum())                 # E_μ|y|
chi2_tok, chi2_seq = float(chi_square(mdp, pi_old, mu, level="token")), float(chi_square(mdp, pi_old, mu))
power = (1 + chi2_tok) ** mean_length - 1
print(f"E_μ|y| = {mean_length:.2f}; χ² per token {chi2_tok:.3f}: (1 + χ²)^E|y| − 1 = {power:.3f}, "
      f"exact χ² per response {chi2_seq:.3f}")
assert chi2_tok < chi2_seq and abs(power - chi2_seq) < 0.1 * chi2_seq

# %% [markdown]
# The power is close but not exact: the factors of one response are not independent, and its
# length varies.
#
# ## 2. The decomposition $\rho = (\pi_{\text{old}}/\mu)(\pi_\theta/\pi_{\text{old}})$
#
# The weight that corrects a token drawn by $\mu$ for $\pi_\theta$ factors exactly (Zheng et al.
# 2025, arXiv 2512.01374, Eq. 5):
#
# $$
# \rho_t = \frac{\pi_\theta(y_t|s_t)}{\mu(y_t|s_t)}
# = \underbrace{\frac{\pi_{\text{old}}(y_t|s_t)}{\mu(y_t|s_t)}}_{w_t:\ \text{train–inference}}
# \cdot \underbrace{\frac{\pi_\theta(y_t|s_t)}{\pi_{\text{old}}(y_t|s_t)}}_{r_t:\ \text{staleness}} .
# $$
#
# In `tokenmdp` the surrogate owns $r$ and the correction owns the detached $w$. So the token-ratio
# surrogate with a token IS correction must have exactly the moments of the token ratio taken
# against $\mu$ directly (tell `moments` that $\pi_{\text{old}} = \mu$), and the same holds per
# sequence. With a stale $\pi_\theta$ (one step of 0.5 along $\nabla J$) and $\sigma = 0.4$:

# %%
pi_theta = step_along(pi_old, grad_J, 0.5)
split = {"token": (rloo(ImportanceSampling(level=Level.TOKEN)), rloo(NoCorrection())),
         "sequence": (rloo(ImportanceSampling(level=Level.SEQUENCE), SequenceRatio()),
                      rloo(NoCorrection(), SequenceRatio()))}
rows = []
for level, (w_times_r, rho) in split.items():
    a = expected(w_times_r, mu, policy=pi_theta)
    b = moments(mdp, pi_theta, rho, group_size=G, behavior=mu, method=METHOD)   # r = π_θ/μ
    rows.append((level, float((a.mean - b.mean).abs().max()), a.total_variance - b.total_variance,
                 a.relative_bias))
    assert (a.mean - b.mean).abs().max() < EXACT_TOL
    assert abs(a.total_variance - b.total_variance) < EXACT_TOL
show(table(rows, ["level", "max |Δ E ĝ|", "Δ variance", "relative bias to ∇J(π_θ)"], fmt=".2e"))

# %% [markdown]
# The same numbers to rounding error, and sequence-level $\rho$ is unbiased for $\nabla J(\pi_\theta)$
# whatever $\mu$ is: the split is bookkeeping. It matters because the two factors have different
# sizes and sources: $r$ is the trainer's own doing and PPO-style clips control it; $w$ is the
# engine's, and only the correction sees it.
#
# ## 3. The exact bias of ignoring the first factor
#
# Drop $w$ ("w/o train–inference IS") and the estimator treats $\mu$'s samples as $\pi_{\text{old}}$'s.
# Its expected gradient moves from $\mathbb{E}_{\pi_{\text{old}}}[\hat g]$ to
# $\mathbb{E}_\mu[\hat g]$. A group of $G$ responses to one prompt has the joint weight
# $\prod_i W_i$, with $1 + \chi^2_G = \sum_x D(x) \big(\sum_y \pi_{\text{old}}(y|x)^2/\mu(y|x)\big)^G$
# (`chi_square(..., group_size=G)`), and Cauchy–Schwarz bounds the shift:
#
# $$
# \big\|\mathbb{E}_\mu[\hat g] - \mathbb{E}_{\pi_{\text{old}}}[\hat g]\big\|
# = \Big\|\mathbb{E}_\mu\big[(1 - \textstyle\prod_i W_i)\,\hat g\big]\Big\|
# \le \sqrt{\chi^2_G}\;\sqrt{\mathbb{E}_\mu\|\hat g\|^2} .
# $$
#
# We sweep the noise and compute the shift of the uncorrected estimator exactly, with the bound.

# %%
SIGMAS = [0.05, 0.1, 0.2, 0.4, 0.8, 1.2]
on_policy = expected(rloo(NoCorrection()), pi_old)
assert on_policy.bias.norm() < EXACT_TOL                    # unbiased on π_old's own samples
sweep = []
for sigma in SIGMAS:
    mu_s = engine(noise_std=sigma)
    m = expected(rloo(NoCorrection()), mu_s)
    shift = float((m.mean - grad_J).norm())
    bound = math.sqrt(float(chi_square(mdp, pi_old, mu_s, group_size=G))) * \
        math.sqrt(m.total_variance + float(m.mean @ m.mean))
    assert shift <= bound
    sweep.append(dict(sigma=sigma, mu=mu_s, chi2_tok=float(chi_square(mdp, pi_old, mu_s, level="token")),
                      chi2_seq=float(chi_square(mdp, pi_old, mu_s)), bias=shift / float(grad_J.norm()),
                      bound=bound / float(grad_J.norm()), cosine=m.cosine))
show(table([(r["sigma"], r["chi2_tok"], r["chi2_seq"], r["bias"], r["bound"], r["cosine"]) for r in sweep],
           ["σ", "χ² token", "χ² response", "‖bias‖/‖∇J‖", "√χ²_G bound / ‖∇J‖", "cos(E ĝ, ∇J)"],
           fmt=".4f"))

# %%
fig, ax = plt.subplots(figsize=(7, 4.2))
root = [math.sqrt(r["chi2_seq"]) for r in sweep]
ax.loglog(root, [r["bias"] for r in sweep], "o-", color="C3", label="‖bias‖ / ‖∇J‖ (exact)")
ax.loglog(root, [r["bound"] for r in sweep], ":", color="C3", label="Cauchy–Schwarz bound")
slope = sweep[0]["bias"] / root[0]
ax.loglog(root, [slope * x for x in root], "k--", lw=0.8, label=f"{slope:.2f} √χ² (slope 1)")
finish(ax, title="Ignoring π_old/μ: the bias grows like √χ²", xlabel="√χ²(π_old ‖ μ) per response",
       ylabel="relative bias of the uncorrected estimator")
plt.show()

# %% [markdown]
# The bias is first order in the perturbation, like $\sqrt{\chi^2}$, and for small mismatches the
# ratio bias$/\sqrt{\chi^2}$ is a constant (about 0.8 here): **$\sqrt{\chi^2}$ predicts the bias**.
# The bound holds exactly at every $\sigma$ and is loose by a factor of 7 to 9, as a worst-case
# bound over all directions and all functions of the group must be.
#
# ## 4. MiniRL and its two ablations
#
# MiniRL (Zheng et al. 2025, arXiv 2512.01374, Eq. 9) is the PPO mask on $r$, a truncated token
# weight $\min(w_t, 5)$, group-mean advantage and the sequence-mean of token sums. The paper's two
# ablations are in the registry: `minirl_no_is` (no train–inference IS, which collapses in the
# paper's long runs) and `minirl_len_norm` (each sequence's tokens averaged, $1/|y_i|$). One
# optimizer step's exact expected gradient, against two engines, on-policy ($\pi_\theta =
# \pi_{\text{old}}$) and after a stale step of 0.5:

# %%
MINIRL = ["minirl", "minirl_no_is", "minirl_len_norm"]
SETTINGS = {"2 mantissa bits": (engine(rounding=2), pi_old),
            "noise σ = 0.4": (engine(noise_std=0.4), pi_old),
            "noise σ = 0.4, stale step 0.5": (engine(noise_std=0.4), pi_theta)}
rows = []
for setting, (mu_k, policy) in SETTINGS.items():
    for name in MINIRL:
        m = expected(get(name), mu_k, policy=policy)
        rows.append((setting, name, m.cosine, m.directional_bias, m.total_variance))
show(table(rows, ["setting", "estimator", "cos(E ĝ, ∇J)", "directional bias", "variance"],
           fmt=".4f"))

# %% [markdown]
# In one step, every cosine is high: token TIS at $C = 5$ removes only part of the
# uncorrected estimator's direction error, because a token-level weight fixes the action
# probabilities at each visited state but not *which* states $\mu$ visits (tutorial 3, section 2).
# Length normalization costs more direction than the mismatch does — it ascends another objective
# (tutorial 4) — and buys a much smaller variance, partly only because it rescales the gradient.
# The paper's collapse without IS is a long-run effect: a small bias in the same direction at
# every step, and a mismatch that grows as the policy sharpens.
#
# ### Exercise 2 — how much of the bias does MiniRL's token TIS remove?
#
# *Predict* first: with the engine $\sigma = 0.4$ at $\pi_\theta = \pi_{\text{old}}$, is
# MiniRL's relative shift $\|\mathbb{E}_\mu\hat g - \mathbb{E}_{\pi_{\text{old}}}\hat g\| /
# \|\mathbb{E}_{\pi_{\text{old}}}\hat g\|$ closer to zero (the correction removes the bias), to
# half of `minirl_no_is`'s, or to all of `minirl_no_is`'s (it removes almost none)? Record it as
# `minirl_bias_prediction` (`"zero"`, `"half"` or `"all"`). Then compute the shift exactly with
# `moments` (the registry's `minirl`, $G = 2$, once with data from $\mu$ and once from
# $\pi_{\text{old}}$).

# %%
# Solution
minirl_bias_prediction = "all"      # recorded before computing: "zero", "half" or "all"
minirl = get("minirl")
off = moments(mdp, pi_old, minirl, group_size=G, behavior=mu, old=pi_old, method=METHOD).mean
on = moments(mdp, pi_old, minirl, group_size=G, behavior=pi_old, method=METHOD).mean
minirl_bias_answer = float((off - on).norm() / on.norm())

# %%
# Check
tokenmdp.check("tr07_minirl_bias", minirl_bias_answer)
tokenmdp.check("tr07_predict_minirl_bias", minirl_bias_prediction)

# %%
no_is = get("minirl_no_is")
no_is_off = moments(mdp, pi_old, no_is, group_size=G, behavior=mu, old=pi_old, method=METHOD).mean
no_is_on = moments(mdp, pi_old, no_is, group_size=G, behavior=pi_old, method=METHOD).mean
no_is_shift = float((no_is_off - no_is_on).norm() / no_is_on.norm())
print(f"relative shift: minirl {minirl_bias_answer:.4f}, minirl_no_is {no_is_shift:.4f}: minirl keeps "
      f"{minirl_bias_answer / no_is_shift:.2f} of it")

# %% [markdown]
# Most of it stays: the token weight removes about a sixth of the shift (it keeps 0.84). Only a
# sequence-level weight removes it all, at the price of the variance of section 5.
#
# ## 5. Truncated and masked IS at three levels, against the cap
#
# Every correction acts on $w$ at a level — per token $w_t$, per sequence $W = \prod_t w_t$, or the
# geometric mean $W^{1/|y|}$ (GSPO's level) — and either truncates it, $\min(w, C)$ (TIS; Yao et
# al. 2025), or masks it, $w\,\mathbf 1\{\text{band}\}$. **IcePop** (arXiv 2510.18855) is a
# *two-sided token* mask, band $[0.5, 5]$; tutorial 3's masked-IS sweep was a *one-sided sequence*
# mask $W \le C$. We trace all of them on the strongest engine ($\sigma = 0.8$), two-sided masks
# with band $[1/C, C]$, rejected tokens kept in the normalizer.

# %%
mu_strong = sweep[SIGMAS.index(0.8)]["mu"]
CAPS = [1.1, 1.25, 1.5, 2.0, 3.0, 5.0]
FAMILIES = {"TIS token": lambda c: TruncatedIS(cap=c),
            "TIS sequence": lambda c: TruncatedIS(cap=c, level=Level.SEQUENCE),
            "TIS geometric": lambda c: TruncatedIS(cap=c, level=Level.GEOMETRIC),
            "MIS token [1/C, C] (IcePop)": lambda c: MaskedIS(low=1 / c, high=c, masked_in_normalizer=True),
            "MIS sequence W ≤ C": lambda c: MaskedIS(high=c, masked_in_normalizer=True, level=Level.SEQUENCE),
            "MIS geometric [1/C, C]": lambda c: MaskedIS(low=1 / c, high=c, masked_in_normalizer=True,
                                                         level=Level.GEOMETRIC)}
curves = {name: [expected(rloo(make(c)), mu_strong) for c in CAPS] for name, make in FAMILIES.items()}
references = {level: expected(rloo(c), mu_strong) for level, c in
              [("none", NoCorrection()), ("IS token", ImportanceSampling()),
               ("IS sequence", ImportanceSampling(level=Level.SEQUENCE))]}
assert references["IS sequence"].bias.norm() < EXACT_TOL        # the exact correction

# %%
# two panels stacked for the page's column width, one legend under both
fig, (ax_b, ax_v) = plt.subplots(2, 1, figsize=(7.2, 8.4), sharex=True, layout="constrained")
for (name, ms), style in zip(curves.items(), ["o-", "s-", "^-", "o--", "s--", "^--"]):
    ax_b.plot(CAPS, [m.relative_bias for m in ms], style, label=name)
    ax_v.plot(CAPS, [m.total_variance for m in ms], style, label=name)
for (name, m), color in zip(references.items(), ["0.3", "C0", "C1"]):
    ax_b.axhline(m.relative_bias, ls=":", color=color, label=f"{name} (any cap)")
    ax_v.axhline(m.total_variance, ls=":", color=color, label=name)
for ax in (ax_b, ax_v):
    ax.set_xscale("log")
    ax.minorticks_off()
    ax.set_xticks(CAPS, [f"{c:g}" for c in CAPS])
finish(ax_b, title="Bias against the cap (σ = 0.8)", xlabel="", ylabel="‖E ĝ − ∇J‖ / ‖∇J‖",
       legend=False)
finish(ax_v, title="Variance against the cap (σ = 0.8)", xlabel="cap C", ylabel="total variance tr Cov[ĝ]",
       legend=False)
fig.legend(*ax_b.get_legend_handles_labels(), loc="outside lower center", ncol=3, fontsize=9)
plt.show()

# %% [markdown]
# Read from the right (a cap above every weight is plain IS at that level) to the left:
#
# * **sequence TIS** walks from unbiased (IS) down to the uncorrected bias as $C \to 1$, trading
#   variance for bias smoothly; it is the only family that can reach zero bias;
# * **token** and **geometric** corrections never get below their IS level's bias, which is
#   first order (token IS has mean $\nabla L_\mu$; the geometric mean of the weights is not an
#   importance weight of anything), but their variance is lower;
# * **masks** have the steepest bias once the band cuts into the bulk: a two-sided token mask
#   with a narrow band throws away most tokens, so the step shrinks (the rejected tokens stay in
#   the normalizer) and the bias exceeds even the uncorrected estimator's. IcePop's band
#   $[0.5, 5]$ is at least as wide as $C = 2$ here, where the token mask is within 5% of token IS:
#   it removes only the rare extreme tokens.
#
# ## 6. The diagnostics: effective sample size and $\chi^2$ of the weights
#
# Which number in a training log says that the weights have become a problem? Two classics of
# importance sampling, now in the estimator's metrics (`is_ess`, `is_chi2`; `is_seq_ess`,
# `is_seq_chi2` when the correction acts per sequence) and in the trainer's step metrics:
#
# $$
# \frac{\mathrm{ESS}}{n} = \frac{\big(\sum_i w_i\big)^2}{n\sum_i w_i^2}
# \quad\text{(Kong 1992; Owen 2013, §9.3)},
# \qquad \hat\chi^2 = \frac1n\sum_i w_i^2 - 1 .
# $$
#
# $\hat\chi^2$ is unbiased for $\chi^2(\pi_{\text{old}}\|\mu)$ (per token: for the per-token
# $\chi^2$ averaged over $\mu$'s states), and $\mathrm{ESS}/n \to 1/(1 + \chi^2)$. Eight sampled
# batches of 2000 responses from the $\sigma = 0.4$ engine, through the library's `loss` with a
# sequence-level correction, against the exact values:

# %%
estimator = rloo(TruncatedIS(cap=2.0, level=Level.SEQUENCE))
generator, logged = torch.Generator().manual_seed(7), []
for _ in range(8):
    batch = sample(mdp, mu, 2000, generator=generator, group_size=G)
    with torch.no_grad():
        batch = prepare(batch.replace(old_logprob=pi_old.token_logprobs(batch)), estimator)
        metrics = loss(pi_old.token_logprobs(batch), batch, estimator)[1]
    logged.append([float(metrics[k]) for k in ("is_chi2", "is_ess", "is_seq_chi2", "is_seq_ess")])
logged = torch.tensor(logged, dtype=torch.float64)
mc, se = logged.mean(0), logged.std(0) / math.sqrt(len(logged))
chi2_tok, chi2_seq = float(chi_square(mdp, pi_old, mu, level="token")), float(chi_square(mdp, pi_old, mu))
exact = [chi2_tok, 1 / (1 + chi2_tok), chi2_seq, 1 / (1 + chi2_seq)]
names = ["is_chi2", "is_ess", "is_seq_chi2", "is_seq_ess"]
show(table([(n, float(a), float(s), e, float((a - e) / s)) for n, a, s, e in zip(names, mc, se, exact)],
           ["metric", "Monte Carlo mean", "± s.e.", "exact (large batch)", "z"], fmt=".5f"))
assert all(abs(float(a) - e) < Z_TOL * float(s) for a, s, e in zip(mc, se, exact))

# %% [markdown]
# The trainer logs the same four numbers per step, summed over all ranks before dividing
# (`tokenmdp.estimators.corrections.diagnostics`). Do they predict the bias? Each engine of the sweep of
# section 3, eight sampled batches of 2000 responses each: the square root of the batches' mean
# `is_seq_chi2`, with its standard error (delta method), on the horizontal axis, the exact bias of
# the uncorrected estimator on the vertical one.

# %%
predicted = []
for row in sweep:
    estimates = []
    for _ in range(8):
        b = sample(mdp, row["mu"], 2000, generator=generator, group_size=G)
        with torch.no_grad():
            b = prepare(b.replace(old_logprob=pi_old.token_logprobs(b)), estimator)
            estimates.append(float(loss(pi_old.token_logprobs(b), b, estimator)[1]["is_seq_chi2"]))
    estimates = torch.tensor(estimates, dtype=torch.float64)
    assert abs(float(estimates.mean()) - row["chi2_seq"]) < Z_TOL * float(estimates.std() / math.sqrt(8))
    root_mc = math.sqrt(float(estimates.mean()))
    predicted.append((root_mc, float(estimates.std() / math.sqrt(8)) / (2 * root_mc)))

# %%
fig, ax = plt.subplots(figsize=(7, 4.2))
ax.errorbar([p[0] for p in predicted], [r["bias"] for r in sweep], xerr=[p[1] for p in predicted],
            fmt="o", color="C0", capsize=3, label="√(mean is_seq_chi2 of 8 batches) ± s.e.")
ax.plot([math.sqrt(r["chi2_seq"]) for r in sweep], [r["bias"] for r in sweep], "k--", lw=0.8,
        label="exact √χ² per response")
ax.plot(root, [slope * x for x in root], ":", color="C3", label=f"prediction {slope:.2f} √χ²")
finish(ax, title="The logged χ² predicts the bias of ignoring π_old/μ",
       xlabel="√χ² of the correction weights (per response)", ylabel="exact relative bias, no correction")
plt.show()

# %% [markdown]
# The logged $\hat\chi^2$ lands on the exact curve within its error bars, and the line through
# the smallest mismatch predicts the bias of the larger ones to within about 20%, where
# second-order terms start to bend the curve. The ESS says the same thing as a
# count: at $\sigma = 0.8$ the sequence ESS is $1/(1 + 0.29) \approx 0.78$ of the batch — a
# sequence-level correction would average as if 22% of the responses were missing.
#
# ### Exercise 3 — the sequence ESS of a large batch
#
# *Predict*: for the engine $\sigma = 0.4$, is the large-batch $\mathrm{ESS}/n$ of the sequence
# weights above or below 0.9? Record it as `ess_prediction` (`"above"` or `"below"`). Then
# compute it from the exact $\chi^2$ per response, **without** `chi_square` (use
# `sequence_logprobs` and `mdp.prompt_probs`).

# %%
# Solution
ess_prediction = "above"            # recorded before computing: "above" or "below"
with torch.no_grad():
    second = (2 * sequence_logprobs(mdp, pi_old) - sequence_logprobs(mdp, mu)).exp()
sequence_ess_answer = 1 / float((mdp.prompt_probs[mdp.terminal_prompt_index] * second).sum())

# %%
# Check
tokenmdp.check("tr07_sequence_ess", sequence_ess_answer)
tokenmdp.check("tr07_predict_sequence_ess", ess_prediction)

# %% [markdown]
# Above: 0.94. Per token it is 0.97. Neither looks alarming, yet the uncorrected bias at this
# engine is 20% of $\|\nabla J\|$: an ESS close to 1 is not a license to skip the correction;
# $1 - \mathrm{ESS}/n \approx \chi^2$, and the bias scales with its square root.
#
# ## 7. Failure mode: the weight upside down
#
# A sign slip in the log-ratio, $\log\mu - \log\pi_{\text{old}}$, turns $w$ into $1/w$. It looks
# just as harmless in a loss curve — the weights are still near 1 — but to first order it doubles
# the bias instead of removing it: $1/w \approx 1 - (w - 1)$, so the correction adds the shift of
# no correction a second time.

# %%
@dataclasses.dataclass(frozen=True)
class InvertedIS(Correction):
    # BROKEN ON PURPOSE: μ/π_old per sequence instead of π_old/μ
    level: Level = Level.SEQUENCE

    def __call__(self, batch):
        return CorrectionFactor(importance_weight(-self._log_w(batch)), None)

    def describe(self):
        return "inverted IS (sequence)"


rows = [(name, expected(rloo(c), mu).relative_bias) for name, c in
        [("IS sequence (right)", ImportanceSampling(level=Level.SEQUENCE)),
         ("no correction", NoCorrection()), ("μ/π_old (inverted)", InvertedIS())]]
show(table(rows, ["correction, σ = 0.4", "‖E ĝ − ∇J‖ / ‖∇J‖"], fmt=".4f"))
print(f"inverted / uncorrected bias = {rows[2][1] / rows[1][1]:.3f}")

# %% [markdown]
# Twice the uncorrected bias, as predicted, while the exact correction has none. Nothing in a
# loss curve shows it — the inverted weights are as close to 1 as the right ones — but a test
# that compares the expected gradient with $\nabla J$ catches it at once.
#
# ## What verl / TRL / others call this
#
# Generated from the registry's aliases (the same text as the estimator cards):

# %%
show(alias_box(["minirl", "minirl_no_is", "minirl_len_norm", "ppo_tis", "ppo_mis", "gspo_geo_mis"]))

# %% [markdown]
# ## Summary
#
# * $\rho_t = (\pi_{\text{old}}/\mu)_t(\pi_\theta/\pi_{\text{old}})_t$ exactly; the surrogate owns
#   $r$, the correction the detached $w$.
# * Ignoring $w$ shifts the expected gradient by an amount first order in the mismatch:
#   $\le \sqrt{\chi^2_G}\sqrt{\mathbb{E}_\mu\|\hat g\|^2}$, and in practice a constant times
#   $\sqrt{\chi^2}$.
# * MiniRL's token TIS removes only part of it in one step; length normalization costs more
#   direction than the mismatch and buys variance.
# * Only sequence-level IS is unbiased; truncating it trades bias for variance smoothly. Token and
#   geometric corrections stay at their first-order bias; masks (IcePop is a two-sided token mask)
#   are for rare extreme weights, not a variance dial.
# * The estimator and the trainer log `is_ess`, `is_chi2` (and the sequence-level pair): unbiased
#   $\hat\chi^2$, $\mathrm{ESS}/n \approx 1/(1+\chi^2)$, and $\sqrt{\hat\chi^2}$ predicts the bias of
#   ignoring the weights.
