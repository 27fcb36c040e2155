"""The trainer's step metrics carry the ESS and χ² of the correction weights ``π_old/μ``.

A tiny RL run with a bf16 rollout engine (so ``μ ≠ π_old``): every step's row has ``is_ess``
and ``is_chi2``, and ``is_seq_ess``/``is_seq_chi2`` when the estimator corrects per sequence; the
values of one rollout equal the definitions computed directly from that rollout's log-probs.
"""

import json
import math

import pytest
import torch

from tokenmdp.rl import run_state
from tokenmdp.rl.config import TrainConfig
from tokenmdp.rl.trainer import train

#: the step's float64 sums against a direct float64 computation in another order.
SUM_RTOL = 1e-9

TINY = dict(d_model=32, n_layers=1, n_heads=2, n_experts=4, top_k=2, expert_hidden=16,
            prompts_per_step=4, group_size=4, max_new_tokens=6, eval_size=4, eval_every=2)
TOKEN_KEYS = {"is_ess", "is_chi2"}
SEQUENCE_KEYS = {"is_seq_ess", "is_seq_chi2"}


def _direct(log_w: torch.Tensor) -> tuple[float, float]:
    """(Σw)² / (n Σw²) and mean w² − 1, straight from the definitions."""
    w = log_w.double().exp()
    return float(w.sum() ** 2 / (len(w) * (w ** 2).sum())), float((w ** 2).mean() - 1)


@pytest.mark.parametrize("estimator, keys", [("minirl", TOKEN_KEYS),
                                             ("gspo_geo_mis", TOKEN_KEYS | SEQUENCE_KEYS)])
def test_rollout_statistics_are_the_definitions(tmp_path, estimator, keys):
    cfg = TrainConfig(steps=1, out_dir=str(tmp_path), task="count", estimator=estimator,
                      rollout_precision="bf16", **TINY)
    batch, stats = run_state._Run(cfg).rollout()
    assert keys <= set(stats) and not (SEQUENCE_KEYS - keys) & set(stats)
    log_w = (batch.old_logprob - batch.behavior_logprob).double()
    ess, chi2 = _direct(log_w[batch.loss_mask])
    assert math.isclose(stats["is_ess"], ess, rel_tol=SUM_RTOL)
    assert math.isclose(stats["is_chi2"], chi2, rel_tol=SUM_RTOL, abs_tol=1e-15)
    assert chi2 != 0.0 and ess < 1.0                  # a bf16 engine really differs from π_old
    if "is_seq_ess" in keys:
        per_sequence = [log_w[(batch.sequence_id == s) & batch.loss_mask].sum()
                        for s in range(batch.num_sequences)]
        ess, chi2 = _direct(torch.stack(per_sequence))
        assert math.isclose(stats["is_seq_ess"], ess, rel_tol=SUM_RTOL)
        assert math.isclose(stats["is_seq_chi2"], chi2, rel_tol=SUM_RTOL, abs_tol=1e-15)


def test_every_step_row_has_the_diagnostics(tmp_path):
    cfg = TrainConfig(steps=2, out_dir=str(tmp_path), task="count", estimator="minirl",
                      rollout_precision="bf16", minibatches=2, **TINY)
    rows = train(cfg)
    written = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert written == json.loads(json.dumps(rows)) and len(written) == 2
    for row in written:
        assert TOKEN_KEYS <= set(row) and not SEQUENCE_KEYS & set(row)
        assert 0.0 < row["is_ess"] <= 1.0 and math.isfinite(row["is_chi2"])


def test_an_fp32_engine_gives_neutral_diagnostics(tmp_path):
    # the same weights in the engine and the training pass: w = 1 (up to kernel rounding)
    cfg = TrainConfig(steps=1, out_dir=str(tmp_path), task="count", estimator="minirl",
                      rollout_precision="fp32", **TINY)
    _, stats = run_state._Run(cfg).rollout()
    assert stats["is_ess"] == pytest.approx(1.0, abs=1e-9)
    assert stats["is_chi2"] == pytest.approx(0.0, abs=1e-6)
