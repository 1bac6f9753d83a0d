"""Make the demo's base: the shipped SFT base after a short SFT on a sloppy teacher's traces.

`make demo`'s first part must show learning in a few minutes on 2 cores. From the shipped base
(`assets/vlm_base`) GRPO moves held-out counting only a few points in that time: the tiny model's
errors are perception (it lists the wrong objects), which RL discovers slowly. The situation RL
with a verifiable reward is known to fix quickly is a base that can do the task but has learned
a habit its reward penalises: the common case of SFT on an imperfect teacher's traces. This
script makes such a base: the teacher lists the objects correctly but, in ``--miscount`` of its
traces with two or more objects, its count forgets the last object it listed ("Count: N-1").
The base imitates the habit (greedy answers are mostly one short), while its samples still give
the right count often enough for GRPO to find and reinforce it.

The result is the model in ``assets/vlm_demo_base`` (written with its tokenizer and processor);
the recipe is ``configs/vlm_demo.yaml``. Deterministic in ``--seed``.

    python assets/build/make_demo_base.py [--steps 1000] [--miscount 0.6] [--out assets/vlm_demo_base]

``make assets-demo-base`` runs it.
"""

from __future__ import annotations

import argparse
import random
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from common import install_last_model  # noqa: E402

COUNT = re.compile(r"Count: (\d+)\.</think><answer>(\d+)</answer>$")


def sloppy_teacher(miscount: float, seed: int):
    """``teacher(sample, trace)`` for ``vlm.run.run_sft``: the trace's count (and answer) one
    short with probability ``miscount`` when two or more objects were listed; the draw depends
    only on the sample's id and ``seed``."""

    def teacher(sample: dict, trace: str) -> str:
        m = COUNT.search(trace)
        if m is None or int(m.group(1)) < 2:
            return trace
        if random.Random(f"{seed}:{sample['id']}").random() >= miscount:
            return trace
        n = int(m.group(1)) - 1
        return trace[: m.start()] + f"Count: {n}.</think><answer>{n}</answer>"

    return teacher


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=1000, help="SFT steps on the teacher's traces")
    ap.add_argument("--miscount", type=float, default=0.6, help="share of counts one short")
    ap.add_argument("--base", default="assets/vlm_base")
    ap.add_argument("--out", default="assets/vlm_demo_base")
    ap.add_argument("--run-dir", default="runs/make_demo_base")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    from perceptrl.cli import CONFIGS
    from perceptrl.trainer.runtime import resolve_path
    from perceptrl.vlm.run import run_sft
    from perceptrl.wiring import load_config

    cfg = load_config(
        CONFIGS / "vlm_sft.yaml",
        [f"model.path={resolve_path(args.base)}", "data.families=[count_all]",
         f"train.steps={args.steps}", "train.lr=1.0e-3", "train.warmup_steps=20",
         "train.eval_every=250", f"train.seed={args.seed}", f"data.seed={args.seed}",
         "log.progress=false"],
    )  # fmt: skip
    run_dir = Path(args.run_dir)
    run_sft(cfg, run_dir, teacher=sloppy_teacher(args.miscount, args.seed))
    out = resolve_path(args.out)
    install_last_model(run_dir, out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
