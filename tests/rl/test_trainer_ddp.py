"""The trainer under data parallel: a 2-rank gloo update equals the single-process update, and
``torchrun -m tokenmdp.rl.trainer`` runs, checkpoints and resumes.

The equality test builds one rollout batch in the parent (float64, a bf16 engine, R2 routing),
then runs the trainer's own update (:meth:`_Run.updates`) on it twice: in the parent on the
whole batch, and in two spawned gloo ranks that each hold two of the four prompt groups (with
unequal token counts). The ranks wrap the model in DDP, weight by all-reduced counts and scale
the loss, so the gradient, the reported metrics and the updated weights must equal the
single-process ones up to summation order. Gradient clipping is off: a clipped (or Adam-
normalized) update would hide a gradient of the wrong scale, so the raw gradient is compared.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys

import pytest
import torch

from tests._ranks import join_group, leave_group, run_ranks
from tokenmdp.packing import pack_first_fit_decreasing, select_sequences
from tokenmdp.rl import trainer
from tokenmdp.rl.config import TrainConfig, check_config

WORLD_SIZE = 2
JOIN_TIMEOUT_S = 180
TORCHRUN_TIMEOUT_S = 240
TOL = 1e-10           # float64; only the order of summation differs
# token-mean; seq-mean of token sums + TIS; KL in the loss; batch-normalized advantages; a
# group mean whitened over the step's loss tokens (needs every rank's rewards and lengths)
ESTIMATORS = ("dapo", "minirl", "grpo", "ppo", "reinforce_pp_baseline")
METRICS = ("loss", "grad_norm", "clip_fraction", "r_mean", "r_min", "r_max", "rho_mean",
           "kl_ref")

# with a load-balancing term: each rank's Switch loss over its own tokens, averaged over ranks
BALANCED, LB_COEF = "dapo", 0.5

CFG = TrainConfig(task="count", dtype="float64", grad_clip=0.0, minibatches=1, replay="r2",
                  rollout_precision="bf16", prompts_per_step=4, group_size=4, max_new_tokens=6,
                  d_model=32, n_layers=1, n_heads=2, n_experts=4, top_k=2, expert_hidden=16,
                  eval_size=4, lr=1e-2, seed=3)


def _cfg(name: str) -> TrainConfig:
    return dataclasses.replace(CFG, estimator=name)


def _update(run: trainer._Run, batch) -> dict:
    metrics = run.updates(batch)
    return {"metrics": metrics,
            "grads": {n: p.grad.clone() for n, p in run.model.named_parameters()},
            "params": {n: p.detach().clone() for n, p in run.model.named_parameters()}}


def _step_batches() -> dict:
    """One rollout per estimator (float64), from the same model the ranks build."""
    out = {}
    for name in ESTIMATORS:
        batch, _ = trainer._Run(_cfg(name)).rollout()
        out[name] = batch
    return out


def _rank_share(batch, rank: int):
    groups = torch.arange(4).tensor_split(WORLD_SIZE)[rank]
    keep = torch.isin(batch.group, groups).nonzero().squeeze(1)
    return pack_first_fit_decreasing(select_sequences(batch, keep), batch.tokens.shape[1])


def _worker(rank: int, port: int, out_dir: str) -> None:
    join_group(rank, port, WORLD_SIZE)
    batches = torch.load(f"{out_dir}/batches.pt", weights_only=False)
    results = {}
    for name in ESTIMATORS:
        run = trainer._Run(_cfg(name))
        assert (run.rank, run.world) == (rank, WORLD_SIZE)
        results[name] = _update(run, _rank_share(batches[name], rank))
    run = trainer._Run(dataclasses.replace(_cfg(BALANCED), load_balancing_coef=LB_COEF))
    results["load_balancing"] = _update(run, _rank_share(batches[BALANCED], rank))
    torch.save(results, f"{out_dir}/rank{rank}.pt")
    leave_group()


@pytest.fixture(scope="module")
def updates(tmp_path_factory):
    """``(single-process results, [rank results])`` per estimator."""
    out = tmp_path_factory.mktemp("trainer_ddp")
    batches = _step_batches()
    torch.save(batches, out / "batches.pt")
    single = {name: _update(trainer._Run(_cfg(name)), batches[name]) for name in ESTIMATORS}
    run_ranks(_worker, WORLD_SIZE, out, join_timeout_s=JOIN_TIMEOUT_S)
    ranks = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(WORLD_SIZE)]
    return single, ranks, batches


def test_the_ranks_hold_unequal_token_counts(updates):
    _, _, batches = updates
    for batch in batches.values():  # so a mean of rank token-means would be another estimator
        counts = [_rank_share(batch, r).num_loss_tokens for r in range(WORLD_SIZE)]
        assert counts[0] != counts[1], counts


@pytest.mark.parametrize("name", ESTIMATORS)
def test_two_rank_update_equals_the_single_process_update(updates, name):
    single, ranks, _ = updates
    want = single[name]
    assert max(float(g.abs().max()) for g in want["grads"].values()) > 1e-3  # not vacuous
    for got in (rank[name] for rank in ranks):  # every rank: the global gradient, new weights
        for key in ("grads", "params"):
            for param, value in want[key].items():
                torch.testing.assert_close(got[key][param], value, rtol=TOL, atol=TOL,
                                           msg=lambda m, k=key, p=param: f"{k} {p}: {m}")
        for key in METRICS:
            if key in want["metrics"]:
                assert got["metrics"][key] == pytest.approx(want["metrics"][key], rel=TOL,
                                                            abs=TOL), key


def test_load_balancing_term_is_the_mean_of_the_ranks_own_terms(updates):
    single, ranks, batches = updates
    # independently: the estimator's global gradient (the single-process update without the
    # term) plus LB_COEF times the mean over ranks of grad(Switch loss of the rank's tokens)
    model = trainer._Run(_cfg(BALANCED)).model
    balance = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    for r in range(WORLD_SIZE):
        model.zero_grad()
        model(_rank_share(batches[BALANCED], r)).load_balancing_loss.backward()
        for n, p in model.named_parameters():
            if p.grad is not None:
                balance[n] += p.grad / WORLD_SIZE
    assert max(float(g.abs().max()) for g in balance.values()) > 1e-3  # not vacuous
    for rank in ranks:
        for n, g in rank["load_balancing"]["grads"].items():
            torch.testing.assert_close(g, single[BALANCED]["grads"][n] + LB_COEF * balance[n],
                                       rtol=TOL, atol=TOL, msg=lambda m, p=n: f"{p}: {m}")


def test_batch_normalized_advantages_need_every_ranks_rewards(updates):
    # ppo normalizes over the whole step: a rank normalizing its own share would differ
    from tokenmdp import estimators

    _, _, batches = updates
    est = estimators.get("ppo")
    share = _rank_share(batches["ppo"], 0)
    local = estimators.prepare(share, est).advantage
    whole = estimators.prepare(batches["ppo"], est)
    by_sequence = whole.sequence_sum(whole.advantage) / whole.length
    assert not torch.allclose(share.sequence_sum(local) / share.length,
                              by_sequence[torch.isin(batches["ppo"].group, torch.tensor([0, 1]))])


def test_data_parallel_configurations_are_checked():
    with pytest.raises(ValueError, match="prompts_per_step"):
        check_config(dataclasses.replace(CFG, prompts_per_step=3), world_size=2)
    with pytest.raises(ValueError, match="minibatches"):
        check_config(dataclasses.replace(CFG, minibatches=9), world_size=2)
    check_config(dataclasses.replace(CFG, minibatches=8), world_size=2)


def _torchrun(out_dir, *extra: str) -> subprocess.CompletedProcess:
    args = [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={WORLD_SIZE}", "-m", "tokenmdp.rl.trainer", "--mode", "rl",
            "--task", "count", "--estimator", "minirl", "--replay", "r3", "--minibatches", "2",
            "--rollout-precision", "bf16", "--prompts-per-step", "4", "--group-size", "4",
            "--d-model", "32", "--n-layers", "1", "--expert-hidden", "16", "--eval-size", "6",
            "--eval-every", "1", "--out-dir", str(out_dir), *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(args, capture_output=True, text=True, timeout=TORCHRUN_TIMEOUT_S,
                          env=env)


def test_torchrun_runs_checkpoints_and_resumes(tmp_path):
    done = _torchrun(tmp_path, "--steps", "2")
    assert done.returncode == 0, done.stderr[-4000:]
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [0, 1]  # rank 0 alone writes
    for r in rows:
        assert all(math.isfinite(v) for v in r.values() if isinstance(v, float)), r
        assert r["tokens"] > 0 and 0 <= r["eval_accuracy"] <= 1
    state = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    assert len(state["rng"]) == WORLD_SIZE and state["step"] == 2
    # the ranks sample with their own seeds: their generator states differ
    assert not torch.equal(state["rng"][0]["sample_gen"], state["rng"][1]["sample_gen"])
    done = _torchrun(tmp_path, "--steps", "3", "--resume")
    assert done.returncode == 0, done.stderr[-4000:]
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [0, 1, 2]
