"""Issue 32: which peer each GSPO entry equals, against transcriptions of the peers' documented
formulas (written here from their definitions, on padded ``[B, T]`` tensors).

* verl ``policy_loss.loss_mode=gspo`` is GSPO-*token*: ``log s_it = sg(mean_t log r_it) +
  log π_t − sg(log π_t)`` (the log capped at 10), PPO's clip of ``s_it`` per token, the rollout
  IS weight (``rollout_is=token``) multiplying each token's loss, ``loss_agg_mode``
  ``seq-mean-token-mean``. With the token TIS / MIS weights it equals ``gspo_token_tis`` /
  ``gspo_token_mis`` in value and gradient.
* TRL ``importance_sampling_level='sequence'`` is sequence GSPO: ``s_i = exp(mean_t log r_it)``
  with its gradient through the mean, broadcast to the tokens and clipped, times TRL's vLLM
  token weight, ``loss_type='grpo'`` (a mean over each sequence's tokens, then over sequences).
  It equals ``gspo_tis`` / ``gspo_mis``: every token gets its sequence's *mean* weight.
* The two agree in value and differ in gradient once the weights differ along a sequence.
"""

from __future__ import annotations

import torch

from tests.estimators.registry.padded import padded, peer_world
from tokenmdp import estimators
from tokenmdp.estimators import loss, prepare

#: float64 sums of a dozen terms, two routes.
EXACT = 1e-12
#: The smallest gradient difference counted as "differs" (the gradients are O(0.1) here).
DIFFERS = 1e-4

LOG_R = [[3e-4, -2e-4, 5e-4], [1e-4, 6e-4], [-4e-4, 2e-4, 1e-4, -1e-4], [2e-4]]
LOG_W = [[0.5, -0.8, 1.9], [0.1, 0.3], [-1.0, 0.2, 0.7, 2.0], [0.05]]   # log π_old/μ


def _world():
    old = [[-0.3 - 0.1 * t for t in range(len(r))] for r in LOG_R]
    return peer_world(LOG_R, LOG_W, old, old, [1.0, 0.0, 0.5, 0.2], [0, 0, 1, 1])


def _padded(batch, values_RC):
    return padded(batch, values_RC, [len(r) for r in LOG_R])


def _weights(kind, old, behavior, mask):
    w = torch.exp(old - behavior)
    if kind == "tis":
        return torch.clamp(w, max=2.0)
    return torch.where((w >= 0.5) & (w <= 5.0), w, 0.0) * mask        # IcePop's band


def verl_gspo(log_prob, old, adv, mask, weights, eps_low, eps_high):
    m = mask.to(log_prob.dtype)
    mean_log_r = ((log_prob - old) * m).sum(-1) / m.sum(-1).clamp(min=1)
    log_s = (log_prob - log_prob.detach() + mean_log_r.detach()[:, None]).clamp(max=10.0)
    s = torch.exp(log_s)
    losses = torch.maximum(-adv * s, -adv * torch.clamp(s, 1 - eps_low, 1 + eps_high))
    losses = losses * weights
    per_sequence = (losses * m).sum(-1) / m.sum(-1)                    # seq-mean-token-mean
    return per_sequence.mean()


def trl_sequence_gspo(log_prob, old, adv, mask, weights, eps_low, eps_high):
    m = mask.to(log_prob.dtype)
    log_iw = (((log_prob - old) * m).sum(-1) / m.sum(-1).clamp(min=1.0))[:, None]
    coef_1 = torch.exp(log_iw)
    coef_2 = torch.clamp(coef_1, 1 - eps_low, 1 + eps_high)
    per_token = -torch.minimum(coef_1 * adv, coef_2 * adv) * weights
    return ((per_token * m).sum(-1) / m.sum(-1).clamp(min=1.0)).mean()   # loss_type='grpo'


def _ours(name, batch, lp):
    est = estimators.get(name)
    step = prepare(batch, est)
    value, _ = loss(lp, step, est)
    return value, torch.autograd.grad(value, lp)[0], step


def _peer(formula, kind, batch, lp, step):
    eps_low, eps_high = 3e-4, 4e-4              # the registry's GSPO band (the paper's)
    log_prob, mask = _padded(batch, lp)
    old, _ = _padded(batch, batch.old_logprob)
    behavior, _ = _padded(batch, batch.behavior_logprob)
    adv, _ = _padded(batch, step.advantage)
    value = formula(log_prob, old, adv, mask, _weights(kind, old, behavior, mask), eps_low,
                    eps_high)
    grad_BT = torch.autograd.grad(value, lp)[0]
    return value, grad_BT


def test_verl_gspo_with_token_is_is_gspo_token_and_trl_sequence_level_is_gspo():
    for kind in ("tis", "mis"):
        batch, lp = _world()
        verl_value, verl_grad = _peer(verl_gspo, kind, batch, lp, _ours(f"gspo_token_{kind}",
                                                                          batch, lp)[2])
        token_value, token_grad, _ = _ours(f"gspo_token_{kind}", batch, lp)
        assert abs(float((verl_value - token_value).detach())) < EXACT
        assert float((verl_grad - token_grad).abs().max()) < EXACT

        seq_value, seq_grad, step = _ours(f"gspo_{kind}", batch, lp)
        trl_value, trl_grad = _peer(trl_sequence_gspo, kind, batch, lp, step)
        assert abs(float((trl_value - seq_value).detach())) < EXACT
        assert float((trl_grad - seq_grad).abs().max()) < EXACT

        # the two peers: one value, two gradients (each token its own weight, or the mean's)
        assert abs(float((seq_value - token_value).detach())) < EXACT
        assert float((seq_grad - token_grad).abs().max()) > DIFFERS


def test_the_aliases_say_which_peer_each_gspo_entry_equals():
    def aliases(name):
        return estimators.describe(name).split("Other names:")[1]
    assert "importance_sampling_level='sequence'" in aliases("gspo")
    assert "is gspo_token" in aliases("gspo")
    assert "loss_mode=gspo" in aliases("gspo_token")
    for kind in ("tis", "mis"):
        text = aliases(f"gspo_{kind}")
        assert "importance_sampling_level='sequence'" in text and f"gspo_token_{kind}" in text
        assert "loss_mode=gspo" in aliases(f"gspo_token_{kind}")
    geo = aliases("gspo_geo_mis")
    assert "IcePop" not in geo and "no geometric level" in geo


def test_the_peer_defaults_that_differ_from_an_entry_are_named_in_its_aliases():
    """A default a config does not show (verl's kl_loss_coef 0.001, its CISPO floor 0.8, its
    GSPO band 0.2 / 0.2, TRL's sequence-level loss_type 'dapo') is said where it differs."""
    for name, phrase in (("grpo", "kl_loss_coef defaults to 0.001"),
                         ("cispo", "floors the weight at 0.8"),
                         ("gspo_token", "clip_ratio defaults to 0.2 / 0.2"),
                         ("gspo", "loss_type='dapo' with ε 0.2"),
                         ("gmpo", "clip_ratio default is 0.2"),
                         ("dppo_tv", "clip_ratio_c"),
                         ("kl_cov", "1.0 when unset")):
        assert phrase in estimators.describe(name).split("Other names:")[1], (name, phrase)

