"""One training run of the tiny Qwen2.5-VL through the shared Trainer, for the ZeRO tests.

Run as one process (``python tests/zero_worker.py ...``, torch or deepspeed backend) or under
``torchrun --nproc_per_node 2`` (deepspeed backend, ZeRO-2 or 3, gloo on the CPU). The rollout
source is deterministic: at step ``s`` the global batch is ``PROMPTS`` prompts × ``GROUP`` fixed
completion texts with fixed rewards, and rank ``r`` of ``W`` takes prompts ``r*P/W ...
(r+1)*P/W - 1`` of it, so 1 rank × full batch and W ranks × 1/W batch see the same global batch
and their loss trajectories must agree. (Sampling is tested separately: it would make the two
runs draw different completions.) After training, every rank samples a few completions of its
own prompts under ``rollout_context()`` (ZeRO-3: gathered weights; ranks stop at different
lengths), and rank 0 writes the live weights for the export check.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from PIL import Image, ImageDraw
from safetensors.torch import save_file

from perceptrl.trainer.distributed import shutdown_distributed
from perceptrl.trainer.engine import build_engine
from perceptrl.trainer.loop import Trainer
from perceptrl.vlm.policy import VLMPolicy
from perceptrl.vlm.rollout import SamplingParams
from perceptrl.vlm.sampler import Rollouts
from perceptrl.wiring import Config

PROMPTS, GROUP = 4, 2
COMPLETIONS = ["<answer>2</answer>", "I count 3. <answer>3</answer>", "one", "<answer>1"]


def make_samples(root: Path, n: int = 8) -> list[dict]:
    root.mkdir(parents=True, exist_ok=True)
    out = []
    for i in range(n):
        im = Image.new("RGB", (56 + 28 * (i % 2), 56), (128, 128, 128))
        d = ImageDraw.Draw(im)
        for k in range(i % 3 + 1):
            x = 10 + 14 * k
            d.ellipse([x, 20, x + 10, 30], fill=(230, 40 * k, 40))
        p = root / f"img{i}.png"
        im.save(p)
        out.append({"id": f"s{i}", "images": [str(p)], "question": "How many circles?" + " Count." * (i % 2), "answer": str(i % 3 + 1), "reward": "numeric", "family": "count", "meta": {}})  # fmt: skip
    return out


class FixedSource:
    """Deterministic global batch per step; this rank's contiguous share of its prompts."""

    def __init__(self, samples: list[dict], rank: int, world: int, nan_step: int = -1):
        if PROMPTS % world:
            raise ValueError(f"{PROMPTS} prompts do not split over {world} ranks")
        self.samples, self.rank, self.world = samples, rank, world
        self.nan_step = nan_step
        """at this step the last prompt's rewards are NaN: the minibatch is skipped, after
        earlier micro-batches already ran backward"""

    def collect(self, policy, step: int):
        per = PROMPTS // self.world
        idx = [(step * PROMPTS + self.rank * per + i) % len(self.samples) for i in range(per)]
        rows, texts, rewards = [], [], []
        for j, i in enumerate(idx):
            last = self.rank * per + j == PROMPTS - 1
            for g in range(GROUP):
                c = COMPLETIONS[(i + g + step) % len(COMPLETIONS)]
                rows.append(self.samples[i])
                texts.append(c)
                reward = float(len(c) % 3 == (i + g) % 3) + 0.1 * g
                rewards.append(float("nan") if step == self.nan_step and last else reward)
        batch = policy.completions_batch(rows, texts)
        batch.group_id = torch.arange(len(idx)).repeat_interleave(GROUP)
        batch.rewards = torch.tensor(rewards)
        return batch, {}

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--backend", default="deepspeed")
    ap.add_argument("--stage", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--ckpt-every", type=int, default=0)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--micro", type=int, default=2)
    ap.add_argument("--nan-step", type=int, default=-1, help="0-based step with NaN rewards")
    args = ap.parse_args()

    cfg = Config()
    cfg.train.steps, cfg.train.lr, cfg.train.micro_batch_size = args.steps, 2e-3, args.micro
    cfg.train.ppo_epochs, cfg.train.device, cfg.train.seed = 2, "cpu", 0
    cfg.train.backend, cfg.train.zero_stage = args.backend, args.stage
    cfg.algo.entropy_coef = 0.01
    # batch statistics: must be global under DP (off with NaN rewards, which would spread)
    cfg.algo.whiten_advantages = args.nan_step < 0
    cfg.log.tensorboard, cfg.log.progress = False, False
    cfg.checkpoint.every, cfg.checkpoint.keep_last = args.ckpt_every, 5

    torch.manual_seed(0)
    policy = VLMPolicy.from_pretrained(args.model)
    engine = build_engine(policy, cfg.train)
    out = Path(args.out)
    samples = make_samples(out / "images")
    source = FixedSource(samples, engine.rank, engine.world_size, args.nan_step)
    trainer = Trainer(cfg, policy, source, out, engine=engine)
    trainer.fit(resume=args.resume)

    # rollouts under the engine: each rank its own prompts, lengths differ across ranks
    with engine.rollout_context():
        sampling = SamplingParams(temperature=1.0, max_new_tokens=6 + 5 * engine.rank)
        gen = Rollouts(policy).generate(samples[engine.rank :: 2][:2], n=2, sampling=sampling)
    n_tokens = int(engine.all_reduce_sum(gen.mask.sum()))
    with engine.gathered_params():
        if engine.is_main:
            state = {
                k: v.detach().clone().contiguous() for k, v in policy.model.state_dict().items()
            }
            save_file(state, str(out / "final_state.safetensors"))
    if engine.is_main:
        (out / "rollout.json").write_text(json.dumps({"generated_tokens": n_tokens}))
    shutdown_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
