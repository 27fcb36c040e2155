"""verl's actor and algorithm config → the estimator it trains: the registry's entries where
verl's settings are theirs (as tests/estimators/registry/test_verl_*.py transcribe), to 1e-12 in
float64 on random batches; non-default values change the parts; bad input is one line."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from tests.integrations._helpers import assert_same_loss, logprobs, loss_and_grad, on_random_batches
from tokenmdp import estimators
from tokenmdp.estimators import Level, MaskedIS, TruncatedIS
from tokenmdp.estimators.corrections.rejection import RejectionSampling
from tokenmdp.estimators.corrections.self_normalized import SelfNormalizedIS
from tokenmdp.integrations import estimator_from_verl

GRPO = {"adv_estimator": "grpo"}
DR = {"adv_estimator": "grpo", "norm_adv_by_std_in_grpo": False}
SMTM = "seq-mean-token-mean"


def _dual(name):
    e = estimators.get(name)
    return e.replace(surrogate=dataclasses.replace(e.surrogate, dual_clip=3.0))


#: (actor settings, algorithm section, the registry estimator it equals, exact part match)
CASES = [
    ({"loss_agg_mode": SMTM, "use_kl_loss": True, "kl_loss_coef": 0.04}, GRPO,
     estimators.get("grpo_verl"), True),
    ({"clip_ratio_high": 0.28}, GRPO, estimators.get("dapo_verl"), True),
    ({"loss_agg_mode": "seq-mean-token-sum-norm"}, DR, _dual("dr_grpo"), False),
    ({"policy_loss": {"loss_mode": "gspo"}, "clip_ratio_low": 3e-4, "clip_ratio_high": 4e-4,
      "loss_agg_mode": SMTM}, GRPO, estimators.get("gspo_token"), True),
    ({"policy_loss": {"loss_mode": "sapo"}}, GRPO, estimators.get("sapo"), True),
    ({"policy_loss": {"loss_mode": "cispo"}, "clip_ratio_low": 1.0}, GRPO,
     estimators.get("cispo"), True),
    ({"policy_loss": {"loss_mode": "geo_mean"}, "clip_ratio": 0.4, "clip_ratio_low": None,
      "clip_ratio_high": None}, GRPO, estimators.get("gmpo"), True),
    ({"policy_loss": {"loss_mode": "dppo_tv"}, "clip_ratio_low": 0.15, "clip_ratio_high": 0.15,
      "clip_ratio_c": 10000, "loss_agg_mode": "seq-mean-token-sum-norm"}, DR,
     estimators.get("dppo_tv"), False),
    ({"policy_loss": {"loss_mode": "dppo_kl"}, "clip_ratio_low": 0.05, "clip_ratio_high": 0.05,
      "clip_ratio_c": 10000, "loss_agg_mode": "seq-mean-token-sum-norm"}, DR,
     estimators.get("dppo_kl"), False),
    ({"policy_loss": {"loss_mode": "clip_cov"}}, GRPO, estimators.get("clip_cov"), True),
    ({"policy_loss": {"loss_mode": "kl_cov"}}, GRPO, estimators.get("kl_cov"), True),
    ({}, {"adv_estimator": "reinforce_plus_plus_baseline"},
     estimators.get("reinforce_pp_baseline"), True),
    ({"loss_agg_mode": SMTM, "use_kl_loss": True, "kl_loss_coef": 0.04},
     {**GRPO, "rollout_correction": {"rollout_is": "token", "rollout_is_threshold": 2.0}},
     _dual("grpo_tis"), False),
    ({"loss_agg_mode": SMTM, "use_kl_loss": True, "kl_loss_coef": 0.04},
     {**GRPO, "rollout_correction": {"rollout_is": "token", "rollout_is_threshold": "0.5_5.0"}},
     _dual("grpo_mis"), False),
    ({"loss_agg_mode": SMTM, "use_kl_loss": True, "kl_loss_coef": 0.04},
     {**GRPO, "rollout_correction": {"rollout_rs": "token_k1", "rollout_rs_threshold": "0.5_2.0"}},
     _dual("grpo_rs_token"), False),
]


@pytest.mark.parametrize(("actor", "algorithm", "entry", "exact"), CASES,
                         ids=[f"{c[2].name}-{i}" for i, c in enumerate(CASES)])
def test_verl_settings_are_the_registry_entry(actor, algorithm, entry, exact):
    whole = {"actor_rollout_ref": {"actor": actor, "rollout": {"n": 4}}, "algorithm": algorithm,
             "trainer": {"total_epochs": 1}}
    got = estimator_from_verl(whole)
    assert got == estimator_from_verl(actor, algorithm=algorithm)
    mode = actor.get("policy_loss", {}).get("loss_mode", "vanilla")
    assert got.estimator.name == f"verl:{mode}"
    if exact:
        assert got.same_as == entry.name
        assert got.estimator.replace(name=entry.name) == entry
    est = got.estimator

    @on_random_batches
    def check(batch):
        assert_same_loss(est, entry, batch)
    check()


def test_the_check_sees_a_changed_part():
    # the comparison is not vacuous: the dual clip of verl's vanilla loss shows on these batches
    batch = estimators_batch()
    lp = logprobs(batch)
    a = loss_and_grad(estimators.get("dapo_verl"), batch, lp)
    b = loss_and_grad(estimators.get("dapo"), batch, lp)
    assert float((a[1] - b[1]).abs().max()) > 1e-6


def estimators_batch():
    from tests.estimators.estimator_helpers import make_batch

    g = torch.Generator().manual_seed(1)
    lengths = [3, 2, 4, 1, 3, 2]
    old = [(-0.3 - torch.rand(n, generator=g, dtype=torch.float64)).tolist() for n in lengths]
    batch = make_batch([[9]] * 6, [[1] * n for n in lengths], rewards=[1.0, 0.0, 0.3, 0.9, 0.2, 0.7],
                       groups=[0, 0, 1, 1, 2, 2], old=old, behavior=old, ref=old)
    return batch.replace(old_logprob=batch.old_logprob + 1.5 * batch.loss_mask)  # r up to e^1.5·…


def test_non_default_values_change_the_parts():
    est = estimator_from_verl({"clip_ratio_low": 0.1, "clip_ratio_high": 0.3, "clip_ratio_c": 5,
                               "use_kl_loss": True, "kl_loss_type": "k3+", "kl_loss_coef": 0.2},
                              algorithm={**DR, "rollout_correction": {
                                  "rollout_is": "sequence", "rollout_is_threshold": 4.0,
                                  "rollout_is_batch_normalize": True}}).estimator
    assert est.surrogate == estimators.PPOClip(eps_low=0.1, eps_high=0.3, dual_clip=5.0)
    assert est.kl.estimator is estimators.kl_k3_plus and est.kl.coef == 0.2
    assert est.advantage == estimators.GroupMean()
    assert est.correction == SelfNormalizedIS(level=Level.SEQUENCE, cap=4.0)
    seq = estimator_from_verl({}, algorithm={"rollout_correction": {
        "rollout_is": "sequence", "rollout_is_threshold": 3}}).estimator
    assert seq.correction == TruncatedIS(cap=3.0, level=Level.SEQUENCE)
    band = estimator_from_verl({}, algorithm={"rollout_correction": {
        "rollout_is": "token", "rollout_is_threshold": "0.5_5.0"}}).estimator
    assert band.correction == MaskedIS(low=0.5, high=5.0, level=Level.TOKEN,
                                       masked_in_normalizer=True)
    rs = estimator_from_verl({}, algorithm={"rollout_correction": {
        "rollout_rs": "seq_mean_k3", "rollout_rs_threshold": 0.01}}).estimator
    assert rs.correction == RejectionSampling.from_verl("seq_mean_k3", 0.01)
    reward = estimator_from_verl({}, algorithm={"use_kl_in_reward": True, "kl_penalty": "k1",
                                                "kl_ctrl": {"kl_coef": 0.01}}).estimator
    assert reward.kl.in_reward and reward.kl.coef == 0.01


def test_notes_say_where_verl_differs():
    notes = " ".join(estimator_from_verl({"loss_agg_mode": "seq-mean-token-sum-norm",
                                          "loss_scale_factor": 512}).notes)
    assert "no algorithm section" in notes and "loss_scale_factor = 512" in notes
    assert "dual clip at clip_ratio_c = 3" in notes
    sapo = " ".join(estimator_from_verl({"policy_loss": {"loss_mode": "sapo"}},
                                        algorithm=GRPO).notes)
    assert "whatever loss_agg_mode='token-mean' says" in sapo


def test_a_dict_and_a_yaml_file_give_the_same_estimator(tmp_path):
    yaml = pytest.importorskip("yaml")
    whole = {"actor_rollout_ref": {"actor": {"policy_loss": {"loss_mode": "gspo"},
                                             "optim": {"lr": 1e-6}}}, "algorithm": GRPO}
    (tmp_path / "v.yaml").write_text(yaml.safe_dump(whole))
    (tmp_path / "v.json").write_text(json.dumps(whole))
    assert (estimator_from_verl(whole) == estimator_from_verl(tmp_path / "v.yaml")
            == estimator_from_verl(str(tmp_path / "v.json")))


@pytest.mark.parametrize(("actor", "algorithm", "message"), [
    ({"clip_ratio_lo": 0.2}, None, "actor.clip_ratio_lo: unknown field"),
    ({"policy_loss": {"mode": "gspo"}}, None, "actor.policy_loss.mode: unknown field"),
    ({}, {"adv_estimatr": "grpo"}, "algorithm.adv_estimatr: unknown field"),
    ({}, {"rollout_correction": {"rollout_iss": "token"}},
     "algorithm.rollout_correction.rollout_iss: unknown field"),
    ({"policy_loss": {"loss_mode": "gpg"}}, None, "policy_loss.loss_mode='gpg': no counterpart"),
    ({"loss_agg_mode": "seq-sum"}, None, "actor.loss_agg_mode='seq-sum': no counterpart"),
    ({}, {"adv_estimator": "gae"}, "algorithm.adv_estimator='gae': no counterpart"),
    ({"use_kl_loss": True, "kl_loss_type": "full"}, None, "actor.kl_loss_type='full'"),
    ({"entropy_coeff": 0.001}, None, "actor.entropy_coeff=0.001: no counterpart"),
    ({}, {"use_kl_in_reward": True, "kl_ctrl": {"type": "adaptive"}},
     "algorithm.kl_ctrl.type='adaptive'"),
    ({"use_kl_loss": True}, {"use_kl_in_reward": True}, "algorithm.use_kl_in_reward=True"),
    ({}, {"rollout_correction": {"rollout_is": "token", "rollout_rs": "token_k1",
                                 "rollout_rs_threshold": 2.0}},
     "algorithm.rollout_correction.rollout_rs='token_k1': no counterpart"),
    ({"clip_ratio_c": "${oc.select:x}"}, None, "clip_ratio_c: expected a number"),
])
def test_bad_input_is_one_line_naming_the_field(actor, algorithm, message):
    with pytest.raises(ValueError) as err:
        estimator_from_verl(actor, algorithm=algorithm)
    assert message in str(err.value) and "\n" not in str(err.value)
