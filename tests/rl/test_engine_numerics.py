"""Issue 31, the numeric mismatch mode's new precisions: ``fp4`` weights on the e2m1 grid in
blocks of 32 rows, ``fp8_w8a8`` activations rounded per token where they meet a weight; both
engines sample what they record, with and without a KV cache, and the trainer accepts them."""

from __future__ import annotations

import pytest
import torch

from tests.model.models import TINY, make_model
from tokenmdp.rl import PRECISIONS, RolloutEngine, compute_old_logprobs, training_inference_kl
from tokenmdp.rl.engine_numerics import (
    FP4_BLOCK,
    FP4_E2M1_GRID,
    _WeightActivations,
    round_activations,
    round_rows_fp8,
    simulate_fp4,
    simulate_fp8,
)

EOS = TINY.vocab_size - 1
#: fp32 compute on the same rounded numbers, another forward pass (cache vs none)
ROUNDING_ATOL = 1e-5


def test_fp4_puts_every_block_on_the_scaled_e2m1_grid():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(70, 5, generator=gen, dtype=torch.float64)      # 3 blocks, the last short
    q = simulate_fp4(w)
    assert q.shape == w.shape and q.dtype == w.dtype
    grid = torch.tensor(FP4_E2M1_GRID, dtype=torch.float64)
    for start in range(0, 70, FP4_BLOCK):
        block, qb = w[start:start + FP4_BLOCK], q[start:start + FP4_BLOCK]
        scale = block.abs().amax(0) / 6                               # one per column
        scaled = qb.abs() / scale
        assert float((scaled[..., None] - grid).abs().min(-1).values.max()) < 1e-12
        torch.testing.assert_close(qb.abs().amax(0), block.abs().amax(0))   # absmax -> 6 exactly
        assert bool((torch.sign(qb) * torch.sign(block) >= 0).all())
        # nearest grid point: no other is closer
        err = (qb - block).abs() / scale
        assert float(err.max()) <= 1.0 + 1e-12                       # half the widest gap (2)
    torch.testing.assert_close(simulate_fp4(q), q)                    # idempotent
    stacked = torch.randn(3, 40, 6, generator=gen)                    # experts [E, in, out]
    torch.testing.assert_close(simulate_fp4(stacked)[1], simulate_fp4(stacked[1]))
    assert torch.equal(simulate_fp4(torch.zeros(4, 4)), torch.zeros(4, 4))
    with pytest.raises(ValueError, match="^w:"):
        simulate_fp4(torch.ones(5))
    with pytest.raises(ValueError, match="^block:"):
        simulate_fp4(w, block=0)


def test_activations_are_rounded_per_row_only_where_they_meet_a_weight():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4, 8, generator=gen) * torch.tensor([[1e-3], [1.0], [50.0], [0.0]])
    w = torch.randn(8, 3, generator=gen)
    other = torch.randn(8, 3, generator=gen)
    rows = round_rows_fp8(x)
    for r in range(4):          # one scale per row: the row's own absmax maps to 448
        torch.testing.assert_close(rows[r], simulate_fp8(x[r]) if x[r].abs().max() > 0 else x[r])
    with _WeightActivations({w.untyped_storage().data_ptr()}):
        got_w, got_other = x @ w, torch.matmul(x, other)
    torch.testing.assert_close(got_w, rows @ w, rtol=0, atol=0)
    torch.testing.assert_close(got_other, x @ other, rtol=0, atol=0)


@pytest.mark.parametrize("precision", ["fp4", "fp8_w8a8"])
def test_the_new_engines_record_what_they_sample_and_differ_from_the_trainer(precision):
    model = make_model(TINY, seed=3)
    engine = RolloutEngine(model, precision=precision)
    assert precision in PRECISIONS
    if precision == "fp4":
        torch.testing.assert_close(engine.model.blocks[0].mlp.w_up,
                                   simulate_fp4(model.blocks[0].mlp.w_up.detach()))
    prompts = [[1, 2, 3], [4, 5], [6, 1, 2, 7]] * 8
    kw = dict(max_new_tokens=10, eos_id=EOS)
    batch = engine.generate(prompts, generator=torch.Generator().manual_seed(4), **kw)
    again = engine.generate(prompts, generator=torch.Generator().manual_seed(4),
                            use_cache=False, **kw)
    assert torch.equal(batch.tokens, again.tokens)
    torch.testing.assert_close(batch.behavior_logprob, again.behavior_logprob, rtol=0,
                               atol=ROUNDING_ATOL)
    mu = engine.next_token_logprobs(batch)
    rec = mu.gather(-1, batch.tokens[..., None])[..., 0][batch.loss_mask]
    torch.testing.assert_close(batch.behavior_logprob[batch.loss_mask], rec, rtol=0,
                               atol=ROUNDING_ATOL)
    kl = training_inference_kl(compute_old_logprobs(model, batch, "none"))
    weights_only = RolloutEngine(model, precision="fp8")
    assert kl > 1e-6
    if precision == "fp8_w8a8":   # the activations add to the weights' rounding
        plain = weights_only.next_token_logprobs(batch)
        assert float((plain - mu).abs().max()) > 1e-4


def test_round_activations_checks_its_model_and_the_config_takes_the_precisions():
    from tokenmdp.rl.config import TrainConfig, check_config

    with pytest.raises(TypeError, match="^model:"):
        round_activations(torch.nn.Linear(2, 2))
    for precision in ("fp4", "fp8_w8a8"):
        check_config(TrainConfig(rollout_precision=precision))
    with pytest.raises(ValueError, match="^rollout_precision:"):
        check_config(TrainConfig(rollout_precision="fp6"))
