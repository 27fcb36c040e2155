"""The long-answer study's sizes and runs: the configurations, the grid of runs, their training
configurations, the SFT start and the pool that runs them (``long_study.py`` is the entry point;
its docstring describes the study)."""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from replay_study import run_all as _run_all  # noqa: E402

MODEL_CPU = dict(d_model=64, n_layers=2, n_heads=4, n_experts=4, top_k=2, expert_hidden=64)
RECIPE = dict(warmup_steps=20, optimizer_state="reset", zero_variance_groups="skip")
"""Every RL run's start (issue 31; the guide *An RL recipe that does not start cold*): a 20-step
learning-rate warm-up, AdamW reset on purpose (SFT's moments are of another loss), groups of
equal rewards skipped (a step of zero advantages takes no update, so AdamW's moments cannot move
the weights). With the configurations' group sizes (``rl``), chosen from the SFT start's pass
rate (``benchmarks/rl_recipe.py`` measures it)."""
CONFIGS = {
    "cpu": dict(
        model=MODEL_CPU, device="cpu", precision="fp8", seeds=(0, 1, 2), workers=2,
        length=64, sigma=1.0, lengths=(16, 64), sigmas=(0.0, 1.0, 2.0), room_sigmas=(0.25, 1.0),
        room_steps=120, fresh_groups=2000,
        sft=dict(prompts_per_step=32, lr=1e-3, warmup_steps=50, target=0.5, check=10,
                 max_steps=1500),
        rl=dict(steps=80, prompts_per_step=2, group_size=16, lr=3e-4, eval_every=20,
                eval_size=100, **RECIPE)),
    "gpu": dict(
        model=dict(d_model=128, n_layers=4, n_heads=4, n_experts=8, top_k=2, expert_hidden=128),
        device="cuda", precision="fp8", seeds=(0, 1, 2), workers=12,
        length=64, sigma=1.0, lengths=(16, 32, 64, 128), sigmas=(0.0, 1.0, 2.0),
        room_sigmas=(0.25, 1.0), room_steps=150, fresh_groups=2000,
        sft=dict(prompts_per_step=128, lr=1e-3, warmup_steps=50, target=0.5, check=10,
                 max_steps=2000),
        rl=dict(steps=100, prompts_per_step=16, group_size=16, lr=3e-4, eval_every=25,
                eval_size=256, **RECIPE)),
    "quick": dict(
        model=dict(d_model=32, n_layers=2, n_heads=2, n_experts=4, top_k=2, expert_hidden=32),
        device="cpu", precision="fp8", seeds=(0,), workers=1,
        length=8, sigma=1.0, lengths=(8,), sigmas=(0.0, 1.0), room_sigmas=(0.25,), room_steps=2,
        fresh_groups=40,
        sft=dict(prompts_per_step=8, lr=1e-3, warmup_steps=2, target=0.3, check=4, max_steps=4),
        rl=dict(steps=2, prompts_per_step=4, group_size=2, lr=3e-4, eval_every=2, eval_size=8,
                **RECIPE)),
}
"""Sizes per configuration: model, device, engine precision, RL seeds, workers, the main grid's
length and dial, the phase diagram's lengths and dials, the room group's dials and steps, the
groups of the exact world's fresh-noise Monte Carlo, the SFT stage (until ``target`` held-out
accuracy) and the RL stage (shared by every run: :data:`RECIPE` and a group size where groups
with no right answer are rare. The SFT start passes about 0.53 of its samples at temperature 1
under the sigma = 0 engine and 0.20 under sigma = 1; a group of G has none right with chance
E_x (1 - p_x)^G = 0.42 at G = 4, 0.18 at G = 8 and 0.03 at G = 16 at sigma = 1 (0.05, 0.005 and
0.0003 at sigma = 0), so G = 16, with the 32 (cpu) or 256 (gpu) samples a step of G = 4 or 8
had; the gpu configuration's start, SFT to the same target, is not measured)."""

ON_POLICY = ("minirl", "minirl_no_is", "minirl_len_norm")
MINIBATCHES = (2, 4, 8)
REPLAYS = ("none", "r2", "r3")
PHASE_ESTIMATORS = ("minirl_no_is", "minirl")
ROOM_GROUP = "room (eval T=1)"
"""The group evaluated by sampling at temperature 1, where the start is far from 100%."""


def run_specs(args) -> list[dict]:
    """Every run: its name, table group, seed, length, dial, evaluation temperature (None: the
    trainer's default, near greedy), steps (None: the configuration's) and the fields that differ."""
    size, specs = args.size, []

    def add(name, group, label, length, sigma, estimator, n, replay, eval_t=None, steps=None):
        specs.extend({"name": name, "group": group, "label": label, "seed": seed,
                      "length": length, "sigma": sigma, "estimator": estimator,
                      "minibatches": n, "replay": replay, "eval_temperature": eval_t,
                      "steps": steps} for seed in args.seeds)

    L, sigma = size["length"], size["sigma"]
    for est in ON_POLICY:
        add(f"onpolicy_{est}", "on-policy (N=1)", est, L, sigma, est, 1, "none")
    if not args.no_room:
        for s in size["room_sigmas"]:
            for est in ON_POLICY:
                add(f"room_s{s:g}_{est}", ROOM_GROUP, f"{est} σ={s:g}", L, s, est, 1, "none",
                    eval_t=1.0, steps=size["room_steps"])
    for n in MINIBATCHES:
        for replay in REPLAYS:
            add(f"offpolicy_n{n}_{replay}", f"off-policy N={n}", f"minirl {replay}", L, sigma,
                "minirl", n, replay)
    if not args.no_phase:
        for length in size["lengths"]:
            for s in size["sigmas"]:
                for est in PHASE_ESTIMATORS:
                    if (length, s) == (L, sigma) and est in ON_POLICY:
                        continue  # the main grid's on-policy runs are this cell
                    add(f"phase_L{length}_s{s:g}_{est}", "phase", est, length, s, est, 1, "none")
    if args.only:
        unknown = set(args.only) - {s["name"] for s in specs}
        if unknown:
            raise SystemExit(f"--only: unknown run names {sorted(unknown)}")
        specs = [s for s in specs if s["name"] in args.only]
    return specs


def phase_cell(spec: dict, size: dict) -> str:
    """The run name whose results fill a phase-diagram cell (the main grid's when shared)."""
    if (spec["length"], spec["sigma"]) == (size["length"], size["sigma"]):
        return f"onpolicy_{spec['estimator']}"
    return f"phase_L{spec['length']}_s{spec['sigma']:g}_{spec['estimator']}"


def base_config(args, length: int, mode: str):
    """The settings every stage at ``length`` shares (task, engine, model, device)."""
    from tokenmdp.rl.config import TrainConfig

    size = args.size
    return TrainConfig(mode=mode, task=f"running_sum_{length}", max_new_tokens=length + 2,
                       rollout_precision=size["precision"], device=size["device"],
                       eval_size=size["rl"]["eval_size"], checkpoint_every=0,
                       deterministic=size["device"] == "cpu", **size["model"])


def rl_config(args, spec: dict, init: str):
    """The training configuration of one run of :func:`run_specs`, from the SFT checkpoint."""
    rl = {**args.size["rl"]}
    if spec.get("steps"):
        rl["steps"] = spec["steps"]
    if args.steps:
        rl["steps"] = args.steps
    extra = {} if spec.get("eval_temperature") is None else {
        "eval_temperature": spec["eval_temperature"]}
    return dataclasses.replace(
        base_config(args, spec["length"], "rl"), estimator=spec["estimator"],
        replay=spec["replay"], minibatches=spec["minibatches"], init=init, seed=spec["seed"],
        rollout_logit_noise=spec["sigma"], overwrite=True,
        out_dir=str(Path(args.out) / "runs" / f"{spec['name']}_s{spec['seed']}"), **rl, **extra)


def train_sft(args, length: int) -> dict:
    """SFT on ``running_sum_<length>`` in chunks of ``check`` steps (exact resume) until the
    held-out accuracy *sampled at temperature 1* (the RL runs' split and sampling temperature;
    the engine without the dial) reaches ``target``: the RL runs then get rewards to learn from.
    A finished SFT of the same settings in the output folder (``sft.json``) is reused: on the
    CPU with deterministic algorithms it is the same checkpoint."""
    from tokenmdp.rl.trainer import train

    sft = dict(args.size["sft"])
    target, check, max_steps = sft.pop("target"), sft.pop("check"), sft.pop("max_steps")
    cfg = dataclasses.replace(base_config(args, length, "sft"), eval_every=check, seed=0,
                              eval_temperature=1.0, out_dir=str(Path(args.out) / f"sft_L{length}"),
                              **sft)
    record = Path(cfg.out_dir) / "sft.json"
    settings = {"config": dataclasses.asdict(cfg), "target": target, "max_steps": max_steps}
    if record.exists() and (Path(cfg.out_dir) / "checkpoint.pt").exists():
        done = json.loads(record.read_text())
        if done.get("settings") == json.loads(json.dumps(settings)):
            print(f"  SFT L={length}: reused {cfg.out_dir} ({done['result']['steps']} steps, "
                  f"accuracy at T = 1 {done['result']['accuracy']:.3f})", flush=True)
            return done["result"]
    t0, rows = time.perf_counter(), []
    for end in range(check, max_steps + check, check):
        rows += train(dataclasses.replace(cfg, steps=min(end, max_steps), resume=bool(rows),
                                          overwrite=not rows))
        if rows[-1]["eval_accuracy"] >= target or end >= max_steps:
            break
    acc = rows[-1]["eval_accuracy"]
    print(f"  SFT L={length}: {len(rows)} steps, {time.perf_counter() - t0:.0f} s, held-out "
          f"accuracy sampled at T = 1 {acc:.3f}", flush=True)
    result = {"checkpoint": str(Path(cfg.out_dir) / "checkpoint.pt"), "accuracy": acc,
              "steps": len(rows), "seconds": time.perf_counter() - t0}
    record.write_text(json.dumps({"settings": settings, "result": result}, indent=2))
    return result


def engine_accuracy(cfg, checkpoint: str) -> float:
    """Held-out accuracy of the model in ``checkpoint`` by the engine of ``cfg`` (its precision
    and its dial, as the RL run's own evaluations, at its evaluation temperature): the start that
    run's Δ acc is measured from. The trainer's evaluation, step 0 (split, temperature,
    generator seed ``eval_seed``)."""
    import torch

    from tokenmdp.rl.run_setup import build_engine, build_model
    from tokenmdp.rl.tasks import get_task

    task = get_task(cfg.task)
    model = build_model(cfg, task.tokenizer.vocab_size)
    model.load_state_dict(torch.load(checkpoint, map_location=cfg.device,
                                     weights_only=True)["model"])
    engine = build_engine(cfg, model)
    eval_set = task.eval_split(cfg.eval_size, cfg.eval_seed)
    with torch.no_grad():
        batch = engine.generate([task.tokenizer.encode(ex.prompt) for ex in eval_set],
                                max_new_tokens=cfg.max_new_tokens, eos_id=task.tokenizer.EOS,
                                generator=torch.Generator(device=cfg.device).manual_seed(
                                    cfg.eval_seed), temperature=cfg.eval_temperature)
    return float(np.mean([task.is_correct(ex, r) for ex, (_, r) in
                          zip(eval_set, batch.sequences())]))


def run_all(cfgs: list, workers: int, specs: list[dict]) -> list[dict]:
    """Every run in a pool of ``workers`` spawned processes (``replay_study.run_all``)."""
    return _run_all(cfgs, workers, specs, width=30)
