"""The trainer's optimizer choice (``optimizer``: adamw or sgd), checked against the update rules.

SGD without momentum's history and without clipping moves the weights by ``lr`` times the
gradient, so the step's Euclidean length is ``lr`` times the gradient norm the trainer logs
(clip_grad_norm_'s total norm, taken before any clipping); a fresh AdamW's first step moves every
coordinate with a gradient by ``lr`` (``m̂ / √v̂ = sign g``), whatever the gradient's scale. The
length-normalization control of the long-answer study rests on that difference: a loss whose
gradient is 1/|y| as large takes a step 1/|y| as long under SGD and the same step under AdamW.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from tests.rl._cli import TINY_ARGS, one_line_error, run_cli
from tests.rl.test_rl_recipe import ADAM_RTOL, TINY, _rl, _state, make_sft
from tokenmdp.rl import trainer
from tokenmdp.rl.config import TrainConfig, check_config
from tokenmdp.rl.run_setup import build_optimizer
from tokenmdp.rl.trainer import train

#: float32 weights: |θ1 − θ0| against lr · |g| (a sum of squares over every parameter)
SGD_RTOL = 1e-4


@pytest.fixture(scope="module")
def sft(tmp_path_factory):
    """An SFT checkpoint on ``count`` (AdamW moments)."""
    return make_sft(tmp_path_factory.mktemp("sft"), tasks=("count",))


def _move(before: dict, after: dict) -> tuple[float, float]:
    """Euclidean length and largest coordinate of the move between two state dicts."""
    sq, largest = 0.0, 0.0
    for key in before:
        d = (after[key].double() - before[key].double())
        sq += float((d ** 2).sum())
        largest = max(largest, float(d.abs().max()))
    return math.sqrt(sq), largest


def test_sgd_steps_scale_with_the_loss_and_adamw_steps_do_not(sft, tmp_path):
    """One step of MiniRL and of length-normalized MiniRL from the same start, under plain SGD
    and under AdamW: SGD moves lr × |g| (so the length-normalized loss, whose gradient is about
    1/|y| of MiniRL's, moves that much less), AdamW moves each coordinate by lr (both alike)."""
    start = _state(sft["count"])["model"]
    moves = {}
    for est in ("minirl", "minirl_len_norm"):
        for opt in ("sgd", "adamw"):
            cfg = dataclasses.replace(_rl(sft, tmp_path, f"{est}_{opt}", optimizer=opt,
                                          grad_clip=0.0, lr=1e-3,
                                          **({"beta1": 0.0} if opt == "sgd" else {})),
                                      estimator=est)
            norm = train(cfg)[0]["grad_norm"]
            length, largest = _move(start, _state(tmp_path / f"{est}_{opt}" / "checkpoint.pt")
                                    ["model"])
            moves[est, opt] = (length, largest, norm)
    for est in ("minirl", "minirl_len_norm"):
        length, _, norm = moves[est, "sgd"]
        assert norm > 0 and length == pytest.approx(1e-3 * norm, rel=SGD_RTOL)
        assert moves[est, "adamw"][1] == pytest.approx(1e-3, rel=ADAM_RTOL)
    ratio = moves["minirl_len_norm", "sgd"][0] / moves["minirl", "sgd"][0]
    assert ratio < 0.5     # responses of up to 6 tokens: the 1/|y| scale shows under SGD


def test_sgd_momentum_first_step_and_its_state(sft, tmp_path):
    cfg = _rl(sft, tmp_path, "mom", optimizer="sgd", beta1=0.9, grad_clip=0.0, lr=1e-3)
    run = trainer._Run(cfg)
    assert isinstance(run.optimizer, torch.optim.SGD)
    group = run.optimizer.param_groups[0]
    assert (group["momentum"], group["lr"], group["weight_decay"]) == (0.9, 1e-3, 0.0)
    row = train(cfg)[0]
    state = _state(tmp_path / "mom" / "checkpoint.pt")
    length, _ = _move(_state(sft["count"])["model"], state["model"])
    assert length == pytest.approx(1e-3 * row["grad_norm"], rel=SGD_RTOL)  # buffer = g at first
    buffers = state["optimizer"]["state"]
    assert buffers and all(set(e) == {"momentum_buffer"} for e in buffers.values())


def test_carry_moves_sgd_momentum_and_refuses_another_optimizers_state(sft, tmp_path):
    sgd_sft = tmp_path / "sgd_sft"
    train(TrainConfig(mode="sft", task="count", steps=2, lr=1e-2, optimizer="sgd",
                      out_dir=str(sgd_sft), **TINY))
    saved = _state(sgd_sft / "checkpoint.pt")["optimizer"]["state"]
    cfg = dataclasses.replace(_rl(sft, tmp_path, "carry_sgd", optimizer="sgd",
                                  optimizer_state="carry"), init=str(sgd_sft / "checkpoint.pt"))
    state = trainer._Run(cfg).optimizer.state_dict()["state"]
    assert state.keys() == saved.keys() and state
    assert all(torch.equal(state[i]["momentum_buffer"], saved[i]["momentum_buffer"])
               for i in state)
    adamw_init = _rl(sft, tmp_path, "carry_bad", optimizer="sgd", optimizer_state="carry")
    with pytest.raises(ValueError, match=r"^optimizer_state: .* trained with adamw, this run "
                                         r"uses sgd; carry needs the same optimizer"):
        trainer._Run(adamw_init)          # the SFT checkpoint holds AdamW's moments
    plain_init = dataclasses.replace(adamw_init, optimizer="adamw", init=str(
        _plain_sgd_sft(tmp_path)))
    with pytest.raises(ValueError, match=r"trained with sgd, this run uses adamw"):
        trainer._Run(plain_init)          # plain SGD keeps no state: refused by its config


def _plain_sgd_sft(tmp_path):
    out = tmp_path / "plain_sgd_sft"
    train(TrainConfig(mode="sft", task="count", steps=1, lr=1e-2, optimizer="sgd", beta1=0.0,
                      out_dir=str(out), **TINY))
    assert _state(out / "checkpoint.pt")["optimizer"]["state"] == {}
    return out / "checkpoint.pt"


def test_resume_refuses_another_optimizer(sft, tmp_path):
    cfg = _rl(sft, tmp_path, "resume", optimizer="sgd", steps=1)
    train(cfg)
    with pytest.raises(ValueError, match=r"^resume: .* trained with optimizer sgd, this run has "
                                         r"adamw; resume with the same optimizer"):
        train(dataclasses.replace(cfg, optimizer="adamw", steps=2, resume=True))
    assert train(dataclasses.replace(cfg, steps=2, resume=True))[-1]["step"] == 1


def test_build_optimizer_and_bad_names():
    params = [torch.nn.Parameter(torch.zeros(3))]
    assert isinstance(build_optimizer(TrainConfig(), params), torch.optim.AdamW)
    assert isinstance(build_optimizer(TrainConfig(optimizer="sgd"), params), torch.optim.SGD)
    with pytest.raises(ValueError, match="^optimizer: expected one of adamw, sgd"):
        check_config(TrainConfig(optimizer="adam"))
    line = one_line_error(run_cli("train", *TINY_ARGS, "--optimizer", "adam"))
    assert "optimizer" in line and "adam" in line
