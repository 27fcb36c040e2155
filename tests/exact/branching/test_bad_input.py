"""Bad input to the tree samplers, laws and moments: a clear error naming the argument."""

import numpy as np
import pytest
import torch

from tokenmdp.exact.branching import (
    TreeWorkspace,
    at_budget,
    sample_trees,
    tree_law,
    tree_moments,
)
from tokenmdp.tree_schedules import EntropyForks, FixedForks, RandomForks, as_schedule


def gen():
    return torch.Generator().manual_seed(0)


def test_a_fork_deeper_than_any_response_names_depths(mdp, pi):
    with pytest.raises(ValueError, match=r"^depths: a fork after 3 tokens"):
        sample_trees(mdp, pi, FixedForks((1, 3), (2, 2)), 4, generator=gen())
    with pytest.raises(ValueError, match=r"^depths"):
        tree_law(mdp, pi, FixedForks((5,), (2,)))


@pytest.mark.parametrize("make", [lambda: FixedForks((1,), (0,)),
                                  lambda: EntropyForks((1,), (0,)),
                                  lambda: RandomForks((2, 1), (1, 0))])
def test_a_branching_budget_of_zero_names_branching(make):
    with pytest.raises(ValueError, match=r"^branching\[\d\] = 0: a branching budget of zero"):
        make()


@pytest.mark.parametrize("schedule, leaves", [(FixedForks((0, 1), (2, 2)), 4),
                                              (EntropyForks((1, 2), (3, 1)), 6)])
def test_a_schedule_whose_leaves_are_not_g_names_group_size(mdp, pi, schedule, leaves):
    assert schedule.leaves == leaves
    for call in (lambda: sample_trees(mdp, pi, schedule, 3, generator=gen(), group_size=5),
                 lambda: tree_law(mdp, pi, schedule, group_size=5),
                 lambda: tree_moments(mdp, pi, "reinforce", schedule, group_size=5)):
        with pytest.raises(ValueError, match=rf"^group_size: 5 leaves asked.*grows {leaves}"):
            call()


@pytest.mark.parametrize("kwargs, match", [
    (dict(depths=(2, 1), branching=(2, 2)), r"^depths: must increase strictly"),
    (dict(depths=(-1,), branching=(2,)), r"^depths\[0\] = -1"),
    (dict(depths=(1,), branching=(2, 2)), r"^branching: 2 entries for 1 depths"),
    (dict(depths=(), branching=()), r"^depths: expected at least one entry"),
])
def test_malformed_fixed_forks(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FixedForks(**kwargs)


def test_other_bad_arguments(mdp, pi):
    with pytest.raises(TypeError, match=r"^generator"):
        sample_trees(mdp, pi, FixedForks((1,), (2,)), 3, generator=0)
    with pytest.raises(ValueError, match=r"^num_trees"):
        sample_trees(mdp, pi, FixedForks((1,), (2,)), 0, generator=np.random.default_rng(0))
    with pytest.raises(ValueError, match=r"^method: the recursion needs i.i.d. children"):
        tree_law(mdp, pi, EntropyForks((1,), (2,)), method="recursion")
    with pytest.raises(ValueError, match=r"^max_trees"):
        tree_law(mdp, pi, FixedForks((0,), (3,)), max_trees=10)
    with pytest.raises(TypeError, match=r"^schedule"):
        as_schedule(("fixed", 1, 2))
    ws = TreeWorkspace(mdp, pi)
    with pytest.raises(ValueError, match=r"^method"):
        ws.moments("reinforce", FixedForks((1,), (2,)), method="exhaustive")
    with pytest.raises(ValueError, match=r"^reference: estimator 'grpo'"):
        ws.moments("grpo", FixedForks((1,), (2,)))
    with pytest.raises(TypeError, match=r"^estimator"):
        ws.moments(lambda lp, b: lp.sum(), FixedForks((1,), (2,)))
    with pytest.raises(ValueError, match=r"^budget"):
        at_budget(ws.moments("reinforce", FixedForks((1,), (2,))), 0.0)


def test_a_schedule_is_one_object_in_both_worlds_and_reads_its_text_form():
    from tokenmdp.rl import tree_rollout

    assert tree_rollout.FixedForks is FixedForks and tree_rollout.EntropyForks is EntropyForks
    assert as_schedule("fixed:1x2") == FixedForks((1,), (2,))
    assert as_schedule("entropy:1x2") == EntropyForks((1,), (2,))
    assert as_schedule("random:2x1") == RandomForks((2,), (1,))
    with pytest.raises(ValueError, match="^schedule: 'none'"):
        as_schedule("none")
    with pytest.raises(ValueError, match="^schedule: expected none"):
        as_schedule("fixed:1")
