"""Short trainer-world runs on the exact MDP (tokenmdp.rl.replay_runs): the recorded J is the
exact objective of the trained weights, the logged values are the trainer's, runs repeat under a
seed, and R3's old-logprob pass sees no routing mismatch."""

from __future__ import annotations

import copy

import pytest
import torch

from tokenmdp.course.setups import copy_task
from tokenmdp.exact import objective
from tokenmdp.rl.replay_exact import moe_policy
from tokenmdp.rl.replay_runs import mdp_training_run

#: Two float64 evaluations of one J.
EXACT_TOL = 1e-12


@pytest.fixture(scope="module")
def setup():
    mdp, _ = copy_task()
    return mdp, moe_policy(mdp, seed=0)


def test_a_run_records_the_exact_J_and_repeats_under_its_seed(setup):
    mdp, model = setup
    kw = dict(replay="r2", minibatches=2, steps=3, prompts_per_step=4, selection_noise=1.0,
              engine_seed=1, seed=5)
    a, b = mdp_training_run(mdp, model, "rloo", **kw), mdp_training_run(mdp, model, "rloo", **kw)
    assert a == b and len(a.J) == 4 and len(a.flip_fraction) == 3
    with torch.no_grad():
        assert abs(a.J[0] - float(objective(mdp, model))) < EXACT_TOL   # the model is not modified
    assert a.J[-1] != a.J[0]                                           # the copy was trained
    assert all(0 < f < 1 for f in a.flip_fraction) and all(k > 0 for k in a.train_infer_kl)


def test_r3s_old_logprob_pass_sees_no_mismatch(setup):
    mdp, model = setup
    run = mdp_training_run(mdp, model, "rloo", replay="r3", minibatches=2, steps=2,
                           prompts_per_step=4, selection_noise=1.0, engine_seed=1)
    assert run.logged_mismatch == [0.0, 0.0]
    assert all(k < 1e-10 for k in run.train_infer_kl)     # fp32 engine: rounding only
    assert all(f > 0 for f in run.flip_fraction)          # the engines still disagree un-replayed


def test_bad_settings_raise_naming_the_argument(setup):
    mdp, model = setup
    with pytest.raises(ValueError, match="minibatches"):
        mdp_training_run(mdp, model, "rloo", minibatches=9, prompts_per_step=2, group_size=2)
    with pytest.raises(ValueError, match="steps"):
        mdp_training_run(mdp, model, "rloo", steps=0)
    with pytest.raises(TypeError, match="model"):
        mdp_training_run(mdp, copy.deepcopy(model).float(), "rloo")
    with pytest.raises(TypeError, match="mdp"):
        mdp_training_run(None, model, "rloo")
