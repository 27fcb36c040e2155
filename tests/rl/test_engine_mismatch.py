"""Issue 31, the rollout engine's mismatch modes (``RolloutEngine(mismatch=EngineMismatch(...))``):
for every mode the engine samples from the distribution it records (frequencies against the
recorded ``μ``) and ``E_μ[π_old/μ] = 1``; the deterministic modes give a prefix the same logits in
every call and batch layout; the engine and the exact world's copy of the same policy agree state
by state, in their response distribution and in the per-token KL; the trainer's options turn the
modes on and refuse bad values in one line."""

from __future__ import annotations

import math

import pytest
import torch
from scipy import stats

from tests.model.models import make_model
from tokenmdp.exact import EngineMismatch, inference_copy, sequence_probs
from tokenmdp.exact.world.engine_mismatch import DETERMINISTIC_MODES
from tokenmdp.exact.world.mdp import TokenMDP
from tokenmdp.exact.world.rewards import TokenCount
from tokenmdp.model import ModelConfig
from tokenmdp.packing import pack_first_fit_decreasing
from tokenmdp.rl import RolloutEngine, compute_old_logprobs, training_inference_kl
from tokenmdp.rl.replay_exact import EnginePolicy, moe_policy

from ._cli import TINY_ARGS, one_line_error, run_cli

CFG = ModelConfig(vocab_size=8, d_model=32, n_heads=2, n_experts=4, top_k=2, expert_hidden=32,
                  init_std=0.2)
EOS = CFG.vocab_size - 1
#: fp32 engine, the same prefix through another forward pass (cache vs none, other batch shape)
ROUNDING_ATOL = 1e-5
#: a goodness-of-fit test fails below this p-value (a false alarm once in 1000 runs of one test;
#: every draw here is seeded, so a run either passes or fails for good)
P_THRESHOLD = 1e-3
#: |sample mean - expectation| below this many standard errors
SE_BAND = 4.0
MODES = {"fresh": EngineMismatch("fresh", 0.8),
         "fixed": EngineMismatch("fixed", 0.8, seed=5),
         "heavy": EngineMismatch("heavy", 2.0, 0.2, seed=5),
         "growing": EngineMismatch("growing", 0.5, seed=5)}


def _prompts(n, seed=0, length=3):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, EOS, (length,), generator=gen).tolist() for _ in range(n)]


def _generate(engine, prompts, *, seed=1, max_new_tokens=12, use_cache=True):
    return engine.generate(prompts, max_new_tokens=max_new_tokens, eos_id=EOS,
                           generator=torch.Generator().manual_seed(seed), use_cache=use_cache)


def _chi_square_p(counts, expected):
    """Pearson's χ² goodness-of-fit p-value, the cells expected fewer than 5 times pooled into
    one (where the χ² approximation of the statistic holds)."""
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    if float(exp[-1]) == 0:
        assert float(obs[-1]) == 0
        obs, exp = obs[:-1], exp[:-1]
    exp = exp * obs.sum() / exp.sum()          # the rounding of the probabilities' sum
    return stats.chisquare(obs.numpy(), exp.numpy()).pvalue


# ------------------------------------------------------------------ the sampled distribution
@pytest.mark.parametrize("name", list(MODES))
def test_per_token_frequencies_match_the_recorded_probabilities(name):
    # E_μ[1{y = v} / μ(y)] = 1 for every token v at every state (the indicator over the recorded
    # probability), for fresh noise too, whose μ is the draw the engine recorded
    engine = RolloutEngine(make_model(CFG), mismatch=MODES[name])
    batch = _generate(engine, _prompts(400))
    mask = batch.loss_mask
    y, inv_mu = batch.tokens[mask], torch.exp(-batch.behavior_logprob[mask].double())
    n = y.numel()
    for v in range(CFG.vocab_size):
        terms = torch.where(y == v, inv_mu, 0.0)
        se = float(terms.std()) / math.sqrt(n)
        assert abs(float(terms.mean()) - 1) < SE_BAND * se, (v, float(terms.mean()), se)


@pytest.mark.parametrize("name", DETERMINISTIC_MODES)
def test_a_chi_square_test_of_the_first_token_against_the_full_mu(name):
    # one prompt, many copies: every copy samples its first token from the same fixed μ
    engine = RolloutEngine(make_model(CFG), mismatch=MODES[name])
    prompt, n = [1, 4, 2], 6000
    batch = _generate(engine, [prompt] * n, max_new_tokens=1, seed=2)
    first = batch.tokens[batch.loss_mask]
    mu = engine.next_token_logprobs(batch)[batch.loss_mask].double().exp()
    assert float((mu - mu[0]).abs().max()) < ROUNDING_ATOL          # one distribution
    recorded = batch.behavior_logprob[batch.loss_mask].double().exp()
    torch.testing.assert_close(recorded, mu.gather(1, first[:, None])[:, 0], rtol=0,
                               atol=ROUNDING_ATOL)
    counts = torch.bincount(first, minlength=CFG.vocab_size).double()
    assert _chi_square_p(counts, n * mu[0] / mu[0].sum()) > P_THRESHOLD
    plain = RolloutEngine(make_model(CFG)).next_token_logprobs(batch)[batch.loss_mask][0]
    assert float((mu[0].log() - plain.double()).abs().max()) > 0.05   # the mode moved μ


@pytest.mark.parametrize("name", list(MODES))
def test_the_importance_weight_has_mean_one(name):
    model = make_model(CFG)
    batch = compute_old_logprobs(model, _generate(RolloutEngine(model, mismatch=MODES[name]),
                                                  _prompts(300, seed=3)), "none")
    w = torch.exp((batch.old_logprob - batch.behavior_logprob).double()[batch.loss_mask])
    se = float(w.std()) / math.sqrt(w.numel())
    assert abs(float(w.mean()) - 1) < SE_BAND * se, (float(w.mean()), se)
    assert training_inference_kl(batch) > 1e-3                     # and there is a mismatch


# ------------------------------------------------------------------ determinism
@pytest.mark.parametrize("name", DETERMINISTIC_MODES)
def test_the_same_prefix_gets_the_same_distribution_in_every_call_and_layout(name):
    model = make_model(CFG)
    engine = RolloutEngine(model, mismatch=MODES[name])
    prompts = _prompts(24, seed=4)
    batch = _generate(engine, prompts, seed=5)
    mu = engine.next_token_logprobs(batch)
    # what generate recorded is the μ of the whole-prefix pass, with and without a KV cache
    rec = batch.behavior_logprob[batch.loss_mask]
    torch.testing.assert_close(rec, mu.gather(-1, batch.tokens[..., None])[..., 0][
        batch.loss_mask], rtol=0, atol=ROUNDING_ATOL)
    no_cache = _generate(engine, prompts, seed=5, use_cache=False)
    assert torch.equal(no_cache.tokens, batch.tokens)
    # packed: other rows, other columns, the same μ at the same tokens
    packed = pack_first_fit_decreasing(batch, 40)
    assert packed.tokens.shape != batch.tokens.shape
    mu_packed = engine.next_token_logprobs(packed)
    torch.testing.assert_close(mu_packed[packed.loss_mask], _by_sequence(mu, packed), rtol=0,
                               atol=ROUNDING_ATOL)
    # a second engine with the same mode is the same engine; another seed is another one
    twin = RolloutEngine(model, mismatch=MODES[name])
    torch.testing.assert_close(twin.next_token_logprobs(batch), mu, rtol=0, atol=0)
    other = RolloutEngine(model, mismatch=EngineMismatch(name, MODES[name].scale,
                                                         MODES[name].fraction, seed=6))
    assert float((other.next_token_logprobs(batch) - mu).abs().max()) > 0.05


def _by_sequence(mu, packed):
    """``mu`` (one sequence per row) at the loss tokens of ``packed``, in its order."""
    out = []
    for r, c in packed.loss_mask.nonzero().tolist():
        s, pos = int(packed.sequence_id[r, c]), int(packed.position[r, c])
        out.append(mu[s, pos])
    return torch.stack(out)


def test_one_prompt_alone_or_in_a_batch_and_repeated_gets_the_same_first_distribution():
    model = make_model(CFG)
    engine = RolloutEngine(model, mismatch=MODES["fixed"])
    prompts = _prompts(16, seed=7)
    together = _generate(engine, prompts, max_new_tokens=1, seed=8)
    mu_all = engine.next_token_logprobs(together)[together.loss_mask]
    for i in (0, 5, 15):
        alone = _generate(engine, [prompts[i]] * 3, max_new_tokens=1, seed=9 + i)
        mu_alone = engine.next_token_logprobs(alone)[alone.loss_mask]
        for row in mu_alone:
            torch.testing.assert_close(row, mu_all[i], rtol=0, atol=ROUNDING_ATOL)


def test_fresh_is_the_old_dial_bit_for_bit():
    model = make_model(CFG)
    a = _generate(RolloutEngine(model, logit_noise=0.7), _prompts(32))
    b = _generate(RolloutEngine(model, mismatch=EngineMismatch("fresh", 0.7)), _prompts(32))
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.behavior_logprob, b.behavior_logprob)
    assert RolloutEngine(model, logit_noise=0.7).mismatch == EngineMismatch("fresh", 0.7)
    c = _generate(RolloutEngine(model, mismatch=EngineMismatch("fixed", 0.0)), _prompts(32))
    d = _generate(RolloutEngine(model), _prompts(32))
    assert torch.equal(c.tokens, d.tokens) and torch.equal(c.behavior_logprob, d.behavior_logprob)


# ------------------------------------------------------------------ the exact world agrees
@pytest.mark.parametrize("name", DETERMINISTIC_MODES)
def test_the_engine_and_the_exact_copy_are_the_same_mu(name):
    mdp = TokenMDP(vocab_size=4, max_len=3, reward=TokenCount(0), prompts=[(0,), (1, 2)])
    model = moe_policy(mdp, seed=1, init_std=0.5)
    m = MODES[name]
    engine = RolloutEngine(model, precision="fp32", mismatch=m)
    pi_engine = EnginePolicy(mdp, engine.model)              # the engine's numerics, no mismatch
    mu_exact = inference_copy(pi_engine, mismatch=m)         # wrapped by the exact world
    # state by state: the engine's μ on the enumeration is the copy's
    enum = mdp.enumerate()
    mu_engine = engine.next_token_logprobs(enum).double()
    with torch.no_grad():
        want = mu_exact.next_token_logprobs(enum)
    torch.testing.assert_close(mu_engine[enum.loss_mask], want[enum.loss_mask], rtol=0,
                               atol=ROUNDING_ATOL)
    # sampled: response frequencies against the copy's sequence probabilities (χ² test)
    n = 6000
    prompt_index = [i % 2 for i in range(n)]
    batch = engine.generate([mdp.prompts[p] for p in prompt_index], max_new_tokens=mdp.max_len,
                            eos_id=mdp.eos, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        probs = sequence_probs(mdp, mu_exact)
    responses = mdp.responses()
    index = {r: i for i, r in enumerate(responses)}
    counts = torch.zeros(len(responses), dtype=torch.float64)
    for p, (_, r) in zip(prompt_index, batch.sequences()):
        counts[index[(mdp.prompts[p], tuple(r))]] += 1
    assert _chi_square_p(counts, probs * (n / 2)) > P_THRESHOLD   # each prompt n/2 times
    # the per-token KL(μ || π): the engine's sampled k3 against the exact, weighted by μ's visits
    batch = compute_old_logprobs(engine.model, batch, "none")
    with torch.no_grad():
        lp_mu, lp_pi = mu_exact.next_token_logprobs(enum), pi_engine.next_token_logprobs(enum)
        kl_RC = (lp_mu.exp() * (lp_mu - lp_pi)).sum(-1)
        w_S = mdp.prompt_probs[mdp.terminal_prompt_index] * probs
    exact_kl = float((w_S[:, None] * kl_RC * enum.loss_mask).sum()
                     / (w_S[:, None] * enum.loss_mask).sum())
    log_r = (batch.old_logprob - batch.behavior_logprob).double()[batch.loss_mask]
    terms = torch.expm1(log_r) - log_r
    se = float(terms.std()) / math.sqrt(terms.numel())
    assert exact_kl > 1e-3
    assert abs(training_inference_kl(batch) - exact_kl) < SE_BAND * se + ROUNDING_ATOL


# ------------------------------------------------------------------ bad input
def test_bad_engine_arguments_are_refused_naming_them():
    model = make_model(CFG)
    with pytest.raises(TypeError, match="^mismatch:"):
        RolloutEngine(model, mismatch="fixed")
    with pytest.raises(ValueError, match="^logit_noise, mismatch:"):
        RolloutEngine(model, logit_noise=0.5, mismatch=EngineMismatch("fixed", 1.0))
    engine = RolloutEngine(model, mismatch=EngineMismatch("fresh", 1.0))
    batch = _generate(engine, _prompts(2), max_new_tokens=2)
    with pytest.raises(TypeError, match="^generator:"):
        engine.next_token_logprobs(batch)
    with pytest.raises(ValueError, match="^temperature:"):
        engine.next_token_logprobs(batch, temperature=0.0)
    with pytest.raises(TypeError, match="^batch:"):
        engine.next_token_logprobs(batch.tokens)


# ------------------------------------------------------------------ the trainer's options
TINY = dict(d_model=32, n_layers=1, n_heads=2, n_experts=4, top_k=2, expert_hidden=16,
            prompts_per_step=4, group_size=4, max_new_tokens=6, eval_size=4, eval_every=0,
            steps=2, task="count", estimator="minirl", rollout_precision="fp32")


def test_the_trainer_logs_the_kl_and_chi2_of_each_mode(tmp_path):
    from tokenmdp.rl.config import TrainConfig
    from tokenmdp.rl.trainer import train

    for mode, scale, fraction in (("fixed", 1.0, 1.0), ("heavy", 4.0, 0.2),
                                  ("growing", 3.0, 1.0)):   # the start is flat: large
        rows = train(TrainConfig(out_dir=str(tmp_path / mode), rollout_mismatch=mode,
                                 rollout_mismatch_scale=scale,
                                 rollout_mismatch_fraction=fraction, **TINY))
        assert max(r["train_infer_kl_k3"] for r in rows) > 1e-3, mode
        assert all(math.isfinite(r["is_chi2"]) for r in rows)


@pytest.mark.parametrize("changes, field", [
    (dict(rollout_mismatch="fixd"), "rollout_mismatch"),
    (dict(rollout_mismatch="fixed"), "rollout_mismatch_scale"),          # no scale
    (dict(rollout_mismatch_scale=1.0), "rollout_mismatch_scale"),        # no mode
    (dict(rollout_mismatch="heavy", rollout_mismatch_scale=1.0, rollout_mismatch_fraction=0.0),
     "rollout_mismatch_fraction"),
    (dict(rollout_mismatch="fresh", rollout_mismatch_scale=1.0, rollout_mismatch_fraction=0.5),
     "rollout_mismatch_fraction"),
    (dict(rollout_mismatch="fixed", rollout_mismatch_scale=1.0, rollout_mismatch_seed=-1),
     "rollout_mismatch_seed"),
    (dict(rollout_mismatch="fixed", rollout_mismatch_scale=1.0, rollout_logit_noise=0.5),
     "rollout_logit_noise, rollout_mismatch"),
])
def test_check_config_names_the_bad_field(changes, field):
    from tokenmdp.rl.config import TrainConfig, check_config

    with pytest.raises(ValueError, match=f"^{field}:"):
        check_config(TrainConfig(**changes))
    check_config(TrainConfig(rollout_mismatch="heavy", rollout_mismatch_scale=4.0,
                             rollout_mismatch_fraction=0.05, rollout_mismatch_seed=3))


def test_the_options_parse_and_build_the_engine():
    import argparse

    from tokenmdp.rl.cli_commands import add_trainer_commands
    from tokenmdp.rl.options import config_from_args
    from tokenmdp.rl.run_setup import build_engine

    parser = argparse.ArgumentParser(prog="tokenmdp")
    add_trainer_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["train", "--rollout-mismatch", "heavy", "--rollout-mismatch-scale",
                              "8", "--rollout-mismatch-fraction", "0.02",
                              "--rollout-mismatch-seed", "9"])
    cfg = config_from_args(args, args.trainer_mode)
    engine = build_engine(cfg, make_model(CFG))
    assert engine.mismatch == EngineMismatch("heavy", 8.0, 0.02, seed=9)
    old = config_from_args(parser.parse_args(["train", "--rollout-logit-noise", "0.5"]), "rl")
    assert build_engine(old, make_model(CFG)).mismatch == EngineMismatch("fresh", 0.5)


@pytest.mark.parametrize("args, field", [
    (("--rollout-mismatch", "bogus"), "rollout_mismatch"),
    (("--rollout-mismatch-scale", "1"), "rollout_mismatch_scale"),
])
def test_the_cli_refuses_bad_modes_in_one_line(tmp_path, args, field):
    line = one_line_error(run_cli("train", *TINY_ARGS, *args, "--out-dir", tmp_path / "x"))
    assert f"error: {field}:" in line
    assert not (tmp_path / "x").exists()
