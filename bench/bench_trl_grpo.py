"""How fast is our GRPO step against TRL's GRPOTrainer on the same work, and at what memory?

Our GRPO step against TRL's ``GRPOTrainer``, side by side: wall time per step and peak RSS.

Both arms train the shipped tiny Qwen2.5-VL base (fp32, CPU) on the same synthetic counting
prompts with images, in the same order, with the same system prompt and chat template, group
size, prompts per step, completion length, temperature, learning rate, clipping and reward
(``format`` 0.2 + ``accuracy`` 1.0, our composite wrapped as a TRL reward function). One optimizer
step per generation batch on both sides:

=====================  ===============================  ====================================
setting                perceptrl (configs/vlm_clevr)    TRL GRPOConfig
=====================  ===============================  ====================================
batch per step         prompts_per_step x group_size    per_device_train_batch_size x
                                                        gradient_accumulation_steps
micro-batch            train.micro_batch_size           per_device_train_batch_size
loss normaliser        token-mean over the step         loss_type="dapo" (active tokens of
                                                        the accumulated batch)
advantage              (r - mean_g) / (std_g + eps)     scale_rewards="group"
clip                   0.2 / 0.28                       epsilon / epsilon_high
KL (``--kl``, 0)       kl_coef, k3 in the loss, a       beta (k3 in the loss, a reference
                       reference policy                 model)
epochs                 ppo_epochs 1, one minibatch      num_iterations 1
=====================  ===============================  ====================================

Each arm runs in its own process (so ``ru_maxrss`` is its own), started from a neutral working
directory so that ``import datasets`` is the Hugging Face library, with PYTHONPATH reduced to the
folder holding the ``perceptrl`` the driver imported (a checkout's code is what runs). The first
``--warmup`` steps are excluded from the timings.

    python bench/bench_trl_grpo.py [--steps 10] [--warmup 2] [--prompts 16] [--group 8]
    python bench/bench_trl_grpo.py --kl 0.04 --arms perceptrl,trl   # with a KL reference model

Writes bench/results/trl_vs_perceptrl_grpo.{json,md} (``--kl``: ``..._kl.{json,md}``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common import peak_rss_mb

FAMILIES = ["count_all", "count_color", "count_shape"]
REWARD = {"format": 0.2, "accuracy": 1.0}
GOAL_SPEEDUP = 2.0
"""issue 15's goal for the step (issue 13's was 1.5x)"""
ARMS = ("perceptrl", "trl", "perceptrl_scored", "perceptrl_noshare")
"""``perceptrl_scored``: our loop with the separate old-log-prob pass forced on every step (how
it ran before the behaviour log-probs were deferred), to show that change's share;
``perceptrl_noshare``: our loop with ``model.share_prefix=false`` (one forward over prompt +
completion per row, the G copies of a prompt recomputed), to show the shared prefix's share."""


def our_config(args):
    """The GRPO recipe with the benchmark's sizes (no dynamic sampling: TRL has none)."""
    share = args.arm != "perceptrl_noshare"
    from perceptrl.cli import CONFIGS
    from perceptrl.wiring import load_config

    return load_config(
        CONFIGS / "vlm_clevr.yaml",
        [
            f"model.path={args.base}", f"data.train={args.data}", "data.val=",
            "algo.dynamic_sampling=false", f"rollout.prompts_per_step={args.prompts}",
            f"rollout.group_size={args.group}", f"rollout.max_new_tokens={args.max_new_tokens}",
            f"train.micro_batch_size={args.micro}", f"train.seed={args.seed}", "train.device=cpu",
            "train.eval_every=0", "train.eval_samples=0", "train.steps=100000",
            "checkpoint.every=0", "log.tensorboard=false", "log.progress=false",
            f"model.share_prefix={str(share).lower()}", f"algo.kl_coef={args.kl}",
            "algo.kl_estimator=k3", "algo.kl_in_reward=false",
        ],
    )  # fmt: skip


def data_order(n: int, seed: int) -> list[int]:
    """The order in which our rollout source draws the first epoch (TRL gets the same)."""
    import numpy as np

    return [int(i) for i in np.random.default_rng([seed, 0]).permutation(n)]


# ------------------------------------------------------------------------------------ our arm


def run_perceptrl(args) -> dict:
    from perceptrl.trainer.runtime import seed_everything
    from perceptrl.vlm.builder import build_trainer as vlm_trainer

    cfg = our_config(args)
    trainer = vlm_trainer(cfg, Path(args.arm_dir))
    if args.arm == "perceptrl_scored":
        trainer.behaviour_source = lambda batch: "score"
    seed_everything(cfg.train.seed)
    rss_setup = peak_rss_mb()
    walls, cpus, rows = [], [], []
    for _ in range(args.warmup + args.steps):
        t, c = time.perf_counter(), time.process_time()
        m = trainer.train_step()
        walls.append(time.perf_counter() - t)
        cpus.append(time.process_time() - c)
        trainer.step += 1
        rows.append(m)
    timed = rows[args.warmup :]
    keys = ["rollout", "reward", "old_logp", "forward_backward", "optimizer"]
    per_step = {k: [r.get(f"time/{k}", 0.0) for r in timed] for k in keys}
    return {
        "step_s": walls[args.warmup :],
        "step_cpu_s": cpus[args.warmup :],
        "warmup_step_s": walls[: args.warmup],
        "breakdown_s": {k: statistics.mean(v) for k, v in per_step.items()},
        "breakdown_steps_s": per_step,
        "completion_len_mean": statistics.mean(r["rollout/completion_len_mean"] for r in timed),
        "reward_mean": statistics.mean(r["reward/mean"] for r in timed),
        "rss_after_setup_mb": rss_setup,
    }


# ------------------------------------------------------------------------------------ TRL arm


def composite_reward_fn():
    """Our ``format`` + ``accuracy`` composite as a TRL reward function; each row carries its
    sample as JSON in the ``sample`` column (TRL passes dataset columns as keyword lists)."""
    from perceptrl.rewards import build_reward

    composite = build_reward(REWARD, timeout_s=10.0)

    def perceptrl_format_accuracy(prompts, completions, sample, **_):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        totals, _, _ = composite(texts, [json.loads(s) for s in sample])
        return [float(t) for t in totals]

    return perceptrl_format_accuracy


def trl_dataset(samples: list[dict], system_prompt: str):
    """TRL's documented VLM form: conversational ``prompt`` plus an ``image`` column."""
    from datasets import Dataset, Image

    rows = {
        "prompt": [
            [
                {"role": "system", "content": system_prompt},
                {"role": "user", "content": s["question"]},
            ]
            for s in samples
        ],
        "image": [s["images"][0] for s in samples],
        "sample": [json.dumps(s) for s in samples],
    }
    return Dataset.from_dict(rows).cast_column("image", Image())


def check_same_prompt(processor, ds, samples, cfg) -> bool:
    """TRL's prompt ids (its message preparation + the processor's chat template) equal ours."""
    from trl.data_utils import prepare_multimodal_messages

    from perceptrl.vlm.prompts import PromptConfig, encode_prompt

    row = ds[0]
    msgs = prepare_multimodal_messages(row["prompt"], images=[row["image"]])
    theirs = processor.apply_chat_template(
        conversation=[msgs], add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"][0]
    ours = encode_prompt(
        processor, samples[0], PromptConfig(system_prompt=cfg.rollout.system_prompt)
    )
    return [int(x) for x in theirs] == ours.input_ids.tolist()


def run_trl(args) -> dict:
    import importlib

    import torch
    import trl
    from transformers import AutoProcessor, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from perceptrl.datasets.loader import load_samples

    datasets = importlib.import_module("datasets")  # Hugging Face's, not perceptrl/datasets
    if not hasattr(datasets, "Dataset"):
        raise RuntimeError(
            f"`import datasets` gave {getattr(datasets, '__path__', datasets)}, not Hugging Face "
            "datasets: run this arm from a directory without a datasets/ folder, PYTHONPATH unset"
        )
    cfg = our_config(args)
    samples = load_samples(args.data)[0]
    samples = [samples[i] for i in data_order(len(samples), args.seed)]
    ds = trl_dataset(samples, cfg.rollout.system_prompt)
    processor = AutoProcessor.from_pretrained(args.base)
    same_prompt = check_same_prompt(processor, ds, samples, cfg)
    batch = args.prompts * args.group
    if batch % args.micro:
        raise ValueError(f"prompts x group = {batch} is not a multiple of --micro {args.micro}")
    conf = GRPOConfig(
        output_dir=str(Path(args.arm_dir) / "out"),
        use_cpu=True, bf16=False, fp16=False, gradient_checkpointing=False,
        per_device_train_batch_size=args.micro, gradient_accumulation_steps=batch // args.micro,
        num_generations=args.group, max_completion_length=args.max_new_tokens,
        temperature=cfg.rollout.temperature, top_p=1.0, top_k=0,
        learning_rate=cfg.train.lr, lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=cfg.train.weight_decay, max_grad_norm=cfg.train.grad_clip,
        beta=args.kl, num_iterations=1, epsilon=cfg.algo.clip_low, epsilon_high=cfg.algo.clip_high,
        loss_type="dapo", scale_rewards="group", mask_truncated_completions=False,
        disable_dropout=True, shuffle_dataset=False, seed=args.seed,
        max_steps=args.warmup + args.steps, logging_steps=1, save_strategy="no",
        report_to="none", dataloader_num_workers=0, disable_tqdm=True,
        model_init_kwargs={"dtype": "float32"},
    )  # fmt: skip
    trainer = GRPOTrainer(
        model=str(args.base), reward_funcs=[composite_reward_fn()], args=conf,
        train_dataset=ds, processing_class=processor,
    )  # fmt: skip

    gen_s: list[float] = []
    inner = trainer._generate_and_score_completions

    def timed_generate(inputs):  # observation only: time TRL's rollout + reward + advantages
        t = time.perf_counter()
        out = inner(inputs)
        gen_s.append(time.perf_counter() - t)
        return out

    trainer._generate_and_score_completions = timed_generate

    class StepClock(TrainerCallback):
        def __init__(self):
            self.marks: list[tuple[float, float]] = []  # (wall, process CPU) at each step end
            self.logs: list[dict] = []

        def on_step_begin(self, a, state, control, **kw):
            if not self.marks:
                self.marks.append((time.perf_counter(), time.process_time()))

        def on_step_end(self, a, state, control, **kw):
            self.marks.append((time.perf_counter(), time.process_time()))

        def on_log(self, a, state, control, logs=None, **kw):
            self.logs.append(dict(logs or {}))

    clock = StepClock()
    trainer.add_callback(clock)
    rss_setup = peak_rss_mb()
    trainer.train()
    walls = [b[0] - a[0] for a, b in zip(clock.marks, clock.marks[1:])]
    cpus = [b[1] - a[1] for a, b in zip(clock.marks, clock.marks[1:])]
    logs = [r for r in clock.logs if "completions/mean_length" in r][args.warmup :]
    return {
        "step_s": walls[args.warmup :],
        "step_cpu_s": cpus[args.warmup :],
        "warmup_step_s": walls[: args.warmup],
        "breakdown_s": {
            "generate_and_score": statistics.mean(gen_s[args.warmup :]),
            "loss_backward_optimizer": statistics.mean(walls[args.warmup :])
            - statistics.mean(gen_s[args.warmup :]),
        },
        "breakdown_steps_s": {
            "generate_and_score": gen_s[args.warmup :],
            "loss_backward_optimizer": [w - g for w, g in zip(walls, gen_s)][args.warmup :],
        },
        "completion_len_mean": statistics.mean(r["completions/mean_length"] for r in logs),
        "reward_mean": statistics.mean(r["reward"] for r in logs),
        "rss_after_setup_mb": rss_setup,
        "prompt_ids_identical_to_ours": same_prompt,
        "versions": {"trl": trl.__version__, "datasets": datasets.__version__},
        "torch_threads": torch.get_num_threads(),
    }


# ------------------------------------------------------------------------------------ driver


def run_arm(args) -> None:
    import torch

    fn = run_trl if args.arm == "trl" else run_perceptrl
    out = fn(args)
    out["peak_rss_mb"] = peak_rss_mb()
    out.setdefault("torch_threads", torch.get_num_threads())
    Path(args.result).write_text(json.dumps(out, indent=1))


def spawn(arm: str, args, out: Path) -> dict:
    """One arm in a fresh process, cwd = the output dir, PYTHONPATH only the driver's
    ``perceptrl`` parent (never a folder with a ``datasets/`` in it)."""
    result = out / f"{arm}.json"
    arm_dir = out / arm
    arm_dir.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    import perceptrl

    parent = Path(perceptrl.__file__).resolve().parents[1]
    if (parent / "perceptrl").is_dir() and not (parent / "datasets").exists():
        env["PYTHONPATH"] = str(parent)
    threads = str(args.threads)
    env.update(OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads, HF_HUB_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false", HF_DATASETS_OFFLINE="1", CUDA_VISIBLE_DEVICES="")  # fmt: skip
    cmd = [sys.executable, str(Path(__file__).resolve()), "--arm", arm, "--result", str(result),
           "--arm-dir", str(arm_dir), "--data", str(args.data), "--base", str(args.base),
           "--steps", str(args.steps), "--warmup", str(args.warmup), "--prompts", str(args.prompts),
           "--group", str(args.group), "--micro", str(args.micro), "--seed", str(args.seed),
           "--max-new-tokens", str(args.max_new_tokens), "--kl", str(args.kl)]  # fmt: skip
    t, load = time.perf_counter(), os.getloadavg()[0]
    subprocess.run(cmd, check=True, env=env, cwd=out)
    r = json.loads(result.read_text())
    r["process_wall_s"] = time.perf_counter() - t
    r["loadavg_1min"] = [load, os.getloadavg()[0]]  # before / after: other work on the cores
    return r


def result_name(kl: float) -> str:
    return "trl_vs_perceptrl_grpo" + ("_kl" if kl > 0 else "")


def kl_text(beta: float) -> str:
    """The KL setting as the report states it for both sides."""
    if beta <= 0:
        return "`beta=0` (no reference model; ours `kl_coef` 0)"
    return (
        f"`beta={beta:g}` with a reference model (ours `algo.kl_coef={beta:g}`, k3 in the loss, "
        "a reference policy scored every step)"
    )


def median_breakdown(rs: list[dict]) -> dict[str, float]:
    """Per-phase medians over all timed steps (robust to a step slowed by other work); results
    written before per-step phases were kept give the means of the least disturbed run."""
    if all("breakdown_steps_s" in r for r in rs):
        keys = rs[0]["breakdown_steps_s"]
        return {
            k: statistics.median(x for r in rs for x in r["breakdown_steps_s"][k]) for k in keys
        }
    return min(rs, key=lambda r: statistics.median(r["step_s"]))["breakdown_s"]


def summarize(runs: dict[str, list[dict]]) -> dict:
    out = {}
    for arm, rs in runs.items():
        steps = [x for r in rs for x in r["step_s"]]
        cpu = [x for r in rs for x in r["step_cpu_s"]]
        out[arm] = {
            "median_step_s": statistics.median(steps),
            "mean_step_s": statistics.mean(steps),
            "min_step_s": min(steps),
            "max_step_s": max(steps),
            "median_step_cpu_s": statistics.median(cpu),
            "timed_steps": len(steps),
            "peak_rss_mb": max(r["peak_rss_mb"] for r in rs),
            "rss_after_setup_mb": max(r["rss_after_setup_mb"] for r in rs),
            "completion_len_mean": statistics.mean(r["completion_len_mean"] for r in rs),
            "reward_mean": statistics.mean(r["reward_mean"] for r in rs),
            "breakdown_s": median_breakdown(rs),
        }
    t = out["trl"]
    for arm in [a for a in runs if a != "trl"]:
        p = out[arm]
        p["speedup_vs_trl"] = {
            "median": t["median_step_s"] / p["median_step_s"],
            "mean": t["mean_step_s"] / p["mean_step_s"],
            "min": t["min_step_s"] / p["min_step_s"],
            "median_cpu": t["median_step_cpu_s"] / p["median_step_cpu_s"],
            # the arms sample their own completions: time per generated token
            "median_per_token": (t["median_step_s"] / t["completion_len_mean"])
            / (p["median_step_s"] / p["completion_len_mean"]),
        }
        p["peak_rss_vs_trl"] = p["peak_rss_mb"] / t["peak_rss_mb"]
    return out


def markdown(data: dict) -> str:
    s, m, st = data["summary"], data["machine"], data["settings"]
    p, t = s["perceptrl"], s["trl"]
    sp = p["speedup_vs_trl"]
    goal = "met" if sp["median"] >= GOAL_SPEEDUP and p["peak_rss_vs_trl"] <= 1.0 else "not met"
    bp, bt = p["breakdown_s"], t["breakdown_s"]
    # TRL's generate-and-score phase computes the reference log-probs when beta > 0; ours does
    # that in the old-log-prob phase, so it joins our sampling side for a like-for-like ratio
    with_ref = st["trl"]["beta"] > 0
    gen_s = bp["rollout"] + bp["reward"] + (bp["old_logp"] if with_ref else 0.0)
    upd_extra = 0.0 if with_ref else bp["old_logp"]
    ours_gen = "ours: rollout + reward" + (" + reference log-probs" if with_ref else "")
    per_step = all("breakdown_steps_s" in r for rs in data["runs"].values() for r in rs)
    how = "medians over the timed steps" if per_step else "means of the least disturbed run"
    loads = [x for rs in data["runs"].values() for r in rs for x in r["loadavg_1min"]]
    lines = [
        "# perceptrl GRPO step vs TRL GRPOTrainer (tiny Qwen2.5-VL, CPU)",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores shared with other work (timed runs serialised; "
        f"1-min load average {min(loads):.1f}-{max(loads):.1f} around the arms), "
        f"{st['threads']} torch threads, torch {m['torch']}, transformers {m['transformers']}, "
        f"TRL {m['trl']}. Model {st['base']} (fp32). {st['prompts']} prompts x {st['group']} "
        f"completions per step, max {st['max_new_tokens']} new tokens, temperature 1.0, "
        f"micro-batch {st['micro']}, one optimizer step per generation batch; "
        f"{st['warmup']} warm-up steps excluded, {p['timed_steps']} timed steps per arm "
        f"({st['repeats']} alternating run(s) per arm, each in its own process)."
        + (
            f" The load average above {m['cores']} means other programs kept the cores busy "
            "during the arms (the arms alternate, so each saw it)."
            if max(loads) > m["cores"]
            else ""
        )
        + (
            f" {st['threads']} torch thread(s) on {m['cores']} cores: with fewer idle cores than "
            "threads, OpenMP threads wait on each other and every arm slows many-fold."
            if st["threads"] < m["cores"]
            else ""
        ),
        "",
        "| arm | median step (s) | mean (s) | min (s) | median CPU s/step | peak RSS (MB) "
        "| completion tokens | reward |",
        "|---|---|---|---|---|---|---|---|",
    ]
    names = {"perceptrl": "perceptrl", "perceptrl_scored": "perceptrl, old-logp pass forced",
             "perceptrl_noshare": "perceptrl, shared prefix off", "trl": "TRL GRPOTrainer"}  # fmt: skip
    for arm in [a for a in names if a in s]:
        r = s[arm]
        lines.append(
            f"| {names[arm]} | {r['median_step_s']:.2f} | {r['mean_step_s']:.2f} "
            f"| {r['min_step_s']:.2f} | {r['median_step_cpu_s']:.2f} | {r['peak_rss_mb']:.0f} "
            f"| {r['completion_len_mean']:.1f} | {r['reward_mean']:.3f} |"
        )
    lines += [
        "",
        f"Speed-up of our step (TRL time / ours): {sp['median']:.2f}x median, {sp['mean']:.2f}x "
        f"mean, {sp['min']:.2f}x fastest step, {sp['median_cpu']:.2f}x CPU time, "
        f"{sp['median_per_token']:.2f}x per generated token. Peak RSS ours / TRL: "
        f"{p['peak_rss_vs_trl']:.2f}. Goal (>= {GOAL_SPEEDUP:g}x faster, no more memory): {goal}.",
    ]
    if "perceptrl_scored" in s:
        lines.append(
            f"With the separate old-log-prob forward forced (the loop before this benchmark's "
            f"change): {s['perceptrl_scored']['speedup_vs_trl']['median']:.2f}x median."
        )
    if "perceptrl_noshare" in s:
        n = s["perceptrl_noshare"]
        lines.append(
            f"With the shared-prefix training forward off (`model.share_prefix=false`: each row's "
            f"prompt recomputed with its completion): {n['speedup_vs_trl']['median']:.2f}x median, "
            f"forward/backward {n['breakdown_s']['forward_backward']:.2f} s per step vs "
            f"{bp['forward_backward']:.2f} s with it, peak RSS {n['peak_rss_mb']:.0f} MB."
        )
    lines += [
        "",
        f"Ours per step: rollout {bp['rollout']:.2f} s + reward {bp['reward']:.3f} + old log-probs "
        f"{bp['old_logp']:.2f} + forward/backward {bp['forward_backward']:.2f} + optimizer "
        f"{bp['optimizer']:.3f} ({how}). TRL per step: generate + score "
        f"{bt['generate_and_score']:.2f} s, loss/backward/optimizer "
        f"{bt['loss_backward_optimizer']:.2f} s ({how}). So sampling + scoring ({ours_gen}) is "
        f"{bt['generate_and_score'] / gen_s:.2f}x faster here and the update "
        f"{bt['loss_backward_optimizer'] / (bp['forward_backward'] + bp['optimizer'] + upd_extra):.2f}x.",
        "",
        f"Same work on both sides: prompts in the same order (TRL prompt ids identical to ours: "
        f"{data['prompt_ids_identical']}), reward `format` 0.2 + `accuracy` 1.0, lr 2e-4 constant, "
        'AdamW, grad clip 1.0. TRL: `loss_type="dapo"` (token mean over the accumulated batch, '
        f'= our `token-mean`), `scale_rewards="group"`, {kl_text(st["trl"]["beta"])}, '
        "`num_iterations=1`, `epsilon` 0.2 / `epsilon_high` 0.28, "
        f"{st['micro']} x {st['prompts'] * st['group'] // st['micro']} accumulation = "
        f"{st['prompts'] * st['group']} completions. Ours: `configs/vlm_clevr.yaml` without dynamic "
        "sampling (TRL has none). Neither side runs a separate old-log-prob forward when the step "
        "is on-policy. Left as each library does it: we suppress vision placeholder tokens while "
        "sampling; TRL runs the processor on every one of the G copies of a prompt; our training "
        "forward runs each distinct prompt once and its G completions attend to its keys/values "
        "(`model.share_prefix`, same log-probs and gradients), TRL forwards prompt + completion "
        "for every row.",
    ]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10, help="timed steps per arm and run")
    ap.add_argument("--warmup", type=int, default=2, help="untimed first steps")
    ap.add_argument("--prompts", type=int, default=16, help="prompts per step")
    ap.add_argument("--group", type=int, default=8, help="completions per prompt (G)")
    ap.add_argument("--micro", type=int, default=32, help="micro-batch (rows per forward)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2, help="alternating runs of each arm")
    ap.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated subset of {ARMS}")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kl", type=float, default=0.0, help="KL coefficient (TRL's beta), k3")
    ap.add_argument("--base", default="assets/vlm_base")
    ap.add_argument("--out", default="runs/bench_trl_grpo")
    ap.add_argument("--arm", choices=ARMS, help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    ap.add_argument("--arm-dir", help=argparse.SUPPRESS)
    ap.add_argument("--data", help=argparse.SUPPRESS)
    ap.add_argument("--report-only", action="store_true", help="rewrite the .md from the .json")
    args = ap.parse_args()
    if args.arm:
        return run_arm(args)
    if args.report_only:
        from common import RESULTS, write_results

        name = result_name(args.kl)
        data = json.loads((RESULTS / f"{name}.json").read_text())
        data["summary"] = summarize(data["runs"])
        seeds = data.get("provenance", {}).get("seeds", [args.seed])
        write_results(name, data, markdown(data), seeds=seeds, keep_provenance=True)
        return print(markdown(data))

    from common import machine, write_results

    from perceptrl.datasets.clevr import generate
    from perceptrl.trainer.runtime import resolve_path

    out = Path(args.out).resolve()
    args.base = resolve_path(args.base).resolve()
    n = (args.warmup + args.steps) * args.prompts
    args.data = generate(out / "data", splits={"train": n}, families=FAMILIES, seed=1)["train"]
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    if "perceptrl" not in arms or "trl" not in arms or set(arms) - set(ARMS):
        raise SystemExit(f"--arms must include perceptrl and trl, from {ARMS}; got {arms}")
    runs: dict[str, list[dict]] = {a: [] for a in arms}
    for rep in range(args.repeats):
        for arm in arms if rep % 2 == 0 else arms[::-1]:
            print(f"[bench_trl_grpo] run {rep + 1}/{args.repeats}: {arm}", flush=True)
            runs[arm].append(spawn(arm, args, out))
    import transformers

    trl_versions = runs["trl"][0]["versions"]
    data = {
        "machine": machine(transformers=transformers.__version__, **trl_versions),
        "settings": {
            "base": str(Path(args.base).relative_to(Path(args.base).parents[1]))
            if "assets" in Path(args.base).parts
            else Path(args.base).name,
            "prompts": args.prompts,
            "group": args.group,
            "micro": args.micro,
            "max_new_tokens": args.max_new_tokens,
            "warmup": args.warmup,
            "steps": args.steps,
            "repeats": args.repeats,
            "threads": args.threads,
            "seed": args.seed,
            "data": f"synthetic counting {FAMILIES}, seed 1, {n} samples, same order in both arms",
            "reward": REWARD,
            "dtype": "float32",
            "trl": {
                "loss_type": "dapo",
                "scale_rewards": "group",
                "beta": args.kl,
                "num_iterations": 1,
                "epsilon": 0.2,
                "epsilon_high": 0.28,
            },
        },  # fmt: skip
        "summary": summarize(runs),
        "prompt_ids_identical": all(r["prompt_ids_identical_to_ours"] for r in runs["trl"]),
        "runs": runs,
    }
    md = markdown(data)
    seeds = {"train": [args.seed], "data": 1}
    js, mdp = write_results(result_name(args.kl), data, md, seeds=seeds)
    print(md)
    print(f"\nwrote {js} and {mdp}")


if __name__ == "__main__":
    main()
