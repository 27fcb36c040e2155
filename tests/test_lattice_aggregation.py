"""Section 5 of ``benchmarks/lattice.py`` (``benchmarks/_lattice_aggregation.py``): who counts
the tokens, at length.

Its figures must be what they say: the conditional lengths and their gradients equal a sum over
every response of the enumerable twin; the token mean's exact lattice moments equal the
enumeration engine's at ``G ≥ 2`` (where its normalizer couples the group) and are the
per-sequence token mean's at ``G = 1``; the constant and the sequence mean of token sums have the
same scale-free figures; ``∇J`` leaves both conditional lengths alone; the figures of the mean
agree with :class:`~tokenmdp.exact.Moments`' own; the crossover ``B*`` equalises the two gains.
"""

import math
import sys
from pathlib import Path

import pytest
import torch

from tokenmdp import exact as E
from tokenmdp.estimators import Aggregation
from tokenmdp.exact import lattice as L

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import _lattice_aggregation as A  # noqa: E402

TOL = 1e-12


def tiny(T=4, V=3, **kw):
    return A.answer_world(T, V, **kw)


def test_conditional_lengths_and_their_gradients_equal_the_enumeration():
    mdp, pi, _ = tiny(T=4, V=4)
    tm = L.to_token_mdp(mdp)
    probs = E.sequence_probs(tm, L.as_prefix_policy(tm, pi))
    n = tm.terminal_lengths.to(torch.float64)
    right = tm.rewards == 1
    wrong = (tm.rewards == 0) & (n > 1)                   # the empty answer is the only |y| = 1
    enumerated = ((probs * n).sum(), (probs * n * right).sum() / (probs * right).sum(),
                  (probs * n * wrong).sum() / (probs * wrong).sum())
    grads = A.length_gradients(mdp, pi)
    for name, value in zip(("length", "right", "wrong"), enumerated, strict=True):
        assert abs(grads["values"][name] - float(value.detach())) < TOL
        g = torch.autograd.grad(value, pi.logits, retain_graph=True)[0].reshape(-1)
        assert (grads["tabular"][name] - g).abs().max() < TOL
        assert (grads["shared"][name] - g.reshape(mdp.shape).sum(0).reshape(-1)).abs().max() \
            < TOL


@pytest.mark.parametrize("G", [2, 3])
def test_token_mean_equals_the_enumeration_twin(G):
    mdp, pi, _ = tiny(T=4, V=3)
    est = A.estimator("group-mean", Aggregation.TOKEN_MEAN)
    assert L.exact_support(est, G) == (True, "")
    a = L.moments(mdp, pi, est, group_size=G, method="lattice")
    tm = L.to_token_mdp(mdp)
    b = E.moments(tm, L.as_prefix_policy(tm, pi), est, group_size=G, method="enumeration")
    assert a.method == "lattice"
    assert (a.mean - b.mean).abs().max() < TOL
    assert abs(a.total_variance - b.total_variance) < TOL
    row = A.measure(mdp, pi, pi, est, G, A.length_gradients(mdp, pi))
    assert abs(row.tabular["cosine"] - b.cosine) < 1e-10
    assert abs(row.tabular["bias"] - b.directional_bias) < 1e-10
    rel_var = b.total_variance / float(b.mean @ b.mean)
    assert abs(row.relative_variance - rel_var) < 1e-9 * rel_var
    assert abs(row.gain - b.cosine ** 2 / (1 + rel_var)) < 1e-10


def test_token_mean_is_the_sequence_mean_at_one_response_only():
    mdp, pi, _ = tiny(T=6, V=3)
    grads = A.length_gradients(mdp, pi)
    rows = {(agg, G): A.measure(mdp, pi, pi, A.estimator("reward", agg), G, grads)
            for agg in (Aggregation.TOKEN_MEAN, Aggregation.SEQUENCE_MEAN_TOKEN_MEAN)
            for G in (1, 2)}
    one, per_seq = rows[Aggregation.TOKEN_MEAN, 1], rows[Aggregation.SEQUENCE_MEAN_TOKEN_MEAN, 1]
    for coords in A.COORDINATES:
        for key, value in getattr(one, coords).items():
            assert abs(value - getattr(per_seq, coords)[key]) < 1e-10, (coords, key)
    assert abs(one.relative_variance - per_seq.relative_variance) < 1e-9 * one.relative_variance
    # at G = 2 the shared normalizer Σ_j |y_j| makes them differ, and the token mean is closer
    two, per_seq_two = rows[Aggregation.TOKEN_MEAN, 2], rows[Aggregation.SEQUENCE_MEAN_TOKEN_MEAN, 2]
    assert two.tabular["bias"] < per_seq_two.tabular["bias"] - 1e-3


def test_constant_and_sequence_sum_share_the_scale_free_figures_and_leave_the_lengths():
    mdp, pi, _ = tiny(T=8, V=4)
    grads = A.length_gradients(mdp, pi)
    rows = [A.measure(mdp, pi, pi, A.estimator("group-mean", agg), 3, grads)
            for agg in (Aggregation.CONSTANT, Aggregation.SEQUENCE_MEAN_TOKEN_SUM)]
    for coords in A.COORDINATES:
        a, b = getattr(rows[0], coords), getattr(rows[1], coords)
        assert all(abs(a[k] - b[k]) < 1e-10 for k in a)
        assert abs(a["cosine"] - 1) < 1e-12 and a["bias"] < 1e-7
        assert abs(a["right_per_J"]) < 1e-10 and abs(a["wrong_per_J"]) < 1e-10
    assert abs(rows[0].relative_variance / rows[1].relative_variance - 1) < 1e-10
    # the per-sequence token mean shortens right answers and lengthens wrong ones
    s = A.measure(mdp, pi, pi, A.estimator("group-mean", Aggregation.SEQUENCE_MEAN_TOKEN_MEAN),
                  3, grads).shared
    assert s["right_per_J"] < 0 < s["wrong_per_J"]


def test_grid_references_and_crossover():
    rows, refs = A.grid([6], [1, 2], ["group-mean"], V=3)
    # the group mean at G = 1 is A = 0: no row
    assert sorted((r.aggregation.value, r.G) for r in rows) == sorted(
        (agg.value, 2) for agg in A.AGGREGATIONS)
    assert all(r.method == "lattice" for r in rows)
    ref = refs[6]["tabular"]
    assert ref["cosine"] == pytest.approx(1) and abs(ref["right_per_J"]) < 1e-10
    B = A.crossover_groups(rows, 6, 2)
    by = {r.aggregation: r for r in rows}
    s, c = by[Aggregation.SEQUENCE_MEAN_TOKEN_MEAN], by[Aggregation.CONSTANT]
    assert 1 < B < math.inf                     # one group: the per-sequence mean gains more

    def gain(r, cos, groups):
        return cos ** 2 / (1 + r.relative_variance / groups)

    assert gain(s, s.tabular["cosine"], B) == pytest.approx(gain(c, 1.0, B), rel=1e-9)
    assert gain(s, s.tabular["cosine"], 1) > gain(c, 1.0, 1)
    assert gain(s, s.tabular["cosine"], 10 * B) < gain(c, 1.0, 10 * B)
    assert math.isnan(A.crossover_groups(rows, 6, 8))


def test_world_refuses_bad_arguments():
    with pytest.raises(ValueError, match="V"):
        A.answer_world(8, 2)
    with pytest.raises(ValueError, match="p_right"):
        A.answer_world(8, 4, p_right=0.7, p_empty=0.4)
    _, pi, mu = A.answer_world(8, 4, sigma=0.2)
    assert mu is not pi and not mu.logits.requires_grad
