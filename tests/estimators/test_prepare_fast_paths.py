"""Issue 17: the fast paths of ``prepare`` against what they replace, bit for bit.

* the advantages' group index by runs (sorted ids) against the sort-based one;
* gathers by ``index_select`` (``take``) against advanced indexing.
"""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenmdp.estimators._common import take
from tokenmdp.estimators.advantages import group as A


def reference(group_S):
    return torch.unique(group_S, return_inverse=True)[1]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(-5, 40), min_size=0, max_size=60), st.booleans())
def test_group_index_equals_unique(ids, sort):
    group_S = torch.tensor(sorted(ids) if sort else ids, dtype=torch.long)
    assert torch.equal(A._group_index(group_S), reference(group_S))


def test_stacked_steps_take_the_run_path(monkeypatch):
    group_S = torch.arange(64) // 4                       # as the exact lab stacks its steps
    calls = []
    real = torch.unique_consecutive
    monkeypatch.setattr(torch, "unique_consecutive", lambda *a, **k: calls.append(1) or real(*a, **k))
    assert torch.equal(A._group_index(group_S), reference(group_S)) and calls
    shuffled = group_S[torch.randperm(64, generator=torch.Generator().manual_seed(0))]
    calls.clear()
    assert torch.equal(A._group_index(shuffled), reference(shuffled)) and not calls
    reward = torch.linspace(0, 1, 64, dtype=torch.float64)
    for ids in (group_S, shuffled):                      # the advantages themselves, bit for bit
        index = reference(ids)
        size = torch.zeros(16, dtype=torch.float64).index_add(0, index, torch.ones(64,
                                                                             dtype=torch.float64))
        mean = torch.zeros(16, dtype=torch.float64).index_add(0, index, reward) / size
        assert torch.equal(A.group_mean_advantage(reward, ids), reward - mean[index])


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 30), st.integers(0, 3), st.sampled_from([(), (2,), (2, 3)]),
       st.sampled_from([torch.float64, torch.int64, torch.bool]), st.integers(0, 10_000))
def test_take_equals_advanced_indexing(n, index_dims, trailing, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    values = (torch.randn(n, *trailing, generator=g, dtype=torch.float64) * 3).to(dtype)
    index = torch.randint(0, n, (3, 4, 2)[:index_dims], generator=g)
    assert torch.equal(take(values, index), values[index])
