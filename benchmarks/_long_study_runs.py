"""The long-answer study's sizes and runs: the engines (mismatch arms), the configurations, the
grid of runs, their training configurations, the SFT starts and the pool that runs them
(``long_study.py`` is the entry point; its docstring describes the study)."""

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

ARMS = {
    "fixed": dict(precision="fp8", mode="fixed", scale=0.3, fraction=1.0),
    "heavy": dict(precision="fp8", mode="heavy", scale=4.0, fraction=0.0007),
    "growing": dict(precision="fp8", mode="growing", scale=0.06, fraction=1.0),
    "fp4": dict(precision="fp4", mode="none", scale=0.0, fraction=1.0),
}
"""The engines of the study (:class:`tokenmdp.exact.EngineMismatch` on top of the engine's
precision; pattern seed 0, the same engine in every run). The three logit modes on an fp8 engine
are set to the same per-token ``KL(μ ‖ π_old)`` at the SFT start of ``running_sum_64``, about
1.3e-3 (measured, 512 held-out prompts at T = 1, docs: *Benchmarks* › *Long answers*): ``fixed``
σ = 0.3 (1.28e-3), ``heavy`` ±4 on 0.07% of the (context, token) pairs (1.26e-3: rare large
deviations), ``growing`` σ = 0.06 (1.24e-3, grows as the logits sharpen); fp8 alone gives
1.5e-4. ``fp4`` has no logit perturbation: the mismatch of an fp4-weight engine's numerics and
the routing they move (3.6e-3, with a χ² of 0.10: heavy-tailed), for the R2/R3 question."""

ON_POLICY = ("minirl", "minirl_no_is", "minirl_len_norm", "minirl_seq_tis")
MINIBATCHES = (2, 4, 8)
SGD_LR = 5e-4
"""Plain SGD's learning rate in the ``optimizer`` control: the largest of its sweep over MiniRL
(40 steps, seeds 0–2) at which no seed collapsed (1e-3 collapsed two of three; docs,
*Benchmarks* › *Long answers*)."""
REPLAYS = ("none", "r2", "r3")
GROUPS = ("onpolicy", "sweep", "offpolicy", "routing", "coldstart", "lengths")
"""The groups of runs, in the order of priority in which the study runs them (``--groups``)."""
CONTROLS = ("optimizer", "convergence")
"""Control groups, run only when named (``--groups optimizer convergence``): ``optimizer``,
length normalization under plain SGD (no momentum, no clip: the update is lr × the gradient)
beside MiniRL, at the same learning rate (the 1/|y| scale and the direction) and at it times
the answer's tokens (the direction alone), after an SGD learning-rate sweep of MiniRL;
``convergence``, the cold starts at four times the steps (do the starts end comparable?)."""

CONFIGS = {
    "cpu": dict(
        model=MODEL_CPU, device="cpu", precision="fp8", seeds=(0, 1, 2, 3, 4),
        collapse_seeds=tuple(range(10)), sweep_seeds=(0, 1, 2), workers=2,
        length=64, lengths=(16, 128), onpolicy_arms=("heavy", "growing", "fixed"),
        lengths_arm="heavy", offpolicy_arm="fixed", routing_arm="fp4", routing_minibatches=4,
        coldstart_arm="heavy", coldstart_targets=(0.15, 0.3, 0.5),
        sweep=dict(minibatches=(2, 4), lr_clip=((3e-4, 1.0), (1e-4, 1.0), (3e-5, 1.0),
                                                (1e-4, 0.1))),
        optimizer_control=dict(arm="heavy", lr=SGD_LR, steps=120,
                               sweep_lrs=(3e-5, 1e-4, 3e-4, 5e-4, 1e-3, 3e-3, 1e-2), sweep_steps=40),
        convergence=dict(steps=160, seeds=(0, 1, 2, 3, 4)),
        long=dict(length=128, steps=30, eval_size=50),
        sft=dict(prompts_per_step=32, lr=1e-3, warmup_steps=50, target=0.5, check=10,
                 max_steps=1500),
        rl=dict(steps=80, prompts_per_step=2, group_size=16, lr=3e-4, eval_every=20,
                eval_size=100, **RECIPE),
        rl_study=dict(steps=40, lr=1e-4, grad_clip=1.0, eval_every=10, eval_temperature=1.0)),
    "gpu": dict(
        model=dict(d_model=128, n_layers=4, n_heads=4, n_experts=8, top_k=2, expert_hidden=128),
        device="cuda", precision="fp8", seeds=(0, 1, 2, 3, 4), collapse_seeds=tuple(range(10)),
        sweep_seeds=(0, 1, 2), workers=12, length=64, lengths=(16, 128),
        onpolicy_arms=("heavy", "growing", "fixed"), lengths_arm="heavy", offpolicy_arm="fixed",
        routing_arm="fp4", routing_minibatches=4, coldstart_arm="heavy",
        coldstart_targets=(0.15, 0.3, 0.5),
        sweep=dict(minibatches=(2, 4), lr_clip=((3e-4, 1.0), (1e-4, 1.0), (3e-5, 1.0),
                                                (1e-4, 0.1))),
        optimizer_control=dict(arm="heavy", lr=SGD_LR, steps=300,
                               sweep_lrs=(1e-4, 3e-4, 5e-4, 1e-3, 3e-3), sweep_steps=100),
        convergence=dict(steps=400, seeds=(0, 1, 2, 3, 4)),
        long=dict(length=128, steps=100, eval_size=256),
        sft=dict(prompts_per_step=128, lr=1e-3, warmup_steps=50, target=0.5, check=10,
                 max_steps=2000),
        rl=dict(steps=100, prompts_per_step=16, group_size=16, lr=3e-4, eval_every=25,
                eval_size=256, **RECIPE),
        rl_study=dict(steps=100, lr=1e-4, grad_clip=1.0, eval_every=25, eval_temperature=1.0)),
    "quick": dict(
        model=dict(d_model=32, n_layers=2, n_heads=2, n_experts=4, top_k=2, expert_hidden=32),
        device="cpu", precision="fp8", seeds=(0,), collapse_seeds=(0,), sweep_seeds=(0,),
        workers=1, length=8, lengths=(16,), onpolicy_arms=("heavy",), lengths_arm="heavy",
        offpolicy_arm="fixed", routing_arm="fp4", routing_minibatches=2, coldstart_arm="heavy",
        coldstart_targets=(0.05, 0.3),
        sweep=dict(minibatches=(2,), lr_clip=((1e-4, 1.0),)),
        optimizer_control=dict(arm="heavy", lr=SGD_LR, steps=2, sweep_lrs=(1e-3,), sweep_steps=2),
        convergence=dict(steps=3, seeds=(0,)),
        long=dict(length=16, steps=2, eval_size=8),
        sft=dict(prompts_per_step=8, lr=1e-3, warmup_steps=2, target=0.3, check=4, max_steps=4),
        rl=dict(steps=2, prompts_per_step=4, group_size=2, lr=3e-4, eval_every=2, eval_size=8,
                **RECIPE),
        rl_study=dict(steps=2, lr=1e-4, grad_clip=1.0, eval_every=2, eval_temperature=1.0)),
}
"""Sizes per configuration: model, device, the engines' precision (``engine_mismatch.py`` and
``rl_recipe.py`` read it), RL seeds (``collapse_seeds`` where the claim is a collapse rate,
``sweep_seeds`` for the learning-rate and clip sweep), the main length and the other lengths
(``long``: the longest, with fewer steps and a smaller evaluation), the arm of :data:`ARMS` per
group, the cold-start group's SFT targets, the controls' sizes (``optimizer_control``: engine, SGD
rate, steps and the rates of its sweep; ``convergence``: steps and seeds), the SFT stage (until
``target`` held-out accuracy at T = 1) and the RL stage shared by every run: ``rl``
(:data:`RECIPE`, G = 16: at the start's pass rate about 0.5 a group with no right answer has chance
about 1e-4; ``rl_recipe.py`` runs ``rl`` as it is) with the study's ``rl_study`` on top (evaluated
at T = 1, where the start is about 0.5, so a run can gain or lose; ``lr`` and ``grad_clip`` the
sweep's choice, docs: the sweep's table). The gpu configuration is sized by estimate, not measured."""


def run_specs(args) -> list[dict]:
    """Every run: its name, group, label, seed, length, arm, estimator, N, replay, learning rate,
    gradient clip, SFT target of its start, steps and evaluation size (None: the configuration's)."""
    size, rl, specs = args.size, {**args.size["rl"], **args.size["rl_study"]}, []
    groups = args.groups or (GROUPS + CONTROLS if args.only else GROUPS)

    def add(name, group, label, arm, estimator, n=1, replay="none", *, length=None, lr=None,
            clip=None, target=None, seeds=None, steps=None, eval_size=None, optimizer="adamw"):
        specs.extend({"name": name, "group": group, "label": label, "seed": seed,
                      "length": length or size["length"], "arm": arm, "estimator": estimator,
                      "minibatches": n, "replay": replay, "lr": lr or rl["lr"],
                      "grad_clip": rl["grad_clip"] if clip is None else clip,
                      "target": target or size["sft"]["target"], "steps": steps,
                      "eval_size": eval_size, "optimizer": optimizer}
                     for seed in (seeds or args.seeds))

    for group in groups:
        if group == "onpolicy":
            for arm in size["onpolicy_arms"]:
                for est in ON_POLICY:
                    add(f"onpolicy_{arm}_{est}", f"on-policy {arm}", est, arm, est)
        elif group == "sweep":
            for n in size["sweep"]["minibatches"]:
                for lr, clip in size["sweep"]["lr_clip"]:
                    add(f"sweep_n{n}_lr{lr:g}_clip{clip:g}", "sweep", f"N={n} lr {lr:g} clip "
                        f"{clip:g}", size["offpolicy_arm"], "minirl", n, lr=lr, clip=clip,
                        seeds=size["sweep_seeds"])
        elif group == "offpolicy":
            for n in MINIBATCHES:
                for replay in REPLAYS:
                    add(f"offpolicy_n{n}_{replay}", f"off-policy N={n}", f"minirl {replay}",
                        size["offpolicy_arm"], "minirl", n, replay)
        elif group == "routing":
            for replay in REPLAYS:
                n = size["routing_minibatches"]
                add(f"routing_n{n}_{replay}", f"routing {size['routing_arm']} N={n}",
                    f"minirl {replay}", size["routing_arm"], "minirl", n, replay)
        elif group == "coldstart":
            for target in size["coldstart_targets"]:
                add(f"coldstart_t{target:g}", "cold start", f"SFT to {target:g}",
                    size["coldstart_arm"], "minirl", target=target, seeds=size["collapse_seeds"])
        elif group == "lengths":
            long = size["long"]
            for length in size["lengths"]:
                extra = (dict(steps=long["steps"], eval_size=long["eval_size"])
                         if length == long["length"] else {})
                for est in ON_POLICY:
                    add(f"length{length}_{est}", f"on-policy L={length}", est,
                        size["lengths_arm"], est, length=length, **extra)
        elif group == "optimizer":
            oc, tokens = size["optimizer_control"], size["length"] + 1   # digits and EOS
            for lr in oc["sweep_lrs"]:
                add(f"optimizer_sweep_lr{lr:g}", "optimizer sweep", f"sgd minirl lr {lr:g}",
                    oc["arm"], "minirl", lr=lr, clip=0.0, seeds=size["sweep_seeds"],
                    steps=oc["sweep_steps"], optimizer="sgd")
            for est, lr in (("minirl", oc["lr"]), ("minirl_len_norm", oc["lr"]),
                            ("minirl_len_norm", oc["lr"] * tokens)):
                scaled = "" if lr == oc["lr"] else f"_x{tokens}"
                add(f"optimizer_sgd_{est}{scaled}", "optimizer: sgd", f"sgd {est} lr {lr:g}",
                    oc["arm"], est, lr=lr, clip=0.0, steps=oc["steps"], optimizer="sgd")
        elif group == "convergence":
            conv = size["convergence"]
            for target in size["coldstart_targets"]:
                add(f"convergence_t{target:g}", f"cold start, {conv['steps']} steps",
                    f"SFT to {target:g}", size["coldstart_arm"], "minirl", target=target,
                    seeds=conv["seeds"], steps=conv["steps"])
        else:
            raise SystemExit(f"--groups: unknown group {group!r} (one of "
                             f"{', '.join(GROUPS + CONTROLS)})")
    if args.only:
        unknown = set(args.only) - {s["name"] for s in specs}
        if unknown:
            raise SystemExit(f"--only: unknown run names {sorted(unknown)}")
        specs = [s for s in specs if s["name"] in args.only]
    return specs


def sft_starts(specs: list[dict]) -> list[tuple[int, float]]:
    """The SFT starts the runs need: (length, target) pairs."""
    return sorted({(s["length"], s["target"]) for s in specs})


def base_config(args, length: int, mode: str):
    """The settings every stage at ``length`` shares (task, engine precision, model, device)."""
    from tokenmdp.rl.config import TrainConfig

    size = args.size
    return TrainConfig(mode=mode, task=f"running_sum_{length}", max_new_tokens=length + 2,
                       rollout_precision=size["precision"], device=size["device"],
                       eval_size=size["rl"]["eval_size"], checkpoint_every=0,
                       deterministic=size["device"] == "cpu", **size["model"])


def arm_fields(arm: str) -> dict:
    """The :class:`~tokenmdp.rl.config.TrainConfig` fields of an engine of :data:`ARMS`."""
    a = ARMS[arm]
    return dict(rollout_precision=a["precision"], rollout_mismatch=a["mode"],
                rollout_mismatch_scale=a["scale"], rollout_mismatch_fraction=a["fraction"],
                rollout_mismatch_seed=0)


def rl_config(args, spec: dict, init: str):
    """The training configuration of one run of :func:`run_specs`, from the SFT checkpoint."""
    rl = {**args.size["rl"], **args.size["rl_study"], "lr": spec["lr"],
          "grad_clip": spec["grad_clip"], "optimizer": spec.get("optimizer", "adamw")}
    if rl["optimizer"] == "sgd":
        rl["beta1"] = 0.0                 # plain SGD: no momentum
    for key in ("steps", "eval_size"):
        if spec.get(key):
            rl[key] = spec[key]
    if args.steps:
        rl["steps"] = args.steps
    return dataclasses.replace(
        base_config(args, spec["length"], "rl"), estimator=spec["estimator"],
        replay=spec["replay"], minibatches=spec["minibatches"], init=init, seed=spec["seed"],
        overwrite=True, out_dir=str(Path(args.out) / "runs" / f"{spec['name']}_s{spec['seed']}"),
        **arm_fields(spec["arm"]), **rl)


def train_sft(args, length: int, target: float | None = None) -> dict:
    """SFT on ``running_sum_<length>`` in chunks of ``check`` steps (exact resume) until the
    held-out accuracy *sampled at temperature 1* (the RL runs' split and sampling temperature;
    the fp8 engine without a mismatch mode) reaches ``target`` (default: the configuration's):
    the RL runs then get rewards to learn from. A finished SFT of the same settings in the output
    folder (``sft.json``) is reused: on the CPU with deterministic algorithms it is the same
    checkpoint."""
    from tokenmdp.rl.trainer import train

    sft = dict(args.size["sft"])
    default, check, max_steps = sft.pop("target"), sft.pop("check"), sft.pop("max_steps")
    target = default if target is None else target
    folder = f"sft_L{length}" + ("" if target == default else f"_t{target:g}")
    cfg = dataclasses.replace(base_config(args, length, "sft"), eval_every=check, seed=0,
                              eval_temperature=1.0, out_dir=str(Path(args.out) / folder), **sft)
    record = Path(cfg.out_dir) / "sft.json"
    settings = {"config": dataclasses.asdict(cfg), "target": target, "max_steps": max_steps}
    if record.exists() and (Path(cfg.out_dir) / "checkpoint.pt").exists():
        done = json.loads(record.read_text())
        if done.get("settings") == json.loads(json.dumps(settings)):
            print(f"  SFT L={length} to {target:g}: reused {cfg.out_dir} "
                  f"({done['result']['steps']} steps, accuracy at T = 1 "
                  f"{done['result']['accuracy']:.3f})", flush=True)
            return done["result"]
    t0, rows = time.perf_counter(), []
    for end in range(check, max_steps + check, check):
        rows += train(dataclasses.replace(cfg, steps=min(end, max_steps), resume=bool(rows),
                                          overwrite=not rows))
        if rows[-1]["eval_accuracy"] >= target or end >= max_steps:
            break
    acc = rows[-1]["eval_accuracy"]
    print(f"  SFT L={length} to {target:g}: {len(rows)} steps, {time.perf_counter() - t0:.0f} s, "
          f"held-out accuracy sampled at T = 1 {acc:.3f}", flush=True)
    result = {"checkpoint": str(Path(cfg.out_dir) / "checkpoint.pt"), "accuracy": acc,
              "steps": len(rows), "seconds": time.perf_counter() - t0, "target": target}
    record.write_text(json.dumps({"settings": settings, "result": result}, indent=2))
    return result


def engine_accuracy(cfg, checkpoint: str, step: int = 0) -> float:
    """Held-out accuracy of the model in ``checkpoint`` by the engine of ``cfg`` (its precision
    and its mismatch mode, as the RL run's own evaluations, at its evaluation temperature): the
    start that run's Δ acc is measured from. The trainer's evaluation after ``step`` updates
    (split, temperature, generator seed ``eval_seed + step``): with a run's ``steps``,
    the start is sampled with the same random numbers as the run's final accuracy, so the
    sampling noise of the evaluation (at T = 1, 100 prompts: a standard deviation of 0.05 per
    draw) cancels from Δ acc as far as the two models agree."""
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
                                    cfg.eval_seed + step), temperature=cfg.eval_temperature)
    return float(np.mean([task.is_correct(ex, r) for ex, (_, r) in
                          zip(eval_set, batch.sequences())]))


def run_all(cfgs: list, workers: int, specs: list[dict]) -> list[dict]:
    """Every run in a pool of ``workers`` spawned processes (``replay_study.run_all``)."""
    return _run_all(cfgs, workers, specs, width=30)
