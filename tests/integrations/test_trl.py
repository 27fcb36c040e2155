"""TRL's GRPOConfig → the estimator it computes: the registry's entries where TRL's settings are
theirs (the transcription tests in tests/estimators/registry/ state which), to 1e-12 in float64
on random batches; non-default values change the parts as they say; bad input is one line."""

from __future__ import annotations

import dataclasses
import json
import sys
import types

import pytest

from tests.integrations._helpers import assert_same_loss, on_random_batches
from tokenmdp import estimators
from tokenmdp.estimators import GroupNormalized, Level, MaskedIS, PPOClip, TruncatedIS
from tokenmdp.integrations import TRL_DEFAULTS, estimator_from_trl

NO_BIAS_KL = {"beta": 0.04, "use_bias_correction_kl": False}
TIS2 = {"use_vllm": True, "vllm_importance_sampling_mode": "token_truncate",
        "vllm_importance_sampling_clip_max": 2.0}

#: (TRL settings, registry entry, whether TRL's std + 1e-4 is the only difference)
CASES = [
    ({"loss_type": "grpo", **NO_BIAS_KL}, "grpo", True),
    ({"loss_type": "dr_grpo", "scale_rewards": "none"}, "dr_grpo", False),
    ({"loss_type": "dr_grpo", "scale_rewards": False}, "dr_grpo", False),
    ({"loss_type": "dapo", "epsilon_high": 0.28}, "dapo", True),
    ({"epsilon_high": 0.28, "use_vllm": True}, "dapo_trl_mis", True),
    ({"loss_type": "grpo", **NO_BIAS_KL, "use_vllm": True}, "grpo_trl_mis", True),
    ({"loss_type": "grpo", **NO_BIAS_KL, **TIS2}, "grpo_tis", True),
    ({"loss_type": "dapo", "epsilon_high": 0.28, **TIS2}, "dapo_tis", True),
    ({"loss_type": "dr_grpo", "scale_rewards": "none", **TIS2}, "dr_grpo_tis", False),
    ({"loss_type": "grpo", "importance_sampling_level": "sequence", "epsilon": 3e-4,
      "epsilon_high": 4e-4}, "gspo", True),
    ({"loss_type": "luspo", "importance_sampling_level": "sequence", "epsilon": 2e-3,
      "epsilon_high": 2.5e-3}, "luspo", True),
    ({"loss_type": "sapo"}, "sapo", True),
    ({"loss_type": "cispo", "epsilon_high": 1.2}, "cispo", True),
    ({"loss_type": "dapo", "scale_rewards": "batch"}, "grpo_batch_std", False),
    ({"loss_type": "grpo", **NO_BIAS_KL, "off_policy_mask_threshold": 0.5, "use_vllm": True,
      "vllm_importance_sampling_correction": False}, "grpo_opsm", True),
]


@pytest.mark.parametrize(("config", "name", "std_only"), CASES,
                         ids=[f"{c[1]}-{i}" for i, c in enumerate(CASES)])
def test_trl_settings_are_the_registry_entry(config, name, std_only):
    got = estimator_from_trl(config)
    entry = estimators.get(name)
    est = got.estimator
    assert est.name == f"trl:{config.get('loss_type', 'dapo')}"
    if std_only:                                   # TRL's group std + 1e-4; the entry's 1e-6
        assert est.advantage == GroupNormalized(ddof=1, eps=1e-4)
        assert got.same_as is None
        assert any(name in n and "1e-4" in n for n in got.notes), got.notes
        est = est.replace(advantage=entry.advantage)
    else:
        assert got.same_as == name
    assert est.replace(name=name) == entry

    @on_random_batches
    def check(batch):
        assert_same_loss(est, entry, batch)
    check()


def test_the_defaults_are_trls_dapo_without_correction():
    got = estimator_from_trl({})
    assert got.estimator.surrogate == PPOClip(eps_low=0.2, eps_high=0.2)
    assert got.estimator.aggregation is estimators.Aggregation.TOKEN_MEAN
    assert isinstance(got.estimator.correction, estimators.NoCorrection)
    assert any("use_vllm=True only" in n for n in got.notes)
    assert got.peer == "trl 1.16.0" and TRL_DEFAULTS["loss_type"] == "dapo"


def test_non_default_values_change_the_parts_as_they_say():
    est = estimator_from_trl({"epsilon": 0.1, "epsilon_high": 0.3, "delta": 2.0, "beta": 0.1,
                              "use_bias_correction_kl": False, "use_vllm": True,
                              "vllm_importance_sampling_mode": "sequence_truncate",
                              "vllm_importance_sampling_clip_max": 5.0,
                              "vllm_importance_sampling_clip_min": 0.5}).estimator
    assert est.surrogate == PPOClip(eps_low=0.1, eps_high=0.3, dual_clip=2.0)
    assert est.kl.coef == 0.1 and not est.kl.in_reward and est.kl.estimator is estimators.kl_k3
    assert est.correction == TruncatedIS(cap=5.0, level=Level.SEQUENCE, floor=0.5)
    mask = estimator_from_trl({"use_vllm": True, "vllm_importance_sampling_mode": "token_mask",
                               "vllm_importance_sampling_cap": 4.0}).estimator
    assert mask.correction == MaskedIS(high=4.0, level=Level.TOKEN, masked_in_normalizer=True)
    dapo = estimators.get("dapo")
    with_delta = estimator_from_trl({"epsilon_high": 0.28, "delta": 1.5}).estimator

    @on_random_batches
    def check(batch):      # TRL's delta is the dual clip: PPOClip(dual_clip=δ) on dapo
        assert_same_loss(with_delta, dapo.replace(
            surrogate=dataclasses.replace(dapo.surrogate, dual_clip=1.5),
            advantage=GroupNormalized(ddof=1, eps=1e-4)), batch)
    check()


def test_notes_say_where_trl_differs():
    notes = " ".join(estimator_from_trl({"loss_type": "dr_grpo", "max_completion_length": 64,
                                         "mask_truncated_completions": True}).notes)
    assert "max_len=max_completion_length (64)" in notes
    assert "loss_mask False on truncated completions" in notes


def test_a_dict_a_yaml_file_a_json_file_and_an_object_give_the_same_estimator(tmp_path):
    config = {"loss_type": "grpo", "epsilon_high": 0.28, **NO_BIAS_KL, **TIS2,
              "learning_rate": 1e-6, "num_generations": 8}
    (tmp_path / "c.yaml").write_text("".join(f"{k}: {json.dumps(v)}\n" for k, v in config.items()))
    (tmp_path / "c.json").write_text(json.dumps(config))
    obj = types.SimpleNamespace(**{**TRL_DEFAULTS, **config})
    ests = [estimator_from_trl(c) for c in (config, tmp_path / "c.yaml", str(tmp_path / "c.json"), obj)]
    assert all(e == ests[0] for e in ests)


@pytest.mark.parametrize(("config", "message"), [
    ({"lossType": "grpo"}, "lossType: unknown field"),
    ({"loss_type": "vespo"}, "loss_type='vespo': no counterpart"),
    ({"loss_type": "ppo"}, "loss_type='ppo': no counterpart"),
    ({"top_entropy_quantile": 0.2}, "top_entropy_quantile=0.2: no counterpart"),
    ({"entropy_coef": 0.01}, "entropy_coef=0.01: no counterpart"),
    ({"beta": 0.04}, "use_bias_correction_kl=True: no counterpart"),
    ({"delta": 1.1}, "delta=1.1: no counterpart"),
    ({"scale_rewards": "std"}, "scale_rewards='std': no counterpart"),
    ({"importance_sampling_level": "group"}, "importance_sampling_level='group'"),
    ({"loss_type": "luspo"}, "importance_sampling_level='token': no counterpart"),
    ({"loss_type": "sapo", "importance_sampling_level": "sequence"},
     "importance_sampling_level='sequence': no counterpart"),
    ({"use_vllm": True, "vllm_importance_sampling_mode": "geo_mask"},
     "vllm_importance_sampling_mode='geo_mask'"),
    ({"use_vllm": True, "vllm_importance_sampling_clip_max": None},
     "vllm_importance_sampling_clip_max=None"),
    ({"multi_objective_aggregation": "normalize_then_sum"}, "multi_objective_aggregation="),
    ({"loss_type": "cispo"}, "epsilon_high=None: no counterpart"),
])
def test_bad_input_is_one_line_naming_the_field(config, message):
    with pytest.raises(ValueError) as err:
        estimator_from_trl(config)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_yaml_without_pyyaml_names_the_package(tmp_path, monkeypatch):
    (tmp_path / "c.yaml").write_text("loss_type: grpo\n")
    monkeypatch.setitem(sys.modules, "yaml", None)
    with pytest.raises(ValueError, match=r"needs pyyaml \(pip install pyyaml\)"):
        estimator_from_trl(tmp_path / "c.yaml")


def test_bad_files_are_one_line(tmp_path):
    (tmp_path / "list.yaml").write_text("- a\n- b\n")
    (tmp_path / "bad.json").write_text("{")
    for path, message in ((tmp_path / "list.yaml", "must hold a mapping"),
                          (tmp_path / "bad.json", "not valid JSON"),
                          (tmp_path / "missing.yaml", "cannot read")):
        with pytest.raises(ValueError, match=message):
            estimator_from_trl(path)
