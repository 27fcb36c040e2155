"""The engine-mismatch dial (``RolloutEngine(logit_noise=sigma)``): the sampled distribution is
the one written out by hand, the measured training-inference KL grows with ``sigma`` on a fixed
model and batch and follows the second-order formula at small ``sigma``, the routing mismatch is
reported as it is, and 0 is the engine without the dial bit for bit."""

from __future__ import annotations

import pytest
import torch

from tests.model.models import make_model
from tokenmdp.batch import TokenBatch
from tokenmdp.model import ModelConfig
from tokenmdp.rl import (
    ENGINE_ROUTING,
    OLD_ROUTING,
    RolloutEngine,
    compute_old_logprobs,
    routing_mismatch_rate,
    training_inference_kl,
)

CFG = ModelConfig(vocab_size=16, d_model=32, n_heads=2, n_experts=8, top_k=2, expert_hidden=32,
                  init_std=0.1)
EOS = CFG.vocab_size - 1
#: fp32 engine vs the fp32 trainer: the same math in another summation order.
ROUNDING_ATOL = 1e-5
#: relative tolerance of the measured KL against the second-order formula at small sigma
#: (sampling noise of ~1500 tokens and the third-order term; seen: within 10%).
SMALL_SIGMA_RTOL = 0.3
SIGMAS = (0.0, 0.1, 0.3, 1.0, 3.0)


def _prompts(n=64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, EOS, (4,), generator=gen).tolist() for _ in range(n)]


def _generate(engine, *, seed=1, max_new_tokens=24, prompts=None):
    return engine.generate(prompts or _prompts(), max_new_tokens=max_new_tokens, eos_id=EOS,
                           generator=torch.Generator().manual_seed(seed))


def test_one_step_is_the_noisy_softmax_written_out():
    model = make_model(CFG)
    sigma, temperature = 0.7, 0.8
    prompts = _prompts(16)
    batch = RolloutEngine(model, logit_noise=sigma).generate(
        prompts, max_new_tokens=1, eos_id=EOS, generator=torch.Generator().manual_seed(5),
        temperature=temperature)
    # by hand: the prompt's last logits, the noise then the sample from the same generator
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():  # log-softmax of the logits: the same distribution once perturbed
        logits = torch.stack([model.next_token_logprobs(TokenBatch.from_sequences(
            [p], [[0]], rewards=[0.0]))[0, len(p)] for p in prompts])
    noisy = logits + sigma * torch.randn(logits.shape, generator=gen)
    lp = torch.log_softmax(noisy / temperature, -1)
    y = torch.multinomial(lp.exp(), 1, generator=gen).squeeze(1)
    got = [(r[-1], batch.behavior_logprob[batch.loss_mask][i]) for i, (_, r) in
           enumerate(batch.sequences())]
    assert [int(t) for t, _ in got] == y.tolist()
    torch.testing.assert_close(torch.stack([lp_ for _, lp_ in got]),
                               lp.gather(1, y[:, None])[:, 0], rtol=0, atol=ROUNDING_ATOL)


def test_kl_grows_with_the_dial_on_a_fixed_model_and_batch():
    model = make_model(CFG)
    kls, mismatch = [], []
    for sigma in SIGMAS:
        batch = compute_old_logprobs(model, _generate(RolloutEngine(model, logit_noise=sigma)),
                                     "none")
        kls.append(training_inference_kl(batch))
        mismatch.append(routing_mismatch_rate(batch.token_extras[ENGINE_ROUTING],
                                              batch.token_extras[OLD_ROUTING]))
    assert kls[0] < 1e-9                                  # no dial: rounding only
    assert all(a < b for a, b in zip(kls, kls[1:])), kls  # strictly growing with sigma
    # the dial perturbs the logits only: same weights, same routing of the tokens fed
    assert mismatch == [0.0] * len(SIGMAS)


def test_small_sigma_kl_follows_the_second_order_formula():
    # E KL(mu || pi) = sigma^2 (1 - sum_v pi_v^2) / 2 at T = 1, to second order in sigma; the
    # tokens are mu's, so weigh pi's collision probability at the states actually visited
    model, sigma = make_model(CFG), 0.1
    batch = compute_old_logprobs(model, _generate(RolloutEngine(model, logit_noise=sigma)),
                                 "none")
    with torch.no_grad():
        p_RCV = model.next_token_logprobs(batch).exp()
    collide = (p_RCV ** 2).sum(-1)[batch.loss_mask].double()
    predicted = float((sigma ** 2 * (1 - collide) / 2).mean())
    assert training_inference_kl(batch) == pytest.approx(predicted, rel=SMALL_SIGMA_RTOL)


def test_zero_is_the_engine_without_the_dial_and_bad_values():
    model = make_model(CFG)
    a = _generate(RolloutEngine(model))
    b = _generate(RolloutEngine(model, logit_noise=0.0))
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.behavior_logprob, b.behavior_logprob)
    for bad in (-0.1, float("nan"), float("inf"), True, "0.1"):
        with pytest.raises(ValueError, match="logit_noise"):
            RolloutEngine(model, logit_noise=bad)


def test_the_trainer_option_turns_the_dial(tmp_path):
    from tokenmdp.rl.config import TrainConfig, check_config
    from tokenmdp.rl.trainer import train

    tiny = dict(d_model=32, n_layers=1, n_heads=2, n_experts=4, top_k=2, expert_hidden=16,
                prompts_per_step=4, group_size=4, max_new_tokens=6, eval_size=4, eval_every=0,
                steps=2, task="count", estimator="minirl", rollout_precision="fp32")
    kl = {}
    for sigma in (0.0, 1.0):
        rows = train(TrainConfig(out_dir=str(tmp_path / str(sigma)), rollout_logit_noise=sigma,
                                 **tiny))
        kl[sigma] = max(r["train_infer_kl_k3"] for r in rows)
    assert kl[0.0] < 1e-10 < 1e-3 < kl[1.0], kl   # synced fp32 engine: rounding only
    with pytest.raises(ValueError, match="rollout_logit_noise"):
        check_config(TrainConfig(rollout_logit_noise=-1.0))
