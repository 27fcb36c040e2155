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
# # Tutorial 5 — The trainer world: SFT and RL are one loop
#
# **The question.** Supervised fine-tuning and RL are usually taught as two different
# algorithms. Are they one loss on one kind of batch, and what does a real trainer add on top of
# the estimators of tutorials 1–4: a sampler with its own numerics, and a mismatch that the
# logged numbers may or may not show?
#
# Tutorials 1-4 computed gradients *exactly* on MDPs small enough to enumerate. This one leaves the
# exact world for the trainer world of `tokenmdp.rl`: a tiny MoE transformer, a verifiable task
# (2-digit addition, `"12+7="` → `"19"`), a rollout engine with its own numerics, and one training
# loop. The point of the notebook is in its title. Supervised fine-tuning and policy-gradient RL
# differentiate the same thing,
#
# $$
# \mathcal{L} = -\sum_{\text{loss tokens } (i,t)} w_{i,t}\, c_{i,t}\, A_{i,t}
# \log \pi_\theta(y_{i,t} \mid x_i, y_{i,<t}),
# $$
#
# (for RL the log-probability may sit inside a clipped or masked ratio, and $c$ is the correction
# for the rollout engine) and differ only in where the tokens and the two per-token fields come
# from:
#
# | | tokens | `advantage` $A$ | `loss_weight` $w$ |
# |---|---|---|---|
# | SFT | a demonstration (the answer) | 1 | 1 / (answer tokens of the step) |
# | RL | sampled by the engine $\mu$ | the estimator's: $R_i - \bar R_{\text{group}}$, ... | the estimator's |
#
# Both are a packed `TokenBatch`; `tokenmdp.estimators.prepare` fills the two fields and
# `tokenmdp.estimators.loss` turns them into a scalar. In this notebook we
#
# 1. build one SFT batch and one RL batch by hand and print their fields side by side;
# 2. look at the rollout engine's own numerics: a bf16 engine samples from $\mu \ne \pi_{\text{old}}$,
#    partly because it routes tokens to other experts, and routing replay (R3) removes that part;
# 3. run the real trainer: SFT to a checkpoint, then MiniRL (Zheng et al. 2025, arXiv 2512.01374,
#    Sec. 4.1) from it, and plot the curves it logged;
# 4. check, in an exercise, what the other replay mode (R2) does to the `old_logprob` pass;
# 5. skip the `old_logprob` pass on purpose and see the mismatch vanish from every number.
#
# The whole notebook takes under a minute of CPU time on one thread (`benchmarks/tutorials.py`
# measures each tutorial).

# %% [markdown]
# ## Setup
#
# All randomness is seeded: `numpy` generators for the task's prompts, `torch.Generator`s for the
# weights and every sample. The trainer runs under deterministic algorithms (its default), so on a
# given machine and PyTorch build every number below repeats exactly. The model is tiny, so torch
# runs on one thread: on a small CPU, thread synchronization would cost more than it gains.

# %%
# %matplotlib inline
import tempfile
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import torch

import tokenmdp
from tokenmdp import estimators
from tokenmdp.batch import TokenBatch
from tokenmdp.course.display import alias_box, table
from tokenmdp.course.setups import copy_task
from tokenmdp.course.tutorials.t05 import (
    batch_summary,
    binomial_se,
    evaluation_table,
    fields_table,
    hand_written_groups,
    packed_rollouts,
    run_summary,
    training_curves,
)
from tokenmdp.exact import inference_copy, sample, sequence_kl
from tokenmdp.rl.config import TrainConfig
from tokenmdp.rl.mismatch import (
    ENGINE_ROUTING,
    OLD_ROUTING,
    compute_old_logprobs,
    routing_mismatch_rate,
    training_inference_kl,
)
from tokenmdp.rl.rollout import RolloutEngine
from tokenmdp.rl.run_setup import build_model
from tokenmdp.rl.tasks import get_task
from tokenmdp.rl.trainer import SFT_ESTIMATOR, train

torch.set_num_threads(1)

# The tiny MoE of benchmarks/acceptance.py: 2 blocks, 4 experts per layer, 2 per token.
MODEL = dict(d_model=64, n_layers=2, n_heads=4, n_experts=4, top_k=2, expert_hidden=64)
MAX_NEW_TOKENS = 4  # an answer has at most 3 digits, then EOS
EXACT_TOL = 1e-12   # two float64 computations of the same quantity
Z_TOL = 4.0         # |Monte Carlo estimate - exact| in standard errors

task = get_task("addition")
tok = task.tokenizer
print("tokenmdp", tokenmdp.__version__, "| torch", torch.__version__)
print(f"vocabulary: {tok.vocab_size} ids (PAD = {tok.PAD}, EOS = {tok.EOS}, then {tok.chars!r})")

# %% [markdown]
# ## 1. One batch type, two sources of tokens
#
# Three training prompts from the task's own sampler (it never draws a held-out prompt). For
# **SFT** the response is the demonstration, the answer followed by EOS, with reward 1.
# For **RL** each prompt gets a *group* of $G = 3$ responses; here we write them by hand (one
# right, two wrong, one of them longer) so that the rewards differ, and section 2 samples real
# ones. The task scores every response exactly.
#
# `TokenBatch.from_sequences` builds both. It sets `advantage = loss_weight = 1` on the response
# tokens: the raw weights of pretraining, before any estimator has spoken.

# %%
examples = task.sample(3, np.random.default_rng(5))
prompts = [tok.encode(ex.prompt) for ex in examples]

# SFT: one demonstration per prompt, reward 1
sft_batch = TokenBatch.from_sequences(
    prompts, [tok.encode(ex.answer) + [tok.EOS] for ex in examples],
    rewards=[1.0] * len(examples))

# RL: a group of G = 3 responses per prompt (right, wrong, wrong), scored by the task
G = 3
rl_examples, rl_responses = hand_written_groups(tok, examples)  # answer, last digit +1, +3 then "0"
rl_batch = TokenBatch.from_sequences(
    [tok.encode(ex.prompt) for ex in rl_examples], rl_responses,
    rewards=[task.reward(ex, r) for ex, r in zip(rl_examples, rl_responses)],
    groups=[i for i in range(len(examples)) for _ in range(G)])

print(batch_summary(examples, sft_batch, rl_batch))

# %% [markdown]
# Now the estimators fill the two fields. SFT is an estimator like any other, `SFT_ESTIMATOR` of
# the trainer: REINFORCE with the reward as the advantage ($A = R = 1$) and the token mean. The RL
# batch gets MiniRL from the registry: group-mean advantage $A_i = R_i - \text{mean}_g R$ and the
# sequence mean of token sums ($w = 1/S$). MiniRL also corrects for the rollout engine
# ($\min(\pi_{\text{old}}/\mu, 5)$), so its batch needs `old_logprob` and `behavior_logprob`: we
# take both from a freshly initialized model, which makes this toy batch exactly on-policy
# ($\mu = \pi_{\text{old}}$, every ratio 1). `prepare` runs once per optimizer step, on whole groups.

# %%
model = build_model(TrainConfig(seed=0, **MODEL), tok.vocab_size)  # float32, seeded init
minirl = estimators.get("minirl")
print("SFT   :", SFT_ESTIMATOR)
print("MiniRL:", minirl)

with torch.no_grad():
    lp = model.token_logprobs(rl_batch.to(dtype=torch.float32)).double()
rl_batch = rl_batch.replace(old_logprob=lp, behavior_logprob=lp.clone())

sft_prepared = estimators.prepare(sft_batch, SFT_ESTIMATOR)
rl_prepared = estimators.prepare(rl_batch, minirl, max_len=MAX_NEW_TOKENS)

# one line per sequence: its text, reward, and the two fields on its loss tokens
print(fields_table(sft_prepared, tok, "SFT (A = 1, w = 1 / answer tokens of the step):"))
print(fields_table(rl_prepared, tok, "RL, MiniRL (A = R - group mean, w = 1 / S):"))

# %% [markdown]
# (`·` marks EOS.) The SFT weights are all $1/N$ with $N$ the number of answer tokens of the step;
# the RL weights are all $1/S$, one over the number of sequences, and the advantages are zero-sum
# within each group. Both batches then go through **the same** `estimators.loss`. For SFT the result
# must be the mean negative log-likelihood of the answer tokens; for the on-policy MiniRL batch
# (ratios 1, nothing clipped, IS factor 1) it must be $-\frac1S \sum_i A_i \sum_t \log\pi(y_{i,t})$.
# We check both against those formulas written out by hand.

# %%
def logprobs(batch: TokenBatch) -> torch.Tensor:
    # log π_θ of every token under the model, float64 like the batch
    return model.token_logprobs(batch.to(dtype=torch.float32)).double()


with torch.no_grad():  # values only: no update here
    sft_loss, _ = estimators.loss(logprobs(sft_prepared), sft_prepared, SFT_ESTIMATOR)
    rl_loss, rl_metrics = estimators.loss(logprobs(rl_prepared), rl_prepared, minirl)
    mean_nll = -logprobs(sft_prepared)[sft_prepared.loss_mask].mean()
    lp_rl = logprobs(rl_prepared)
adv_S = rl_batch.reward - rl_batch.reward.view(-1, G).mean(1).repeat_interleave(G)
by_hand = -(adv_S * rl_prepared.sequence_sum(lp_rl)).sum() / rl_batch.num_sequences

print(f"SFT: estimators.loss = {float(sft_loss):.10f}   mean NLL of the answers = {float(mean_nll):.10f}")
print(f"RL:  estimators.loss = {float(rl_loss):.10f}   -1/S Σ A_i Σ_t log π     = {float(by_hand):.10f}")
print(f"     clip fraction {float(rl_metrics['clip_fraction']):.0f}, "
      f"ratio π_θ/π_old in [{float(rl_metrics['r_min']):.3f}, {float(rl_metrics['r_max']):.3f}]")
assert abs(float(sft_loss - mean_nll)) < EXACT_TOL and abs(float(rl_loss - by_hand)) < EXACT_TOL

# %% [markdown]
# So an SFT step is an RL step whose "rollouts" are demonstrations, whose advantage is 1 and whose
# aggregation is the token mean (tutorial 4: the right convention for likelihood training). The
# trainer exploits this literally: `train(TrainConfig(mode="sft"))` replaces only the first stage of
# the RL loop (rollout, reward, `old_logprob` pass) with demonstrations, and then runs the same
# `prepare`, mini-batch split, `loss`, clipping and AdamW update.
#
# ## 2. The rollout engine is a different policy
#
# In production the sampler (vLLM, SGLang) is not the trainer (FSDP, Megatron): other kernels, other
# precision, other batch shapes. The distribution it samples from, $\mu$, is therefore not the
# trainer's $\pi_{\text{old}}$ even with identical weights. `RolloutEngine` reproduces this: it holds
# its own copy of the weights in its own precision and samples with a KV cache, recording
# $\log\mu$ of every sampled token and, in an MoE, **which experts it routed each token to**.
#
# The trainer's `old_logprob` pass (`compute_old_logprobs`) recomputes $\log\pi_{\text{old}}$ of
# the same tokens in float32. It records its own routing, and with `replay="r3"` (rollout routing
# replay, Zheng et al. 2025) it *replays the engine's experts* instead of choosing its own. Two
# numbers compare the passes: `routing_mismatch_rate`, the fraction of (token, layer) pairs whose
# expert sets differ, and `training_inference_kl`, the per-token $k_3$ estimate of
# $\mathrm{KL}(\mu \,\|\, \pi_{\text{old}})$ from the sampled tokens.
#
# We use the model of section 1 and sample 4 responses to each of 128 prompts at temperature 1
# with three engines. Its weights are the random initial ones, so its next-token distributions are
# nearly uniform and every KL below is small; section 3 shows both numbers again, measured by the
# trainer on a trained model.

# %%
rollout_prompts = [tok.encode(ex.prompt) for ex in task.sample(128, np.random.default_rng(6))
                   for _ in range(4)]
capacity = task.max_prompt_len() + MAX_NEW_TOKENS

print(f"{'engine':>6} {'replay':>6} {'routing mismatch':>17} {'KL(μ‖π_old), k3':>17}")
results = {}
for precision in ("fp32", "bf16", "fp16"):
    engine = RolloutEngine(model, precision=precision)
    sampled = packed_rollouts(engine, rollout_prompts, max_new_tokens=MAX_NEW_TOKENS,  # packed
                              eos_id=tok.EOS, capacity=capacity, seed=7)  # as the trainer packs
    for replay in ("none", "r3"):
        b = compute_old_logprobs(model, sampled, replay)
        mismatch = routing_mismatch_rate(b.token_extras[ENGINE_ROUTING], b.token_extras[OLD_ROUTING])
        kl = training_inference_kl(b, kind="k3")
        results[precision, replay] = (mismatch, kl)
        print(f"{precision:>6} {replay:>6} {mismatch:>17.4f} {kl:>17.2e}")

# %% [markdown]
# Three things to read off the table.
#
# * The **fp32** engine is the trainer up to floating-point summation order (KV-cache decoding vs
#   one packed pass): its KL is at the level of float32 round-off.
# * A **bf16** (or fp16) engine routes some (token, layer) pairs to other experts, because a
#   rounded router score can reorder two close ones. A token routed elsewhere goes through other
#   weights, so its log-probability can differ by far more than rounding: routing is the
#   discontinuous part of the mismatch.
# * **R3** makes the mismatch exactly 0 by construction: the `old_logprob` pass uses the engine's
#   experts wherever the engine recorded them. The KL drops but does not vanish: the gates and
#   every matrix product are still computed in a different precision. What is left is smooth, and
#   that is what the importance-sampling correction of the estimator (MiniRL's
#   $\min(\pi_{\text{old}}/\mu, 5)$) is for.
#
# Zheng et al. (2025, arXiv 2512.01374, Sec. 3.2 and 4.4) study both replays in large MoE
# models: R2 (section 4)
# works better when the updates are only slightly off-policy, R3 when they are far off-policy.
# Neither is better everywhere; which one to use depends on how many updates share a rollout.
#
# ### Exercise 1 — the k1 estimate of the bf16 engine's KL
#
# The table used $k_3$. The other common estimator is $k_1$, the plain average of
# $\log\mu - \log\pi_{\text{old}}$ over the tokens $\mu$ sampled (Schulman 2020, "Approximating
# KL divergence"). *Predict* its sign for the bf16 engine without replay and record it as
# `k1_prediction` (`"positive"` or `"negative"`), then compute it by hand from the batch's
# `behavior_logprob` and `old_logprob` and store it in `k1_answer`.

# %%
# Solution
k1_prediction = "negative"          # recorded before computing: "positive" or "negative"
engine = RolloutEngine(model, precision="bf16")
bf16_batch = packed_rollouts(engine, rollout_prompts, max_new_tokens=MAX_NEW_TOKENS,
                             eos_id=tok.EOS, capacity=capacity, seed=7)  # section 2's samples
old_none = compute_old_logprobs(model, bf16_batch, "none")
k1_terms = (old_none.behavior_logprob - old_none.old_logprob).double()[old_none.loss_mask]
k1_answer = float(k1_terms.mean())

# %%
# Check
tokenmdp.check("tr05_k1_estimate", k1_answer)
tokenmdp.check("tr05_predict_k1_sign", k1_prediction)

# %% [markdown]
# Negative, although a KL is never negative. $k_1$ is unbiased, but its terms take both signs, and
# their mean has a standard error far larger than the KL itself; $k_3 = (r - 1) - \log r$ with
# $r = \pi_{\text{old}}/\mu$ has the same expectation and is $\ge 0$ term by term:

# %%
k1_se = float(k1_terms.std() / k1_terms.numel() ** 0.5)
print(f"{k1_terms.numel()} tokens: k1 = {k1_answer:+.2e} ± {k1_se:.1e} ({k1_answer / k1_se:+.2f} s.e.)"
      f", k3 = {training_inference_kl(old_none, kind='k3'):.2e}, "
      f"share of negative k1 terms {float((k1_terms < 0).double().mean()):.2f}")

# %% [markdown]
# The $k_1$ estimate is within two standard errors of zero: noise, on a KL of order $10^{-6}$.
# The trainer logs both (`train_infer_kl_k1`, `train_infer_kl_k3`); read $k_1$ with its error
# bar, or read $k_3$.
#
# The transformer's KL cannot be computed exactly, but the same estimators can be checked where
# it can: the copy task of tutorial 1 with $\mu$ = its policy's logits rounded to bf16
# (`inference_copy`, tutorial 7). Summed over a response, both $k_1 = \log(\mu/\pi_{\text{old}})$
# and $k_3$ have expectation $\mathrm{KL}(\mu\,\|\,\pi_{\text{old}})$ of whole responses, which
# `sequence_kl` computes exactly.

# %%
toy_mdp, toy_old = copy_task()
toy_mu = inference_copy(toy_old, rounding="bf16")         # the engine: logits rounded to bf16
with torch.no_grad():
    toy_kl = float(sequence_kl(toy_mdp, toy_mu, toy_old))
    toy = sample(toy_mdp, toy_mu, 20000, generator=torch.Generator().manual_seed(0))
    log_w = toy_old.token_logprobs(toy) - toy_mu.token_logprobs(toy)   # log π_old/μ, 0 off y
    per_response = {"k1": toy.sequence_sum(-log_w),
                    "k3": toy.sequence_sum(torch.where(toy.loss_mask, torch.expm1(log_w) - log_w, 0))}
rows = [(k, float(v.mean()), float(v.std() / v.numel() ** 0.5), toy_kl) for k, v in per_response.items()]
assert all(abs(r[1] - r[3]) < Z_TOL * r[2] for r in rows)
table([r + ((r[1] - r[3]) / r[2],) for r in rows],
      ["estimator", "Monte Carlo", "± s.e.", "exact KL", "z"], fmt=".3g")

# %% [markdown]
# Both are unbiased; $k_1$'s error bar is about a thousand times wider than $k_3$'s, so from
# 20000 responses it cannot even tell the sign of a KL of $10^{-6}$, while $k_3$ pins it down.
# That is the transformer's table above, with the exact answer beside it.

# %% [markdown]
# ## 3. A real run: SFT, then MiniRL from the checkpoint
#
# Now the trainer itself: `train(TrainConfig(...))` runs the whole loop, writes
# `metrics.jsonl` and `checkpoint.pt` under `out_dir`, and returns the metric rows of the run. The
# configuration is that of `benchmarks/acceptance.py`, shortened to fit the notebook:
#
# * **SFT**: 400 steps of 64 demonstrations, learning rate $3\cdot10^{-3}$;
# * **RL**: MiniRL from the SFT checkpoint (`init=`), 200 steps of 16 prompts × $G = 8$ samples,
#   learning rate $3\cdot10^{-4}$, a bf16 rollout engine (so that the training–inference correction
#   has something to correct) and no routing replay (the trainer's default; try `replay="r3"`);
#   one mini-batch per step (`minibatches=1`, the default), so every update is the first on its
#   rollout: $\pi_\theta = \pi_{\text{old}}$ at the update, $r \equiv 1$, and PPO-style clipping of
#   $r$ is inert; the correction $\min(\pi_{\text{old}}/\mu, 5)$ is what acts;
# * **evaluation**: held-out exact-match accuracy on 200 prompts that training never draws,
#   near-greedy (temperature 0.01) with the same bf16 engine.
#
# Both runs share the model shape and seed. Together they take about 45 CPU seconds (one thread,
# measured on a two-core machine).

# %%
tmp = tempfile.TemporaryDirectory()
runs = Path(tmp.name)
common = dict(task="addition", max_new_tokens=MAX_NEW_TOKENS, eval_size=200,
              rollout_precision="bf16", seed=0, checkpoint_every=0, **MODEL)

sft_cfg = TrainConfig(mode="sft", steps=400, prompts_per_step=64, lr=3e-3, eval_every=100,
                      out_dir=str(runs / "sft"), **common)
sft_rows = train(sft_cfg)

rl_cfg = TrainConfig(mode="rl", estimator="minirl", init=str(runs / "sft" / "checkpoint.pt"),
                     steps=200, prompts_per_step=16, group_size=8, lr=3e-4, eval_every=50,
                     out_dir=str(runs / "rl"), **common)
rl_rows = train(rl_cfg)

print(run_summary(sft_rows, rl_rows))  # steps and time, the last RL row, max |r - 1|
assert all(r["clip_fraction"] == 0 for r in rl_rows)

# %% [markdown]
# Each row is one step: `reward` and `train_accuracy` of the step's samples (temperature 1),
# `response_length`, `entropy` of $\pi_{\text{old}}$ (from the same forward pass as the old
# log-probs, `model.token_outputs`), the training–inference KL and routing mismatch of section 2
# (now measured by the trainer on its own rollouts), the update's loss, gradient norm and clip
# fraction, `load_balancing` (the MoE Switch loss of the update passes, ~1 per layer when the
# experts share the tokens evenly; it joins the loss only with `load_balancing_coef > 0`), and
# `eval_accuracy` on evaluation steps. The evaluation steps:

# %%
n_eval = rl_cfg.eval_size
# one line per evaluation step; the train reward and the KL are means since the previous one
print(evaluation_table({"SFT": sft_rows, "RL": rl_rows}, n_eval))
sft_acc = sft_rows[-1]["eval_accuracy"]
rl_acc = rl_rows[-1]["eval_accuracy"]
print(f"\nheld-out accuracy: SFT checkpoint {sft_acc:.3f}, after {len(rl_rows)} MiniRL steps {rl_acc:.3f}"
      f" ({100 * (rl_acc - sft_acc):+.1f} points;"
      f" each accuracy ± {100 * binomial_se(rl_acc, n_eval):.1f} points SE)")

# %% [markdown]
# The curves on one step axis: the RL run starts where SFT stopped (its step 0 is step
# 400 of the whole pipeline), the held-out accuracies carry ±1 binomial standard error, and the
# SFT run logged neither a reward nor a training–inference KL (it samples nothing).
# (`tokenmdp plot` draws each run's metrics on its own axis.)

# %%
fig = training_curves(sft_rows, rl_rows, n_eval)  # the RL run continues the SFT steps
plt.show()

# %% [markdown]
# The SFT curve rises to the accuracy of the checkpoint. The RL reward is noisy (16 prompts per
# step, and prompts differ a lot in difficulty), and the held-out accuracy of 200 prompts has a
# standard error of several points, comparable to its changes between evaluations: a 200-step run
# shows the direction, not a converged result. The KL panel repeats exercise 1's lesson along the
# run: the per-step $k_1$ dips below zero, $k_3$ never does.
# `benchmarks/acceptance.py` runs the same recipe (SFT until a target held-out accuracy, then a
# few minutes of RL) over three seeds on a larger evaluation set; the README reports the mean
# gain and its standard error.
#
# ## 4. Exercise 2: what does R2 do to the `old_logprob` pass?
#
# R2 ("routing replay 2") records the routing of the `old_logprob` pass and replays it in every
# *update* pass of the step, so that the mini-batch updates after the first see the same experts as
# $\pi_{\text{old}}$. Sample with the bf16 engine of section 2 again (same prompts, same generator
# seed: exercise 1's `bf16_batch`). *Predict* which of section 2's numbers R2's routing mismatch
# against the engine reproduces: (a) the bf16 engine's without replay, (b) its mismatch with R3,
# or (c) neither? Record it as `r2_prediction` (`"a"`, `"b"` or `"c"`); then run
# `compute_old_logprobs` with `"r2"` and store that mismatch in `r2_mismatch`.

# %%
# Solution
r2_prediction = "a"                 # recorded before computing: "a", "b" or "c"
old_r2 = compute_old_logprobs(model, bf16_batch, "r2")
r2_mismatch = routing_mismatch_rate(old_r2.token_extras[ENGINE_ROUTING],
                                    old_r2.token_extras[OLD_ROUTING])

# %%
# Check
tokenmdp.check("tr05_r2_routing_mismatch", r2_mismatch)
tokenmdp.check("tr05_predict_r2_mismatch", r2_prediction)

# %%
same_old = torch.equal(old_r2.old_logprob, old_none.old_logprob)
print(f"R2's old_logprob identical to no replay's: {same_old}; mismatch: R2 {r2_mismatch:.4f}, "
      f"none {results['bf16', 'none'][0]:.4f}, R3 {results['bf16', 'r3'][0]:.4f}")

# %% [markdown]
# R2 leaves the `old_logprob` pass alone: it routes by itself, exactly as without replay, so the
# gap between $\mu$ and $\pi_{\text{old}}$ is untouched. What R2 removes is the routing drift *within*
# a step, between $\pi_{\text{old}}$ and the $\pi_\theta$ of the later mini-batch updates (it is a
# no-op with one mini-batch per step). R3 removes the routing part of the *training–inference* gap
# instead. Which matters more depends on how off-policy the updates are, the question
# `benchmarks/replay_study.py` asks.
#
# ## 5. Failure mode: skip the `old_logprob` pass
#
# A tempting shortcut: the engine already returned a log-probability for every token, so use it as
# `old_logprob` and save a forward pass. Then $\pi_{\text{old}}/\mu \equiv 1$ by construction:

# %%
shortcut = bf16_batch.replace(old_logprob=bf16_batch.behavior_logprob.clone())  # BROKEN ON PURPOSE
print(f"KL(μ ‖ π_old) k3: with the old pass {training_inference_kl(old_none, kind='k3'):.2e}, "
      f"with the shortcut {training_inference_kl(shortcut, kind='k3'):.1e}; largest log-ratio "
      f"{float((shortcut.old_logprob - shortcut.behavior_logprob).abs().max()):.0e}")
assert training_inference_kl(shortcut, kind="k3") == 0.0

# %% [markdown]
# Every diagnostic now reads a perfect match, and MiniRL's correction $\min(\pi_{\text{old}}/\mu, 5)$
# is 1 on every token: the estimator silently becomes `minirl_no_is`, and the ratio $r$ of later
# mini-batches is measured against the engine's numerics instead of the trainer's. The mismatch is
# still there; only its measurement is gone.
#
# ## What verl / TRL / others call this
#
# Generated from the estimator registry's aliases:

# %%
alias_box(["minirl"])

# %% [markdown]
# ## Summary
#
# * SFT and RL are one loop over one batch type: SFT is `advantage` 1 with token-mean weights, RL
#   fills `advantage` and `loss_weight` from the estimator, and `estimators.loss` is shared.
# * A rollout engine in another precision samples from $\mu \ne \pi_{\text{old}}$; in an MoE part
#   of the gap is routing, which R3 replays away, leaving a smooth gap for the IS correction; R2
#   replays the old pass's routing in the later updates instead (Zheng et al.: R2 is better when
#   slightly off-policy, R3 when far). $k_1$ estimates of that KL can be negative; $k_3$ cannot.
# * `train(TrainConfig(...))` runs SFT and MiniRL with the same code; its metric rows (and
#   `metrics.jsonl`, `tokenmdp plot`) show reward, held-out accuracy, KL and routing mismatch.

# %%
tmp.cleanup()  # the two run folders
