"""register_with_verl on the real verl package: every registry entry is a verl policy loss, and
called through verl's own entry points (``get_policy_loss_fn``, the actor's ``ppo_loss``) it
equals verl's own loss modes on random inputs, value and gradient.

Tolerances: float64, 1e-12 relative on the value and 1e-12 on each gradient entry (the same
operations in another order: measured at most 2e-15); float32, 1e-5 relative and 1e-6 (measured
at most 5e-7 and 3e-8). The log-probs are kept below 0 (verl's DPPO-KL takes ``log(1 - p)``).
"""

from __future__ import annotations

import math
import sys

import pytest

pytest.importorskip("verl", reason="the verl extra is not installed (pip install 'tokenmdp[verl]')")

import torch  # noqa: E402
from tensordict import TensorDict  # noqa: E402
from verl.trainer.ppo import core_algos  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.utils.import_utils import import_external_libs  # noqa: E402
from verl.workers.config import ActorConfig, PolicyLossConfig  # noqa: E402
from verl.workers.utils.losses import ppo_loss  # noqa: E402

from tokenmdp import estimators  # noqa: E402
from tokenmdp.estimators import Aggregation  # noqa: E402
from tokenmdp.integrations.common import batch_from_padded  # noqa: E402
from tokenmdp.integrations.verl_losses import (  # noqa: E402
    PREFIX,
    policy_loss,
    register_with_verl,
    verl_settings,
)

TOL = {torch.float64: (1e-12, 1e-12), torch.float32: (1e-5, 1e-6)}
REGISTERED = register_with_verl()


def actor(**fields):
    info = fields.pop("global_batch_info", {})
    config = ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, **fields)
    config.global_batch_info.update(info)
    return config


def inputs(seed, dtype=torch.float64, B=6, L=7, per_token=False, empty_row=False):
    """verl's padded micro-batch: right-padded responses, log-probs below 0 and around π_old."""
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, L, generator=gen, dtype=dtype) * 3 - 0.05
    lp = (old + 0.5 * torch.randn(B, L, generator=gen, dtype=dtype)).clamp(max=-0.01)
    adv = torch.randn(B, L if per_token else 1, generator=gen, dtype=dtype).expand(B, L)
    mask = torch.arange(L) < torch.randint(1, L + 1, (B, 1), generator=gen)
    if empty_row:
        mask[1] = False
    return old, lp.requires_grad_(), adv.contiguous(), mask


def value_and_grad(mode, old, lp, adv, mask, config, weights=None):
    value, metrics = core_algos.get_policy_loss_fn(mode)(old, lp, adv, mask, config.loss_agg_mode,
                                                        config, weights)
    return value.detach(), torch.autograd.grad(value, lp)[0], metrics


def assert_close(a, b, dtype):
    rel, grad = TOL[dtype]
    assert abs(float(a[0] - b[0])) <= rel * max(1.0, abs(float(b[0])))
    assert float((a[1] - b[1]).abs().max()) <= grad


# registry entry, verl's loss mode, the actor fields that make verl's mode the entry (verl's
# vanilla always dual-clips at clip_ratio_c: 1e9 turns it off; DPPO caps at it too)
CASES = [
    ("ppo_verl", "vanilla", {}),
    ("dapo_verl", "vanilla", {"clip_ratio_high": 0.28}),
    ("ppo", "vanilla", {"clip_ratio_c": 1e9}),
    ("dapo", "vanilla", {"clip_ratio_high": 0.28, "clip_ratio_c": 1e9}),
    ("dr_grpo", "vanilla", {"clip_ratio_c": 1e9, "loss_agg_mode": "seq-mean-token-sum-norm"}),
    ("reinforce_pp_baseline", "vanilla", {}),
    ("cispo", "cispo", {"clip_ratio_low": 1.0, "clip_ratio_high": 0.2}),
    ("cispo_tinker", "cispo", {"clip_ratio_low": 1.0, "clip_ratio_high": 3.0,
                               "loss_agg_mode": "token-sum"}),
    ("gspo_token", "gspo", {"clip_ratio_low": 3e-4, "clip_ratio_high": 4e-4,
                            "loss_agg_mode": "seq-mean-token-mean"}),
    ("sapo", "sapo", {"loss_agg_mode": "seq-mean-token-mean"}),
    ("dppo_tv", "dppo_tv", {"clip_ratio": 0.15, "clip_ratio_low": 0.15, "clip_ratio_high": 0.15,
                            "clip_ratio_c": 1e9, "loss_agg_mode": "seq-mean-token-sum-norm"}),
    ("dppo_kl", "dppo_kl", {"clip_ratio": 0.05, "clip_ratio_low": 0.05, "clip_ratio_high": 0.05,
                            "clip_ratio_c": 1e9, "loss_agg_mode": "seq-mean-token-sum-norm"}),
    # verl's geo_mean is a plain mean over the micro-batch's rows (no loss_agg_mode, no counts)
    ("gmpo", "geo_mean", {"clip_ratio_low": 0.4, "clip_ratio_high": 0.4,
                          "loss_agg_mode": "seq-mean-token-mean"}),
]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("name, mode, fields", CASES, ids=[c[0] for c in CASES])
def test_each_entry_equals_verls_own_loss_mode(name, mode, fields, dtype):
    config = actor(**fields)
    for seed in range(4):
        args = inputs(seed, dtype, per_token=mode not in ("geo_mean",) and seed % 2 == 1)
        theirs = value_and_grad(mode, *args, config)
        ours = value_and_grad(PREFIX + name, *args, config)
        assert_close(ours, theirs, dtype)
        assert ours[0].dtype == dtype
        assert set(ours[2]) >= {"actor/pg_clipfrac", "actor/ppo_kl", "tokenmdp/r_mean"}
        assert ours[2]["actor/ppo_kl"] == pytest.approx(theirs[2]["actor/ppo_kl"], rel=1e-5)


@pytest.mark.parametrize("mode", ["token-mean", "token-sum", "seq-mean-token-mean",
                                  "seq-mean-token-sum", "seq-mean-token-sum-norm"])
def test_global_counts_rollout_weights_and_an_empty_response_follow_verl(mode):
    """verl's counts of the mini-batch over its data-parallel ranks, its rollout IS weights."""
    agg = Aggregation.CONSTANT if mode == "seq-mean-token-sum-norm" else Aggregation(mode)
    est = estimators.get("ppo_verl").replace(aggregation=agg, name=f"ppo_verl_{mode}")
    register_with_verl([est])
    for seed, info in enumerate([{}, {"dp_size": 2, "batch_num_tokens": 97, "global_batch_size": 24},
                                 {"dp_size": 4, "batch_num_tokens": 300, "global_batch_size": 64,
                                  "loss_scale_factor": 16}]):
        old, lp, adv, mask = inputs(seed, per_token=True, empty_row=True)
        weights = torch.rand(old.shape, generator=torch.Generator().manual_seed(seed),
                             dtype=old.dtype) * 2
        config = actor(loss_agg_mode=mode, loss_scale_factor=info.get("loss_scale_factor"),
                       global_batch_info=info)
        theirs = value_and_grad("vanilla", old, lp, adv, mask, config, weights)
        ours = value_and_grad(PREFIX + est.name, old, lp, adv, mask, config, weights)
        assert_close(ours, theirs, torch.float64)


def micro_batch(seed, P=3):
    """verl's actor inputs: a TensorDict of one micro-batch and the model's flat log-probs."""
    old, lp, adv, mask = inputs(seed)
    B, L = old.shape
    ref = old + 0.3 * torch.randn(old.shape, generator=torch.Generator().manual_seed(seed),
                                  dtype=old.dtype)
    lens = mask.sum(1)
    pad = torch.zeros(P - 1, dtype=old.dtype)
    flat = torch.cat([torch.cat([pad, lp[b, :lens[b]], pad[:1]]) for b in range(B)])
    data = TensorDict({"prompts": torch.ones(B, P, dtype=torch.long),
                       "responses": torch.ones(B, L, dtype=torch.long),
                       "attention_mask": torch.cat([torch.ones(B, P, dtype=torch.long),
                                                    mask.long()], 1),
                       "response_mask": mask.long(), "old_log_probs": old, "advantages": adv,
                       "ref_log_prob": ref}, batch_size=[B])
    tu.assign_non_tensor(data, dp_size=1, batch_num_tokens=int(mask.sum()), global_batch_size=B)
    return data, flat, (old, lp, adv, mask, ref)


@pytest.mark.parametrize("name", ["grpo_verl", "ppo_verl", "grpo"])
def test_verls_actor_loss_adds_the_entrys_kl_and_equals_the_whole_estimator(name):
    settings = verl_settings(name)
    for seed in range(3):
        losses = {}
        for mode in (PREFIX + name, "vanilla"):
            data, flat, (old, lp, adv, mask, ref) = micro_batch(seed)
            fields = {"clip_ratio_c": 1e9} if name == "grpo" and mode == "vanilla" else {}
            config = actor(policy_loss=PolicyLossConfig(loss_mode=mode), **settings, **fields)
            value, metrics = ppo_loss(config, {"log_probs": flat}, data)
            losses[mode] = (value.detach(), torch.autograd.grad(value, lp)[0])
        assert ("kl_loss" in metrics) == settings["use_kl_loss"]
        est = estimators.get(name)
        step = estimators.prepare(batch_from_padded(mask, old, dtype=old.dtype, ref_logprob_BT=ref),
                                  est, advantage_S=adv[:, 0].clone())
        whole = estimators.loss(lp, step, est)[0]
        assert_close(losses[PREFIX + name], losses["vanilla"], torch.float64)
        assert_close(losses[PREFIX + name], (whole.detach(), torch.autograd.grad(whole, lp)[0]),
                     torch.float64)


FIELDS = ("behavior_logprob", "ref_logprob", "group")


def test_every_registry_entry_is_registered_and_runs_or_names_what_verl_lacks():
    old, lp, adv, mask = inputs(0)
    refused = []
    for name in estimators.names():
        fn = core_algos.get_policy_loss_fn(PREFIX + name)
        assert fn.tokenmdp_estimator == estimators.get(name) == REGISTERED[PREFIX + name]
        try:
            settings = verl_settings(name)
        except ValueError as err:
            refused.append(name)
            assert any(field in str(err) for field in FIELDS), err
            with pytest.raises(ValueError) as raised:
                fn(old, lp, adv, mask, "token-mean", actor(), None)
            assert str(raised.value) == str(err)
            continue
        value, metrics = fn(old, lp, adv, mask, settings["loss_agg_mode"], actor(**settings), None)
        grad = torch.autograd.grad(value, lp)[0]
        assert math.isfinite(float(value.detach())) and bool(grad.isfinite().all()), name
        assert all(isinstance(v, float) for v in metrics.values())
    assert {"minirl", "grpo_tis", "reinforce_pp_kl", "per_decision_is", "grpo_opsm"} <= set(refused)
    assert not {"grpo", "dapo", "gspo", "cispo", "minirl_no_is", "clip_cov"} & set(refused)


def test_verl_settings_that_differ_from_the_entry_are_refused_by_name():
    old, lp, adv, mask = inputs(0)
    grpo, ppo = (core_algos.get_policy_loss_fn(PREFIX + n) for n in ("grpo", "ppo"))
    cases = [(grpo, actor(loss_agg_mode="token-mean"), "loss_agg_mode='token-mean'"),
             (grpo, actor(loss_agg_mode="seq-mean-token-mean"), "use_kl_loss=False"),
             (grpo, actor(**{**verl_settings("grpo"), "kl_loss_type": "kl"}), "low_var_kl"),
             (ppo, actor(use_kl_loss=True), "use_kl_loss=True"),
             (ppo, actor(entropy_coeff=0.01), "entropy_coeff")]
    for fn, config, words in cases:
        with pytest.raises(ValueError, match=words):
            fn(old, lp, adv, mask, config.loss_agg_mode, config, None)
    config = actor()
    with pytest.raises(ValueError, match="advantages"):
        ppo(old, lp, adv[:, :3], mask, "token-mean", config, None)
    with pytest.raises(ValueError, match="rollout_is_weights"):
        ppo(old, lp, adv, mask, "token-mean", config, adv[:2])
    with pytest.raises(TypeError, match="old_log_prob"):
        ppo(old.tolist(), lp, adv, mask, "token-mean", config, None)
    with pytest.raises(TypeError, match="estimator"):
        policy_loss(3)


def test_register_with_verl_keeps_verls_own_losses_unless_told(monkeypatch):
    with pytest.raises(ValueError, match="'cispo': verl already has"):
        register_with_verl("cispo", prefix="")
    monkeypatch.setitem(core_algos.POLICY_LOSS_REGISTRY, "cispo",
                        core_algos.POLICY_LOSS_REGISTRY["cispo"])
    assert set(register_with_verl("cispo", prefix="", replace=True)) == {"cispo"}
    assert core_algos.get_policy_loss_fn("cispo").tokenmdp_estimator.name == "cispo"
    assert register_with_verl(["ppo"]) == {PREFIX + "ppo": estimators.get("ppo")}   # again: fine
    with pytest.raises(ValueError, match="two estimators"):
        register_with_verl(["ppo", estimators.get("dapo").replace(name="ppo")])
    with pytest.raises(TypeError, match="prefix"):
        register_with_verl(prefix=None)


def test_verls_external_lib_import_registers_every_entry(monkeypatch):
    for name in [n for n in core_algos.POLICY_LOSS_REGISTRY if n.startswith(PREFIX)]:
        monkeypatch.delitem(core_algos.POLICY_LOSS_REGISTRY, name)
    monkeypatch.delitem(sys.modules, "tokenmdp.integrations.verl_plugin", raising=False)
    import_external_libs("tokenmdp.integrations.verl_plugin")   # what model.external_lib does
    assert core_algos.get_policy_loss_fn(PREFIX + "grpo").tokenmdp_estimator.name == "grpo"
    assert len([n for n in core_algos.POLICY_LOSS_REGISTRY if n.startswith(PREFIX)]) >= len(
        estimators.names())


def test_another_verl_release_line_is_refused_at_import(monkeypatch):
    import verl

    monkeypatch.setattr(verl, "__version__", "0.10.0")
    monkeypatch.delitem(sys.modules, "tokenmdp.integrations.verl_losses")
    with pytest.raises(ImportError, match="tested with verl 0.9.x; verl 0.10.0 is installed"):
        import tokenmdp.integrations.verl_losses  # noqa: F401
