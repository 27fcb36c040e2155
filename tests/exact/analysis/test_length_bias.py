"""Length bias: what each aggregation ascends, exactly, and the drift of E|y| under ascent."""

import torch

from tests.exact.conftest import make_policy
from tokenmdp import estimators as E
from tokenmdp.exact import (
    TabularPolicy,
    TokenMDP,
    aggregation_gradients,
    expected_length,
    flat_grad,
    gradient,
    length_drift,
    length_normalized_objective,
    sequence_probs,
)
from tokenmdp.exact.world.rewards import ExactMatch, LengthReward

EXACT_TOL = 1e-10


def length_mdp():
    """Right answers are short: R = 1 for the response (0, EOS), and long responses cost."""
    return TokenMDP(3, 3, LengthReward(-0.1, content=ExactMatch((0, 2))), prompts=[(0,), (1,)])


def test_each_aggregation_ascends_its_objective():
    mdp = length_mdp()
    pi = make_policy(TabularPolicy, mdp, seed=0)
    reinforce = E.get("reinforce")  # A = R, so the objectives have no baseline term
    out = {a.aggregation: a for a in aggregation_gradients(mdp, pi, reinforce, group_size=2)}
    g_J = gradient(mdp, pi)
    g_norm = flat_grad(length_normalized_objective(mdp, pi), pi)
    for agg in (E.Aggregation.TOKEN_SUM, E.Aggregation.SEQUENCE_MEAN_TOKEN_SUM,
                E.Aggregation.CONSTANT):
        assert abs(out[agg].cosine_to_grad_J - 1) < EXACT_TOL
    per_token = out[E.Aggregation.SEQUENCE_MEAN_TOKEN_MEAN]
    assert abs(per_token.cosine_to_grad_length_normalized - 1) < EXACT_TOL
    torch.testing.assert_close(per_token.mean, g_norm, rtol=0, atol=EXACT_TOL)
    assert per_token.cosine_to_grad_J < 1 - 1e-3          # a different objective
    token_mean = out[E.Aggregation.TOKEN_MEAN]
    assert token_mean.cosine_to_grad_J < 1 - 1e-6         # no fixed objective
    grad_len = flat_grad(expected_length(mdp, pi), pi)
    # token-sum adds the G = 2 sequences: E[ĝ] = 2 ∇J
    assert abs(out[E.Aggregation.TOKEN_SUM].length_slope - 2 * float(g_J @ grad_len)) < EXACT_TOL


def test_expected_length_matches_enumeration():
    mdp = length_mdp()
    pi = make_policy(TabularPolicy, mdp, seed=1)
    with torch.no_grad():
        probs = sequence_probs(mdp, pi)
        direct = sum(float(mdp.prompt_probs[x]) * float(p) * len(y) for (x_tok, y), p, x in
                     zip(mdp.responses(), probs, mdp.terminal_prompt_index.tolist()))
        assert abs(float(expected_length(mdp, pi)) - direct) < EXACT_TOL


def test_length_drift_differs_between_aggregations():
    mdp = length_mdp()
    pi = make_policy(TabularPolicy, mdp, seed=2)
    ests = {agg.value: E.get("reinforce").replace(aggregation=agg)
            for agg in (E.Aggregation.TOKEN_SUM, E.Aggregation.SEQUENCE_MEAN_TOKEN_MEAN)}
    tracks = length_drift(mdp, pi, ests, group_size=2, steps=5, lr=0.5)
    for track in tracks.values():
        assert len(track) == 6
        assert track[-1][0] > track[0][0]                 # both improve J ...
    final_len = {k: v[-1][1] for k, v in tracks.items()}
    assert abs(final_len["token-sum"] - final_len["seq-mean-token-mean"]) > 1e-3  # ... differently
    with torch.no_grad():                                  # the policy itself is untouched
        assert abs(tracks["token-sum"][0][1] - float(expected_length(mdp, pi))) < EXACT_TOL
