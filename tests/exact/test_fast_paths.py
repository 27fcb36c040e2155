"""Issue 17: the fast paths of the exact world against the computations they replace.

* the terminal layout and the level prefixes (a broadcast fill) against integer div/mod decoding;
* ``RandomTable`` over the prefix tree against its row-wise form and a pure-Python splitmix64;
* ``objective`` and ``gradient`` (one pass of values down the tree, closed-form backward) against
  the per-response formula ``Σ_y D(x) π(y|x) R(x, y)`` differentiated by autograd.

On the fixtures and on hypothesis-generated MDPs, in float64, bit for bit or within 1e-12.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenmdp.exact import (
    LogLinearPolicy,
    NeuralPolicy,
    TabularPolicy,
    TokenMDP,
    flat_grad,
    gradient,
    objective,
    sequence_probs,
)
from tokenmdp.exact.world.rewards import RandomTable
from tokenmdp.testing.strategies import mdps

from .conftest import OnlyTokenLogprobs

#: float64 round-off of sums over at most a few thousand terms, in different orders.
EXACT_TOL = 1e-12
M64 = (1 << 64) - 1


def divmod_decode(codes: torch.Tensor, k: int, b: int) -> torch.Tensor:
    """The digits by integer division (the code the broadcast fill replaced)."""
    powers = b ** torch.arange(k - 1, -1, -1, dtype=torch.long)
    return (codes[:, None] // powers) % b


def per_response_objective(mdp, policy) -> torch.Tensor:
    """``J = Σ D(x) π(y|x) R(x, y)`` over the enumerated responses (differentiable)."""
    weights = mdp.prompt_probs[mdp.terminal_prompt_index]
    return (weights * sequence_probs(mdp, policy) * mdp.rewards).sum()


def splitmix_py(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & M64
    return x ^ (x >> 31)


def random_table_py(seed: int, prompt, response) -> float:
    """RandomTable's documented hash chain in plain Python integers."""
    h = splitmix_py(seed)
    for t in prompt:
        h = splitmix_py(h ^ (t + 1))
    for t in response:
        h = splitmix_py(h ^ (t + 1))
    h = splitmix_py(h ^ len(response))
    return (h >> 11) / 2 ** 53


def policies(mdp):
    gen = torch.Generator().manual_seed(0)
    tab = TabularPolicy(mdp, generator=gen)
    return [tab, LogLinearPolicy(mdp, generator=gen), NeuralPolicy(mdp, generator=gen),
            OnlyTokenLogprobs(tab)]


def check_layout(mdp):
    b, L = mdp.branching, mdp.max_len
    pidx, resp, lengths = mdp._terminal_layout
    blocks, lens = [], []
    for k in range(L + 1):
        block = torch.full((b ** k, L), mdp.eos, dtype=torch.long)
        block[:, :k] = divmod_decode(torch.arange(b ** k), k, b)
        blocks.append(block)
        lens.append(torch.full((b ** k,), min(k + 1, L), dtype=torch.long))
    P = mdp.num_prompts
    assert torch.equal(resp, torch.cat(blocks).repeat(P, 1))
    assert torch.equal(lengths, torch.cat(lens).repeat(P))
    assert torch.equal(pidx, torch.arange(P).repeat_interleave(mdp.responses_per_prompt))
    for k in range(L):
        prompt_index, prefix = mdp.level_prefixes(k)
        codes = torch.arange(b ** k).repeat(P)
        assert torch.equal(prefix, divmod_decode(codes, k, b))
        assert torch.equal(prefix, mdp.decode(codes, k))
        assert torch.equal(mdp.state_index(prompt_index, prefix),
                           torch.arange(mdp.level_offsets[k], mdp.level_offsets[k + 1]))


def check_objective(mdp, policy):
    reference = per_response_objective(mdp, policy)
    g_ref = flat_grad(reference, policy)
    J = objective(mdp, policy)
    assert abs(float(J.detach()) - float(reference.detach())) <= EXACT_TOL
    assert (flat_grad(J, policy) - g_ref).abs().max() <= EXACT_TOL          # lazy backward
    assert (gradient(mdp, policy) - g_ref).abs().max() <= EXACT_TOL         # eager
    g3 = flat_grad(3.0 * objective(mdp, policy), policy)                    # grad_output 3
    assert (g3 - 3.0 * g_ref).abs().max() <= 3 * EXACT_TOL
    with torch.no_grad():
        assert abs(float(objective(mdp, policy)) - float(reference.detach())) <= EXACT_TOL
        assert (gradient(mdp, policy) - g_ref).abs().max() <= EXACT_TOL


@pytest.mark.parametrize("V, L, prompts", [(2, 1, [(0,)]), (2, 5, [(1,)]), (3, 3, [(0,), (1, 0)]),
                                            (5, 3, [(4,), (0, 1), (2,)]), (11, 3, [(0,)])])
def test_layout_matches_divmod_decoding(V, L, prompts):
    check_layout(TokenMDP(V, L, RandomTable(seed=1), prompts=prompts))


@settings(max_examples=40, deadline=None)
@given(mdps(max_vocab_size=5, max_len=4))
def test_layout_matches_divmod_decoding_on_generated_mdps(mdp):
    check_layout(mdp)


@settings(max_examples=40, deadline=None)
@given(mdps(max_vocab_size=5, max_len=4), st.sampled_from([None, 0.3]))
def test_random_table_tree_equals_rows_and_plain_python(mdp, binary_p):
    reward = RandomTable(seed=12345, low=-0.5, high=2.0, binary_p=binary_p)
    pidx, resp, lengths = mdp._terminal_layout
    rows = torch.as_tensor(reward.vectorized(mdp.prompts, pidx, resp, lengths, eos=mdp.eos))
    tree = torch.as_tensor(reward.on_prefix_tree(mdp.prompts, mdp.vocab_size, mdp.max_len))
    assert torch.equal(rows, tree)
    for i, (p, y) in enumerate(mdp.responses()[:50]):
        u = random_table_py(12345, p, y)
        expected = float(u < binary_p) if binary_p is not None else -0.5 + 2.5 * u
        assert float(tree[i]) == expected


def test_random_table_tree_chunks_the_truncated_block(monkeypatch):
    """More depth-(L-1) prefixes than one chunk, and a ragged last chunk."""
    from tokenmdp.exact.world import _hashing
    monkeypatch.setattr(_hashing, "TREE_CHUNK", 7)
    mdp = TokenMDP(5, 3, RandomTable(seed=4), prompts=[(0,), (3, 1)])
    pidx, resp, lengths = mdp._terminal_layout
    rows = mdp.reward_fn.vectorized(mdp.prompts, pidx, resp, lengths, eos=mdp.eos)
    assert torch.equal(mdp.rewards, torch.as_tensor(rows))


def test_objective_and_gradient_on_the_fixture(mdp, policy):
    check_objective(mdp, policy)
    check_objective(mdp, OnlyTokenLogprobs(policy))


@settings(max_examples=25, deadline=None)
@given(mdps(max_vocab_size=4, max_len=3))
def test_objective_and_gradient_on_generated_mdps(mdp):
    for policy in policies(mdp):
        check_objective(mdp, policy)


def test_workspaces_never_leak_between_calls_or_mdps():
    a = TokenMDP(4, 3, RandomTable(seed=0), prompts=[(0,), (1,)])
    b = TokenMDP(3, 4, RandomTable(seed=1))
    pa, pb = TabularPolicy(a, generator=torch.Generator().manual_seed(0)), \
        TabularPolicy(b, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        first = gradient(a, pa).clone(), float(objective(a, pa))
        gradient(b, pb), objective(b, pb)
        g = gradient(a, pa)
        assert torch.equal(g, first[0]) and float(objective(a, pa)) == first[1]
        g2 = gradient(a, pa)
    assert g2.data_ptr() != g.data_ptr() and torch.equal(g, g2)     # a fresh result each call


def test_the_closed_form_gradient_is_what_the_check_sees():
    """The checks fail when the backward pass is broken: a wrong sign of the baseline term."""
    from tokenmdp.exact.world import _tree_objective
    mdp = TokenMDP(3, 3, RandomTable(seed=2), prompts=[(0,), (1, 0)])
    policy = NeuralPolicy(mdp, generator=torch.Generator().manual_seed(0))
    reference = flat_grad(per_response_objective(mdp, policy), policy)
    original = _tree_objective._tree_pass

    def uncentered(mdp, probs, out, centered):
        return original(mdp, probs, out, centered=False)
    try:
        _tree_objective._tree_pass = uncentered
        broken = gradient(mdp, policy)
    finally:
        _tree_objective._tree_pass = original
    # d π Q is the gradient in the log-probabilities, not in the logits
    assert (broken - reference).abs().max() > 1e-3
    assert (gradient(mdp, policy) - reference).abs().max() <= EXACT_TOL


# ------------------------------------------------------------------ exchangeability, packed
def test_packed_batches_evaluate_every_term_exactly_once():
    """Each (response y of type τ, multiset m of the others' types) appears in exactly one valid
    slot, and the number of batches is the cost's closed form."""
    from tokenmdp.exact.lab.exchangeability import _members, _packed_batches, _packed_count
    from tokenmdp.exact.lab.group_draws import multisets

    type_of = torch.tensor([0, 1, 1, 2, 0, 1, 1, 1, 2, 0])
    q = torch.tensor([.1, .1, .1, .0, .2, .1, .1, .1, .1, .1], dtype=torch.float64)
    K, G = 3, 4
    rep = torch.tensor([0, 1, 3])
    others = multisets(K, G - 1)[0]
    index = {tuple(r): i for i, r in enumerate(others.tolist())}
    members = _members(type_of, q, K)
    ids, valid, rows = _packed_batches(multisets(K, G)[0], members, rep, index, G)
    seen = sorted(zip(ids[valid].tolist(), rows[valid].tolist()))
    expected = sorted((int(y), int(type_of[y]) * len(index) + m)
                      for y in (q > 0).nonzero().view(-1) for m in range(len(index)))
    assert seen == expected
    assert (type_of[ids] * len(index) == rows - rows % len(index)).all()  # slots hold their type
    n_type = torch.tensor([m.numel() for m in members])
    assert ids.shape[0] == _packed_count(multisets(K, G)[0], n_type)
    assert ids.shape[0] < int((q > 0).sum()) * len(index)                # fewer than one per term


def test_chunked_cross_term_and_packing_agree(monkeypatch):
    from tokenmdp import estimators as E
    from tokenmdp.exact import inference_copy, moments, stale_copy
    from tokenmdp.exact.lab import exchangeability
    mdp = TokenMDP(3, 3, RandomTable(seed=5, binary_p=0.5), prompts=[(0,), (1,)])
    pi = TabularPolicy(mdp, generator=torch.Generator().manual_seed(0))
    old = stale_copy(mdp, pi, distance=0.3)
    mu = inference_copy(old, noise_std=0.3, generator=torch.Generator().manual_seed(1))
    kw = dict(group_size=4, behavior=mu, old=old, reference=old, method="exchangeability")
    whole = moments(mdp, pi, E.get("grpo"), **kw)
    monkeypatch.setattr(exchangeability, "CROSS_CHUNK_ENTRIES", 7)
    monkeypatch.setattr(exchangeability, "PACK_BLOCK", 3)       # and the batches in pieces
    chunked = moments(mdp, pi, E.get("grpo"), **kw)
    assert abs(whole.total_variance - chunked.total_variance) <= EXACT_TOL
    assert (whole.covariance - chunked.covariance).abs().max() <= EXACT_TOL
    enum = moments(mdp, pi, E.get("grpo"), **{**kw, "method": "enumeration"})
    assert abs(enum.total_variance - chunked.total_variance) <= EXACT_TOL
    assert (enum.mean - chunked.mean).abs().max() <= EXACT_TOL
