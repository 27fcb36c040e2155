"""``minirl_seq_tis`` (issue 31): MiniRL's surrogate with the sequence-level truncated
training–inference weight ``min(Π_t π_old/μ_t, 5)`` on every token of a response.

Its exact moments (``tokenmdp.exact.moments``, ``method="auto"``) against a brute-force sum over
every group of two responses written here from the formula, with no estimator code; the weight
of a hand-made packed batch against its product worked out by hand; the lattice's refusal (a min
of a product is no product of token messages)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from tests.estimators.estimator_helpers import make_batch, repack, response_values
from tokenmdp import estimators
from tokenmdp.exact import (
    TabularPolicy,
    TokenMDP,
    flat_grad,
    inference_copy,
    moments,
    sequence_probs,
)
from tokenmdp.exact import lattice as L
from tokenmdp.exact.world import rewards

#: two float64 sums of the same finite terms in different orders
EXACT_TOL = 1e-12
CAP = 5.0
G = 2


def test_the_entry_is_minirl_with_the_sequence_level_weight_only():
    mine, base = estimators.get("minirl_seq_tis"), estimators.get("minirl")
    assert mine.correction == estimators.TruncatedIS(cap=CAP, level=estimators.Level.SEQUENCE)
    assert mine.replace(correction=base.correction, name="minirl") == base
    entry = estimators.registry.lookup._entry("minirl_seq_tis")
    assert "2512.01374" in entry.paper and "min(W_i, 5)" in entry.formula
    assert "sequence_truncate" in entry.aliases and "rollout_is=sequence" in entry.aliases


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_every_token_gets_the_capped_product_of_its_response(packed):
    # response 0: log w = 0.5 + 0.9 + 0.4 = 1.8 -> W = e^1.8 = 6.05, capped at 5
    # response 1: log w = -0.7 + 0.2 = -0.5 -> W = e^-0.5 = 0.607 on both of its tokens
    batch = make_batch([[7, 7], [8]], [[1, 2, 3], [4, 5]], rewards=[1.0, 0.0],
                       behavior=[[-1.0, -2.0, -0.5], [-1.5, -0.3]])
    if packed:
        batch = repack(batch, [[1, 0]], capacity=9)
    old = batch.behavior_logprob + response_values(batch, [[0.5, 0.9, 0.4], [-0.7, 0.2]])
    batch = batch.replace(old_logprob=old)
    factor = estimators.get("minirl_seq_tis").correction(batch).factor_RC
    want = response_values(batch, [[CAP] * 3, [math.exp(-0.5)] * 2])
    torch.testing.assert_close(factor[batch.loss_mask], want[batch.loss_mask], atol=EXACT_TOL,
                               rtol=0)


def _world():
    mdp = TokenMDP(vocab_size=3, max_len=2, reward=rewards.RandomTable(seed=3),
                   prompts=((0,), (1,)), prompt_probs=(0.4, 0.6))
    pi = TabularPolicy(mdp, generator=torch.Generator().manual_seed(4))
    mu = inference_copy(pi, noise_std=1.5, generator=torch.Generator().manual_seed(5))
    return mdp, pi, mu


def _brute_force(mdp, pi, mu):
    """Mean and total variance of ``ĝ = 1/G Σ_i min(Π_t π/μ (y_it), 5) (R_i − mean_g R)
    ∇log π(y_i)`` (MiniRL at ``θ = θ_old``: every ratio 1, inside the band) over every group of
    ``G`` responses to one prompt, drawn from ``μ``; and the largest sequence weight."""
    batch = mdp.enumerate()
    with torch.no_grad():
        p_pi, p_mu = sequence_probs(mdp, pi), sequence_probs(mdp, mu)
    scores = [flat_grad(batch.sequence_sum(pi.token_logprobs(batch))[s], pi)   # ∇log π(y_s)
              for s in range(batch.num_sequences)]
    first, second = torch.zeros_like(scores[0]), 0.0
    for x in range(mdp.num_prompts):
        mine = [s for s in range(batch.num_sequences) if int(batch.prompt_index[s]) == x]
        for group in itertools.product(mine, repeat=G):
            prob = float(mdp.prompt_probs[x]) * math.prod(float(p_mu[s]) for s in group)
            mean_r = sum(float(batch.reward[s]) for s in group) / G
            g = sum(min(float(p_pi[s] / p_mu[s]), CAP) * (float(batch.reward[s]) - mean_r)
                    * scores[s] for s in group) / G
            first += prob * g
            second += prob * float(g @ g)
    return first, second - float(first @ first), float((p_pi / p_mu).max())


def test_exact_moments_equal_the_sum_over_every_group():
    mdp, pi, mu = _world()
    est = estimators.get("minirl_seq_tis")
    got = moments(mdp, pi, est, group_size=G, behavior=mu, old=pi, method="auto")
    assert got.method != "monte_carlo"                   # exact: enumeration or types
    mean, total_variance, largest = _brute_force(mdp, pi, mu)
    assert largest > CAP                                 # the cap binds on some response
    torch.testing.assert_close(got.mean, mean, atol=EXACT_TOL, rtol=0)
    assert got.total_variance == pytest.approx(total_variance, abs=EXACT_TOL)
    # and it is not MiniRL's token-level weight
    token = moments(mdp, pi, estimators.get("minirl"), group_size=G, behavior=mu, old=pi,
                    method="auto")
    assert (token.mean - got.mean).abs().max() > 1e-3


def test_the_lattice_says_a_min_of_a_product_is_not_exact_there():
    ok, why = L.exact_support(estimators.get("minirl_seq_tis"), 4)
    assert not ok and "not token-level" in why
    assert L.exact_support(estimators.get("minirl"), 4) == (True, "")
