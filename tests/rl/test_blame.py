"""The update's blame diagnostics (:func:`tokenmdp.rl.update.blame_sums`) against their definitions.

On one rollout of a noisy engine (``rollout_logit_noise``, so that ``π_old/μ`` is far from 1 and
some sampled tokens are ones ``π_old`` gives less than 1/2), the pushes ``|φ_t| (1 − p_t)`` are
recomputed token by token from MiniRL's coefficient at ``θ = θ_old``: ``φ_t = min(π_old/μ, 5)
A_t w_t`` (``w_t`` the loss weight; the clip is inactive at ratio 1), and ``A_t w_t`` without the
correction; the counts and the sequence log-weights from the log-probs directly.
"""

import math

import pytest
import torch

from tokenmdp import estimators
from tokenmdp.rl import run_state
from tokenmdp.rl.config import TrainConfig
from tokenmdp.rl.update import LOW_PROBABILITY, blame_stats, blame_sums

#: float64 sums in another order.
SUM_RTOL = 1e-9
#: the pushes: φ comes out of the loss's backward pass in the batch's float32.
PUSH_RTOL = 1e-6
TINY = dict(d_model=32, n_layers=1, n_heads=2, n_experts=4, top_k=2, expert_hidden=16,
            prompts_per_step=4, group_size=4, max_new_tokens=6, eval_size=4, eval_every=2)
CAP = {"minirl": 5.0, "minirl_no_is": None}


def _direct(batch, cap):
    """The sums of blame_sums, one token at a time."""
    out = dict.fromkeys(("n_low", "n_high", "neg_low", "neg_high", "pos_low", "pos_high",
                         "w_low", "w_high"), 0.0)
    seq_logw = [0.0] * batch.num_sequences
    for r, c in torch.nonzero(batch.loss_mask).tolist():
        old, beh = float(batch.old_logprob[r, c]), float(batch.behavior_logprob[r, c])
        a, lw = float(batch.advantage[r, c]), float(batch.loss_weight[r, c])
        w = math.exp(old - beh)
        phi = (a * lw) if cap is None else min(w, cap) * a * lw
        kind = "low" if math.exp(old) < LOW_PROBABILITY else "high"
        out[f"n_{kind}"] += 1
        out[f"w_{kind}"] += w
        if a < 0:
            out[f"neg_{kind}"] += abs(phi) * (1 - math.exp(old))
        if a > 0:
            out[f"pos_{kind}"] += abs(phi) * (1 - math.exp(old))
        seq_logw[int(batch.sequence_id[r, c])] += old - beh
    out["seq_logw"] = sum(seq_logw)
    return out


@pytest.mark.parametrize("name", ["minirl", "minirl_no_is"])
def test_blame_sums_are_the_definitions(tmp_path, name):
    cfg = TrainConfig(steps=1, out_dir=str(tmp_path), task="count", estimator=name,
                      rollout_logit_noise=2.0, seed=3, **TINY)
    run = run_state._Run(cfg)
    batch, _ = run.rollout()
    batch = estimators.prepare(batch, run.est, max_len=cfg.max_new_tokens)
    got = {k.removeprefix("blame_"): v for k, v in blame_sums(batch, run.est).items()}
    want = _direct(batch, CAP[name])
    assert want["n_low"] > 0 and want["neg_low"] + want["neg_high"] > 0   # the test has teeth
    for key, value in want.items():
        rtol = PUSH_RTOL if key[:4] in ("neg_", "pos_") else SUM_RTOL
        assert math.isclose(got[key], value, rel_tol=rtol, abs_tol=1e-12), key
    stats = blame_stats(blame_sums(batch, run.est))
    assert math.isclose(stats["neg_push_low_share"],
                        want["neg_low"] / (want["neg_low"] + want["neg_high"]), rel_tol=PUSH_RTOL)
    assert math.isclose(stats["low_token_fraction"],
                        want["n_low"] / (want["n_low"] + want["n_high"]), rel_tol=SUM_RTOL)


def test_blame_stats_over_nothing_are_none():
    zero = {f"blame_{k}": 0.0 for k in (
        "n_low", "n_high", "w_low", "w_high", "logw_low", "logw_high", "neg_low", "neg_high",
        "pos_low", "pos_high", "seqs", "seq_logw", "seq_logw_sq", "failed", "failed_low",
        "passed", "passed_low")}
    assert all(v is None for v in blame_stats(zero).values())


def test_blame_sums_needs_both_logprobs(tmp_path):
    cfg = TrainConfig(steps=1, out_dir=str(tmp_path), task="count", **TINY)
    run = run_state._Run(cfg)
    batch, _ = run.rollout()
    with pytest.raises(ValueError, match="behavior_logprob"):
        blame_sums(batch.replace(behavior_logprob=None), run.est)
