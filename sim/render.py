"""The one place a MuJoCo renderer is made: `make_renderer` runs the EGL/triton guard first.

Measured on the development machine (Mesa llvmpipe under ``MUJOCO_GL=egl``): a process that
renders and afterwards imports triton (as torch's optimizer, ``torch._dynamo`` and torchvision
do) segfaults; importing triton before the first render avoids it. Importing plain ``torch``
first does not (it loads triton lazily). Every renderer in the project is created through
`make_renderer`, so every process that renders (trainer, evaluation, env workers, dataset
generators) is safe without each caller remembering the import order.
"""

from __future__ import annotations

import importlib
import importlib.util

import mujoco

from ..errors import render_error


def import_triton_first() -> None:
    """Import triton, when installed, before this process's first EGL context (see the module
    docstring); a no-op without triton (e.g. CPU-only torch wheels) or when already imported."""
    if importlib.util.find_spec("triton") is not None:
        importlib.import_module("triton")


def make_renderer(model: mujoco.MjModel, height: int, width: int) -> mujoco.Renderer:
    """``mujoco.Renderer(model, height, width)`` after the import-order guard. Create it lazily,
    in the process that renders (an EGL context must not cross a fork)."""
    import_triton_first()
    try:
        return mujoco.Renderer(model, height, width)
    except (mujoco.FatalError, RuntimeError, ImportError, AttributeError, OSError) as e:
        raise render_error(e) from e
