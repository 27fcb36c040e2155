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
# # Tutorial 11 — Branching rollouts: a tree of responses is a gradient estimator
#
# **The question.** A *tree rollout* generates a prefix once and forks it into several
# continuations, so a group of $G$ responses costs fewer generated tokens than $G$ independent
# ones. Is the gradient computed from the tree's leaves still an estimate of $\nabla J$, and at an
# equal budget of *generated* tokens, is it a better one than an independent group's?
#
# Tree rollouts are argued for by training curves: TreeRL (Hou et al. 2025, arXiv 2506.11902)
# forks at the tokens of highest entropy and gives each prefix a value from the leaves below it;
# VinePPO (Kazemnejad et al. 2024, arXiv 2410.01679) estimates values by Monte Carlo
# continuations from intermediate states; TreePO (Li et al. 2025, arXiv 2508.17445) samples
# segment by segment and shares the KV cache of common prefixes. On an exact MDP the law of the
# trees is known, so each tree estimator's mean and variance are computable. In this notebook we
#
# 1. draw a tree, read it as one batch (one sequence per leaf, a node id per token) and count
#    what it costs;
# 2. ask when a leaf is a sample of the sampler $\mu$, exactly and by Monte Carlo, and what that
#    means for leaf-level REINFORCE; repair it with *splitting weights*;
# 3. find the weight of a token that several leaves share, and why a baseline taken from the
#    tree's own leaves gives a shared stem **no gradient at all** (the failure mode);
# 4. see what forks chosen *after* the chain is drawn (TreeRL's entropy forks) do to the leaves;
# 5. compare tree estimators with independent groups at equal generated-token budget;
# 6. go to the trainer: a tree packed once under a tree attention mask gives the expanded loss.
#
# Everything runs in float64 on a CPU in well under a minute.

# %% [markdown]
# ## Setup
#
# The course's copy task (`tokenmdp.course.setups.copy_task()`: prompts $x \in \{0, 1\}$,
# tokens $\{0, 1, \text{EOS}\}$, at most $L = 3$ response tokens, +1 per token that copies the
# prompt, −1 for a truncated response) and its seeded tabular policy, which is also the sampler:
# on-policy, $\mu = \pi$. One step is one prompt's group of $G = 4$ nominal leaves.

# %%
# %matplotlib inline
import matplotlib.pyplot as plt
import torch

import tokenmdp
from tokenmdp import estimators
from tokenmdp.course.display import alias_box, show
from tokenmdp.course.setups import copy_task
from tokenmdp.course.tutorials import t11
from tokenmdp.course.tutorials.t11_figures import leaf_law_figure
from tokenmdp.exact import expected_length, gradient, objective, sequence_probs
from tokenmdp.exact.branching import TreeWorkspace, sample_trees
from tokenmdp.model import ModelConfig, MoETransformer, tree_attention_mask
from tokenmdp.rl.rollout import RolloutEngine
from tokenmdp.tree_packing import pack_tree
from tokenmdp.tree_schedules import EntropyForks, FixedForks
from tokenmdp.tree_training import packed_tree_logprobs
from tokenmdp.trees import batch_from_trees, tree_structure

# Named tolerances for the checks in this notebook.
EXACT_TOL = 1e-12  # two exact float64 computations of the same quantity
Z_TOL = 4.0        # |Monte Carlo estimate - exact| in standard errors

torch.set_num_threads(1)           # tiny tensors: one thread is fastest
G = 4
print("tokenmdp", tokenmdp.__version__, "| torch", torch.__version__)

mdp, pi = copy_task()
ws = TreeWorkspace(mdp, pi, reference=pi)          # π_ref = π: GRPO's KL term is zero here
true_grad = gradient(mdp, pi)
with torch.no_grad():
    mu_N = sequence_probs(mdp, pi) * mdp.prompt_probs[mdp.terminal_prompt_index]   # D(x) μ(y|x)
    mean_length = float(expected_length(mdp, pi))
scores = t11.score_matrix(mdp, pi)                 # σ(y) = ∇ log π(y|x), one row per response
rewards = mdp.rewards
assert (mu_N.sum() - 1).abs() < EXACT_TOL
score_check = float(((mu_N * rewards) @ scores - true_grad).abs().max())
assert score_check < EXACT_TOL
with torch.no_grad():
    J = float(objective(mdp, pi))
print(f"{mdp.num_sequences} responses, J = {J:.4f}, E|y| = {mean_length:.4f}, "
      f"‖∇J‖ = {float(true_grad.norm()):.4f}")
print(f"∇J = Σ_y D(x) μ(y|x) R(y) σ(y) to {score_check:.1e}")

# %% [markdown]
# ## 1. A tree is a batch
#
# `FixedForks((1,), (4,))` (text form `fixed:1x4`) generates one first token, then forks every
# live branch into 4 after it. `sample_trees` draws trees with an explicit generator; each is a
# `ResponseTree` (tokens and parent pointers, a reward per leaf), and `batch_from_trees` turns
# trees into the one batch type of the library: **one sequence per leaf**, root to leaf, and
# `token_extras["tree_node"]` naming the node of every token. Tokens that several sequences share
# carry one id: they are one transition, generated once.

# %%
one_level = FixedForks((1,), (4,))
drawn = sample_trees(mdp, pi, one_level, 3, generator=torch.Generator().manual_seed(3))
tree = next(t for t in drawn.trees if len(t.leaves) == G)      # one that forked
print(t11.tree_text(tree, eos=mdp.eos))
batch = batch_from_trees([tree])
print("\ntokens   \n", batch.tokens)
print("tree_node\n", batch.token_extras["tree_node"])
structure = tree_structure(batch)
print(f"\n{structure.num_nodes} distinct nodes (prompt included) for {int(batch.length.sum())} "
      f"response tokens in {batch.num_sequences} sequences; "
      f"generated {tree.generated_tokens}, expanded {tree.expanded_tokens}")
assert tree.generated_tokens < tree.expanded_tokens

# %% [markdown]
# A branch that emits EOS *before* a fork depth does not fork: its one leaf stands for the
# branches it did not grow, and that tree has fewer than $G$ leaves.

# %%
short = next(t for t in sample_trees(mdp, pi, one_level, 50,
                                     generator=torch.Generator().manual_seed(0)).trees
             if len(t.leaves) == 1)
print(t11.tree_text(short, eos=mdp.eos))

# %% [markdown]
# ### Exercise 1 — what a tree costs
#
# An i.i.d. group of 4 generates $4\,\mathbb{E}_\mu|y|$ tokens on average (EOS counted). A
# `fixed:1x4` tree generates its first token once and then four continuations (or nothing more,
# when the first token is EOS). *Predict* first: on average, does the tree generate **fewer**,
# **exactly** or **more** than 3 tokens less than the i.i.d. group? Record it as
# `saving_prediction` (`"fewer"`, `"exactly"` or `"more"`). Then compute the expected generated
# tokens of one `fixed:1x4` tree from `mean_length` alone, without the tree law, as
# `tree_tokens`.
#
# *Hint:* when the first token is EOS, how many tokens do the four continuations have after it?

# %%
# Solution
saving_prediction = "exactly"       # recorded before computing
# tokens = 1 + 4 (|y| - 1) for every first token: after an EOS all four continuations are
# empty, and |y| - 1 = 0. So E[tokens] = 1 + 4 (E|y| - 1) = 4 E|y| - 3, whatever μ is.
tree_tokens = 4 * mean_length - 3

# %%
# Check
tokenmdp.check("tr11_predict_tree_saving", saving_prediction)
tokenmdp.check("tr11_generated_tokens", tree_tokens)

# %% [markdown]
# The exact law of the trees (`ws.law(schedule)`, every tree up to the order of siblings with
# its probability) agrees, and so does a Monte Carlo count:

# %%
law_one = ws.law(one_level)
mc_tokens = sample_trees(mdp, pi, one_level, 4000,
                         generator=torch.Generator().manual_seed(1)).generated_tokens.double()
mc_mean, mc_se = float(mc_tokens.mean()), float(mc_tokens.std() / 4000 ** 0.5)
print(f"{law_one.num_trees} trees; E[generated] exact {law_one.expected('generated_tokens'):.6f}, "
      f"Monte Carlo {mc_mean:.4f} ± {mc_se:.4f}; i.i.d. group of 4: {4 * mean_length:.6f}; "
      f"E[leaves] = {law_one.expected('leaves'):.4f}")
assert abs(law_one.expected("generated_tokens") - tree_tokens) < EXACT_TOL
assert abs(mc_mean - tree_tokens) < Z_TOL * mc_se

# %% [markdown]
# The tree saves exactly three tokens on average, but it also has fewer leaves: an EOS first
# token leaves one response where the group has four. Cost per leaf is what a budget buys, and
# section 5 compares at equal budget.
#
# ## 2. When is a leaf a sample of $\mu$?
#
# Each leaf-level estimator (REINFORCE, RLOO, GRPO over the leaves) treats the leaves as a group
# of samples. Its mean depends only on how often each response appears as a leaf. With the
# leaves averaged ($1/n$ each, the sequence mean), that is the **leaf law**
# $q(y) = \mathbb{E}\big[\tfrac1n \sum_{\text{leaves}} \mathbb{1}\{y_\ell = y\}\big]$, and
# leaf-level REINFORCE $\hat g = \frac1n\sum_\ell R(y_\ell)\,\sigma(y_\ell)$ has mean
# $\sum_y q(y) R(y) \sigma(y)$: it is unbiased for every reward exactly when $q = \mu$.
#
# A fork at a **fixed** depth is a stopping time: it looks at no token. So every one of the
# $\prod B$ *slots* of a fixed-fork tree is marginally a $\mu$ sample, where a leaf that ended
# before a fork fills the slots of all the branches it skipped. With one fork level every tree
# has 1 or $G$ leaves, both weighted correctly by $1/n$; with two levels it need not be. Compare
# the leaf law with $\mu$ (`law.leaf_marginal("leaves")`) on three schedules.
#
# *Predict*: on the two-level schedule `fixed:0x2,1x2` (two branches from the prompt, each
# forking into two after one token), is leaf-level REINFORCE **unbiased** or **biased**? Record
# it as `two_level_prediction`; the next exercise checks it.

# %%
two_level = FixedForks((0, 1), (2, 2))
entropy = EntropyForks((1,), (3,))
SCHEDULES = {"fixed:1x4": one_level, "fixed:0x2,1x2": two_level, "entropy:1x3": entropy}
N_MC = 3000
panels, tv = {}, {}
for name, schedule in SCHEDULES.items():
    q = ws.law(schedule).leaf_marginal("leaves")
    sample = sample_trees(mdp, pi, schedule, N_MC, generator=torch.Generator().manual_seed(7))
    W = t11.leaf_weight_matrix(sample.grown, schedule, mdp.num_sequences, "leaves")
    est, se = W.mean(0), W.std(0) / N_MC ** 0.5
    z = ((est - q).abs() / se.clamp_min(1e-12))[se > 0]
    tv[name] = float((q - mu_N).abs().sum() / 2)
    panels[f"{name}: TV(q, μ) = {tv[name]:.4f} (exact); max |MC − exact| = "
           f"{float(z.max()):.1f} s.e."] = (q, est, se)
    assert float(z.max()) < Z_TOL
labels = [f"{mdp.prompts[int(mdp.terminal_prompt_index[i])][0]}|"
          + "".join("E" if t == mdp.eos else str(t) for t in y)
          for i, (_, y) in enumerate(mdp.responses())]
leaf_law_figure(mu_N, panels, labels=labels)
plt.show()
assert tv["fixed:1x4"] < EXACT_TOL and tv["fixed:0x2,1x2"] > 0.01 and tv["entropy:1x3"] > 0.01

# %% [markdown]
# One fork level: the leaf law *is* $\mu$ (to rounding error). Two levels: it is not. A tree
# in which one of the two first branches ended at once (an EOS first token) has three leaves,
# and its short leaf gets $1/3$ instead of the $1/2$ its two slots are worth, so the response
# that ends at once is under-represented and the others over-represented. The Monte Carlo
# points sit on the exact bars within their error bars.
#
# ### Exercise 2 — the bias of leaf-level REINFORCE on two fork levels
#
# Without `moments`, write the exact mean of leaf-level REINFORCE on `fixed:0x2,1x2` from its
# leaf law, $\mathbb{E}\hat g = \sum_y q(y)R(y)\sigma(y)$ (`scores` holds $\sigma(y)$ row by row,
# `rewards` holds $R(y)$), and its relative bias $\lVert\mathbb{E}\hat g -
# \nabla J\rVert/\lVert\nabla J\rVert$ as `two_level_bias`.

# %%
# Solution
two_level_prediction = "biased"     # recorded before computing
q_two = ws.law(two_level).leaf_marginal("leaves")
mean_two = (q_two * rewards) @ scores
two_level_bias = float((mean_two - true_grad).norm() / true_grad.norm())

# %%
# Check
tokenmdp.check("tr11_predict_two_level_bias", two_level_prediction)
tokenmdp.check("tr11_two_level_bias", two_level_bias)

# %% [markdown]
# The library's exact moments of the registry's `reinforce` on the same trees (every tree of the
# law through `prepare` and `loss`, `ws.moments`) agree, and Monte Carlo over sampled trees sits
# within its standard error:

# %%
exact_two = ws.moments("reinforce", two_level, method="exact")
mc_two = ws.moments("reinforce", two_level, method="monte_carlo", num_samples=N_MC,
                    generator=torch.Generator().manual_seed(11))
print(f"reinforce on fixed:0x2,1x2: relative bias {exact_two.relative_bias:.4f} (exact), "
      f"{mc_two.relative_bias:.4f} (Monte Carlo, {N_MC} trees)")
z_two = (mc_two.mean - exact_two.mean).abs() / mc_two.mean_se
print(f"largest |MC − exact| over the {z_two.numel()} components: {float(z_two.max()):.2f} s.e.")
assert float((exact_two.mean - mean_two).abs().max()) < EXACT_TOL
assert float(z_two.max()) < Z_TOL

# %% [markdown]
# ### Splitting weights repair it
#
# Weigh each leaf by its slots over $G$ instead of $1/n$: the leaf that ended before the second
# fork counts for the two branches it skipped. This is the *splitting* estimator of rare-event
# simulation: at every fork the children's estimates are averaged, so by the tower property the
# mean of the tree's estimate is $\mathbb{E}_\mu[R\,\sigma] = \nabla J$. The slot-weighted leaf
# law (`leaf_marginal("slots")`) is $\mu$ exactly, and so the estimator is unbiased, exactly and
# by Monte Carlo:

# %%
split_exact = t11.exact_leaf_moments(ws.law(two_level), scores, rewards, true_grad, "slots")
split_mc = t11.sampled_leaf_moments(
    sample_trees(mdp, pi, two_level, N_MC, generator=torch.Generator().manual_seed(12)),
    scores, rewards, true_grad, "slots")
q_slots = ws.law(two_level).leaf_marginal("slots")
print(f"slot-weighted leaf law: max |q − μ| = {float((q_slots - mu_N).abs().max()):.1e}")
print(f"slot-weighted REINFORCE on fixed:0x2,1x2: relative bias {split_exact.relative_bias:.1e} "
      f"(exact), variance {split_exact.total_variance:.4f} vs {exact_two.total_variance:.4f} "
      f"with 1/n weights")
z_split = (split_mc.mean - split_exact.mean).abs() / split_mc.mean_se
print(f"Monte Carlo: largest |MC − exact| {float(z_split.max()):.2f} s.e.")
assert split_exact.relative_bias < 1e-10 and float(z_split.max()) < Z_TOL

# %% [markdown]
# ## 3. The weight of a shared token, and a stem nobody trains
#
# Every estimator here is computed on the **expanded** paths: a token of node $n$ appears once in
# each of the $|L(n)|$ sequences through it, so its gradient weight is the **sum over its
# leaves**, $\sum_{i\in L(n)} w_i A_{i,t}$. (This is the token-mean question of tutorial 4, on a
# tree: does a shared token count once per leaf, or once?) With a baseline taken from the tree's
# own leaves (RLOO, GRPO, the node values), the advantages of the leaves below the root of a
# one-level tree sum to zero, and so does the weight of the token they all share. Look at one
# tree under RLOO:

# %%
rloo = estimators.get("rloo")
step = estimators.prepare(batch_from_trees([tree]), rloo)
node = tree_structure(step).node_RC
stem = (node == node[0, 1]) & step.loss_mask               # the first response token's copies
print("advantage of each leaf:", [round(float(a), 4) for a in step.advantage[:, 1]])
print(f"weight of the shared first token: Σ_leaves w A = "
      f"{float((step.advantage * step.loss_weight)[stem].sum()):+.1e}")
assert abs(float((step.advantage * step.loss_weight)[stem].sum())) < EXACT_TOL
prompt_logits = t11.prompt_state_mask(mdp, pi)   # the logits of the first token's states

# %% [markdown]
# *Predict*: what is RLOO's **expected** gradient on the logits of the prompt states (the first
# response token's distribution) when the tree forks only after one token (`fixed:1x4`):
# **zero**, **smaller** than $\nabla J$'s there, or **unchanged**? Record it as
# `stem_prediction`.
#
# ### Exercise 3 — what RLOO on a stem estimates
#
# Below the first token, the four continuations are an i.i.d. group from the state it reached,
# and RLOO over them is unbiased for that state's value gradient. Use this to write RLOO's
# expected gradient on `fixed:1x4` from `true_grad` and `prompt_logits` (the mask of the prompt
# states' logits), without `moments`, and give its cosine with $\nabla J$ as `stem_cosine`.

# %%
# Solution
stem_prediction = "zero"            # recorded before computing
rloo_mean = torch.where(prompt_logits, 0.0, true_grad)     # ∇J without the first token's part
stem_cosine = float(rloo_mean @ true_grad / (rloo_mean.norm() * true_grad.norm()))

# %%
# Check
tokenmdp.check("tr11_predict_stem_gradient", stem_prediction)
tokenmdp.check("tr11_stem_cosine", stem_cosine)

# %%
exact_stem = ws.moments("rloo", one_level, method="exact")
print(f"RLOO on fixed:1x4 (exact): relative bias {exact_stem.relative_bias:.4f}, cosine "
      f"{exact_stem.cosine:.4f}; {exact_stem.skipped:.3f} of the trees have one leaf (skipped)")
print(f"max |E ĝ − ∇J with the prompt logits zeroed| = "
      f"{float((exact_stem.mean - rloo_mean).abs().max()):.1e}")
print(f"E ĝ on the prompt logits: {float(exact_stem.mean[prompt_logits].abs().max()):.1e};  "
      f"∇J there: {float(true_grad[prompt_logits].norm()):.4f}")
assert float((exact_stem.mean - rloo_mean).abs().max()) < EXACT_TOL

# %% [markdown]
# ### Failure mode: a stem with a baseline from its own leaves
#
# The mean gradient of RLOO on `fixed:1x4` is exactly $\nabla J$ with the first token's part
# cut out: in expectation the first token is **never** trained. The same holds for every
# estimator whose baseline comes from the tree's leaves (GRPO, and all the tree entries: the node
# values are means of the leaves below), for every prefix that all leaves share. Follow the
# expected gradient for a few steps and watch the first token's distribution: with an i.i.d.
# group it learns to copy the prompt; on a stem it does not move.

# %%
def expected_ascent(draw, steps=8, lr=4.0):
    policy = copy_task()[1]
    first_copy = []
    for _ in range(steps):
        work = TreeWorkspace(mdp, policy)
        m = work.iid("rloo", G, method="exact") if draw == "iid" else work.moments("rloo", draw)
        with torch.no_grad():
            first = torch.softmax(policy.table[:mdp.num_prompts], -1)
            first_copy.append(float(mdp.prompt_probs @ first[[0, 1], [0, 1]]))
            policy.table += lr * m.mean.reshape(policy.table.shape)
    return first_copy


for label, draw in (("iid:4", "iid"), ("fixed:1x4", one_level)):
    track = expected_ascent(draw)
    print(f"{label:>10}: P(first token copies the prompt) " +
          " ".join(f"{p:.3f}" for p in track))
    if draw != "iid":
        assert max(track) - min(track) < EXACT_TOL

# %% [markdown]
# TreeRL grows several trees per prompt from independent initial chains ($M$ in its EPTree; Hou
# et al., Sec. 3.1), which is a fork **at the prompt** (depth 0): it gives the first token leaves
# that disagree. The cure in the
# schedule is `fixed:0x...`; in the estimator, a baseline that does not come from the leaves
# below the shared prefix (REINFORCE's none, a learned value).
#
# ## 4. Forks chosen after the chain is drawn
#
# TreeRL's EPTree samples one chain, then forks at the prefix states where the sampler's
# entropy is highest (`EntropyForks((1,), (3,))`: one such state, three new children). The fork
# point now depends on the tokens of the chain, so a leaf is not a $\mu$ sample (the third panel
# of the figure above), and the slots cannot help: every leaf of a schedule of rounds is one
# slot. The bias is *selection*, not weighting:

# %%
for name in ("reinforce", "rloo"):
    m = ws.moments(name, entropy, method="exact")
    mc = ws.moments(name, entropy, method="monte_carlo", num_samples=N_MC,
                    generator=torch.Generator().manual_seed(13))
    z = float(((mc.mean - m.mean).abs() / mc.mean_se).max())
    print(f"{name:>10} on entropy:1x3: relative bias {m.relative_bias:.4f} (exact, "
          f"{ws.law(entropy).num_trees} trees), {mc.relative_bias:.4f} (Monte Carlo); "
          f"largest |MC − exact| {z:.2f} s.e.")
    assert z < Z_TOL
assert ws.moments("reinforce", entropy).relative_bias > 0.1

# %% [markdown]
# ## 5. At equal generated-token budget
#
# A step that generates $c$ tokens on average can be repeated $B/c$ times on a budget of $B$
# tokens: the mean of those steps keeps the bias and divides the variance by $B/c$
# (`at_budget`). So a tree wins at equal budget when its variance *per generated token*
# ($\operatorname{tr}\operatorname{Cov}\cdot c$) is lower, unless its bias, which no budget
# removes, costs more. `t11.budget_table` prints, for a few estimators, the exact bias, the
# variance, the cost and $\mathrm{MSE}(c^*)$ (after the best rescaling) at $B$ = one i.i.d. group
# of 4 and at $16B$, and that MSE relative to the same estimator on an i.i.d. group.

# %%
NAMES = ("reinforce", "rloo", "grpo", "tree_value_diff", "treerl", "vineppo_tree")
DRAWS = (G, one_level, two_level, FixedForks((0, 2), (2, 2)), entropy, EntropyForks((3,), (1,)))
budget_rows = t11.budget_table(ws, NAMES, DRAWS)
print(budget_rows)

# %% [markdown]
# Read it row by row.
#
# * **Cost.** Every tree generates fewer tokens than the group (9.07 on average), from 5.5 to
#   7.2.
# * **Variance.** Correlated leaves carry less information each: REINFORCE's variance per step
#   is higher on every tree, and so is its variance per generated token (`var·tok`), 1.7 to 2.6
#   against the group's 1.54. The tokens saved do not pay for the correlation.
# * **Bias.** Only REINFORCE on `fixed:1x4` is unbiased. The leaf baselines pay for their stems
#   (`fixed:1x4`), and every estimator pays for entropy forks. REINFORCE's small MSE on
#   `fixed:0x2,2x2` at $16B$ is a rescaling effect: its bias lies mostly along $\nabla J$
#   (cosine 0.998, mean 1.14 times as long), which the best step size $c^*$ absorbs.
# * **The tree entries.** On an i.i.d. group (`iid:4` is a tree that forks at the prompt only)
#   the node-value estimators train the first token and nothing else: a node with one leaf below
#   has the value of that leaf, so every advantage after a branch's first token is zero. Trees
#   with forks below the prompt give them more to work with, so on trees they beat their own
#   i.i.d. group (`vs iid@16B` below 1), but they stay far behind REINFORCE or RLOO on an
#   i.i.d. group.
#
# Three checks: the node-value entries give no gradient below the first token of an i.i.d.
# group; `tree_value_diff` and `tree_return_minus_value` give the same gradient (the sum over a
# node's leaves of $R_i$ is $|L(n)|\hat V(n)$, so the two advantages sum to the same weight on
# every node); and the unbiased estimators, compared by their variance per generated token.

# %%
rows = {(r[0], r[1]): r for r in budget_rows.rows}
value_iid = ws.iid("tree_value_diff", G, method="exact").mean
print(f"tree_value_diff on iid:4: largest |E ĝ| below the first token "
      f"{float(value_iid[~prompt_logits].abs().max()):.1e}, on it "
      f"{float(value_iid[prompt_logits].abs().max()):.4f}")
assert float(value_iid[~prompt_logits].abs().max()) < EXACT_TOL
a = ws.moments("tree_value_diff", two_level).mean
b = ws.moments("tree_return_minus_value", two_level).mean
print(f"tree_value_diff vs tree_return_minus_value on fixed:0x2,1x2: max |Δ E ĝ| = "
      f"{float((a - b).abs().max()):.1e}")
assert float((a - b).abs().max()) < EXACT_TOL

iid_per_token = rows["reinforce", "iid:4"][6]
print(f"\nREINFORCE, variance × generated tokens (i.i.d. group of 4: {iid_per_token:.4f})")
print(f"{'schedule':>14} {'1/n: bias':>10} {'var·tok':>8} {'slots: bias':>12} {'var·tok':>8} "
      f"{'vs iid':>7}")
split_per_token = {}
for schedule in (one_level, FixedForks((2,), (4,)), two_level, FixedForks((0, 2), (2, 2)),
                 FixedForks((1, 2), (2, 2))):
    law = ws.law(schedule)
    cost = law.expected("generated_tokens")
    plain, split = (t11.exact_leaf_moments(law, scores, rewards, true_grad, w)
                    for w in ("leaves", "slots"))
    split_per_token[str(schedule)] = split.total_variance * cost
    assert split.relative_bias < 1e-10
    print(f"{str(schedule):>14} {plain.relative_bias:>10.4f} {plain.total_variance * cost:>8.4f} "
          f"{split.relative_bias:>12.1e} {split.total_variance * cost:>8.4f} "
          f"{split.total_variance * cost / iid_per_token:>7.3f}")
assert split_per_token["fixed:0x2,2x2"] < iid_per_token < split_per_token["fixed:1x4"]

# %% [markdown]
# This is the answer to the question, on this MDP. Leaf-level REINFORCE with splitting weights
# is unbiased on every fixed-fork tree. On one fork level its variance per generated token is
# *higher* than the group's (the four leaves of a `fixed:1x4` tree share their first token, and
# the three tokens saved do not make up for it). On two levels with a fork at the prompt it is
# *lower*: `fixed:0x2,2x2` needs about 9 % less variance per token than an i.i.d. group, so at
# any equal budget it is the better estimator, with no bias to trade. The leaf averages ($1/n$)
# on the same trees are biased and noisier; the baselines computed from the leaves are biased
# by their stems.

# %% [markdown]
# ## 6. The trainer world: a tree packed once
#
# In a trainer the expanded batch would run every shared prefix through the model once per
# leaf. `tokenmdp.tree_packing.pack_tree` lays each node out **once**, the nodes of a tree in
# depth-first preorder, so a node's descendants are the columns up to `tree_end`, and the tree
# attention mask is one comparison per pair: query $q$ sees key $k$ iff
# $k \le q < \text{tree\_end}[k]$, i.e. $k$ is $q$ or one of its ancestors. Every packed token
# keeps its position in its paths, so RoPE sees what the expanded path would. On the CPU the
# mask is a bool `attn_mask` of `scaled_dot_product_attention`; on CUDA the same predicate is a
# FlexAttention block mask. The log-probs are gathered back to the expanded layout, so the loss
# *is* the expanded loss, and the backward of the gather sums a shared token's gradient over its
# leaves: the weight of section 3.
#
# The rollout engine forks the same way: a fork replicates a row of its KV cache, so a shared
# prefix is fed to the model once. We sample two trees from a tiny MoE transformer in float64,
# pack them, and compare the packed pass's GRPO loss and gradient with the expanded one's.

# %%
config = ModelConfig(vocab_size=8, d_model=16, n_layers=1, n_heads=2, n_experts=4, top_k=2,
                     expert_hidden=16)
model = MoETransformer(config, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
rollout = RolloutEngine(model).generate_tree(
    [[1, 2, 3], [4, 5]], "fixed:1x2,3x2", max_new_tokens=5, eos_id=7,
    generator=torch.Generator().manual_seed(0), dtype=torch.float64)
print(rollout.stats)
tree_batch = rollout.batch.replace(reward=torch.tensor(
    [float(i % 3 == 0) for i in range(rollout.batch.num_sequences)], dtype=torch.float64))
packed = pack_tree(tree_batch)
print(f"packed: {packed.num_nodes} tokens (each node once) for {packed.num_expanded_tokens} "
      f"expanded tokens; first tree's mask (rows: queries, columns: keys)")
n0 = int((packed.node_RC[0] >= 0).sum())
for row in tree_attention_mask(packed.tree_end_RC)[0, 0, :n0, :n0].int().tolist():
    print("  " + "".join("■" if v else "·" for v in row))

grpo = estimators.get("tree_grpo")
with torch.no_grad():   # old log-probs off the current ones by a shift per position: ratios ≠ 1
    old = packed_tree_logprobs(model, tree_batch, packed) \
        - 0.05 * tree_batch.position * tree_batch.response_mask
prepared = estimators.prepare(tree_batch.replace(old_logprob=old), grpo, max_len=5)
params = list(model.parameters())
expanded_loss = estimators.loss(model.token_logprobs(prepared), prepared, grpo)[0]
packed_loss = estimators.loss(packed_tree_logprobs(model, prepared, packed), prepared, grpo)[0]
g_expanded = torch.autograd.grad(expanded_loss, params)
g_packed = torch.autograd.grad(packed_loss, params)
gap = max(float((x - y).abs().max()) for x, y in zip(g_expanded, g_packed))
size = max(float(x.abs().max()) for x in g_expanded)
loss_gap = abs(float((expanded_loss - packed_loss).detach()))
print(f"loss: expanded {float(expanded_loss.detach()):+.15f}, packed "
      f"{float(packed_loss.detach()):+.15f} (difference {loss_gap:.1e}); largest gradient entry "
      f"{size:.2e}, largest difference {gap:.1e}")
assert loss_gap < EXACT_TOL and gap < EXACT_TOL < size

# %% [markdown]
# On the command line the same trees train with any registry estimator:
# `tokenmdp train --rollout-tree fixed:2x2,4x2 --group-size 4 --estimator tree_grpo ...`
# (`entropy:NxT` for TreeRL's forks), with the generated and shared tokens in the metrics.
#
# ## What TreeRL and others call things
#
# * **Entropy forks** (`EntropyForks`, `entropy:NxT`) are TreeRL's EPTree (arXiv 2506.11902):
#   fork at the $N$ tokens of highest entropy, $T$ branches each, over $L$ iterations, from $M$
#   initial chains. TreePO (arXiv 2508.17445) also branches where the local uncertainty is high.
# * **Fixed forks** (`FixedForks`, `fixed:DxB`) are closest to TreePO's fixed-length segments,
#   which fork at segment boundaries.
# * **Node values** $\hat V(n)$, the mean reward of the leaves below a node, are TreeRL's values
#   of a node; VinePPO (arXiv 2410.01679) estimates the same value by $K$ extra Monte Carlo
#   continuations of a state that it does not train on; TreePO takes statistics of the subtree
#   (its "sub-group") below each node.
# * **`treerl`** is TreeRL's global advantage $\hat V(n) - \hat V(\text{root})$ plus its local
#   advantage $\hat V(n) - \hat V(p(n))$, divided by $\sqrt{|L(n)|}$; TreePO averages a leaf's
#   advantages relative to each subtree above it.
# * **`vineppo_tree`** is VinePPO's $\hat V(s_{t+1}) - \hat V(s_t)$, with values from the tree's
#   other leaves instead of extra rollouts.
# * **The expanded paths** are the root-to-leaf responses that all of them train on.
#
# The registry entries that need trees, with their formulas and what each leaves out of its
# paper, are listed with `estimators.names(trees=True)`:

# %%
show(alias_box(["treerl", "vineppo_tree", "tree_grpo", "tree_value_diff"],
               title="What TreeRL, VinePPO and others call this"))

# %% [markdown]
# ## Summary
#
# * A tree is a batch: one sequence per leaf, and a node id per token; shared tokens are one
#   transition. `fixed:1x4` generates $4\,\mathbb{E}|y| - 3$ tokens, three fewer than a group.
# * A leaf is a $\mu$ sample when the forks look at no token and each leaf is weighted by its
#   slots; with one fork level the plain $1/n$ mean is the same thing. Two fork levels with $1/n$
#   under-weight responses that ended early (biased); the splitting weights repair it exactly.
# * Forks chosen after the chain (entropy, random) select their leaves: biased, and no
#   weighting by slots repairs it.
# * A shared token's weight is the sum over its leaves. A baseline from the tree's own leaves
#   makes that sum zero for a prefix all leaves share: fork at the prompt.
# * At equal generated-token budget the correlation of the leaves eats most of the tokens saved:
#   one fork level loses to an i.i.d. group. Splitting weights on a tree that forks at the prompt
#   and again below it win (variance per generated token 9 % lower on `fixed:0x2,2x2`), unbiased.
#   The node-value entries beat their own i.i.d. group, not REINFORCE's or RLOO's.
# * In the trainer a tree is packed once under a tree attention mask, and its loss and gradient
#   are the expanded paths' to 1e-12.
