"""Shared by the benchmark scripts: the machine description and result writing."""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def machine(**extra) -> dict:
    """CPU model, cores and library versions: every result file says where it was measured."""
    model = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import torch

    info = {
        "cpu": model,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "platform": platform.platform(),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", ""),
    }
    info.update(extra)
    return info


def write_results(name: str, data: dict, markdown: str) -> tuple[Path, Path]:
    RESULTS.mkdir(parents=True, exist_ok=True)
    js, md = RESULTS / f"{name}.json", RESULTS / f"{name}.md"
    js.write_text(json.dumps(data, indent=2) + "\n")
    md.write_text(markdown.rstrip() + "\n")
    return js, md
