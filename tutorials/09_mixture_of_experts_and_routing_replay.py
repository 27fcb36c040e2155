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
# # Tutorial 9 — Mixture-of-Experts and routing replay, exactly
#
# **The question.** In a Mixture-of-Experts model the inference engine and the trainer can send
# the same token to different experts. Routing replay fixes the experts of the training passes:
# **R2** replays the trainer's own `old_logprob` pass, **R3** the rollout engine's. Both change
# the policy whose gradient is taken. *When does replaying the engine's experts (R3) pay for its
# bias, and when is R2 better?*
#
# The papers state the trade-off (Zheng et al. 2025, arXiv 2512.01374, Sec. 3.2 "Routing Replay
# Restores First-order Approximation, Yet May Introduce Bias", and the off-policy runs of
# Sec. 4.4; R3 is Ma et al. 2025, arXiv 2510.11370). Here we measure it. The trainer's
# `MoETransformer` implements the exact world's policy protocol, so on a tiny enumerable MDP it
# *is* an exact policy: every response, every routing record, every gradient can be computed.
# We will
#
# 1. use a top-2-of-4 MoE transformer as the policy of the copy task and check it against the
#    exact world's ground truth;
# 2. count the **routing flips** an engine's perturbation causes (precision, router-score noise)
#    and compute $\mathrm{KL}(\mu\,\|\,\pi_{\text{old}})$ with and without R3, exactly and as the
#    trainer logs it from the real rollout engine;
# 3. write R2 and R3 as **one-line swaps** of whose routing is replayed, and check the three
#    identities: R2 is a no-op on the first mini-batch, R3 makes $\pi_{\text{old}} = \mu$ when
#    only the expert selection differs, and the router gets no gradient with $K = 1$;
# 4. compute **the exact bias of replay itself** — the expected replayed gradient against the
#    true $\nabla J$ of the un-replayed policy, against the engine's, and against the first-order
#    surrogate — as staleness and mismatch grow;
# 5. run the trainer's RL step on the same MDP with $N = 2$ and $N = 8$ mini-batches, none / R2 /
#    R3, and read the runs against the exact numbers;
# 6. break the alignment of a replayed trace on purpose.
#
# Everything is exact (float64, full enumeration) except where a Monte Carlo estimate stands
# beside the exact value with its standard error.

# %% [markdown]
# ## Setup
#
# The MDP is the course's copy task (`tokenmdp.course.setups.copy_task()`: two prompts, tokens
# $\{0, 1, \text{EOS}\}$, at most 3 response tokens, +1 per token that copies the prompt, −1 for a
# truncated response). The policy $\pi_{\text{old}}$ is a float64 `MoETransformer`
# (`tokenmdp.rl.replay_exact.moe_policy`: 2 layers, width 8, **top-2 of 4 experts** per layer,
# weights $\mathcal N(0, 0.3^2)$, so that router scores are of order 1 and some routing decisions
# are close). The engine $\mu$ is its copy in other numerics (`engine_model`): a lower precision,
# or a fixed per-layer, per-expert bias $b \sim \mathcal N(0, \sigma^2)$ added to the router scores
# for the top-$K$ *selection* only, as the rollout engine's `selection_noise` does (the gates stay
# the softmax of the true scores). `tokenmdp.course.tutorials.t09.tr09_world(σ)` builds the three together.

# %%
# %matplotlib inline

import matplotlib.pyplot as plt
import torch

import tokenmdp
from tokenmdp.course.display import alias_box, finish, show, table
from tokenmdp.course.tutorials.t09 import (
    REPLAYS,
    bias_figure,
    bias_grid,
    engine_rows,
    run_rows,
    sampled_engine_stats,
    tr09_estimator,
    tr09_world,
)
from tokenmdp.exact import (
    expected_length,
    gradient,
    moments,
    objective,
    sequence_kl,
    sequence_logprobs,
    sequence_probs,
    state_logprobs,
    state_visitation,
)
from tokenmdp.rl.replay_bias import ReplayWorld, replay_gradient
from tokenmdp.rl.replay_exact import RoutedPolicy, engine_model

# Named tolerances for the checks in this notebook.
EXACT_TOL = 1e-12  # two exact float64 computations of the same quantity
Z_TOL = 4.0        # |Monte Carlo estimate - exact| in standard errors

SIGMA = 1.0        # the router-score noise of the engine of sections 2-4 and of the exercises
print("tokenmdp", tokenmdp.__version__, "| torch", torch.__version__)

# Every tensor here is tiny: one CPU thread avoids the cost of synchronizing several.
torch.set_num_threads(1)

# %%
world = tr09_world(SIGMA)
mdp, old, estimator = world.mdp, world.old, tr09_estimator()
grad_J = gradient(mdp, old)
print(f"{mdp.num_sequences} responses, {mdp.num_states} states, {grad_J.numel()} parameters, "
      f"J(π_old) = {float(objective(mdp, old).detach()):.4f}, ||∇J|| = {float(grad_J.norm()):.4f}")

# %% [markdown]
# ## 1. The MoE transformer as an exact policy
#
# The exact world asks a policy for `token_logprobs(batch)`; the transformer answers it with one
# forward pass over any layout of sequences. On the enumeration (`mdp.enumerate()`: every
# (prompt, response) once) its token log-probs summed per response must be the
# $\log\pi(y|x)$ that `sequence_logprobs` builds level by level from the states' distributions,
# and $J$ must be $\sum_x D(x) \sum_y \pi(y|x) R(x, y)$ by hand.
#
# To evaluate the policy *under a given routing* we need one more object.
# `RoutedPolicy(mdp, model, routing)` is the same model with the expert selection of every
# (token, layer) fixed to a trace `[R, C, L, K]` aligned with the enumeration (`None`: routed
# freely): a prefix policy whose distribution at state $s$ is read from the response
# $s + \text{EOS}$. Replaying the routing the model would choose anyway runs exactly the same
# operations, so it must be the free model **bit for bit**.

# %%
enum = mdp.enumerate()
with torch.no_grad():
    by_hand = old.token_logprobs(enum).sum(-1)
    assert torch.allclose(sequence_logprobs(mdp, old), by_hand, atol=EXACT_TOL, rtol=0)
    J_by_hand = (mdp.prompt_probs[mdp.terminal_prompt_index] * by_hand.exp() * mdp.rewards).sum()
    assert abs(float(J_by_hand - objective(mdp, old))) < EXACT_TOL
own = RoutedPolicy(mdp, old, world.old_routing)          # replay π_old's own routing
free = RoutedPolicy(mdp, old)
assert all(torch.equal(own.level_logits(k), free.level_logits(k)) for k in range(mdp.max_len))
x, y = mdp.responses()[4]
print(f"routing record of {x} -> {y}, layer 0, token by token:", world.old_routing[4, :4, 0].tolist())

# %% [markdown]
# Each (token, layer) record holds the $K = 2$ experts of that token; the last token of a
# sequence is routed too, but nothing in the sequence depends on it (the rollout engine does not
# route it at all).
#
# ## 2. Routing flips and the training–inference KL
#
# How often does an engine's perturbation send a token to other experts? The trainer logs
# `routing_mismatch`: among the (token, layer) records of a sampled batch that both engines made,
# the share whose *sets* of experts differ. Its large-batch limit is a ratio of expectations
# under $\mu$, which `ReplayWorld.flip_fraction` computes exactly:
#
# $$
# f = \frac{\sum_x D(x) \sum_y \mu(y|x)\, n_{\text{diff}}(x, y)}{\sum_x D(x) \sum_y \mu(y|x)\,
# n_{\text{rec}}(x, y)} ,
# $$
#
# with $n_{\text{rec}}$ the records of every token but the last (prompt tokens included) in every
# layer. Beside it, $\mathrm{KL}(\mu\,\|\,\pi_{\text{old}})$ of whole responses, without replay
# and with R3's `old_logprob` pass (which replays the engine's experts), and both per token
# (over $\mathbb E_\mu|y|$, what the trainer logs as `train_infer_kl_k3`).

# %%
ENGINES = {"fp32": dict(selection_noise=0.0, precision="fp32"),
           "bf16": dict(selection_noise=0.0, precision="bf16"),
           "fp8 (simulated)": dict(selection_noise=0.0, precision="fp8"),
           "router noise σ = 0.3": dict(selection_noise=0.3),
           "router noise σ = 1": dict(selection_noise=1.0),
           "router noise σ = 3": dict(selection_noise=3.0),
           "bf16 + σ = 1": dict(selection_noise=1.0, precision="bf16")}
rows = engine_rows(ENGINES)
show(table(rows, ["engine μ", "flip fraction", "KL none", "KL R3", "KL/token none",
                  "KL/token R3"], fmt=".3e"))

# %% [markdown]
# Three things to read off the table.
#
# * **Precision alone** flips few records: bf16 rounding reorders two router scores only where
#   they are nearly tied (6% of the records), and fp8's rounding flips none here. Yet almost all
#   of bf16's KL comes from those few flips — R3 divides it by 200 — while fp8's is the smooth
#   rounding of every weight, which R3 leaves as it is.
# * **Router-score noise** flips many records — most of them at $\sigma = 1$ — yet the KL stays
#   small: the 4 experts are random networks of the same kind, so another pair of experts gives a
#   similar output. A flip fraction is not a KL.
# * **R3** makes the KL of a selection-only engine exactly 0 (to float64 rounding): once the
#   trainer uses the engine's experts, the two computations are the same. With bf16 numerics
#   as well, what is left is the bf16 engine's own KL.
#
# The same numbers as the trainer logs them: the real `RolloutEngine` (fp32 compute, KV-cache
# decoding, the same router-score bias) samples eight batches of 256 responses, the
# `old_logprob` pass of the float64 trainer scores them, and the trainer's own counters give
# `routing_mismatch` and $k_3$ per token. The exact values are those of the fp32 engine.

# %%
sampled = sampled_engine_stats(world, precision="fp32", selection_noise=SIGMA)
fp32_world = ReplayWorld(mdp, old, engine_model(old, precision="fp32", selection_noise=SIGMA, seed=1))
with torch.no_grad():
    exact = {"mismatch": fp32_world.flip_fraction(),
             "kl": float(sequence_kl(mdp, fp32_world.mu, old) / expected_length(mdp, fp32_world.mu))}
show(table([(k, sampled[k], sampled[k + "_se"], exact[k], (sampled[k] - exact[k]) / sampled[k + "_se"])
            for k in exact], ["logged", "Monte Carlo mean", "± s.e.", "exact", "z"], fmt=".5f"))
assert all(abs(sampled[k] - exact[k]) < Z_TOL * sampled[k + "_se"] for k in exact)

# %% [markdown]
# ### Exercise 1 — the flip fraction by hand
#
# *Predict* before you run: for the $\sigma = 1$ engine, is the flip fraction under $\mu$'s
# sampling larger or smaller than the share of flipped records among all enumerated responses
# counted once each? Record it as `flip_prediction` (`"larger"` or `"smaller"`). Then compute it
# **without** `flip_fraction`: `world.engine_routing` and
# `world.old_routing` are the two records `[R, C, L, K]` on the enumeration; weight each response
# by $D(x)\mu(y|x)$ (`sequence_probs(mdp, world.mu)`), skip the last token of each response, and
# compare expert *sets*.

# %%
# Solution
flip_prediction = "larger"           # recorded before computing: "larger" or "smaller"
same_set = (world.engine_routing.sort(-1).values == world.old_routing.sort(-1).values).all(-1)
last = enum.sequence_lengths_total() - 1
counted = (torch.arange(enum.tokens.shape[1])[None, :] < last[:, None])[..., None].expand_as(same_set)
with torch.no_grad():
    w_y = mdp.prompt_probs[mdp.terminal_prompt_index] * sequence_probs(mdp, world.mu)
n_diff = ((~same_set) & counted).sum((1, 2)).double()
n_rec = counted.sum((1, 2)).double()
flip_answer = float((w_y * n_diff).sum() / (w_y * n_rec).sum())

# %%
# Check
tokenmdp.check("tr09_predict_flip_weighting", flip_prediction)
tokenmdp.check("tr09_flip_fraction", flip_answer)

# %%
print(f"under μ: {flip_answer:.4f}; every enumerated record once: "
      f"{float(n_diff.sum() / n_rec.sum()):.4f}")

# %% [markdown]
# Larger here (0.787 against 0.713): the enumeration weighs the long, unlikely responses — which
# hold most of its records — as much as the likely ones. The trainer's logged number estimates
# the one under $\mu$.
#
# ### Exercise 2 — the KL per token
#
# *Predict*: is $\mathrm{KL}(\mu\,\|\,\pi_{\text{old}})$ per token above or below $10^{-2}$ for
# this engine, given that 79% of its records flip? Record it as `kl_prediction` (`"above"` or
# `"below"`). Then compute it **without** `sequence_kl`: the
# per-state $\mathrm{KL}(\mu(\cdot|s)\,\|\,\pi_{\text{old}}(\cdot|s))$ averaged with the weights
# $d^\mu(s) / \sum_s d^\mu(s)$ (`state_logprobs`, `state_visitation` of `world.mu`).

# %%
# Solution
kl_prediction = "below"              # recorded before computing: "above" or "below"
with torch.no_grad():
    lp_mu = torch.cat([x.reshape(-1, mdp.vocab_size) for x in state_logprobs(mdp, world.mu)])
    lp_old = torch.cat([x.reshape(-1, mdp.vocab_size) for x in state_logprobs(mdp, old)])
    d_mu = state_visitation(mdp, world.mu)
kl_answer = float((d_mu * (lp_mu.exp() * (lp_mu - lp_old)).sum(-1)).sum() / d_mu.sum())

# %%
# Check
tokenmdp.check("tr09_predict_kl_per_token_size", kl_prediction)
tokenmdp.check("tr09_kl_per_token", kl_answer)

# %% [markdown]
# Below, by a factor of five: $2.1 \times 10^{-3}$ nats per token. By the chain rule of the KL,
# the per-state average under $d^\mu$ is the KL of whole responses divided by $\mathbb E_\mu|y|$:
# the table's two KL columns.
#
# ## 3. R2 and R3 as one-line swaps
#
# The trainer's update passes call `replay_routing(batch, replay)`
# (`tokenmdp.rl.rollout`): `none` returns nothing, `r2` the `old_logprob` pass's record
# (`OLD_ROUTING`), `r3` the engine's (`ENGINE_ROUTING`); the `old_logprob` pass itself replays
# the engine's under R3 only. `ReplayWorld` holds both records in the enumeration's
# `token_extras` and calls the same function, so that switching the replay is one argument:
#
# ```python
# policy = world.policy(model, "r2")     # π_θ as an R2 update computes it
# old_pass = world.old_policy("r3")      # π_old as R3's old_logprob pass computes it
# ```
#
# Three identities follow from the design of the MoE layer (replay substitutes the selection,
# the gates stay the softmax over the current scores of the selected experts) and are checked
# here exactly:
#
# * **R2 is a no-op on the first mini-batch**: at $\theta = \theta_{\text{old}}$ it replays the
#   routing the model chooses anyway, so the expected gradient of any estimator is unchanged bit
#   for bit;
# * **R3 makes $\pi_{\text{old}} = \mu$** when the engines differ only in their selection;
# * **with $K = 1$ the router gets no gradient**: the gate of one expert is
#   $e^{s_i}/e^{s_i} = 1$ whatever the score, so only the experts learn — replayed or not.

# %%
none_0 = replay_gradient(world, old, estimator, "none")
r2_0 = replay_gradient(world, old, estimator, "r2")
assert torch.equal(none_0.mean, r2_0.mean) and none_0.variance == r2_0.variance
with torch.no_grad():
    kl_r3 = float(sequence_kl(mdp, world.mu, world.old_policy("r3")))
assert kl_r3 < EXACT_TOL
top1 = tr09_world(SIGMA, top_k=1)
router_entries = torch.cat([torch.full((p.numel(),), "router" in name)
                            for name, p in top1.old.named_parameters()])
for policy in (top1.old, top1.policy(top1.old, "r3")):
    assert torch.count_nonzero(gradient(mdp, policy)[router_entries]) == 0
print(f"R2 on the first mini-batch: max |Δ E ĝ| = {float((none_0.mean - r2_0.mean).abs().max())}; "
      f"KL(μ ‖ π_old under R3) = {kl_r3:.1e}; K = 1: {int(router_entries.sum())} router "
      f"weights, all with gradient 0")

# %% [markdown]
# So R3 is the only replay that touches the first mini-batch. What does it do there? Its
# `old_logprob` pass equals $\mu$, so its data are on-policy for the policy it differentiates:
# $\pi_\theta$ **with the engine's experts**. At $\theta_{\text{old}}$ that policy *is* the
# engine's: the engine's selection is locally constant in $\theta$ (a top-$K$ of scores away
# from ties), so the replayed policy and the engine agree on a neighbourhood of
# $\theta_{\text{old}}$ and have the same gradient. R3 ascends $J(\mu_\theta)$, the objective of
# the policy that samples — and is served — and not $J(\pi_\theta)$ of the trainer's
# computation.
#
# ### Exercise 3 — the size of R3's target shift
#
# *Predict*: relative to $\|\nabla J(\pi_{\text{old}})\|$, is the distance between the gradient
# R3 takes at the first mini-batch and the trainer's $\nabla J(\pi_{\text{old}})$ closer to 1%,
# 10% or 30%, for the engine whose KL per token is $2 \times 10^{-3}$? Record it as
# `shift_prediction` (`"1%"`, `"10%"` or `"30%"`). Then compute it with `gradient` of the
# replayed policy (`world.policy(old, "r3")`) and of `old`.

# %%
# Solution
shift_prediction = "30%"             # recorded before computing: "1%", "10%" or "30%"
r3_grad = gradient(mdp, world.policy(old, "r3"))
r3_shift_answer = float((r3_grad - grad_J).norm() / grad_J.norm())

# %%
# Check
tokenmdp.check("tr09_predict_r3_shift_size", shift_prediction)
tokenmdp.check("tr09_r3_target_shift", r3_shift_answer)

# %%
engine_grad = gradient(mdp, world.engine_at(old))            # ∇J(μ): the engine, differentiated
assert torch.allclose(r3_grad, engine_grad, atol=EXACT_TOL, rtol=0)
print(f"R3 target shift {r3_shift_answer:.3f}; the bias of no replay (E_μ ĝ against ∇J(π_old)) "
      f"{none_0.relative_bias:.3f}; R3's gradient = ∇J(μ) to {float((r3_grad - engine_grad).norm()):.1e}")

# %% [markdown]
# About 30%: six times the bias of ignoring the mismatch altogether. The KL measures how
# different the engine's *probabilities* are; the gradient of a flipped token flows into other
# experts' weights, a difference in *parameter space* that no KL sees. The identity
# $\nabla J(\pi^{\text{R3}}_{\theta_{\text{old}}}) = \nabla J(\mu_{\theta_{\text{old}}})$ holds to
# rounding.
#
# ## 4. The exact bias of replay as staleness and mismatch grow
#
# Now the trade-off itself. Updates $2..N$ of a step are stale: $\theta \ne \theta_{\text{old}}$
# (here $\theta = \theta_{\text{old}} + s\,\nabla J/\|\nabla J\|$, `world.stale(s)`). For each
# engine noise $\sigma$, staleness $s$ and replay, `replay_gradient` gives the exact $\mathbb E[\hat g]$
# of the notebook's estimator (token ratio against the `old_logprob` pass, leave-one-out
# advantage, no train–inference correction, $G = 2$, data from $\mu$) and three targets
# (`bias_grid` computes the targets once per $(\sigma, s)$ for the three replays):
#
# * $\nabla J(\pi_\theta)$ of the freely routed policy — the trainer's objective;
# * $\nabla J(\mu_\theta)$ of the engine's policy at the same weights — the sampler's objective;
# * $\nabla_\theta L_{\pi_{\text{old}}}(\pi_\theta)$, the first-order (CPI) surrogate of the
#   un-replayed policy (`tokenmdp.exact.surrogate`), which the token-level estimator targets
#   off-policy.

# %%
SIGMAS, STALENESS = [0.3, 1.0, 3.0], [0.0, 0.1, 0.2, 0.4]
grid = bias_grid(SIGMAS, STALENESS, estimator,        # section 3's first-mini-batch results reused
                 known={(SIGMA, 0.0, "none"): none_0, (SIGMA, 0.0, "r2"): r2_0})
rows = [(sigma, s, *[getattr(grid[sigma, s, r], a) for a in ("relative_bias", "engine_bias")
                     for r in REPLAYS]) for sigma in SIGMAS for s in STALENESS]
show(table(rows, ["σ", "staleness", *[f"vs ∇J(π) {r}" for r in REPLAYS],
                  *[f"vs ∇J(μ) {r}" for r in REPLAYS]], fmt=".3f"))

# %%
fig = bias_figure(grid)
plt.show()

# %% [markdown]
# Read the two panels as two questions.
#
# * **If the trainer's policy is the objective** (top), no replay and R2 are within a few
#   percent of each other everywhere (the grey lines lie under the blue ones): R2 is identical to
#   no replay on the first mini-batch, and its bias appears only once the updates have moved the
#   routing (visibly from $s = 0.2$ here), and stays small. R3 is the worst at every point, by the
#   target shift of exercise 3 — from the first mini-batch on, growing with the flip fraction.
# * **If the engine's policy is the objective** (bottom), R3 is exact on the first mini-batch and
#   the best at every staleness for $\sigma \ge 1$; no replay and R2 are biased towards the
#   trainer's computation by about the distance between the two gradients. At the smallest
#   mismatch ($\sigma = 0.3$), staleness overtakes: from $s = 0.2$ on, R3's frozen experts cost
#   more than the engine's few flips.
#
# Every method's bias grows with staleness by the same first-order error (the distance of
# $\nabla L_{\pi_{\text{old}}}$ from $\nabla J$), which none of the replays removes:

# %%
gaps = [(s, *[grid[SIGMA, s, r].surrogate_gap for r in REPLAYS], grid[SIGMA, s, "none"].target_shift,
         float((grid[SIGMA, s, "none"].surrogate_grad - grid[SIGMA, s, "none"].true_grad).norm()
               / grid[SIGMA, s, "none"].true_grad.norm())) for s in STALENESS]
show(table(gaps, ["staleness (σ = 1)", *[f"‖E ĝ − ∇L‖ {r}" for r in REPLAYS], "none's target shift",
                  "‖∇L − ∇J(π)‖"], fmt=".3f"))
assert all(row[4] == 0.0 for row in gaps)                    # no replay: the policy is π_θ itself

# %% [markdown]
# So the answer to the question, in this world. **R2 is the better replay when the updates are
# few (small $N$) and the trainer's own policy is what is evaluated**: it costs nothing on the
# first mini-batch and little after. **R3 pays for its bias when the mismatch is large and the
# objective is the engine's policy** — the one that samples, and the one an inference server
# deploys: it is then the only method whose first update is unbiased. With many stale updates
# and a small mismatch, neither replay removes the first-order error, and R3's frozen experts
# add to it. Zheng et al. find R2 sufficient and more effective when the off-policiness is small,
# R3 when it is large (Sec. 4.4); the exact numbers add *which objective* each one serves.
#
# ## 5. The trainer world: $N = 2$ and $N = 8$ mini-batches, none / R2 / R3
#
# `tokenmdp.rl.replay_runs.mdp_training_run` is the trainer's RL step with the MDP as the task:
# the real rollout engine (fp32, router-score noise $\sigma = 1$, KV cache) samples $G = 2$
# responses for each of 8 prompts, the `old_logprob` pass records or replays the routing,
# `prepare` runs once, and $N$ AdamW updates follow on shuffled mini-batches (lr $3 \times
# 10^{-3}$, 10 rollouts). Because the world is enumerable, every step also records the exact
# $J$ of the trainer's policy and of the engine's. Three seeds per configuration, mean ±
# standard error.

# %%
run_kw = dict(steps=10, prompts_per_step=8, group_size=2, lr=3e-3, precision="fp32",
              selection_noise=SIGMA, engine_seed=1)
runs, traces = run_rows(mdp, old, estimator, minibatches=[2, 8], seeds=[0, 1, 2], **run_kw)
show(table(runs, ["N", "replay", "J(π)", "± s.e.", "J(μ)", "± s.e.", "J(μ) − J(π)", "± s.e.",
                  "logged mismatch", "exact flip fraction"], fmt=".4f"))
gap_n2 = {row[1]: row[6] for row in runs if row[0] == 2}
assert gap_n2["none"] < 0 < gap_n2["r3"]           # the sign read below

# %%
fig, ax = plt.subplots(figsize=(7, 4.2))
for (n, replay), color in zip(traces, ["0.35", "C0", "C3"] * 2):
    gap = torch.tensor([[e - j for e, j in zip(r.engine_J, r.J)] for r in traces[n, replay]])
    ax.plot(gap.mean(0), "-" if n == 2 else "--", color=color, label=f"N = {n}, {replay}")
finish(ax, title="Which policy does the run improve? J(μ) − J(π), mean of 3 seeds",
       xlabel="rollout (step)", ylabel="J(engine) − J(trainer), exact")
plt.show()

# %% [markdown]
# How the runs tie back to the exact numbers:
#
# * the trainer's logged `routing_mismatch` (none, R2) is the exact flip fraction at the run's
#   weights, up to sampling noise; under R3 it is 0 by construction (the `old_logprob` pass uses
#   the engine's experts), while the engines still disagree on the exact flip fraction;
# * after 10 rollouts the final $J$ of the configurations are within their standard errors of
#   each other: a bias of 5–30% in the expected direction of one update does not show in ten
#   noisy rollouts of 16 responses each;
# * but *which* policy improves does: with $N = 2$, no replay and R2 leave the trainer's policy
#   ahead of the engine's ($J(\mu) - J(\pi) < 0$), R3 the engine's ahead of the trainer's — the
#   sign that section 4 predicts from R3's target. With $N = 8$ both objectives approach the
#   task's maximum (2) and the difference fades.
#
# ## 6. Failure mode: a trace one token off
#
# A replayed trace must be aligned with the tokens it is replayed on. A plausible slip when the
# engine's records are collected during decoding is an off-by-one: the record made while the
# token at column $c$ was *sampled* is stored at $c$, although it belongs to the token fed at
# $c - 1$. The records are still valid (two distinct experts each), so nothing raises; here is
# what the `old_logprob` pass and the first update then compute, beside no replay and a correct
# R3. Every gradient distance is relative to the same $\|\nabla J(\pi_{\text{old}})\|$; the
# target shift is $\|\nabla J(\text{replayed}) - \nabla J(\pi_{\text{old}})\|$, the bias
# of no replay $\|\mathbb E_\mu \hat g - \nabla J(\pi_{\text{old}})\|$ (section 3).

# %%
shifted = torch.full_like(world.engine_routing, -1)
shifted[:, 1:] = world.engine_routing[:, :-1]                 # BROKEN ON PURPOSE: one column late
misaligned = RoutedPolicy(mdp, old, shifted)
late = moments(mdp, misaligned, estimator, group_size=2, behavior=world.mu, old=misaligned,
               method="enumeration")                          # R3 with the late trace: E ĝ
scale = grad_J.norm()
passes = {"no replay": (world.old_policy("none"), none_0.mean, grad_J),
          "R3": (world.old_policy("r3"), grid[SIGMA, 0.0, "r3"].mean,
                 grid[SIGMA, 0.0, "r3"].replayed_grad),
          "R3, trace one token late": (misaligned, late.mean, gradient(mdp, misaligned))}
rows = []
for name, (old_pass, mean, target) in passes.items():
    with torch.no_grad():
        kl = float(sequence_kl(mdp, world.mu, old_pass))
    rows.append((name, kl, *[float((a - b).norm() / scale) for a, b in
                             ((mean, grad_J), (mean, engine_grad), (target, grad_J))]))
show(table([(name, f"{kl:.3e}", *rest) for name, kl, *rest in rows],
           ["routing", "KL(μ ‖ π_old)", "‖E ĝ − ∇J(π_old)‖", "‖E ĝ − ∇J(μ)‖", "target shift"],
           fmt=".3f"))
(_, kl_none, bias_none, engine_none, _), (_, kl_r3, _, engine_r3, _), \
    (_, kl_late, bias_late, engine_late, late_shift) = rows
assert abs(bias_none - none_0.relative_bias) < EXACT_TOL and engine_r3 < EXACT_TOL
assert kl_late > kl_none > kl_r3 and late_shift > bias_none and bias_late > bias_none
assert engine_r3 < engine_late < engine_none
print(f"late trace: KL {kl_late:.3e} = {kl_late / kl_none:.1f} × no replay's {kl_none:.3e}; "
      f"target shift {late_shift:.3f} ‖∇J‖ = {late_shift / bias_none:.1f} × the bias of no "
      f"replay, {bias_none:.3f} ‖∇J‖")

# %% [markdown]
# The late trace is worse than no replay on both counts the claim compares: the KL that R3 was
# meant to remove is 2.2 times the KL without any replay, and the policy it differentiates is
# 0.193 $\|\nabla J\|$ from the trainer's gradient, 3.9 times the bias of no replay
# (0.050 $\|\nabla J\|$); the update's $\mathbb E \hat g$ itself is 0.186 $\|\nabla J\|$ away.
# Against the engine's gradient it lies between the two: 0.216 $\|\nabla J\|$, where no replay
# is 0.328 and a correct R3 is exact. Its target is neither the trainer's nor the engine's. In a
# log it looks like a KL spike *after* turning R3 on — the symptom to look for. A test that
# compares $\mathrm{KL}(\mu\,\|\,\pi_{\text{old}})$ under R3 with 0 on a selection-only engine
# (section 3) catches it at once.
#
# ## What verl / TRL / others call this
#
# Routing replay is not an estimator, so the registry has no entry for it. ms-swift's GRPO
# documentation calls R2 "Vanilla Routing Replay" and R3 "Rollout Routing Replay"; the
# trainer here takes `--replay none|r2|r3`. The notebook's estimator is RLOO with the token ratio
# (on the first mini-batch the gradient of the registry's `rloo`); MiniRL is the estimator
# Zheng et al. pair with replay:

# %%
show(alias_box(["rloo", "minirl"]))

# %% [markdown]
# ## Summary
#
# * The trainer's MoE transformer is an exact policy of an enumerable MDP; `RoutedPolicy` fixes
#   its routing, and replaying its own routing is the free model bit for bit.
# * An engine's perturbation flips (token, layer) records — precision a few, router-score noise
#   most — and the KL it causes can be tiny while most records flip: the experts are alike in
#   probability, not in parameters.
# * R2 and R3 are one argument of `replay_routing`. R2 is a no-op on the first mini-batch; R3
#   makes $\pi_{\text{old}} = \mu$ for a selection-only engine; with $K = 1$ the router gets no
#   gradient.
# * R3's expected gradient on the first mini-batch is $\nabla J(\mu)$, the engine's: a shift of
#   about 30% from the trainer's $\nabla J(\pi)$ here, against 5% for ignoring the mismatch. R2
#   stays within a few percent of no replay. Which one pays depends on the objective: the
#   trainer's policy (R2) or the engine's (R3, when the mismatch is large).
# * Short trainer runs cannot resolve these biases in $J$, but they show the sign: R3's runs
#   improve the engine's policy more than the trainer's, as the exact gradient predicts.
