"""The EGL/triton import-order guard: a process that renders and then imports torch's compiler
stack does not crash (it segfaulted under Mesa before the guard, measured)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

SCRIPT = """
import gymnasium as gym
import perceptrl.sim
env = gym.make("perceptrl/Reach-v0", obs_mode="rgb", width=32, height=32)
obs, _ = env.reset(seed=0)
assert obs["agentview"].std() > 0
import torch._dynamo, torch.optim  # triton after the first render
print("ok")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="no triton installed")
def test_render_then_import_triton_does_not_crash():
    env = {**os.environ, "MUJOCO_GL": os.environ.get("MUJOCO_GL", "egl")}
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-2000:]
