"""perceptrl: one RL trainer for vision-language models and vision-language-action policies."""

import os

__version__ = "0.1.0"

if not os.environ.get("DISPLAY"):
    # MuJoCo picks its GL backend from MUJOCO_GL when it is first imported; its default (GLFW)
    # needs a display, so headless runs render offscreen through EGL unless the user chose.
    os.environ.setdefault("MUJOCO_GL", "egl")
