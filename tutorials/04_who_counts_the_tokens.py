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
# # Tutorial 4 — Who counts the tokens: aggregation and length bias
#
# **The question.** A loss has to average its token terms somehow: over tokens, over sequences,
# by a constant. Does that choice only rescale the gradient, or does it change the objective the
# model climbs, and in particular the length of the answers it learns to give?
#
# A policy-gradient loss on a batch of responses is a weighted negative log-likelihood,
#
# $$
# \mathcal{L} = -\sum_{i} \sum_{t=1}^{|y_i|} w_{i,t}\, A_i \log \pi_\theta(y_{i,t} \mid x_i, y_{i,<t}),
# $$
#
# and every recipe has to say what the per-token weight $w_{i,t}$ is: how the token terms of the
# batch are *averaged*. The choice looks like bookkeeping (divide by the number of tokens? by the
# number of sequences? by both?), and frameworks expose it as a string option. It is not
# bookkeeping. The five classic rules differentiate different things (a sixth, the prompt mean,
# is the last row):
#
# | `tokenmdp.estimators.Aggregation` | weight $w_{i,t}$ | verl `loss_agg_mode` | TRL `loss_type` |
# |---|---|---|---|
# | `TOKEN_MEAN` | $1 / \sum_j \lvert y_j\rvert$ | token-mean | dapo |
# | `SEQUENCE_MEAN_TOKEN_MEAN` | $1 / (S\,\lvert y_i\rvert)$ | seq-mean-token-mean | grpo |
# | `SEQUENCE_MEAN_TOKEN_SUM` | $1 / S$ | seq-mean-token-sum | — |
# | `CONSTANT` | $1 / (S\,L_{\max})$ | seq-mean-token-sum-norm[^verl] | dr_grpo |
# | `TOKEN_SUM` | $1$ | token-sum | — |
# | `PROMPT_MEAN_TOKEN_MEAN` | $1 / (P\,N_{g(i)})$ | — | — (SkyRL's prompt mean) |
#
# ($S$ is the number of sequences of the optimizer step[^S], $\sum_j |y_j|$ its number of loss
# tokens, $L_{\max}$ the response-length budget, or any positive constant; $N_g$ the loss tokens of
# group $g$ (one prompt's responses) and $P$ the number of groups. With one group per step, as in
# the exact analysis of section 3, the prompt mean *is* the token mean, so we follow the five
# classic rules.) The rows come from the papers: GRPO's objective (Shao et al. 2024, arXiv
# 2402.03300, Eq. 3) averages each response's token terms with $1/|o_i|$ and the group with $1/G$,
# the per-sequence token mean; DAPO's "token-level policy gradient loss" (Yu et al. 2025, arXiv
# 2503.14476) divides by $\sum_i |o_i|$, the token mean; Dr. GRPO (Liu et al. 2025, arXiv
# 2503.20783) drops GRPO's $1/|o_i|$, the source of what it calls the response-level length bias,
# for a constant. In this notebook we
#
# 1. print the five weight vectors side by side on one small packed batch;
# 2. compute, **exactly**, the expected gradient of each rule on a tiny MDP where length and
#    correctness are correlated, and name the objective each one ascends: three are $\nabla J$ at
#    three different scales, one is $\nabla \mathbb{E}[(R-b)/|y|]$, a different objective with a
#    length bias (the analysis of Dr. GRPO, Liu et al. 2025, arXiv 2503.20783), and one (the token
#    mean) has no fixed objective at all;
# 3. follow exact gradient ascent with each rule and watch the expected length drift;
# 4. see why the token mean is nevertheless the right convention for *pretraining*, and how to keep
#    it exact when a batch is split into micro-batches (and what a per-micro-batch normalizer,
#    the failure mode, costs);
# 5. ask the same question, still exactly, of responses of 32 tokens, and point to its answer at
#    4096.
#
# Everything is float64 on a CPU and runs in well under a minute.
#
# [^S]: **What $S$ counts.** Every sampled sequence of the step, also one whose tokens are all
#     masked (a truncated completion under DAPO's overlong masking), as verl (a constant global
#     batch size), TRL (`.mean()` over completions) and the Dr. GRPO paper count it. tokenmdp's
#     other convention, `Estimator(sequence_count=SequenceCount.WITH_LOSS_TOKENS)`, counts only
#     the sequences with a loss token; section 2 shows both on a batch where they differ.
#
# [^verl]: **The scale of verl's `seq-mean-token-sum-norm`.** In the version of verl's
#     `core_algos.agg_loss` we could read (commit `012be9d`), the mode sums the micro-batch's
#     sequence sums and divides by `loss_mask.shape[-1]`, the width of the padded response tensor,
#     with no division by the number of sequences; how the actor then scales each micro-batch
#     loss has changed between versions. So the overall scale depends on the version and the
#     batching; tokenmdp's `CONSTANT` implements $w_{i,t} = 1/(S\,L_{\max})$, Dr. GRPO's
#     constant normalizer with $L_{\max}$ the response budget.

# %% [markdown]
# ## Setup
#
# All randomness comes from explicitly seeded `torch.Generator`s. The tolerances used by the
# checks are named here. The tensors of a tiny exact MDP are far too small to gain from several
# threads, so torch runs on one.

# %%
# %matplotlib inline
import copy
import math

import matplotlib.pyplot as plt
import torch
from torch.nn.utils import parameters_to_vector, vector_to_parameters

import tokenmdp
from tokenmdp.course.display import alias_box, show
from tokenmdp.course.tutorials import t04
from tokenmdp.estimators import (
    Aggregation,
    Estimator,
    GroupMean,
    LeaveOneOut,
    Reinforce,
    RewardAsAdvantage,
    SequenceCount,
    loss,
    loss_weights,
    per_micro_batch_token_mean_loss,
    prepare,
)
from tokenmdp.exact import (
    TabularPolicy,
    TokenMDP,
    aggregation_gradients,
    expected_length,
    flat_grad,
    length_drift,
    length_normalized_objective,
    moments,
    objective,
    sample,
    sequence_probs,
)
from tokenmdp.exact import lattice as lat
from tokenmdp.exact.lab.step_gradients import state_action_jacobian
from tokenmdp.packing import pack_first_fit_decreasing, padded_layout, select_sequences, split_micro_batches

# Tiny tensors: one thread avoids thread synchronization, which dominates on a small or busy CPU.
torch.set_num_threads(1)

# Named tolerances for the checks in this notebook.
EXACT_TOL = 1e-12  # two exact float64 computations of the same quantity
Z_TOL = 4.0        # |Monte Carlo estimate - exact| in standard errors

print("tokenmdp", tokenmdp.__version__, "| torch", torch.__version__)

# %% [markdown]
# ## 1. A question with one right answer, and chatter after it
#
# The MDP has one prompt, tokens `0`, `1` and EOS $= 2$, and responses of at most $L = 4$ tokens.
# The **first** response token is the answer: `0` is right, `1` is wrong, and an immediate EOS is
# an empty (wrong) answer. Whatever follows the answer is chatter that the reward ignores:
#
# $$
# R(x, y) = \mathbb{1}[\,y_1 = 0\,].
# $$
#
# So the expected reward $J$ depends only on the distribution of the first token: the true gradient
# $\nabla J$ is exactly zero on every logit of every chatter state. Any estimator that moves the
# chatter is doing something $J$ did not ask for, and with this reward *what* it does to the chatter
# is exactly its effect on length.
#
# The policy is a `TabularPolicy` (a free logit vector per prefix) with small random logits, then
# edited by hand into a model that is usually wrong and **rambles when it is wrong**: the root
# prefers `1` (and rarely answers nothing), and every state after a wrong answer has its EOS logit
# lowered by 2. Reward and
# length are then correlated, as in real reasoning models, where wrong answers tend to be long.

# %%
V, L = 3, 4
EOS = V - 1
CORRECT, WRONG = 0, 1


def answer_reward(prompt, response):
    # the first response token is the answer; everything after it is ignored
    return float(response[0] == CORRECT)


mdp = TokenMDP(V, L, answer_reward, prompts=[(0,)])
policy = TabularPolicy(mdp, generator=torch.Generator().manual_seed(4), init_std=0.5)

# Name every state by its prefix (state ids run level by level, as in tutorial 1).
PREFIXES = [tuple(pre) for k in range(L) for pre in mdp.level_prefixes(k)[1].tolist()]
with torch.no_grad():
    policy.table[0] = torch.tensor([-1.0, 0.5, -2.5])     # root: usually wrong, rarely empty
    for s, prefix in enumerate(PREFIXES):
        if prefix and prefix[0] == WRONG:
            policy.table[s, EOS] -= 2.0                   # after a wrong answer: ramble

# %%
LENGTH = mdp.terminal_lengths
with torch.no_grad():
    J0, EY0 = float(objective(mdp, policy)), float(expected_length(mdp, policy))
    probs0 = sequence_probs(mdp, policy)
    cov_RL = float((probs0 * mdp.rewards * LENGTH).sum()) - J0 * EY0
print(mdp)
print(f"{mdp.num_states} states, {mdp.num_sequences} responses, "
      f"{sum(p.numel() for p in policy.parameters())} parameters")
print(f"J = P(correct) = {J0:.4f}   E|y| = {EY0:.4f}   Cov(R, |y|) = {cov_RL:+.4f}")
for name, answer in (("correct (y_1 = 0)", CORRECT), ("wrong   (y_1 = 1)", WRONG)):
    with torch.no_grad():
        print(f"E[|y| | {name}] = {float(t04.conditional_length(mdp, policy, answer)):.4f}")

# %% [markdown]
# About one response in six is correct, and wrong answers are longer than right ones
# ($\mathrm{Cov}(R, |y|) < 0$).
#
# ## 2. One batch, five weight vectors
#
# Before any expectation, look at a concrete batch. We draw two groups of $G = 3$ responses
# (`sample(..., group_size=3)`), compute the group-mean advantage $A_i = R_i - \bar R_{\text{group}}$
# with `prepare`, and **pack** the sequences into rows of 8 tokens with first-fit-decreasing, as a
# trainer would. Then `loss_weights(batch, mode, max_len=L)` gives the per-token weight of each
# aggregation. The weights are computed once for the whole step: they are data carried by the
# batch, not a division performed inside the loss.

# %%
G_DEMO = 3
drawn = sample(mdp, policy, 2 * G_DEMO, group_size=G_DEMO,
               generator=torch.Generator().manual_seed(11))
reinforce_group_mean = Estimator(surrogate=Reinforce(), advantage=GroupMean(),
                                 aggregation=Aggregation.TOKEN_MEAN, name="reinforce-group-mean")
demo = pack_first_fit_decreasing(prepare(drawn, reinforce_group_mean), capacity=8)
print(f"{demo}\n")

MODES = [Aggregation.TOKEN_MEAN, Aggregation.SEQUENCE_MEAN_TOKEN_MEAN,   # the five classic
         Aggregation.SEQUENCE_MEAN_TOKEN_SUM, Aggregation.CONSTANT, Aggregation.TOKEN_SUM]
weights = {mode: loss_weights(demo, mode, max_len=L) for mode in MODES}
print(t04.weight_table(demo, weights, eos=EOS))   # every token: its advantage, its 5 weights

# %% [markdown]
# Each sequence occupies a run of one row; its first token is the prompt (no loss, weight 0). Within
# a sequence every mode gives every response token the same weight, so what distinguishes the modes
# is the **total weight of a sequence**, $\sum_t w_{i,t}$, i.e. how much a whole response counts:
#
# | mode | total weight of sequence $i$ | long responses count |
# |---|---|---|
# | token-mean | $\lvert y_i\rvert / N$ | more, relative to the batch's $N = \sum_j \lvert y_j\rvert$ |
# | seq-mean-token-mean | $1/S$ | the same as short ones: each token of a long response counts less |
# | seq-mean-token-sum | $\lvert y_i\rvert / S$ | more |
# | constant | $\lvert y_i\rvert / (S L_{\max})$ | more |
# | token-sum | $\lvert y_i\rvert$ | more |
#
# We check the table against the weights above with `batch.sequence_sum`.

# %%
S_demo, N_demo = demo.num_sequences, demo.num_loss_tokens
len_S = demo.length.to(torch.float64)
closed_form = {
    Aggregation.TOKEN_MEAN: len_S / N_demo,
    Aggregation.SEQUENCE_MEAN_TOKEN_MEAN: torch.full_like(len_S, 1 / S_demo),
    Aggregation.SEQUENCE_MEAN_TOKEN_SUM: len_S / S_demo,
    Aggregation.CONSTANT: len_S / (S_demo * L),
    Aggregation.TOKEN_SUM: len_S,
}
totals = {m: demo.sequence_sum(weights[m]) for m in MODES}
print(t04.sequence_total_table(demo, totals, max_len=L))
worst = max(float((totals[m] - closed_form[m]).abs().max()) for m in MODES)
print(f"\nmax |sequence total - closed form| over all modes = {worst:.1e}")
assert worst < EXACT_TOL

# %% [markdown]
# **What $S$ counts when a completion is fully masked.** No sequence of `demo` is, so both
# conventions give the table above. Mask the middle one of three sequences (as overlong masking
# does with a truncated answer) and take `CONSTANT` with $L_{\max} = 4$: counting every sampled
# sequence (the default, and the peers'), each remaining token weighs $1/(3 \cdot 4) = 1/12$;
# counting only sequences with a loss token it weighs $1/(2 \cdot 4) = 0.125$, so masking one
# answer would silently rescale the others.

# %%
three = select_sequences(drawn, [0, 1, 2])
masked = three.replace(loss_mask=three.loss_mask & (three.sequence_id != 1))
for sequences, S_counted in ((SequenceCount.SAMPLED, 3), (SequenceCount.WITH_LOSS_TOKENS, 2)):
    w = loss_weights(masked, Aggregation.CONSTANT, max_len=L, sequences=sequences)
    on = w[masked.loss_mask]
    assert float((on - 1 / (S_counted * L)).abs().max()) < EXACT_TOL
    print(f"{sequences.value:>16}: S = {S_counted}, each loss token weighs {float(on[0]):.4f}")

# %% [markdown]
# The sums in the last line are the total weight of the step, by which the learning rate is
# effectively multiplied: 1 for the two means, $N/S$ for the sequence mean of sums,
# $N/(S L_{\max})$ for the constant, $N$ for the plain sum. That is a first, harmless difference
# between the modes (a rescaled learning rate). The interesting difference is the *relative* weight
# of long and short responses, and for that we need expectations.

# %% [markdown]
# ## 3. Five expected gradients, exactly
#
# Write $\sigma(y) = \nabla \log \pi_\theta(y \mid x)$ for the score of a whole response. For every
# mode the weight is constant along a sequence, $w_{i,t} = w_i$, so the ascent direction of one
# batch is
#
# $$
# \hat g = -\nabla \mathcal{L} = \sum_{i=1}^{G} w_i\, A_i\, \sigma(y_i).
# $$
#
# With the group-mean advantage $A_i = R_i - \frac1G\sum_j R_j$ and one prompt per batch ($S = G$),
# the expectation over the $G$ i.i.d. responses follows from $\mathbb{E}[\sigma] = 0$ (the lemma of
# tutorial 1): $\mathbb{E}[A_i \sigma(y_i)] = \frac{G-1}{G}\nabla J$. Hence
#
# * **token-sum** ($w_i = 1$): $\mathbb{E}[\hat g] = (G-1)\,\nabla J$;
# * **seq-mean-token-sum** ($w_i = 1/G$): $\mathbb{E}[\hat g] = \frac{G-1}{G}\,\nabla J$;
# * **constant** ($w_i = 1/(G L)$): $\mathbb{E}[\hat g] = \frac{G-1}{G L}\,\nabla J$;
# * **seq-mean-token-mean** ($w_i = 1/(G|y_i|)$): the same computation with $R$ replaced by
#   $R/|y|$ and the baseline by $J/|y|$ gives
#   $\mathbb{E}[\hat g] = \frac{G-1}{G}\, \nabla_\theta\,
#   \mathbb{E}_{y\sim\pi_\theta}\!\left[\frac{R(y) - b}{\lvert y\rvert}\right]\Big|_{b = J}$,
#   the gradient of a **different objective**, the reward per token, with the baseline $b = J$
#   held fixed while differentiating;
# * **token-mean** ($w_i = 1/\sum_j |y_j|$): the normalizer is random and shared by the group, so
#   it correlates with each $A_i$ and $\sigma(y_i)$; there is no closed form, and no fixed objective
#   whose gradient it is.
#
# `aggregation_gradients(mdp, policy, estimator, group_size=G)` swaps each aggregation into the
# estimator and computes $\mathbb{E}[\hat g]$ exactly with `moments`, by enumerating the group draws
# (or by exchangeability, whichever is cheaper). It reports the cosine of each mean to $\nabla J$
# and to $\nabla \mathbb{E}[R/|y|]$, and the length slope $\langle \mathbb{E}[\hat g], \nabla
# \mathbb{E}|y| \rangle$. We pass one precomputed state-action Jacobian, since all five calls are at
# the same $\theta$.

# %%
G = 2
jacobian = state_action_jacobian(mdp, policy)
results = {r.aggregation: r for r in aggregation_gradients(mdp, policy, reinforce_group_mean,
                                                           group_size=G, jacobian=jacobian)}

grad_J = flat_grad(objective(mdp, policy), policy)
grad_len = flat_grad(expected_length(mdp, policy), policy)
J_fixed = float(objective(mdp, policy).detach())
grad_per_token = flat_grad(length_normalized_objective(mdp, policy, baseline=J_fixed), policy)

print(f"G = {G}, one prompt per batch\n")
print(t04.cosine_table(results, grad_per_token, grad_len))

# %% [markdown]
# The last column is the length slope of a unit step along each mean, $\langle \mathbb{E}[\hat g] /
# \lVert\mathbb{E}[\hat g]\rVert, \nabla \mathbb{E}|y| \rangle$, so that modes with different scales
# compare. Three modes have cosine 1 with $\nabla J$ and identical length slopes: they are the same
# direction. The per-sequence token mean has cosine 1 with $\nabla\mathbb{E}[(R-J)/|y|]$ instead,
# and the token mean with neither. The cosines to $\nabla J$ are all close to 1 here, and the overall
# length slopes look alike: in this MDP any step that makes answers right also makes responses
# shorter, because right answers ramble less. Section 4 separates the two effects.
#
# Now the closed forms, coordinate by coordinate: the exact mean, the formula, and the largest
# difference.

# %%
predicted = {   # mode: (formula, closed form)
    Aggregation.TOKEN_SUM: ("(G-1) ∇J", (G - 1) * grad_J),
    Aggregation.SEQUENCE_MEAN_TOKEN_SUM: ("(G-1)/G ∇J", (G - 1) / G * grad_J),
    Aggregation.CONSTANT: ("(G-1)/(G L) ∇J", (G - 1) / (G * L) * grad_J),
    Aggregation.SEQUENCE_MEAN_TOKEN_MEAN: ("(G-1)/G ∇E[(R-J)/|y|]", (G - 1) / G * grad_per_token),
}
closed_forms = t04.closed_form_table([(mode.value, formula, results[mode].mean, target)
                                      for mode, (formula, target) in predicted.items()])
print(closed_forms)
assert max(row[-1] for row in closed_forms.rows) < EXACT_TOL     # max |difference|

# %% [markdown]
# Four of the five modes are pinned down to rounding error. For the three $\nabla J$ modes the only
# difference is the scale, $(G-1)$ against $(G-1)/G$ against $(G-1)/(GL)$: a learning-rate
# change, but one that depends on $G$ and on the length budget $L$, which is why switching
# aggregation in a real run also means retuning the learning rate.
#
# ### Exercise 1 — the constant normalizer at $G = 3$
#
# *Predict* $c$ in $\mathbb{E}[\hat g] = c\,\nabla J$ for the constant normalizer with the
# group-mean advantage, now with groups of $G = 3$ (still $L_{\max} = 4$): is it larger or smaller
# than at $G = 2$? Record it as `scale_prediction` (`"larger"` or `"smaller"`), then store $c$ in
# `constant_scale_answer`.

# %%
# Solution
scale_prediction = "larger"         # recorded before computing: "larger" or "smaller"
# every sequence weighs 1/(G L), and the group mean gives E[A_i σ_i] = (G − 1)/G ∇J
constant_scale_answer = (3 - 1) / (3 * L)

# %%
# Check
tokenmdp.check("tr04_constant_scale_g3", constant_scale_answer)
tokenmdp.check("tr04_predict_constant_scale_g3", scale_prediction)

# %% [markdown]
# Larger: $\frac16$ against $\frac18$ at $G = 2$. The $1/G$ in each sequence's weight is paid back
# by the $G$ sequences of a group; what is left is the group mean's $(G-1)/G$, which grows with $G$.
#
# The exact moments next to a Monte Carlo estimate from 4000 sampled groups, run through the
# library's `prepare` and `loss` (`method="monte_carlo"`), for the per-sequence token mean:

# %%
per_token_mode = reinforce_group_mean.replace(aggregation=Aggregation.SEQUENCE_MEAN_TOKEN_MEAN)
mc = moments(mdp, policy, per_token_mode, group_size=G, method="monte_carlo", num_samples=4000,
             generator=torch.Generator().manual_seed(12))
exact_m = moments(mdp, policy, per_token_mode, group_size=G, jacobian=jacobian)
z_var = (mc.total_variance - exact_m.total_variance) / mc.total_variance_se
z_cos = (mc.cosine - exact_m.cosine) / mc.cosine_se
print(f"seq-mean-token-mean, G = {G}: tr Cov Monte Carlo {mc.total_variance:.5f} ± "
      f"{mc.total_variance_se:.5f}, exact {exact_m.total_variance:.5f} ({z_var:+.2f} s.e.); "
      f"cos(E ĝ, ∇J) Monte Carlo {mc.cosine:.4f} ± {mc.cosine_se:.4f}, exact "
      f"{exact_m.cosine:.4f} ({z_cos:+.2f} s.e.)")
assert abs(z_var) < Z_TOL and abs(z_cos) < Z_TOL

# %% [markdown]
# ## 4. Dividing by $|y|$ changes the objective
#
# ### The baseline is no longer free
#
# For an unbiased policy gradient, a baseline $b$ costs nothing: $\nabla \mathbb{E}[R - b] = \nabla
# J$ because $\mathbb{E}[b\,\sigma] = 0$. After dividing by $|y|$ it is no longer free:
#
# $$
# \nabla\, \mathbb{E}\!\left[\frac{R-b}{|y|}\right] = \nabla\,\mathbb{E}\!\left[\frac{R}{|y|}\right]
# - b\, \nabla\, \mathbb{E}\!\left[\frac{1}{|y|}\right],
# $$
#
# and $\nabla \mathbb{E}[1/|y|]$ is not zero: it points towards shorter responses. So with a
# positive baseline (here $b = J > 0$) the term
# $-b\,\nabla\mathbb{E}[1/|y|]$ pushes towards **longer** responses. We check both halves:
# with no baseline (`RewardAsAdvantage`, $A_i = R_i$) the 1/|y| weighting gives exactly
# $\nabla\mathbb{E}[R/|y|]$; with the group mean it gives $\frac{G-1}{G}\nabla\mathbb{E}[(R-J)/|y|]$
# (checked above), and the difference is the baseline term.

# %%
per_token_mean = Aggregation.SEQUENCE_MEAN_TOKEN_MEAN
no_baseline = Estimator(surrogate=Reinforce(), advantage=RewardAsAdvantage(),
                        aggregation=per_token_mean)
mean_no_baseline = moments(mdp, policy, no_baseline, group_size=G, jacobian=jacobian).mean
grad_R_over_len = flat_grad(length_normalized_objective(mdp, policy), policy)
grad_inv_len = flat_grad(t04.expected_inverse_length(mdp, policy), policy)    # ∇E[1/|y|]
baselines = t04.closed_form_table(
    [("A = R", "∇E[R/|y|]", mean_no_baseline, grad_R_over_len),
     ("A = R - group mean", "(G-1)/G ∇E[(R-J)/|y|]", results[per_token_mean].mean,
      (G - 1) / G * (grad_R_over_len - J_fixed * grad_inv_len))],
    label="advantage", width=18, decimals=6)
print(baselines)
assert max(row[-1] for row in baselines.rows) < EXACT_TOL

# %%
baseline_slope = float(-J_fixed * grad_inv_len @ grad_len)
print(f"\nlength slope of the baseline term -J ∇E[1/|y|]: "
      f"{baseline_slope:+.5f} (> 0: towards longer responses)")
assert baseline_slope > 0

# %% [markdown]
# ### Short when right, long when wrong
#
# Read the per-token objective response by response. Each response $y$ contributes
# $\pi(y)\,(R(y) - b)/|y|$, and its effective reward $(R-b)/|y|$ has the length slope
#
# $$
# \frac{\partial}{\partial |y|}\,\frac{R - b}{|y|} = -\frac{R - b}{|y|^2}
# \quad\begin{cases} < 0 & \text{if } R > b \text{ (a correct answer: shorter is better)},\\
# > 0 & \text{if } R < b \text{ (a wrong answer: longer is better, it is penalized less per token).}
# \end{cases}
# $$
#
# This is the length bias that Liu et al. (arXiv 2503.20783) identify in GRPO: a
# correct response gets a larger update when it is short, and a wrong response is punished less
# when it is long, so wrong responses grow. The table shows the effective reward of our MDP by
# length, with $b = J$.

# %%
print(f"baseline b = J = {J_fixed:.4f}\n")
print(f"{'|y|':>4} {'correct: (1-b)/|y|':>19} {'wrong: (0-b)/|y|':>17}")
lengths = range(1, L + 1)
eff_correct = [(1 - J_fixed) / n for n in lengths]
eff_wrong = [-J_fixed / n for n in lengths]
for n, c, w in zip(lengths, eff_correct, eff_wrong, strict=True):
    shown = f"{c:>19.4f}" if n > 1 else f"{'(none: |y| >= 2)':>19}"
    print(f"{n:>4} {shown} {w:>17.4f}")
slope_c = [b - a for a, b in zip(eff_correct[1:], eff_correct[2:])]
slope_w = [b - a for a, b in zip(eff_wrong, eff_wrong[1:])]
print(f"\nsteps between consecutive lengths: correct {[f'{d:+.3f}' for d in slope_c]}, "
      f"wrong {[f'{d:+.3f}' for d in slope_w]}")
assert all(d < 0 for d in slope_c) and all(d > 0 for d in slope_w)

# %% [markdown]
# That is a statement about the objective; does the expected gradient act on it? Take the two
# conditional lengths $\mathbb{E}[|y| \mid y_1 = 0]$ (how long correct responses are) and
# $\mathbb{E}[|y| \mid y_1 = 1]$ (how long wrong ones are). They depend only on the chatter logits,
# which $\nabla J$ leaves alone, so along the three $\nabla J$ modes their slopes must be exactly 0.
# Along the others the signs should be those of the table: negative for correct, positive for wrong.

# %%
grad_len_correct = flat_grad(t04.conditional_length(mdp, policy, CORRECT), policy)
grad_len_wrong = flat_grad(t04.conditional_length(mdp, policy, WRONG), policy)

print(f"{'mode':>20} {'d E[|y| | correct] / step':>26} {'d E[|y| | wrong] / step':>24}")
slopes = {}
for mode, r in results.items():
    unit = r.mean / r.mean.norm()
    slopes[mode] = (float(unit @ grad_len_correct), float(unit @ grad_len_wrong))
    print(f"{mode.value:>20} {slopes[mode][0]:>+26.2e} {slopes[mode][1]:>+24.2e}")

for mode in (Aggregation.TOKEN_SUM, Aggregation.SEQUENCE_MEAN_TOKEN_SUM, Aggregation.CONSTANT):
    assert max(abs(v) for v in slopes[mode]) < EXACT_TOL       # ∇J does not touch the chatter
for mode in (Aggregation.SEQUENCE_MEAN_TOKEN_MEAN, Aggregation.TOKEN_MEAN):
    assert slopes[mode][0] < 0 < slopes[mode][1]               # short when right, long when wrong

# %% [markdown]
# Both signs appear, and the per-sequence token mean (GRPO's aggregation) is the strongest. The
# **token mean is biased the same way**, more weakly. Its normalizer $\sum_j |y_j|$ contains the
# response's own length: a long correct response inflates the denominator of its own update, a long
# wrong one deflates the penalty it receives. DAPO (Yu et al. 2025, arXiv 2503.14476) adopts the
# token mean to fix GRPO's length problem; the exact computation says it *reduces* it, by roughly a
# factor $G$, and removes it only as the batch grows. We check that on group sizes 2, 3 and 4: the
# relative distance of $\mathbb{E}[\hat g]$ from $\frac{G-1}{G}\nabla J / \mathbb{E}|y|$, the
# large-batch limit (the normalizer tends to $G\,\mathbb{E}|y|$), and the chatter slope of correct
# responses.

# %%
token_mean = reinforce_group_mean.replace(aggregation=Aggregation.TOKEN_MEAN)
E_len = float(expected_length(mdp, policy).detach())
print(f"{'G':>2} {'‖E ĝ - limit‖ / ‖limit‖':>24} {'cos ∇J':>8} {'d E[|y| | correct] / step':>26}")
relative = []
for g_size in (2, 3, 4):
    mean = moments(mdp, policy, token_mean, group_size=g_size, jacobian=jacobian).mean
    limit = (g_size - 1) / g_size * grad_J / E_len
    relative.append(float((mean - limit).norm() / limit.norm()))
    cos = float(mean @ grad_J / (mean.norm() * grad_J.norm()))
    slope = float(mean @ grad_len_correct / mean.norm())
    print(f"{g_size:>2} {relative[-1]:>24.4f} {cos:>8.5f} {slope:>+26.5f}")
assert all(b < a for a, b in zip(relative, relative[1:]))

# %% [markdown]
# ## 5. Length drift under exact gradient ascent
#
# First-order slopes describe one step. `length_drift(mdp, policy, estimators, group_size=G,
# steps=..., lr=...)` runs exact gradient ascent, $\theta \leftarrow \theta + \eta\,
# \mathbb{E}[\hat g] / \lVert \mathbb{E}[\hat g] \rVert$, with each estimator and records $J$ and
# $\mathbb{E}|y|$ after every step. Normalizing the step removes the scale differences (token-sum
# would otherwise take steps $G L$ times longer than the constant), so only the directions compete.
# No sampling noise is involved: every step follows the exact expected gradient.

# %%
DRIFT_STEPS, DRIFT_LR = 12, 0.5
estimators_by_mode = {mode.value: reinforce_group_mean.replace(aggregation=mode) for mode in MODES}
tracks = length_drift(mdp, policy, estimators_by_mode, group_size=G, steps=DRIFT_STEPS,
                      lr=DRIFT_LR)

print(f"{'mode':>20} {'J start':>8} {'J end':>8} {'E|y| start':>11} {'E|y| end':>9}")
for name, track in tracks.items():
    print(f"{name:>20} {track[0][0]:>8.4f} {track[-1][0]:>8.4f} {track[0][1]:>11.4f} "
          f"{track[-1][1]:>9.4f}")
same = max(abs(a - b) for name in ("seq-mean-token-sum", "constant")
           for pa, pb in zip(tracks["token-sum"], tracks[name], strict=True)
           for a, b in zip(pa, pb, strict=True))
print(f"\nmax difference between the tracks of the three ∇J modes: {same:.1e}")
assert same < EXACT_TOL


# %% [markdown]
# The three $\nabla J$ modes follow one path, as they must. To see the two halves of the length bias
# we also need the conditional lengths of correct and wrong responses along the way, which
# `length_drift` does not record. Its loop is short, so we repeat it for one mode of each kind and
# record them too; its $(J, \mathbb{E}|y|)$ must reproduce `length_drift`'s tracks.

# %%
def ascend(estimator, steps, lr):
    # exact normalized gradient ascent from `policy`, recording J, E|y| and the conditional lengths
    pi = copy.deepcopy(policy)
    track = []
    for k in range(steps + 1):
        with torch.no_grad():
            track.append((float(objective(mdp, pi)), float(expected_length(mdp, pi)),
                          float(t04.conditional_length(mdp, pi, CORRECT)),
                          float(t04.conditional_length(mdp, pi, WRONG))))
        if k == steps:
            break
        direction = moments(mdp, pi, estimator, group_size=G).mean
        theta = parameters_to_vector(pi.parameters()).detach()
        vector_to_parameters(theta + lr * direction / direction.norm(), pi.parameters())
    return track


# %%
SHOWN = ("constant", "token-mean", "seq-mean-token-mean")
detailed = {name: ascend(estimators_by_mode[name], DRIFT_STEPS, DRIFT_LR) for name in SHOWN}
agree = max(abs(a[i] - b[i]) for name in SHOWN
            for a, b in zip(detailed[name], tracks[name], strict=True) for i in (0, 1))
print(f"max |own loop - length_drift| over J and E|y|: {agree:.1e}")
assert agree < EXACT_TOL

t04.length_drift_figure(tracks, detailed, lr=DRIFT_LR)   # J, E|y| and the conditional lengths
plt.show()
print(t04.conditional_length_table(detailed))
const = detailed["constant"]
assert abs(const[-1][2] - const[0][2]) < EXACT_TOL and abs(const[-1][3] - const[0][3]) < EXACT_TOL
for name in ("token-mean", "seq-mean-token-mean"):
    assert detailed[name][-1][2] < const[-1][2] and detailed[name][-1][3] > const[-1][3]

# %% [markdown]
# Read the four panels together.
#
# * **$\nabla J$ modes.** Only the answer moves. $\mathbb{E}|y|$ falls because rambling wrong
#   answers are replaced by right ones, and settles at the length of right answers, which never
#   changes: the chatter logits get no gradient at all.
# * **Per-sequence token mean (GRPO).** Right answers get shorter and wrong answers longer, step
#   after step, exactly the two signs of section 4; $J$ lags a little because part of each step is
#   spent on the chatter. Even after $J \approx 1$ the (normalized) direction keeps shortening right
#   answers: in the rare groups that still contain a wrong answer, the per-token objective rewards
#   being short.
# * **Token mean (DAPO).** The same two effects, about half as strong at $G = 2$.
#
# Here the overall length falls under every mode, because the wrong answers disappear. When many
# answers stay wrong, as on hard training problems, the growth of the wrong ones can dominate: Liu et
# al. (arXiv 2503.20783) observe that under GRPO the length of incorrect responses keeps increasing,
# and remove the effect with the constant normalizer.

# %% [markdown]
# ## 6. Why the token mean is the pretraining convention
#
# If the token mean is biased for RL, why is it everywhere? Because with **advantage 1** it is the
# pretraining loss: $-\frac{1}{N}\sum_{(i,t)} \log \pi(y_{i,t} \mid \cdot)$, the average negative
# log-likelihood per token, i.e. the log of the perplexity. There every token is a prediction
# target in its own right, and averaging over tokens is the natural estimate of the per-token loss. The
# length "bias" is the intended behaviour: a document with more tokens carries more signal.
#
# In tokenmdp, supervised training is the same loss with $A = 1$: `RewardAsAdvantage` on a batch
# whose rewards are all 1. We check that the loss equals the average NLL computed by hand.

# %%
sft = Estimator(surrogate=Reinforce(), advantage=RewardAsAdvantage(),
                aggregation=Aggregation.TOKEN_MEAN, name="sft")
corpus = sample(mdp, policy, 12, generator=torch.Generator().manual_seed(21))
corpus = corpus.replace(reward=torch.ones(corpus.num_sequences, dtype=torch.float64))
step = pack_first_fit_decreasing(prepare(corpus, sft), capacity=8)    # advantage 1, weights 1/N

logprobs_RC = policy.token_logprobs(step)                   # log π(y_t | x, y_<t)
full_loss, _ = loss(logprobs_RC, step, sft)
nll = -logprobs_RC[step.loss_mask].mean()                    # by hand: mean over loss tokens
print(step)
print(f"token-mean loss with A = 1: {full_loss.item():.12f}")
print(f"average NLL per token:      {nll.item():.12f}   difference {(full_loss - nll).item():.1e}")
assert abs((full_loss - nll).item()) < EXACT_TOL

# %% [markdown]
# ### Failure mode: a normalizer computed per micro-batch
#
# A step rarely fits in one forward pass: it is split into micro-batches and the gradients are
# accumulated. The token mean's normalizer $N$ is a property of the **whole step**. `prepare`
# computes the weights $1/N$ once, before the split, and `loss` only reads them, so the micro-batch
# losses **sum** to the full loss for any split. The common alternative normalizes each micro-batch
# by its own token count and averages the micro-batch means (gradient accumulation over mean
# losses; TRL's `bnpo`). tokenmdp keeps that only as a named counter-example,
# `per_micro_batch_token_mean_loss`. It depends on the split, because a micro-batch with few tokens
# gives each of them a larger weight.
#
# We split the 12 sequences into 1, 2, 3 and 6 micro-batches of whole rows (`split_micro_batches`),
# and compare both the loss and its gradient with the full step.

# %%
splits = []
for K in (1, 2, 3, 6):
    parts = [mb.batch for mb in split_micro_batches(step, K)]
    summed = sum(loss(policy.token_logprobs(p), p, sft)[0] for p in parts)      # step weights
    naive = sum(per_micro_batch_token_mean_loss(policy.token_logprobs(p), p, sft)[0]
                for p in parts) / K                                          # mean of means
    splits.append((K, [p.num_loss_tokens for p in parts], summed, naive))
split_table = t04.micro_batch_table(step, full_loss, splits, policy)   # values and gradients
print(split_table)
for _, _, _, d_sum, g_sum, *_ in split_table.rows:
    assert abs(d_sum) < EXACT_TOL and g_sum < EXACT_TOL

# %%
# layout is memory, not meaning: the same step padded, one sequence per row
padded = padded_layout(step)
padded_loss = loss(policy.token_logprobs(padded), padded, sft)[0]
print(f"\npadded layout ({padded.num_rows} rows): loss {padded_loss.item():.12f}, "
      f"difference {(padded_loss - full_loss).item():.1e}")
assert abs((padded_loss - full_loss).item()) < EXACT_TOL

# %% [markdown]
# With step-wide weights the sum is the full loss to rounding error, for every split and for every
# layout; the mean of micro-batch means agrees only for $K = 1$ and drifts as soon as the
# micro-batches hold different numbers of tokens. The same rule holds for every aggregation: what
# $N$, $S$ and $|y_i|$ are is decided once per optimizer step (in data-parallel training, with counts
# summed over ranks), never inside a micro-batch.
#
# So the token mean is right for pretraining, where it *is* the objective, and a biased choice for
# RL, where the objective is $J$ and the per-token weights should not depend on the length of the
# response or of its batch-mates.
#
# ## 7. Exercise 2: leave-one-out baselines and the per-token objective
#
# RLOO (Kool et al. 2019; Ahmadian et al. 2024, arXiv 2402.14740) uses the leave-one-out
# advantage $A_i = R_i - \frac{1}{G-1}\sum_{j\neq i} R_j$, which is unbiased for $\nabla J$ with a
# sum aggregation. Pair it with the per-sequence token mean (`LeaveOneOut()` with
# `Aggregation.SEQUENCE_MEAN_TOKEN_MEAN`). *Predict*: which vector is its expected gradient,
# (a) $\nabla J$, (b) $\nabla\mathbb{E}[(R - J)/|y|]$ with $J$ held fixed, or
# (c) $\frac{G-1}{G}\nabla\mathbb{E}[(R - J)/|y|]$? Record it as `vector_prediction` (`"a"`, `"b"`
# or `"c"`). Then write it with `flat_grad` and `length_normalized_objective`, without calling
# `moments`, as `answer`, and store its norm in `rloo_token_mean_norm`.
#
# *Hint:* the $R_j$ with $j \neq i$ are independent of $y_i$. Is there still a factor
# $\frac{G-1}{G}$?

# %%
# Solution
vector_prediction = "b"             # recorded before computing: "a", "b" or "c"
# E[A_i σ_i / |y_i|] = E[R σ/|y|] - E[R_j] E[σ/|y|] = ∇E[R/|y|] - J ∇E[1/|y|], since the other
# samples are independent of y_i: exactly ∇E[(R - J)/|y|] with b = J held fixed, and no (G-1)/G
# factor (the leave-one-out mean does not contain R_i). The mean over i of G such terms is one of
# them, because w_i = 1/(G |y_i|).
answer = flat_grad(length_normalized_objective(mdp, policy, baseline=J_fixed), policy)
rloo_token_mean_norm = float(answer.norm())

# %%
# Check
tokenmdp.check("tr04_rloo_token_mean_norm", rloo_token_mean_norm)
tokenmdp.check("tr04_predict_rloo_token_mean_vector", vector_prediction)

# %% [markdown]
# The norm is checked; the whole vector agrees with the exact moments too:

# %%
rloo_per_token = Estimator(surrogate=Reinforce(), advantage=LeaveOneOut(),
                           aggregation=Aggregation.SEQUENCE_MEAN_TOKEN_MEAN)
exact_mean = moments(mdp, policy, rloo_per_token, group_size=G, jacobian=jacobian).mean
print(f"max |answer − exact E ĝ| = {float((answer - exact_mean).abs().max()):.1e}")
assert (answer - exact_mean).abs().max() < EXACT_TOL

# %% [markdown]
# An unbiased baseline does not make a biased aggregation unbiased: RLOO with a per-sequence token
# mean ascends the same per-token objective as GRPO's group mean, just without the $\frac{G-1}{G}$
# shrinkage.
#
# ## 8. At length
#
# Four tokens are enough to see the signs, not to say whether they survive at the lengths of a
# reasoning model. `tokenmdp.exact.lattice` computes the same moments exactly when the reward is
# read by a small automaton, at thousands of tokens, and for the token mean at every $G$: its
# normalizer $N = \sum_j |y_j|$ couples the group, but $1/N = \int_0^\infty e^{-sN}\,ds$ and
# $e^{-sN} = \prod_j e^{-s|y_j|}$ factorizes over the members, one lattice pass each, integrated
# over $s$. Our world fits: three states (no answer yet, answered right, answered wrong), the
# first token is the answer, the rest is chatter. We take $T = 32$
# tokens, wrong answers rambling about twice as long as right ones, and groups of $G = 4$, and
# measure the slopes of section 4 along each mean, $\langle \mathbb{E}[\hat g] /
# \lVert\mathbb{E}[\hat g]\rVert, \nabla \mathbb{E}[|y| \mid \cdot\,] \rangle$, beside the
# cosine to $\nabla J$ and the relative variance $\operatorname{tr}\operatorname{Cov}[\hat g] /
# \lVert\mathbb{E}[\hat g]\rVert^2$ of one group. `method="lattice"` raises rather than sample.

# %%
T_LONG, G_LONG, V_LONG = 32, 4, 4                       # tokens 0 (right), 1, 2 (wrong), 3 = EOS
START, RIGHT_STATE, WRONG_STATE = 0, 1, 2
transitions = [[RIGHT_STATE, WRONG_STATE, WRONG_STATE],   # the first token is the answer,
               [RIGHT_STATE] * 3, [WRONG_STATE] * 3]      # then chatter, which changes nothing
long_mdp = lat.LatticeMDP(lat.RewardAutomaton(transitions, [0.0, 1.0, 0.0]), T_LONG)
long_logits = torch.tensor([
    [-1.0, 0.0, 0.0, -3.0],                             # usually wrong, rarely empty
    [0.0, 0.0, 0.0, math.log(3 / (T_LONG / 4 - 1))],    # right: EOS once in T/4 tokens
    [0.0, 0.0, 0.0, math.log(3 / (T_LONG / 2 - 1))]],   # wrong: once in T/2
    dtype=torch.float64)
long_policy = lat.LatticePolicy(long_mdp, logits=long_logits.expand(T_LONG, 3, V_LONG))


def long_lengths(policy):
    # E[|y| | right], E[|y| | a wrong answer token]: one action at the start, then one per chatter
    # node visited (d(t, z), the lattice's visitation)
    d = lat.visitation(long_mdp, policy)
    p = torch.softmax(policy.logits[0, START], -1)
    return ((p[0] + d[1:-1, RIGHT_STATE].sum()) / p[0],
            (p[1:3].sum() + d[1:-1, WRONG_STATE].sum()) / p[1:3].sum())


len_right, len_wrong = long_lengths(long_policy)
grad_right, grad_wrong = (torch.autograd.grad(q, long_policy.logits, retain_graph=True)[0]
                          .reshape(-1) for q in (len_right, len_wrong))
with torch.no_grad():
    print(f"T = {T_LONG}, G = {G_LONG}: J = {float(lat.objective(long_mdp, long_policy)):.3f}, "
          f"E[|y| | right] = {float(len_right):.1f}, E[|y| | wrong] = {float(len_wrong):.1f}\n")
print(f"{'mode':>20} {'method':>8} {'cos ∇J':>7} {'tr Cov/‖E ĝ‖²':>14} "
      f"{'d E[|y| | right]':>17} {'d E[|y| | wrong]':>17}")
at_length = {}
for mode in (Aggregation.CONSTANT, Aggregation.TOKEN_MEAN, Aggregation.SEQUENCE_MEAN_TOKEN_MEAN):
    m = lat.moments(long_mdp, long_policy, reinforce_group_mean.replace(aggregation=mode),
                    group_size=G_LONG, method="lattice")
    unit = m.mean / m.mean.norm()
    at_length[mode] = (float(unit @ grad_right), float(unit @ grad_wrong))
    print(f"{mode.value:>20} {m.method:>8} {m.cosine:>7.4f} "
          f"{m.total_variance / float(m.mean @ m.mean):>14.1f} "
          f"{at_length[mode][0]:>+17.4f} {at_length[mode][1]:>+17.4f}")
assert max(abs(v) for v in at_length[Aggregation.CONSTANT]) < EXACT_TOL
for mode in (Aggregation.TOKEN_MEAN, Aggregation.SEQUENCE_MEAN_TOKEN_MEAN):
    assert at_length[mode][0] < 0 < at_length[mode][1]          # short when right, long when wrong
assert abs(at_length[Aggregation.TOKEN_MEAN][1]) < abs(at_length[per_token_mean][1])

# %% [markdown]
# The picture of section 4 holds at 32 tokens: the constant leaves both lengths alone, the
# per-sequence token mean shortens right answers and lengthens wrong ones, and the token mean does
# the same, less. What the unbiased rule pays is noise: one group of the constant's gradient has
# the largest relative variance, because its long responses bring many noisy tokens at full
# weight, while the per-sequence mean divides them by $|y|$.
#
# `python benchmarks/lattice.py --aggregation-only` asks the same question of this world for
# $G = 1 \dots 16$ and $T = 64 \dots 4096$, exactly; the documentation page
# [*Long responses*](../concepts/long_responses.md) (Concepts › Long responses) reads its table
# and figure. With one logit table shared by all positions, as an LLM shares its weights, the
# token mean's length bias is still there at 4096 tokens: it shrinks like $1/G$, not with $T$.
# And the per-sequence mean's lower variance outweighs its bias for one group per step, not for
# a step that averages many.
#
# ## What verl / TRL / others call this
#
# Generated from the estimator registry's aliases (each entry names its aggregation):

# %%
show(alias_box(["grpo", "dr_grpo", "dapo"]))

# %% [markdown]
# ## Summary
#
# * Aggregation is a per-token weight. Within a response all five modes weigh every token equally;
#   they differ in how much a whole response counts: $|y_i|/N$, $1/S$, $|y_i|/S$,
#   $|y_i|/(S L_{\max})$ or $|y_i|$.
# * Token-sum, sequence-mean of token-sums and the constant normalizer (Dr. GRPO) give $\nabla J$
#   exactly, at scales $(G-1)$, $(G-1)/G$ and $(G-1)/(GL)$ with a group-mean advantage.
# * The sequence mean of token means (GRPO) gives exactly $\frac{G-1}{G}\nabla\mathbb{E}[(R-b)/|y|]$
#   with $b = J$: a per-token objective in which the baseline is no longer free, correct answers
#   prefer to be short and wrong answers to be long.
# * The token mean (DAPO) has no fixed objective; its length bias has the same signs and shrinks
#   roughly like $1/G$.
# * With $A = 1$ the token mean is the average NLL per token, the pretraining loss; computed once
#   per step, its weights make micro-batch losses sum to the full loss, while per-micro-batch means
#   do not.
# * The lattice gives the same moments exactly at length (here 32 tokens; up to 4096 in
#   `benchmarks/lattice.py`): the signs of the length bias stay, and the unbiased constant pays in
#   variance.
