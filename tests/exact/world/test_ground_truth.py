"""J, ∇J, values and the other ground-truth quantities against independent computations."""

import itertools

import pytest
import torch
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from tests.exact.conftest import OnlyTokenLogprobs, make_policy
from tokenmdp.exact import (
    TabularPolicy,
    TokenMDP,
    flat_grad,
    gradient,
    inference_copy,
    objective,
    sequence_kl,
    sequence_logprobs,
    sequence_probs,
    stale_copy,
    state_logprobs,
    state_visitation,
    surrogate,
    token_entropy,
    values,
)
from tokenmdp.exact.world.rewards import TokenCount

#: float64 round-off on sums over a few hundred terms.
EXACT_TOL = 1e-12
#: central finite differences with step FD_STEP have O(h^2) truncation error ~1e-8.
FD_STEP = 1e-5
FD_TOL = 1e-7
FD_COORDS = 40


def brute_force_responses(mdp):
    """Every response by itertools, independent of the MDP's own enumeration code."""
    out = []
    b, L, eos = mdp.branching, mdp.max_len, mdp.eos
    for p in mdp.prompts:
        for k in range(L):
            out += [(p, c + (eos,)) for c in itertools.product(range(b), repeat=k)]
        out += [(p, c) for c in itertools.product(range(b), repeat=L)]
    return out


@pytest.mark.parametrize("V, L", [(2, 1), (2, 4), (3, 3), (4, 2), (5, 3)])
def test_enumeration_lists_every_response_once_and_matches_closed_form(V, L):
    mdp = TokenMDP(V, L, TokenCount(0), prompts=[(0,), (1, 0)])
    closed_form = 2 * sum((V - 1) ** k for k in range(L + 1))
    assert mdp.num_sequences == closed_form
    listed = mdp.responses()
    assert len(listed) == len(set(listed)) == closed_form
    assert set(listed) == set(brute_force_responses(mdp))
    assert [tuple(p) + tuple(r) for p, r in listed] == [
        tuple(p) + tuple(r) for p, r in mdp.enumerate().sequences()]


def test_probabilities_sum_to_one_per_prompt(mdp, policy):
    probs = sequence_probs(mdp, policy).view(mdp.num_prompts, -1)
    torch.testing.assert_close(probs.sum(1), torch.ones(mdp.num_prompts, dtype=torch.float64),
                               rtol=0, atol=EXACT_TOL)
    mu = inference_copy(policy, rounding=3) if hasattr(policy, "logits") else policy
    torch.testing.assert_close(sequence_probs(mdp, mu).view(mdp.num_prompts, -1).sum(1),
                               torch.ones(mdp.num_prompts, dtype=torch.float64),
                               rtol=0, atol=EXACT_TOL)


def test_level_recursion_matches_token_logprobs_on_the_enumeration(mdp, policy):
    batch = mdp.enumerate()
    via_tokens = batch.sequence_sum(policy.token_logprobs(batch))
    torch.testing.assert_close(sequence_logprobs(mdp, policy), via_tokens, rtol=0, atol=EXACT_TOL)


def test_gradient_three_ways_agree(mdp, policy):
    exact = gradient(mdp, policy)
    # (2) REINFORCE on the full enumeration: sum_y sg[D(x) pi(y|x)] R log pi(y|x)
    batch = mdp.enumerate()
    logp = batch.sequence_sum(policy.token_logprobs(batch))
    # detach: the probability weights are the sampling distribution, not a function of theta;
    # this is the score-function identity ∇J = E[R ∇log pi].
    weights = (mdp.prompt_probs[batch.prompt_index] * logp.exp()).detach()
    reinforce = flat_grad((weights * batch.reward * logp).sum(), policy)
    torch.testing.assert_close(reinforce, exact, rtol=0, atol=EXACT_TOL)
    # (3) central finite differences of J, on FD_COORDS coordinates drawn at random
    theta = parameters_to_vector(policy.parameters()).detach().clone()
    coords = torch.randperm(theta.numel(), generator=torch.Generator().manual_seed(0))[:FD_COORDS]
    fd = torch.empty(len(coords), dtype=torch.float64)
    with torch.no_grad():
        for n, i in enumerate(coords.tolist()):
            j = []
            for sign in (1.0, -1.0):
                t = theta.clone()
                t[i] += sign * FD_STEP
                vector_to_parameters(t, policy.parameters())
                j.append(float(objective(mdp, policy)))
            fd[n] = (j[0] - j[1]) / (2 * FD_STEP)
        vector_to_parameters(theta, policy.parameters())
    torch.testing.assert_close(fd, exact[coords], rtol=0, atol=FD_TOL)
    assert exact.abs().max() > 1e-3  # the comparison is not between zeros


def test_expected_grad_log_prob_is_zero_at_every_state(mdp, policy):
    worst = 0.0
    for k in range(mdp.max_len):
        prompt_index, prefix = mdp.level_prefixes(k)
        for s in range(prompt_index.shape[0]):
            lp = torch.log_softmax(policy.logits(prompt_index[s:s + 1], prefix[s:s + 1]), -1)[0]
            if s == 0 and k == 0:  # control: one log-prob alone has a non-zero gradient
                control = torch.log_softmax(policy.logits(prompt_index[:1], prefix[:1]), -1)
                assert flat_grad(control[0, 0], policy).abs().max() > 1e-3
            # detach: pi(a|s) are the expectation's weights, not differentiated
            expectation = (lp.exp().detach() * lp).sum()
            worst = max(worst, float(flat_grad(expectation, policy).abs().max()))
    assert worst < EXACT_TOL


def test_values_match_brute_force_conditional_expectations(mdp):
    policy = make_policy(TabularPolicy, mdp, seed=5)
    with torch.no_grad():
        tables = values(mdp, policy)
        probs = sequence_probs(mdp, policy)
    responses = mdp.responses()
    rewards = mdp.rewards
    # Q(s, a) = E[R | s, a] = sum over responses through s.a of pi(y) R / sum of pi(y)
    for p_idx, prompt in enumerate(mdp.prompts):
        for k in range(mdp.max_len):
            for prefix in itertools.product(range(mdp.branching), repeat=k):
                sid = int(mdp.state_index(torch.tensor([p_idx]), torch.tensor([prefix],
                                          dtype=torch.long).view(1, k)))
                for a in range(mdp.vocab_size):
                    through = [i for i, (x, y) in enumerate(responses)
                               if x == prompt and y[:k + 1] == prefix + (a,)]
                    w = probs[through]
                    q = float((w * rewards[through]).sum() / w.sum())
                    assert abs(float(tables.Q[sid, a]) - q) < EXACT_TOL
    roots = tables.V[: mdp.num_prompts]
    j_x = (probs * rewards).view(mdp.num_prompts, -1).sum(1)
    torch.testing.assert_close(roots, j_x, rtol=0, atol=EXACT_TOL)


def test_performance_difference_lemma_holds_exactly(mdp, policy):
    mu = stale_copy(mdp, policy, distance=0.7)
    with torch.no_grad():
        lhs = objective(mdp, policy) - objective(mdp, mu)
        d_pi = state_visitation(mdp, policy)
        pi = torch.cat([lp.exp().reshape(-1, mdp.vocab_size)
                        for lp in state_logprobs(mdp, policy)])
        rhs = (d_pi[:, None] * pi * values(mdp, mu).A).sum()
    assert abs(float(lhs)) > 1e-3
    assert abs(float(lhs - rhs)) < EXACT_TOL


def test_visitation_sums_to_expected_length(mdp, policy):
    with torch.no_grad():
        probs = sequence_probs(mdp, policy)
        mean_len = (mdp.prompt_probs[mdp.terminal_prompt_index] * probs
                    * mdp.terminal_lengths).sum()
        assert abs(float(state_visitation(mdp, policy).sum() - mean_len)) < EXACT_TOL


def test_token_entropy_matches_enumeration(mdp, policy):
    batch = mdp.enumerate()
    with torch.no_grad():
        lp_RCV = policy.next_token_logprobs(batch)
        ent_RC = -(lp_RCV.exp() * lp_RCV).sum(-1) * batch.response_mask
        w = mdp.prompt_probs[batch.prompt_index] * sequence_probs(mdp, policy)
        total = (w * batch.sequence_sum(ent_RC)).sum()
        mean_len = (w * batch.length).sum()
        assert abs(float(token_entropy(mdp, policy, reduction="sum") - total)) < EXACT_TOL
        assert abs(float(token_entropy(mdp, policy) - total / mean_len)) < EXACT_TOL


def test_sequence_kl_matches_definition_and_is_zero_on_itself(mdp, policy):
    mu = inference_copy(policy, noise_std=0.3, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        lp, lq = sequence_logprobs(mdp, policy), sequence_logprobs(mdp, mu)
        w = mdp.prompt_probs[mdp.terminal_prompt_index]
        expected = sum(float(w[i] * lp[i].exp() * (lp[i] - lq[i])) for i in range(len(lp)))
        assert abs(float(sequence_kl(mdp, policy, mu)) - expected) < EXACT_TOL
        assert expected > 1e-4
        assert abs(float(sequence_kl(mdp, policy, policy))) < EXACT_TOL


def test_surrogate_matches_its_sample_form_and_first_order_contact(mdp, policy):
    mu = stale_copy(mdp, policy, distance=0.5)
    # L_mu(pi) - J(mu) = E_{y~mu} sum_t (pi/mu)(y_t|s_t) A^mu(s_t, y_t), by enumeration
    batch = mdp.enumerate()
    with torch.no_grad():
        A = values(mdp, mu).A
        lp_pi, lp_mu = policy.token_logprobs(batch), mu.token_logprobs(batch)
        rpos = batch.response_position
        sid = torch.zeros_like(rpos)
        for r in range(batch.num_rows):
            for c in range(batch.capacity):
                t = int(rpos[r, c])
                if t >= 0:
                    prefix = batch.tokens[r, c - t:c].view(1, t)
                    sid[r, c] = mdp.state_index(batch.prompt_index[r:r + 1], prefix)
        adv = A[sid, batch.tokens] * batch.response_mask
        ratio = (lp_pi - lp_mu).exp()
        w = mdp.prompt_probs[batch.prompt_index] * sequence_probs(mdp, mu)
        expected = objective(mdp, mu) + (w * batch.sequence_sum(ratio * adv)).sum()
        assert abs(float(surrogate(mdp, policy, mu) - expected)) < EXACT_TOL
    # first-order contact at pi = mu: equal value, equal gradient
    assert abs(float((surrogate(mdp, mu, mu) - objective(mdp, mu)).detach())) < EXACT_TOL
    torch.testing.assert_close(flat_grad(surrogate(mdp, mu, mu), mu), gradient(mdp, mu),
                               rtol=0, atol=EXACT_TOL)


def test_generic_protocol_path_equals_prefix_fast_path(mdp, policy):
    generic = OnlyTokenLogprobs(policy)
    torch.testing.assert_close(gradient(mdp, generic), gradient(mdp, policy),
                               rtol=0, atol=EXACT_TOL)
    torch.testing.assert_close(values(mdp, generic).Q, values(mdp, policy).Q,
                               rtol=0, atol=EXACT_TOL)
