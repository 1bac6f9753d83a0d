"""The commands that read a finished (or running) run directory: the end-of-run summary that
`perceptrl train`, `sft` and the demo print, `perceptrl doctor` and `perceptrl view`."""

from __future__ import annotations

import argparse
import time
from pathlib import Path


def print_summary(run_dir: Path) -> None:
    """Before/after evaluation table and where the logs are."""
    from .trainer.checkpoint import BEST, best_record
    from .trainer.doctor import doctor_paragraph
    from .trainer.metrics import read_metrics

    rows = read_metrics(run_dir / "metrics.jsonl") if (run_dir / "metrics.jsonl").exists() else []
    evals = [r for r in rows if any(k.startswith("eval/accuracy") for k in r)]
    if len(evals) >= 1:
        first, last = evals[0], evals[-1]
        keys = sorted(k for k in last if k.startswith("eval/accuracy"))
        print(
            f"\n{'held-out metric':<32}{'step ' + str(first['step']):>12}{'step ' + str(last['step']):>12}"
        )
        for k in keys:
            print(f"{k:<32}{first.get(k, float('nan')):>12.3f}{last[k]:>12.3f}")
    _print_skips(rows)
    if rows:
        print("\n" + doctor_paragraph(rows))
    print(f"\nrun directory: {run_dir}")
    print(f"metrics:       {run_dir / 'metrics.jsonl'}")
    print(f"tensorboard:   tensorboard --logdir {run_dir / 'tensorboard'}")
    if (run_dir / "rollouts").is_dir():
        print(f"rollouts:      perceptrl view {run_dir}")
    ckpts = sorted((run_dir / "checkpoints").glob("step_*"))
    if ckpts:
        print(f"model:         {ckpts[-1] / 'model'}")
    best = best_record(run_dir)
    if best is not None:
        print(f"best model:    {run_dir / BEST / 'model'} "
              f"(step {best['step']}, {best['metric']} {best['value']:.3f})")  # fmt: skip


def _print_skips(rows: list[dict]) -> None:
    """Samples skipped in lenient mode: when the data loaded (``data/skipped_<reason>``) and
    while it was drawn (``rollout/skipped_images_total``), from the last row that has them."""
    from .trainer.metrics import latest_skips

    skips = latest_skips(rows)
    counts = [f"{k[13:]} {v:g}" for k, v in skips.items() if k.startswith("data/skipped_")]
    if counts:
        print(f"\nskipped samples (data.strict=false): {', '.join(counts)}")
    drawn = skips.get("rollout/skipped_images_total", 0)
    if drawn:
        print(f"skipped while drawn (unreadable files): {drawn:g}")


def cmd_doctor(args: argparse.Namespace) -> int:
    """Diagnose a run from its metrics (trainer/doctor.py); exit status 1 on a serious finding."""
    from .trainer.doctor import run_doctor

    report_md, serious = run_doctor(Path(args.run), Path(args.out) if args.out else None)
    print(report_md)
    return int(serious)


def cmd_view(args: argparse.Namespace) -> int:
    """Write the run's page (trainer/viewer.py); with ``--serve``, serve it until Ctrl-C."""
    from .trainer.viewer import serve, write_view

    page = write_view(Path(args.run), args.out)
    print(f"wrote {page} (open it in a browser)")
    if args.serve:
        server, url = serve(page, args.port)
        print(f"serving {url} (Ctrl-C stops)")
        try:
            while True:
                time.sleep(3600)
        finally:
            server.shutdown()
    return 0


def add_parsers(sub) -> None:
    p = sub.add_parser("doctor", help="diagnose a run: what went wrong and what to change")
    p.add_argument("run", help="run directory (with metrics.jsonl)")
    p.add_argument("--out", help="output directory (default: RUN/doctor)")
    p.set_defaults(func=cmd_doctor)

    p = sub.add_parser(
        "view", help="a page to browse a run: rollouts, episodes, metric curves, the doctor"
    )
    p.add_argument("run", help="run directory (with metrics.jsonl and rollouts/)")
    p.add_argument("--out", help="HTML file to write (default: RUN/view.html)")
    p.add_argument("--serve", action="store_true", help="also serve it on localhost")
    p.add_argument("--port", type=int, default=0, help="port for --serve (default: a free one)")
    p.set_defaults(func=cmd_view)
