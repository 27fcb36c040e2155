"""The rollout engine follows the trainer's weights: it is re-synced before every rollout.

With an fp32 engine and an fp32 trainer the engine's log-probs ``μ`` are those of ``π_old`` up
to the engine's own kernels (cache, batching), so each step's training–inference ``k3`` is
~1e-15; an engine left on the first step's weights samples from a stale policy and the k3 of
the later steps is about 1e-3 on this run (measured; 4e-4 to 2e-3 on others)."""

from __future__ import annotations

from tokenmdp.rl.config import TrainConfig
from tokenmdp.rl.trainer import train

#: k3 of a synced fp32 engine: float32 kernels in another order (seen: below 1e-14).
K3_SYNCED = 1e-10
TINY = dict(d_model=32, n_layers=1, n_heads=2, n_experts=4, top_k=2, expert_hidden=16,
            prompts_per_step=4, group_size=4, max_new_tokens=6, eval_size=4)


def test_an_fp32_engine_is_synced_before_every_rollout(tmp_path):
    # eval_every=0: evaluation (which also syncs the engine) only after the last step
    cfg = TrainConfig(steps=3, out_dir=str(tmp_path), task="count", estimator="minirl",
                      replay="r2", minibatches=2, rollout_precision="fp32", eval_every=0,
                      **TINY)
    rows = train(cfg)
    assert len(rows) == 3
    for r in rows:
        assert 0 <= r["train_infer_kl_k3"] < K3_SYNCED, r
        assert r["grad_norm"] > 0                 # the weights did move between rollouts
