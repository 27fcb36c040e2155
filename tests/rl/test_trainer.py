"""The trainer: SFT and RL smoke runs, exact resume, bad configurations, non-finite updates,
and the trainer's loss gradient against the exact ∇J of a tiny enumerable MDP."""

import dataclasses
import json
import math
import shutil

import pytest
import torch

from tokenmdp import estimators
from tokenmdp.batch import TokenBatch
from tokenmdp.exact import TokenMDP, gradient, sequence_probs
from tokenmdp.exact.world.rewards import RandomTable
from tokenmdp.packing import pack_first_fit_decreasing, split_micro_batches
from tokenmdp.rl import run_state, trainer
from tokenmdp.rl.config import TrainConfig, check_config
from tokenmdp.rl.mismatch import RoutingReplay, compute_old_logprobs
from tokenmdp.rl.run_setup import build_model
from tokenmdp.rl.run_state import NonFiniteError
from tokenmdp.rl.trainer import TIMING_FIELDS, train
from tokenmdp.rl.update import minibatch_loss, prepare_minibatch, split_minibatches

#: ∇J by exact recursion vs the trainer's loss on the probability-weighted enumeration (float64).
GRADIENT_RTOL = 1e-9
#: two float64 gradient computations of the same loss, summed in different orders.
SAME_LOSS_RTOL = 1e-12

TINY = dict(d_model=32, n_layers=1, n_heads=2, n_experts=4, top_k=2, expert_hidden=16,
            prompts_per_step=4, group_size=4, max_new_tokens=6, eval_size=4, eval_every=2)
RL_KEYS = {"step", "lr", "reward", "response_length", "entropy", "train_infer_kl_k1",
           "train_infer_kl_k3", "clip_fraction", "r_min", "r_mean", "r_max", "routing_mismatch",
           "grad_norm", "loss", "load_balancing", "tokens_per_s", "time_s"}


def _lines(path):
    return [json.loads(line) for line in open(path)]


def _without_timing(rows):
    return [{k: v for k, v in r.items() if k not in TIMING_FIELDS} for r in rows]


def test_rl_smoke_run_writes_finite_metrics_and_held_out_accuracy(tmp_path):
    cfg = TrainConfig(steps=3, out_dir=str(tmp_path), task="count", estimator="minirl",
                      replay="r2", minibatches=2, rollout_precision="bf16", kl_coef=0.01, **TINY)
    rows = train(cfg)
    written = _lines(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in written] == [0, 1, 2] and written == json.loads(json.dumps(rows))
    for r in written:
        assert RL_KEYS <= set(r)
        assert all(math.isfinite(v) for v in r.values() if isinstance(v, float)), r
    assert "eval_accuracy" in written[1] and "eval_accuracy" in written[2]  # every 2, and last
    assert 0.0 <= written[2]["eval_accuracy"] <= 1.0
    assert written[0]["grad_norm"] > 0  # count rewards differ in a group: the model learns
    assert (tmp_path / "checkpoint.pt").exists()
    assert not (tmp_path / "checkpoint.pt.tmp").exists()


def test_sft_checkpoint_starts_rl_and_sft_lowers_the_nll(tmp_path):
    sft = TrainConfig(mode="sft", task="addition", steps=3, out_dir=str(tmp_path / "sft"),
                      lr=1e-2, **TINY)
    rows = train(sft)
    assert all(math.isfinite(r["loss"]) for r in rows)
    assert rows[-1]["loss"] < rows[0]["loss"]  # mean answer-token NLL goes down
    ckpt = torch.load(tmp_path / "sft" / "checkpoint.pt", weights_only=True)
    rl = TrainConfig(steps=1, out_dir=str(tmp_path / "rl"), init=str(tmp_path / "sft" /
                                                                      "checkpoint.pt"), **TINY)
    run = trainer._Run(rl)
    for name, p in run.model.state_dict().items():
        assert torch.equal(p, ckpt["model"][name]), name
    assert torch.equal(run.reference.embed, ckpt["model"]["embed"])  # reference = initial model
    train(rl)
    bad = dataclasses.replace(rl, d_model=16, n_heads=2)
    with pytest.raises(ValueError, match="init"):
        train(bad)


def test_resume_repeats_the_uninterrupted_run_exactly(tmp_path):
    base = TrainConfig(steps=4, task="count", estimator="dapo", minibatches=2, replay="r2", **TINY)
    straight = train(dataclasses.replace(base, out_dir=str(tmp_path / "a")))
    interrupted = dataclasses.replace(base, out_dir=str(tmp_path / "b"))
    ckpt = tmp_path / "b" / "checkpoint.pt"
    train(dataclasses.replace(interrupted, steps=2))
    shutil.copy(ckpt, tmp_path / "at_step_2.pt")
    # a crash after step 2's metrics line was written but before its checkpoint: the resumed
    # run starts from the step-2 checkpoint and drops the orphan line
    train(dataclasses.replace(interrupted, steps=3, resume=True))
    shutil.copy(tmp_path / "at_step_2.pt", ckpt)
    train(dataclasses.replace(interrupted, resume=True))
    a = _without_timing(_lines(tmp_path / "a" / "metrics.jsonl"))
    b = _without_timing(_lines(tmp_path / "b" / "metrics.jsonl"))
    assert a == _without_timing(straight)
    assert len(b) == 4 and a == b
    assert a[2]["grad_norm"] > 0 and a[2]["loss"] != a[3]["loss"]  # not a run that stands still


@pytest.mark.parametrize("changes, match", [
    (dict(task="chess"), "task"),
    (dict(estimator="nope"), "estimator"),
    (dict(minibatches=0), "minibatches"),
    (dict(minibatches=100), "minibatches"),
    (dict(replay="r3", dense=True), "dense"),
    (dict(replay="r4"), "replay"),
    (dict(rollout_precision="fp6"), "rollout_precision"),
    (dict(mode="dpo"), "mode"),
    (dict(lr=0.0), "lr"),
])
def test_bad_configurations_fail_at_start(tmp_path, changes, match):
    cfg = TrainConfig(out_dir=str(tmp_path / "out"), **{**TINY, **changes})
    with pytest.raises(ValueError, match=match):
        train(cfg)
    assert not (tmp_path / "out").exists()  # nothing was done


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a device this machine lacks")
def test_precision_on_a_missing_device_fails_at_start():
    with pytest.raises(ValueError, match="rollout_precision / device.*CUDA"):
        check_config(TrainConfig(device="cuda", rollout_precision="bf16"))


def test_non_finite_updates_are_skipped_then_the_run_stops(tmp_path, monkeypatch, caplog):
    calls = []

    def nan_loss(model, batch, est, replay, **kwargs):
        calls.append(1)
        return model.embed.sum() * float("nan"), {"tokens": torch.tensor(1.0)}

    monkeypatch.setattr(run_state, "minibatch_loss", nan_loss)  # where _Run looks it up
    cfg = TrainConfig(mode="sft", steps=5, max_nonfinite=2, out_dir=str(tmp_path),
                      checkpoint_every=1, **TINY)   # a checkpoint after the skipped step
    before = trainer._Run(cfg).model.embed.detach().clone()
    with pytest.raises(NonFiniteError):
        train(cfg)
    assert len(calls) == 2 and "update skipped" in caplog.text
    rows = _lines(tmp_path / "metrics.jsonl")
    assert rows[0]["skipped_updates"] == 1 and rows[0]["loss"] is None
    state = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    assert torch.equal(state["model"]["embed"], before)  # the skipped update changed nothing


def test_each_minibatch_is_its_own_step_with_the_step_advantages():
    # 4 sequences with response lengths 1, 2, 3, 2 and rewards 1, 0, 1, 0 in two groups of 2;
    # DAPO's group mean/std advantages need whole groups, so they come from the step: in each
    # group (1 - 0.5) / std{1, 0} = 0.5 / (1/√2) = +1/√2 for reward 1, -1/√2 for reward 0.
    batch = TokenBatch.from_sequences([[3], [3], [4], [4]], [[5], [5, 6], [5, 6, 7], [6, 7]],
                                      rewards=[1.0, 0.0, 1.0, 0.0], groups=[0, 0, 1, 1])
    est = estimators.get("dapo")  # token mean over the optimizer step
    batch = batch.replace(old_logprob=torch.zeros_like(batch.advantage))
    step = estimators.prepare(batch, est)
    parts = split_minibatches(step, 2, generator=torch.Generator().manual_seed(1), capacity=5)
    seen = []
    for part in parts:
        assert part.group.tolist() in ([0, 1], [1, 0])  # this shuffle splits both groups
        part = prepare_minibatch(part, est, max_len=3)
        # token mean of *this* update: every loss token weighs 1 / (its loss tokens)
        n = part.num_loss_tokens
        assert torch.allclose(part.loss_weight[part.loss_mask], torch.full((n,), 1.0 / n,
                                                                          dtype=torch.float64))
        adv_S = part.sequence_sum(part.advantage) / part.length
        assert torch.allclose(adv_S, (2 * part.reward - 1) / math.sqrt(2))
        seen += part.reward.tolist()
    assert sorted(seen) == [0.0, 0.0, 1.0, 1.0]


def test_trainer_loss_gradient_is_the_exact_gradient_on_the_enumeration():
    # Tiny MDP: V = 3 (EOS = 2), L = 2, two prompts; the trainer's model with the same vocabulary.
    mdp = TokenMDP(3, 2, RandomTable(1), prompts=[(0,), (1, 2)], prompt_probs=[0.3, 0.7])
    cfg = TrainConfig(dtype="float64", init_std=0.5, seed=2, **TINY)
    model = build_model(cfg, vocab_size=3)
    true_grad = gradient(mdp, model)
    assert float(true_grad.norm()) > 1e-4

    # REINFORCE prepared as the trainer prepares a step: A = R, weights 1/S (sequence-mean of
    # token sums). Rescaled by S D(x) π(y|x) (detached), the loss is -Σ_y D π R log π(y), whose
    # gradient is -∇J exactly (∇π = π ∇log π).
    est = estimators.get("reinforce")
    batch = estimators.prepare(mdp.enumerate(), est)
    prob_S = (mdp.prompt_probs[batch.prompt_index] * sequence_probs(mdp, model)).detach()
    batch = batch.replace(loss_weight=batch.loss_weight * batch.to_tokens(prob_S)
                          * batch.num_sequences)
    batch = pack_first_fit_decreasing(batch, 6)
    for replay in (RoutingReplay.NONE, RoutingReplay.R2):
        model.zero_grad()
        step = compute_old_logprobs(model, batch, replay)  # on-policy: π_old = π_θ
        for part in split_micro_batches(step, 2):  # weights are the step's: the parts sum up
            loss, _ = minibatch_loss(model, part.batch, est, replay)
            loss.backward()
        got = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        torch.testing.assert_close(-got, true_grad, rtol=GRADIENT_RTOL,
                                   atol=GRADIENT_RTOL * float(true_grad.abs().max()))


@pytest.mark.parametrize("name", estimators.names())
def test_every_registry_estimator_runs_a_finite_step(tmp_path, name):
    cfg = TrainConfig(steps=1, out_dir=str(tmp_path), task="count", estimator=name,
                      minibatches=2, **{**TINY, "eval_size": 2})
    (row,) = train(cfg)
    assert math.isfinite(row["loss"]) and math.isfinite(row["grad_norm"])


def test_cli_reports_a_diverged_run_without_a_traceback(tmp_path, monkeypatch, capsys):
    from tokenmdp.cli import main

    def nan_loss(model, batch, est, replay, **kwargs):
        return model.embed.sum() * float("nan"), {"tokens": torch.tensor(1.0)}

    monkeypatch.setattr(run_state, "minibatch_loss", nan_loss)  # where _Run looks it up
    argv = ["sft", "--steps", "3", "--max-nonfinite", "1", "--out-dir", str(tmp_path)]
    for name, value in TINY.items():
        argv += [f"--{name.replace('_', '-')}", str(value)]
    with pytest.raises(SystemExit) as err:
        main(argv)
    assert err.value.code == 1
    assert "stopped" in capsys.readouterr().err


def _dapo_step(prompts, responses, rewards, **cfg):
    """A float64 model (vocabulary 5) and one prepared DAPO group of its own samples' shape (a
    clipped surrogate, no reference model), after the ``old_logprob`` pass."""
    model = build_model(TrainConfig(dtype="float64", seed=3, **{**TINY, **cfg}), vocab_size=5)
    est = estimators.get("dapo")
    batch = TokenBatch.from_sequences(prompts, responses, rewards=rewards,
                                      groups=[0] * len(prompts), dtype=torch.float64)
    return model, est, compute_old_logprobs(model, estimators.prepare(batch, est), "none")


def test_load_balancing_coef_adds_the_switch_loss_gradient():
    model, est, batch = _dapo_step([[1, 2], [3], [2, 2, 1]], [[4, 1, 0], [2, 3], [1]],
                                   [1.0, 0.0, 0.5], init_std=0.5)

    def grad(fn):
        model.zero_grad()
        fn().backward()
        return torch.cat([(torch.zeros_like(p) if p.grad is None else p.grad).reshape(-1)
                          for p in model.parameters()])

    plain = grad(lambda: minibatch_loss(model, batch, est)[0])
    # independently: the model's own forward pass gives the load-balancing loss
    balance = grad(lambda: model(batch).load_balancing_loss)
    assert float(balance.abs().max()) > 0  # the router's gradient
    coef = 0.37
    with torch.no_grad():
        loss, metrics = minibatch_loss(model, batch, est, load_balancing_coef=coef)
    with_coef = grad(lambda: minibatch_loss(model, batch, est, load_balancing_coef=coef)[0])
    torch.testing.assert_close(with_coef, plain + coef * balance, rtol=SAME_LOSS_RTOL,
                               atol=SAME_LOSS_RTOL * float(plain.abs().max()))
    assert float(metrics["load_balancing"]) == pytest.approx(
        float(model(batch).load_balancing_loss.detach()), rel=1e-12)
    assert float(loss) == pytest.approx(float(minibatch_loss(model, batch, est)[0].detach())
                                        + coef * float(metrics["load_balancing"]), rel=1e-12)


@pytest.mark.parametrize("changes, match", [
    ({"load_balancing_coef": -0.1}, "load_balancing_coef"),
    ({"load_balancing_coef": 0.01, "dense": True}, "load_balancing_coef"),
])
def test_load_balancing_coef_is_checked(changes, match):
    with pytest.raises(ValueError, match=match):
        check_config(TrainConfig(**{**TINY, **changes}))


def test_minibatch_loss_takes_a_module_that_returns_log_probs_only():
    model, est, batch = _dapo_step([[1, 2], [3]], [[4, 1], [2, 3, 0]], [1.0, 0.0])

    class LogprobsOnly(torch.nn.Module):  # a user's own wrapper: no load-balancing loss
        def forward(self, batch, routing=None):
            return model.token_logprobs(batch, routing=routing)

    with torch.no_grad():
        loss, metrics = minibatch_loss(LogprobsOnly(), batch, est)
        assert float(loss) == float(minibatch_loss(model, batch, est)[0])
    assert "load_balancing" not in metrics
    with pytest.raises(ValueError, match="load_balancing_coef"):
        minibatch_loss(LogprobsOnly(), batch, est, load_balancing_coef=0.1)


def test_resuming_a_checkpoint_that_predates_a_setting_reads_its_default(tmp_path, caplog):
    cfg = TrainConfig(steps=1, task="count", out_dir=str(tmp_path), **TINY)
    train(cfg)
    state = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    del state["config"]["load_balancing_coef"]  # as written before the setting existed
    del state["sha256"]                         # (and before checkpoints carried a checksum)
    torch.save(state, tmp_path / "checkpoint.pt")
    train(dataclasses.replace(cfg, steps=2, resume=True))
    assert "changed settings" not in caplog.text
    train(dataclasses.replace(cfg, steps=3, resume=True, load_balancing_coef=0.01))
    assert "changed settings: load_balancing_coef" in caplog.text
