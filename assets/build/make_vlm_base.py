"""Make the shipped SFT base: the tiny random-initialised Qwen2.5-VL after SFT on counting traces.

``assets/vlm_base`` is the base of the counting, spatial, video and zoom recipes and of the other
two bases (``make_demo_base.py``, ``make_plan_base.py``). It is ``configs/vlm_sft.yaml`` as it
is (the tiny Qwen2.5-VL built from scratch, 1500 steps on templated counting traces, train seed
0; 55.5% held-out counting accuracy when it was made), run by the CLI in its own process, and
its last checkpoint's model folder (weights, tokenizer and processor) copied to ``--out``:

    python assets/build/make_vlm_base.py [--run-dir runs/vlm_sft] [--out assets/vlm_base]

which is ``perceptrl sft configs/vlm_sft.yaml --run-dir runs/vlm_sft`` followed by the copy.
``make assets-vlm-base`` runs it. Overrides after the options go to
the recipe.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
from common import install_last_model, run_arm  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run-dir", default="runs/vlm_sft", help="the SFT run (deleted first)")
    ap.add_argument("--out", default="assets/vlm_base")
    ap.add_argument("overrides", nargs="*", help="dotted overrides of configs/vlm_sft.yaml")
    args = ap.parse_args()

    run_dir = Path(args.run_dir)
    seconds = run_arm(["sft", str(ROOT / "configs" / "vlm_sft.yaml"), *args.overrides], run_dir)
    out = Path(args.out)
    source = install_last_model(run_dir, out)
    print(f"wrote {out} from {source} ({seconds / 60:.1f} min)")


if __name__ == "__main__":
    main()
