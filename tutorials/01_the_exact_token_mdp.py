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
# # Tutorial 1 — The exact token MDP
#
# **The question.** A trainer pushes up the log-probability of each sampled response in
# proportion to its reward. Does that follow the gradient of the expected reward, and how far
# from that gradient is the estimate one batch of samples gives?
#
# Reinforcement learning on a language model is usually explained with samples: draw some
# responses, score them, push up the log-probability of the good ones. Whether a given recipe
# estimates the right thing is then a matter of belief, because the thing it should estimate, the
# gradient of the expected reward, is never seen.
#
# In this notebook we make the environment small enough to **enumerate every response**. Then the
# expected reward $J(\theta)$ and its gradient $\nabla J(\theta)$ are sums we can compute exactly,
# and every estimator can be put next to the truth. We will
#
# 1. define the token MDP and count its responses in closed form;
# 2. draw a tiny one as a prefix tree, with the policy's probabilities on the edges;
# 3. compute $\nabla J$ three independent ways and watch them agree to rounding error, then a
#    fourth, state by state, with the policy-gradient theorem;
# 4. check the lemma that makes policy gradients work,
#    $\mathbb{E}_{a\sim\pi}[\nabla\log\pi(a|s)] = 0$, at every state;
# 5. put a Monte Carlo REINFORCE estimate, with its error bars, next to the exact gradient;
# 6. break the stop-gradient of the REINFORCE loss on purpose and compute what it costs;
# 7. finish with two "predict, then run" exercises, checked by `tokenmdp.check`.
#
# Everything runs on a CPU in float64, in well under a minute.

# %% [markdown]
# ## Setup
#
# All randomness comes from explicitly seeded `torch.Generator`s, so every number below is
# reproducible. The package computes in float64 throughout.

# %%
# %matplotlib inline
import copy
import itertools
import math

import matplotlib.pyplot as plt
import torch
from torch.nn.utils import parameters_to_vector, vector_to_parameters

import tokenmdp
from tokenmdp.course.display import alias_box, show
from tokenmdp.course.tutorials.t01 import (
    calibration_table,
    count_table,
    flat_grad_retained,
    leaf_table,
    lemma_table,
    monte_carlo_table,
    response_ids,
    response_table,
    route_agreement_table,
    route_table,
)
from tokenmdp.course.tutorials.t01_figures import monte_carlo_figure, prefix_tree_figure
from tokenmdp.exact import (
    LogLinearPolicy,
    NeuralPolicy,
    TabularPolicy,
    TokenMDP,
    flat_grad,
    gradient,
    objective,
    sample,
    sequence_probs,
    state_logprobs,
    state_visitation,
    values,
)

# Named tolerances for the checks in this notebook.
EXACT_TOL = 1e-12  # two exact computations of the same float64 quantity
FD_TOL = 1e-8      # central finite differences with step FD_STEP (error ~ FD_STEP**2 + eps/FD_STEP)
FD_STEP = 1e-5

print("tokenmdp", tokenmdp.__version__, "| torch", torch.__version__)

# Every tensor here is tiny: one CPU thread avoids the cost of synchronizing several.
torch.set_num_threads(1)

# %% [markdown]
# ## 1. The token MDP
#
# A language model answering a prompt is a sequential decision process with a very simple
# structure.
#
# * A **prompt** $x$ is drawn from a finite distribution $D(x)$.
# * The **state** at step $t$ is everything the model conditions on: $s_t = (x, y_{<t})$, the
#   prompt followed by the response prefix written so far.
# * The **action** is the next token, $a_t = y_t \in \{0, \dots, V-1\}$. Token $V-1$ is **EOS**.
# * The **transition** is deterministic: $s_{t+1} = s_t \cdot a_t$ (append the token).
# * The episode **ends** when the policy emits EOS, or is **truncated** when it reaches $L$
#   response tokens (`max_len`) without an EOS.
# * The **reward** $R(x, y)$ arrives once, at the end; every intermediate reward is 0 and nothing
#   is discounted.
#
# A policy $\pi_\theta(a \mid s)$ gives the probability of a whole response as a product of
# next-token probabilities, and the objective is the expected reward:
#
# $$
# \pi_\theta(y \mid x) = \prod_{t=1}^{|y|} \pi_\theta(y_t \mid x, y_{<t}),
# \qquad
# J(\theta) = \sum_x D(x) \sum_y \pi_\theta(y \mid x)\, R(x, y).
# $$
#
# **How many responses are there?** EOS can only be the last token, so with $b = V - 1$ non-EOS
# tokens a response is either $k$ non-EOS tokens followed by EOS ($k = 0, \dots, L-1$; there are
# $b^k$ of them) or $L$ non-EOS tokens cut at the limit ($b^L$ of them). Per prompt,
#
# $$
# N(V, L) = \sum_{k=0}^{L} b^k = \frac{b^{L+1} - 1}{b - 1} \quad (b > 1),
# \qquad N = L + 1 \quad (b = 1).
# $$
#
# The policy acts at the $\sum_{k=0}^{L-1} b^k$ prefixes per prompt that have not ended yet: those
# are the non-terminal states.
#
# Our reward: the prompt is a single token, and the response earns **+1 for every token that copies
# the prompt token** and **−1 if it is truncated** (it never said EOS). Any Python callable
# `reward(prompt, response) -> float` on token tuples will do; the MDP evaluates it once on every
# response and stores the table.

# %%
V, L = 3, 3          # tokens 0 and 1, and EOS = 2; at most 3 response tokens
EOS = V - 1


def copy_reward(prompt, response):
    # +1 per response token equal to the prompt token, -1 if the response was truncated
    copies = sum(token == prompt[0] for token in response)
    truncated = response[-1] != EOS
    return copies - 1.0 * truncated


mdp = TokenMDP(V, L, copy_reward, prompts=[(0,), (1,)], prompt_probs=[0.6, 0.4])
print(mdp)
print("non-terminal states:", mdp.num_states, "| EOS id:", mdp.eos)
print()
print(response_table(mdp, first=15))


# %% [markdown]
# The responses come in a fixed canonical order: prompt first, then EOS after 0, 1, …, $L-1$
# tokens, then the truncated ones. Every per-response tensor in `tokenmdp.exact` (rewards,
# probabilities) uses this order.
#
# Now the count. We check the closed form three ways: against `mdp.num_sequences`, against the
# length of the list of responses, and against a brute-force filter of *all* token strings of length
# 1 to $L$ (a string is a valid response if EOS appears only as its last token, and it either ends
# with EOS or has length $L$).

# %%
def closed_form_count(V, L):
    b = V - 1
    return L + 1 if b == 1 else (b ** (L + 1) - 1) // (b - 1)


def brute_force_count(V, L):
    eos = V - 1
    count = 0
    for n in range(1, L + 1):
        for y in itertools.product(range(V), repeat=n):
            no_inner_eos = eos not in y[:-1]
            ends = y[-1] == eos or n == L
            count += no_inner_eos and ends
    return count


# %%
counts = count_table([(2, 1), (2, 5), (3, 1), (3, 3), (4, 4), (5, 3)], closed_form_count,
                     brute_force_count)          # TokenMDP(V, L) with one prompt and zero reward
print(counts)
for v, l, exact, brute, enumerated, _ in counts.rows:
    assert enumerated == exact == brute == len(TokenMDP(v, l, lambda x, y: 0.0).responses())

per_prompt = closed_form_count(V, L)
assert mdp.num_sequences == mdp.num_prompts * per_prompt
assert mdp.num_states == mdp.num_prompts * sum((V - 1) ** k for k in range(L))
print(f"\nour MDP: {mdp.num_prompts} prompts x {per_prompt} responses = {mdp.num_sequences} "
      f"(mdp.num_sequences = {mdp.num_sequences})")

# A real model: V = 150000 tokens, responses up to 4000 tokens. How many digits does N have?
b_real, L_real = 150000 - 1, 4000
digits = (L_real + 1) * math.log10(b_real) - math.log10(b_real - 1)
print(f"V = 150000, L = 4000: N has about {digits:,.0f} decimal digits")

# %% [markdown]
# The count grows like $b^L$: with a real vocabulary ($V \approx 10^5$) and a few thousand tokens it
# has tens of thousands of digits. That is why practice only ever sees samples, and why the exact
# world has to stay tiny. Tiny is enough: every identity we check below is an algebraic fact that
# does not care about size.

# %% [markdown]
# ## 2. A tiny MDP drawn as a prefix tree
#
# Each state is a node; each action is an edge labelled with its token and its probability
# $\pi(a \mid s)$; each full response is a leaf, labelled with its reward and its probability
# $\pi(y \mid x)$, the product of the edge probabilities on its path.
#
# The policy is a `TabularPolicy`: a free vector of $V$ logits at every state, so
# $\pi(\cdot \mid s) = \mathrm{softmax}(\theta_s)$. It has `num_states × V` parameters, here
# $14 \times 3 = 42$. Its initial logits are drawn from $\mathcal{N}(0, 1)$ with a seeded generator.

# %%
policy = TabularPolicy(mdp, generator=torch.Generator().manual_seed(0), init_std=1.0)
print("parameters:", sum(p.numel() for p in policy.parameters()), "=", tuple(policy.table.shape))

fig = prefix_tree_figure(mdp, policy)
plt.show()

# %% [markdown]
# Reading the tree: the root of each panel is the prompt. From any circle, the three edges are the
# three tokens; the EOS edge always ends at a square. A prefix of $L = 3$ non-EOS tokens has no next
# step: it is itself a full, truncated response, so it is drawn as a square too, and its reward
# carries the −1 truncation penalty.
#
# Two numbers can be read off the tree by hand. The leaf probabilities of one prompt sum to 1,
# and the per-prompt objective $J_x = \sum_y \pi(y \mid x) R(x, y)$ is the probability-weighted sum
# of the leaf rewards. The value function computed by backward recursion,
# $V(s) = \sum_a \pi(a \mid s)\, Q(s, a)$, must give the same number at the root, and
# $J = \sum_x D(x) J_x$ must match `objective`.

# %%
with torch.no_grad():
    probs_S = sequence_probs(mdp, policy)                     # π(y|x) of every response
    tables = values(mdp, policy)                              # V and Q at every state
    J_exact = objective(mdp, policy)

leaves = leaf_table(mdp, probs_S, tables.V)                   # per prompt: Σ π, J_x, V(root)
print(leaves)
for _, total, j_x, root_value, _ in leaves.rows:
    assert abs(total - 1) < EXACT_TOL and abs(j_x - root_value) < EXACT_TOL
J_from_leaves = sum(float(d_x) * j_x for d_x, (_, _, j_x, _, _) in
                    zip(mdp.prompt_probs, leaves.rows, strict=True))

print(f"\nJ = Σ_x D(x) J_x = {J_from_leaves:.12f}   objective(mdp, policy) = {float(J_exact):.12f}"
      f"   difference = {J_from_leaves - float(J_exact):.1e}")
assert abs(J_from_leaves - float(J_exact)) < EXACT_TOL


# %% [markdown]
# ## 3. The gradient, three independent ways
#
# ### Route 1: autograd through the exact objective
#
# `objective(mdp, policy)` builds $J(\theta)$ as a differentiable float64 scalar: it walks the
# prefix tree level by level, accumulating $\log \pi(\text{prefix})$, and sums
# $D(x)\,\pi(y\mid x)\,R(x,y)$ over every leaf. `gradient(mdp, policy)` is autograd of that scalar,
# flattened into one vector in `policy.parameters()` order.
#
# ### Route 2: the REINFORCE loss on the full enumeration
#
# The log-derivative identity $\nabla \pi = \pi\, \nabla \log \pi$ turns the gradient into an
# expectation:
#
# $$
# \nabla J = \sum_x D(x) \sum_y \pi_\theta(y\mid x)\, R(x,y)\, \nabla \log \pi_\theta(y \mid x),
# \qquad
# \log \pi_\theta(y\mid x) = \sum_t \log \pi_\theta(y_t \mid x, y_{<t}).
# $$
#
# This is the likelihood-ratio form of the gradient behind REINFORCE (Williams 1992, *Machine
# Learning* 8:229–256, the episodic REINFORCE algorithm: the reward times the summed
# eligibilities $\nabla\log\pi(y_t\mid s_t)$ of the episode).
# So $\nabla J$ is the gradient of a **weighted negative log-likelihood**, provided the weights
# $w_y = D(x)\,\pi_\theta(y \mid x)$ are held constant (detached):
#
# $$
# \mathcal{L}(\theta) = -\sum_{(x, y)} \underbrace{w_y}_{\text{detached}} \, R(x, y)
#   \sum_t \log \pi_\theta(y_t \mid x, y_{<t}),
# \qquad \nabla J = -\nabla \mathcal{L}.
# $$
#
# This is exactly the shape of a pretraining loss, with the reward as the per-token weight. We
# compute it the way a trainer would: `mdp.enumerate()` returns a `TokenBatch` holding every
# response once (one per row), `policy.token_logprobs(batch)` gives $\log\pi(y_t \mid x, y_{<t})$
# for every response token (0 on prompt tokens and padding), and `batch.sequence_sum` adds them up
# per sequence. This route never calls `objective`; it shares with route 1 only the policy's logits.
#
# ### Route 3: central finite differences
#
# $\partial J / \partial \theta_j \approx \big(J(\theta + h e_j) - J(\theta - h e_j)\big) / 2h$, one
# coordinate at a time, using only *values* of $J$: no autograd at all. The error is
# $O(h^2)$ from truncation plus $O(\varepsilon / h)$ from rounding, about $10^{-10}$ for
# $h = 10^{-5}$.

# %%
def grad_autograd(mdp, policy):
    return gradient(mdp, policy)


def grad_reinforce_enumerated(mdp, policy):
    batch = mdp.enumerate()                                   # every (x, y) once, one per row
    logprobs_RC = policy.token_logprobs(batch)                # log π(y_t | x, y_<t), 0 elsewhere
    seq_logprobs_S = batch.sequence_sum(logprobs_RC)          # log π(y | x)
    # Stop-gradient: w_y = D(x) π(y|x) is the probability of the sample, not a function to
    # differentiate; with it held constant, ∇ of the loss is Σ w_y R ∇log π(y|x) = -∇J
    # (the log-derivative identity ∇π = π ∇log π).
    weights_S = (mdp.prompt_probs[batch.prompt_index] * seq_logprobs_S.exp()).detach()
    loss = -(weights_S * batch.reward * seq_logprobs_S).sum()
    return -flat_grad(loss, policy)


# %%
def grad_finite_differences(mdp, policy, h=FD_STEP):
    probe = copy.deepcopy(policy)                             # leave `policy` untouched
    theta = parameters_to_vector(probe.parameters()).detach()
    out = torch.empty_like(theta)
    with torch.no_grad():
        for j in range(theta.numel()):
            step = torch.zeros_like(theta)
            step[j] = h
            vector_to_parameters(theta + step, probe.parameters())
            j_plus = objective(mdp, probe)
            vector_to_parameters(theta - step, probe.parameters())
            j_minus = objective(mdp, probe)
            out[j] = (j_plus - j_minus) / (2 * h)
    return out


# %% [markdown]
# For a tabular policy, coordinate $j$ is the logit of token $j \bmod V$ at state $\lfloor j/V
# \rfloor$, so we can name every coordinate. States are numbered level by level (depth 0 of every
# prompt, then depth 1, …), which is the order of `mdp.level_prefixes(k)`. Here are the
# coordinates of the first four states, the three routes side by side, and the differences.

# %%
g_auto = grad_autograd(mdp, policy)
g_enum = grad_reinforce_enumerated(mdp, policy)
g_fd = grad_finite_differences(mdp, policy)
print("∇J has", g_auto.numel(), "coordinates")
print(route_table(mdp, g_auto, g_enum, g_fd, coords=range(4 * V)))   # the first four states

print(f"\nmax over all {g_auto.numel()} coordinates: |autograd - REINFORCE| = "
      f"{float((g_auto - g_enum).abs().max()):.1e},  |autograd - finite diff| = "
      f"{float((g_auto - g_fd).abs().max()):.1e}   "
      f"(largest |∇J_j| = {float(g_auto.abs().max()):.3f})")
assert torch.allclose(g_auto, g_enum, rtol=0, atol=EXACT_TOL)
assert torch.allclose(g_auto, g_fd, rtol=0, atol=FD_TOL)

# %% [markdown]
# The two exact routes agree to the last few bits of a double; finite differences agree to
# $10^{-12}$–$10^{-11}$, as predicted. Notice also that the three logits of one state have
# gradients summing to zero: adding a constant to all logits of a state does not change the
# softmax, so $J$ cannot change along that direction.
#
# Nothing above used the tabular structure. The same three routes work for any policy that maps a
# `TokenBatch` to token log-probs: a log-linear policy whose weights are **shared across states**,
# and a small MLP. Sharing makes the check stronger, because one parameter now affects many states
# at once.

# %%
policies = {
    "TabularPolicy": policy,
    "LogLinearPolicy": LogLinearPolicy(mdp, generator=torch.Generator().manual_seed(1)),
    "NeuralPolicy": NeuralPolicy(mdp, generator=torch.Generator().manual_seed(2), hidden=4),
}
routes = route_agreement_table(mdp, policies, grad_autograd, grad_reinforce_enumerated,
                               grad_finite_differences)
print(routes)
for _, _, j_obj, j_batch, autograd_vs_reinforce, autograd_vs_fd in routes.rows:
    assert abs(j_obj - j_batch) < EXACT_TOL
    assert autograd_vs_reinforce <= EXACT_TOL and autograd_vs_fd <= FD_TOL


# %% [markdown]
# ### The same gradient, state by state: the policy-gradient theorem
#
# The sequence form sums over responses. The **policy-gradient theorem** (Sutton, McAllester,
# Singh and Mansour 2000, Theorem 1) sums over states instead, with the action values and the
# visitation held fixed:
#
# $$
# \nabla J = \sum_s d^\pi(s) \sum_a \nabla_\theta \pi_\theta(a\mid s)\, Q^\pi(s, a),
# $$
#
# where here (undiscounted, one episode) $d^\pi(s) = D(x)\,P_\pi(\text{reach } s)$ and
# $Q^\pi(s, a)$ is the expected reward after taking $a$ in $s$. `state_visitation` and `values`
# compute both exactly; differentiating $\sum_s d(s) \sum_a \pi(a\mid s) Q(s, a)$ with $d$ and $Q$
# detached must give $\nabla J$ again.

# %%
with torch.no_grad():
    visitation_S = state_visitation(mdp, policy)              # d^π(s), [14]
    Q_SA = values(mdp, policy).Q                              # Q^π(s, a), [14, V]
probs_SA = torch.cat([lp.exp().reshape(-1, V) for lp in state_logprobs(mdp, policy)])
g_pgt = flat_grad((visitation_S[:, None] * probs_SA * Q_SA).sum(), policy)
print(f"max |policy-gradient theorem − autograd| = {float((g_pgt - g_auto).abs().max()):.1e}"
      f"   (Σ_s d(s) = E|y| = {float(visitation_S.sum()):.4f} tokens)")
assert torch.allclose(g_pgt, g_auto, rtol=0, atol=EXACT_TOL)

# %% [markdown]
# ## 4. The expected grad-log-prob lemma
#
# The identity behind every baseline, every advantage and every "this term vanishes in
# expectation" argument in policy-gradient methods is
#
# $$
# \mathbb{E}_{a \sim \pi_\theta(\cdot \mid s)} \big[ \nabla_\theta \log \pi_\theta(a \mid s) \big]
# = \sum_a \pi_\theta(a \mid s)\, \frac{\nabla_\theta \pi_\theta(a\mid s)}{\pi_\theta(a \mid s)}
# = \nabla_\theta \sum_a \pi_\theta(a \mid s) = \nabla_\theta 1 = 0 .
# $$
#
# It holds at **every state separately**. Each individual score vector
# $\nabla \log \pi(a \mid s)$ is far from zero; only their $\pi$-weighted average vanishes. We check
# both halves of that sentence, for all three policies, at each of the 14 states: the largest
# entry of the expectation, and the norm of the individual scores it averages.

# %%
def expected_score_per_state(mdp, policy):
    # For every state s: E_a[∇ log π(a|s)] as a flat vector, and max_a ||∇ log π(a|s)||.
    logprobs_N = torch.cat([lp.reshape(-1, mdp.vocab_size)             # log π(.|s), one row
                            for lp in state_logprobs(mdp, policy)])    # per state: [14, V]
    expectations, score_norms = [], []
    for logprobs in logprobs_N:
        # Stop-gradient: π(a|s) is the sampling distribution of a in E_a[...], a weight, so only
        # ∇ log π(a|s) is differentiated; the sum is then E_a[∇ log π(a|s)].
        expectations.append(flat_grad_retained((logprobs.exp().detach() * logprobs).sum(), policy))
        score_norms.append(max(float(flat_grad_retained(logprobs[a], policy).norm())
                               for a in range(mdp.vocab_size)))
    return torch.stack(expectations), torch.tensor(score_norms)


# %%
lemma = lemma_table(mdp, policies, expected_score_per_state)
print(lemma)
for _, violation, _, _, _ in lemma.rows:
    assert violation < EXACT_TOL


# %% [markdown]
# The largest violation is at the level of rounding error, while the individual scores have norms of
# order one: the check is not trivially satisfied.
#
# **The consequence we use most: baselines are free.** Multiply the lemma by any $b(s)$ that does not
# depend on the action and it still averages to zero. At the sequence level
# ($\nabla\log\pi(y\mid x) = \sum_t \nabla\log\pi(y_t\mid s_t)$, each term zero in expectation)
# replacing $R(x,y)$ by $R(x,y) - b(x)$ changes nothing in expectation. With enumeration we can
# check it exactly: run route 2 with the reward minus the per-prompt value $b(x) = J_x$, the baseline
# that GRPO-style group means estimate.

# %%
def grad_reinforce_enumerated_with_baseline(mdp, policy, baseline_P):
    batch = mdp.enumerate()
    seq_logprobs_S = batch.sequence_sum(policy.token_logprobs(batch))
    # Stop-gradient: the same log-derivative identity as in route 2 (w_y is a sampling weight).
    weights_S = (mdp.prompt_probs[batch.prompt_index] * seq_logprobs_S.exp()).detach()
    advantages_S = batch.reward - baseline_P[batch.prompt_index]
    return flat_grad((weights_S * advantages_S * seq_logprobs_S).sum(), policy)


with torch.no_grad():
    root_values_P = values(mdp, policy).V[: mdp.num_prompts]  # depth-0 states: J_x per prompt
g_baseline = grad_reinforce_enumerated_with_baseline(mdp, policy, root_values_P)
print(f"baseline b(x) = J_x = {[round(v, 4) for v in root_values_P.tolist()]}")
print(f"max |∇J with baseline - ∇J| = {float((g_baseline - g_auto).abs().max()):.1e}"
      f"   (max |∇J| = {float(g_auto.abs().max()):.3f})")
assert torch.allclose(g_baseline, g_auto, rtol=0, atol=EXACT_TOL)

# %% [markdown]
# ## 5. Monte Carlo REINFORCE next to the truth
#
# In practice we cannot enumerate. We sample $n$ responses $y_i \sim \pi_\theta(\cdot\mid x_i)$,
# $x_i \sim D$, and use the REINFORCE estimator
#
# $$
# \hat g = \frac1n \sum_{i=1}^n R(x_i, y_i)\, \nabla_\theta \log \pi_\theta(y_i \mid x_i),
# $$
#
# (Williams 1992's REINFORCE with baseline 0), which is the same loss as route 2 with the exact
# weights $w_y$ replaced by the sample frequencies
# $1/n$. It is unbiased, $\mathbb{E}[\hat g] = \nabla J$, and each coordinate has standard error
# $\sigma_j / \sqrt{n}$, estimated from the spread of the $n$ per-sample terms.
#
# `sample(mdp, policy, n, generator=...)` draws the responses depth by depth and returns a
# `TokenBatch`, so the estimate is one backward pass of the loss, exactly as in a trainer.

# %%
N_SAMPLES = 2000
batch_mc = sample(mdp, policy, N_SAMPLES, generator=torch.Generator().manual_seed(2024))
print(batch_mc)
seq_logprobs_mc = batch_mc.sequence_sum(policy.token_logprobs(batch_mc))
loss_mc = -(batch_mc.reward * seq_logprobs_mc).mean()             # weights 1/n instead of w_y
g_mc = -flat_grad(loss_mc, policy)


# %% [markdown]
# For error bars we need the $n$ per-sample gradients, not only their mean. In the exact world
# there is a shortcut: every sample *is* one of the 30 responses. So we compute the score vector
# $\nabla\log\pi(y\mid x)$ of each of the 30 responses once, and find which response each sample is
# with `mdp.terminal_index`. The same table of 30 scores gives the **exact** covariance of a single
# sample's term,
# $\Sigma = \sum_y w_y\, R^2\, s_y s_y^\top - \nabla J \nabla J^\top$, so we can compare the
# estimated standard errors with the true ones as well.

# %%
def response_scores(mdp, policy):
    # [N, num_params]: ∇ log π(y|x) of every response, in canonical order.
    batch = mdp.enumerate()
    seq_logprobs_S = batch.sequence_sum(policy.token_logprobs(batch))
    return torch.stack([flat_grad_retained(seq_logprobs_S[i], policy)
                        for i in range(batch.num_sequences)])


# %%
scores_N = response_scores(mdp, policy)                            # [30, 42]
ids = response_ids(mdp, batch_mc)
# the ids point at the right responses: compare the token tuples themselves
all_responses = mdp.responses()
assert [all_responses[i] for i in ids.tolist()] == [
    (tuple(x), tuple(y)) for x, y in batch_mc.sequences()]
terms_n = batch_mc.reward[:, None] * scores_N[ids]                 # per-sample R ∇log π, [n, 42]
print(f"mean of per-sample terms vs. loss gradient: max difference "
      f"{float((terms_n.mean(0) - g_mc).abs().max()):.1e}")
assert torch.allclose(terms_n.mean(0), g_mc, rtol=0, atol=EXACT_TOL)

se_mc = terms_n.std(0) / N_SAMPLES ** 0.5                          # estimated standard errors

# %%
# Exact moments of one sample's term R ∇log π(y|x), by enumeration.
with torch.no_grad():
    w_N = mdp.prompt_probs[mdp.terminal_prompt_index] * sequence_probs(mdp, policy)
terms_N = mdp.rewards[:, None] * scores_N
mean_exact = w_N @ terms_N
cov_exact = terms_N.T @ (w_N[:, None] * terms_N) - torch.outer(mean_exact, mean_exact)
se_exact = (cov_exact.diagonal().clamp(min=0) / N_SAMPLES).sqrt()
print(f"E[R ∇log π] by enumeration vs ∇J: max difference "
      f"{float((mean_exact - g_auto).abs().max()):.1e}")
assert torch.allclose(mean_exact, g_auto, rtol=0, atol=EXACT_TOL)

# %% [markdown]
# The picture: for each of the 42 coordinates, the Monte Carlo estimate with a ±2 standard-error
# bar, and the exact $\nabla J$ as a red cross. Below it, the $z$-score
# $z_j = (\hat g_j - \nabla_j J) / \widehat{\mathrm{se}}_j$; for an unbiased estimator about 95% of
# them should lie within ±2. Vertical lines separate states; coordinates of rarely visited states
# (deep prefixes) have small gradients and small bars, because few samples pass through them.

# %%
visible = se_mc > 0                                # a state no sample reached has no error bar
z = torch.where(visible, (g_mc - g_auto) / torch.where(visible, se_mc, 1.0), torch.nan)
fig = monte_carlo_figure(mdp, g_mc, se_mc, g_auto, z, n_samples=N_SAMPLES)
plt.show()

# %% [markdown]
# The same comparison as numbers, for the eight coordinates with the largest true gradient: the
# estimate, its estimated standard error next to the exact one, the exact gradient, the difference
# and the $z$-score.

# %%
top = g_auto.abs().argsort(descending=True)[:8].sort().values
print(monte_carlo_table(mdp, top.tolist(), g_mc, se_mc, se_exact, g_auto, z))

inside = (z[visible].abs() <= 2).double().mean()
print(f"\n|z| <= 2 for {float(inside):.0%} of the {int(visible.sum())} coordinates with an "
      f"error bar (about 95% expected); max |z| = {float(z[visible].abs().max()):.2f}")
expected_norm = float(cov_exact.trace().clamp(min=0).sqrt()) / N_SAMPLES ** 0.5
print(f"||MC - exact||_2 = {float((g_mc - g_auto).norm()):.4f}   typical size sqrt(tr Σ / n) = "
      f"{expected_norm:.4f}   difference = {float((g_mc - g_auto).norm()) - expected_norm:+.4f}")

# %% [markdown]
# The estimate scatters around the truth within its error bars, and the estimated standard errors
# are close to the exact ones. In this particular draw every $|z|$ is below 2 and the total error is
# smaller than its typical size $\sqrt{\operatorname{tr}\Sigma / n}$: the 42 coordinates are not
# independent (all of them are functions of the same 2000 responses, and the three logits of a state
# have gradients that sum to zero), so in one draw they tend to be small, or large, together.
#
# One draw is one draw. To check the *calibration* of the error bars, repeat the experiment with
# fresh samples: averaged over repetitions, $z_j^2$ (with the exact standard error) should be close
# to 1 and $\|\hat g - \nabla J\|^2$ close to $\operatorname{tr}\Sigma / n$. The per-response
# score table makes each repetition cheap.

# %%
REPEATS = 20
generator = torch.Generator().manual_seed(99)
z_squared, squared_errors = [], []
for _ in range(REPEATS):
    batch_r = sample(mdp, policy, N_SAMPLES, generator=generator)
    g_hat = (batch_r.reward[:, None] * scores_N[response_ids(mdp, batch_r)]).mean(0)
    z_squared.append(((g_hat - g_auto) / se_exact)[se_exact > 0] ** 2)
    squared_errors.append(float((g_hat - g_auto).pow(2).sum()))
z_squared = torch.cat(z_squared)

print(f"{REPEATS} repetitions of n = {N_SAMPLES}\n")
print(calibration_table(z_squared, squared_errors, cov_exact, N_SAMPLES))


# %% [markdown]
# (The last "exact" value is the normal approximation, fine for $n = 2000$.) The error bars are
# honest. This is the pattern the rest of the course builds on: every estimator gets a mean and a
# covariance that we can *compute*, and then compare with samples.
#
# ### What verl / TRL / others call this
#
# Generated from the estimator registry's aliases (the same text as the estimator cards):

# %%
show(alias_box(["reinforce"]))

# %% [markdown]
# ## 6. Failure mode: differentiate the weights too
#
# Route 2 detached the weights $w_y = D(x)\,\pi_\theta(y\mid x)$. Forget the `.detach()` and
# autograd differentiates them as well: by the product rule the loss gains the term
# $\sum_y (\nabla w_y)\, R \log\pi(y\mid x) = \sum_y w_y\, R \log\pi(y\mid x)\,
# \sigma(y)$, with $\sigma(y) = \nabla\log\pi(y\mid x)$, the score table of section 5. We
# compute the broken gradient and that predicted error exactly.

# %%
def grad_reinforce_not_detached(mdp, policy):
    # BROKEN ON PURPOSE: route 2 without .detach() on the weights w_y
    batch = mdp.enumerate()
    seq_logprobs_S = batch.sequence_sum(policy.token_logprobs(batch))
    weights_S = mdp.prompt_probs[batch.prompt_index] * seq_logprobs_S.exp()
    return flat_grad((weights_S * batch.reward * seq_logprobs_S).sum(), policy)


g_broken = grad_reinforce_not_detached(mdp, policy)
with torch.no_grad():
    log_pi_N = sequence_probs(mdp, policy).log()
predicted_error = (w_N * mdp.rewards * log_pi_N) @ scores_N
cosine = float(g_broken @ g_auto / (g_broken.norm() * g_auto.norm()))
print(f"||broken − ∇J|| / ||∇J|| = {float((g_broken - g_auto).norm() / g_auto.norm()):.3f}, "
      f"cos(broken, ∇J) = {cosine:.3f}; max |error − predicted| = "
      f"{float((g_broken - g_auto - predicted_error).abs().max()):.1e}")
assert torch.allclose(g_broken - g_auto, predicted_error, rtol=0, atol=EXACT_TOL)

# %% [markdown]
# The loss *value* is the same with and without `.detach()`, so a test of the value cannot see the
# slip; the gradient is off by a term weighted by $\log\pi(y\mid x) < 0$, largest on the unlikely
# responses. Compare gradients, not losses.
#
# ## 7. Exercises
#
# ### Exercise 1: the uniform policy
#
# A `TabularPolicy` with `init_std=0` has all logits zero, so every next-token distribution is
# uniform, $\pi(a\mid s) = 1/V$. *Predict* first: is $J$ of this policy above or below the $J$ of
# our seeded policy (section 2)? Record it as `uniform_prediction` (`"above"` or `"below"`). Then
# write it in closed form, **without** calling `objective`, using only `mdp.responses()`,
# `mdp.rewards` and `mdp.prompt_probs`, and store it in `uniform_answer`.
#
# *Hint:* what is $\pi(y \mid x)$ for a response of length $|y|$? Is that also right for the
# truncated responses? (And why do these probabilities sum to one per prompt?)

# %%
# Solution
uniform_prediction = "above"        # recorded before computing: "above" or "below"


def j_uniform(mdp):
    # π(y|x) = V^(-|y|): one factor 1/V per response token, the final EOS included; a truncated
    # response has |y| = L tokens and no EOS, so the same formula holds.
    total = 0.0
    for (x, y), r in zip(mdp.responses(), mdp.rewards.tolist(), strict=True):
        d_x = float(mdp.prompt_probs[mdp.prompts.index(x)])
        total += d_x * mdp.vocab_size ** (-len(y)) * r
    return total


uniform_answer = j_uniform(mdp)

# %%
# Check
tokenmdp.check("tr01_uniform_objective", uniform_answer)
tokenmdp.check("tr01_predict_uniform_objective", uniform_prediction)

# %% [markdown]
# Above, by a factor six: the seeded logits happen to send 40% of the responses into truncation
# (reward −1) where the uniform policy sends 30%, and they give the responses that copy a token
# about half the uniform policy's probability. A random initialization is not a neutral one.
#
# Why they sum to one, per prompt: the probability of reaching depth $k$ is $(b/V)^k$. Of that,
# a share $1/V$ stops there with EOS, which is $(b/V)^k - (b/V)^{k+1}$, and whatever reaches depth
# $L$, $(b/V)^L$, stops by truncation. The sum
# $\sum_{k=0}^{L-1} b^k V^{-(k+1)} + b^L V^{-L}$ telescopes to $(b/V)^0 = 1$.
#
# ### Exercise 2: a constant reward
#
# Suppose every response gets the same reward $R(x, y) = c$. *Predict* $\nabla J$, for any policy
# and any $\theta$, and say why: is it zero or not? Record it as `gradient_prediction` (`"zero"`
# or `"nonzero"`). Store $\lVert\nabla J\rVert$ for a `NeuralPolicy` (seed 2, hidden width 4)
# with $c = 3$ in `grad_norm_answer`, without calling `gradient`; then compare it with a Monte
# Carlo REINFORCE estimate from 2000 samples.

# %%
# Solution
gradient_prediction = "zero"        # recorded before computing: "zero" or "nonzero"
# J(θ) = Σ_x D(x) Σ_y π_θ(y|x) c = c for every θ, because Σ_y π_θ(y|x) = 1: J is constant, so
# ∇J = 0. Equivalently, it is the lemma of section 4 at the sequence level,
# E_y[∇ log π(y|x)] = Σ_t E[∇ log π(y_t|s_t)] = 0, multiplied by c.
grad_norm_answer = 0.0

# %%
# Check
tokenmdp.check("tr01_constant_reward_gradient_norm", grad_norm_answer)
tokenmdp.check("tr01_predict_constant_reward_gradient", gradient_prediction)

# %% [markdown]
# The exact answer next to a Monte Carlo estimate: each sample contributes $c\,\sigma(y)$, and
# the error bars come from the spread of those terms.

# %%
C = 3.0
mdp_constant = TokenMDP(V, L, lambda x, y: C, prompts=mdp.prompts,
                        prompt_probs=mdp.prompt_probs.tolist())
neural = NeuralPolicy(mdp_constant, generator=torch.Generator().manual_seed(2), hidden=4)
g_true = gradient(mdp_constant, neural)
batch_c = sample(mdp_constant, neural, 2000, generator=torch.Generator().manual_seed(7))
seq_logprobs_c = batch_c.sequence_sum(neural.token_logprobs(batch_c))
g_c = -flat_grad(-(batch_c.reward * seq_logprobs_c).mean(), neural)
print(f"exact ||∇J|| = {float(g_true.norm()):.1e};  Monte Carlo ||ĝ|| = {float(g_c.norm()):.3f}, "
      f"largest |coordinate| {float(g_c.abs().max()):.3f}")

# %% [markdown]
# The exact gradient vanishes, yet the Monte Carlo estimate is visibly non-zero: it is pure noise,
# $c$ times the average score of the samples, with variance growing like $c^2$. Subtracting the
# baseline $b = c$ (section 4) removes it entirely without changing the expectation. Variance that
# costs nothing to remove, bias that costs something to accept: that trade-off, computed exactly, is
# the subject of the following tutorials.
#
# ## Summary
#
# * The token MDP has states (prompt + prefix), actions (next token), EOS or truncation at $L$, and
#   one terminal reward; per prompt it has $\sum_{k=0}^{L} (V-1)^k$ responses.
# * On a tiny MDP, $J$ and $\nabla J$ are exact: autograd of the objective, the REINFORCE loss on the
#   full enumeration with detached probability weights, and finite differences agree.
# * $\mathbb{E}_{a\sim\pi}[\nabla \log\pi(a\mid s)] = 0$ at every state; it is why baselines do not
#   bias the gradient.
# * A Monte Carlo REINFORCE estimate is unbiased and its errors match the standard errors, which we
#   can also compute exactly.
# * Detaching the sampling weights is part of the estimator: without it the gradient gains
#   $\sum_y w_y R \log\pi(y\mid x)\,\nabla\log\pi(y\mid x)$, while the loss value does not change.
