"""`tokenmdp sft` and `tokenmdp train`: options generated from TrainConfig, SFT → RL by --init."""

import argparse
import dataclasses
import json

import pytest

from tokenmdp.rl.cli_commands import add_trainer_commands
from tokenmdp.rl.config import TrainConfig, field_docs
from tokenmdp.rl.options import config_from_args

SMALL = ["--n-layers", "1", "--prompts-per-step", "2", "--group-size", "2", "--eval-size", "2",
         "--max-new-tokens", "4", "--steps", "2"]


def _parser():
    parser = argparse.ArgumentParser(prog="tokenmdp")
    add_trainer_commands(parser.add_subparsers(dest="command", required=True))
    return parser


def test_every_field_has_a_docstring_and_an_option():
    docs = field_docs()
    fields = [f.name for f in dataclasses.fields(TrainConfig)]
    assert set(docs) == set(fields) and all(docs.values())
    help_text = _parser()._subparsers._group_actions[0].choices["train"].format_help()
    for name in fields:
        if name != "mode":
            assert "--" + name.replace("_", "-") in help_text, name
    assert "Mini-batch updates per step" in help_text


def test_options_parse_into_the_config():
    args = _parser().parse_args(["train", "--task", "addition", "--estimator", "minirl",
                                 "--replay", "r3", "--minibatches", "4",
                                 "--rollout-precision", "bf16", "--device", "cpu",
                                 "--kl-coef", "0.1", "--no-deterministic", "--dense"])
    cfg = config_from_args(args, args.trainer_mode)
    assert (cfg.mode, cfg.estimator, cfg.replay, cfg.minibatches, cfg.rollout_precision,
            cfg.kl_coef, cfg.deterministic, cfg.dense) == ("rl", "minirl", "r3", 4, "bf16",
                                                            0.1, False, True)
    assert cfg.lr == TrainConfig.lr and cfg.init is None
    sft = _parser().parse_args(["sft"])
    assert config_from_args(sft, sft.trainer_mode).out_dir == "runs/sft"


def test_sft_then_train_from_its_checkpoint(tmp_path, capsys):
    parser = _parser()
    args = parser.parse_args(["sft", *SMALL, "--out-dir", str(tmp_path / "sft")])
    assert args.func(args) == 0
    args = parser.parse_args(["train", *SMALL, "--out-dir", str(tmp_path / "rl"), "--init",
                              str(tmp_path / "sft" / "checkpoint.pt"), "--replay", "r3"])
    assert args.func(args) == 0
    assert "rl: 2 steps" in capsys.readouterr().out
    rows = [json.loads(line) for line in open(tmp_path / "rl" / "metrics.jsonl")]
    assert len(rows) == 2 and "reward" in rows[0]


def test_bad_options_fail_with_a_clear_message(tmp_path):
    args = _parser().parse_args(["train", "--replay", "r3", "--dense", "--out-dir",
                                 str(tmp_path)])
    with pytest.raises(ValueError, match="dense"):
        args.func(args)
