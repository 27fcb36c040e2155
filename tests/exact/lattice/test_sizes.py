"""Issue 32, the lattice at its edges: an estimator undefined for the group size says so, and a
group too large to count or to sample is refused before anything of its size is built."""

import time

import pytest
import torch

from tokenmdp.estimators import get, names
from tokenmdp.exact import lattice

QUICK_S = 5.0


@pytest.fixture(scope="module")
def world():
    mdp = lattice.LatticeMDP(lattice.token_count(0, 3, cap=2), max_len=4)
    return mdp, lattice.LatticePolicy(mdp, generator=torch.Generator().manual_seed(0))


def test_exact_support_says_undefined_at_g_1_for_every_estimator_moments_refuses(world):
    mdp, policy = world
    for name in names():
        estimator = get(name)
        exact, reason = lattice.exact_support(estimator, 1)
        if not exact:
            continue
        # whatever the lattice calls exact at G = 1 runs there
        lattice.moments(mdp, policy, estimator, group_size=1, method="lattice",
                        reference=policy)
    exact, reason = lattice.exact_support(get("rloo"), 1)
    assert not exact and reason.startswith("undefined at G = 1: advantage")
    assert "at least 2" in reason
    assert lattice.exact_support(get("rloo"), 2) == (True, "")


def test_a_million_member_group_is_refused_before_it_is_built(world):
    mdp, policy = world
    start = time.perf_counter()
    with pytest.raises(ValueError, match="class-count configurations .G = 1000000"):
        lattice.moments(mdp, policy, get("rloo"), group_size=10 ** 6, method="lattice")
    long = lattice.LatticeMDP(lattice.token_count(0, 3, cap=2), max_len=4096)
    with pytest.raises(ValueError, match="tokens in one sampled group would need about 244 GiB"):
        lattice.moments(long, lattice.LatticePolicy(long, generator=torch.Generator()),
                        get("dapo"), group_size=10 ** 6)
    assert time.perf_counter() - start < QUICK_S
