"""Process-level helpers the trainer and the sides share: device, seeding, progress, memory."""

from __future__ import annotations

import os
import random
import resource
from pathlib import Path

import numpy as np
import torch

from ..errors import MachineError

PACKAGE_ROOT = Path(__file__).resolve().parents[1]
"""the ``perceptrl`` package directory (configs/, assets/ ...)"""


def resolve_path(path: str | Path) -> Path:
    """A path as given (absolute or relative to the working directory), else relative to the
    package, so recipes can name shipped files such as ``assets/vlm_base``."""
    p = Path(path).expanduser()
    if p.exists() or p.is_absolute():
        return p
    shipped = PACKAGE_ROOT / p
    return shipped if shipped.exists() else p


def peak_rss_mb() -> float:
    """Peak resident memory of this process so far (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def seed_everything(seed: int) -> None:
    """Seed Python's, numpy's and torch's global generators."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def resolve_device(name: str) -> torch.device:
    """``auto | cpu | cuda | cuda:N``; a bare ``cuda`` under a launcher is this process's GPU
    (``LOCAL_RANK``)."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda" and device.index is None and "LOCAL_RANK" in os.environ:
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    if device.type == "cuda":
        check_gpu(device)
    return device


def check_gpu(device: torch.device) -> None:
    """`MachineError` (what torch sees, and the setting to change) unless ``device`` is a
    GPU this process can use."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count and (device.index is None or device.index < count):
        return
    if count:
        seen = f"torch sees {count} GPU(s), cuda:0..cuda:{count - 1}"
    elif torch.version.cuda is None:
        seen = f"this torch ({torch.__version__}) is built without CUDA"
    else:
        seen = f"torch ({torch.__version__}, CUDA {torch.version.cuda}) sees no GPU: no driver, or CUDA_VISIBLE_DEVICES hides them"
    raise MachineError(
        f"the run asks for device {str(device)!r} but {seen}. Set train.device=cpu (or auto, "
        "which takes a GPU only where there is one), or run on a machine with a GPU"
    )


def progress_bar(total: int, initial: int, enabled: bool, desc: str = "train"):
    """A tqdm bar over training steps (disabled: a no-op bar)."""
    from tqdm.auto import tqdm

    return tqdm(
        total=total, initial=initial, disable=not enabled, desc=desc, unit="step",
        dynamic_ncols=True,
    )  # fmt: skip
