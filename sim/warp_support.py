"""Support of the MJWarp backend (`sim.mjwarp.WarpEnv`): importing warp, quaternions from rotation
matrices, MJWarp buffer sizes and per-world arrays, the device decorator, and `WorldView`, the
read-only view of one world that the scripted experts read as they read an env.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import numpy as np
import torch

from .robot import Robot
from .tasks import World


def import_warp():
    """``(warp, mujoco_warp)``, or an ImportError that says how to install them."""
    try:
        import mujoco_warp
        import warp
    except ImportError as e:
        raise ImportError(
            f"env.backend=warp needs MJWarp ({e}); install it with "
            "`pip install 'mujoco-warp==4.0.0'` (it brings warp-lang; the package's [warp] extra "
            "pins both) or use env.backend=mujoco"
        ) from e
    warp.config.quiet = True  # no line per compiled kernel module
    return warp, mujoco_warp


def warp_available() -> bool:
    """MJWarp and warp-lang are importable."""
    try:
        import_warp()
    except ImportError:
        return False
    return True


def mat_to_quat(mat: np.ndarray) -> np.ndarray:
    """Rotation matrices [..., 3, 3] -> unit quaternions [..., 4] (w, x, y, z), the branch
    choice and signs of ``mujoco.mju_mat2Quat``."""
    m = np.asarray(mat, np.float64).reshape(*np.shape(mat)[:-2], 9)
    m0, m1, m2, m3, m4, m5, m6, m7, m8 = np.moveaxis(m, -1, 0)
    q = np.zeros((*m.shape[:-1], 4))
    b0 = m0 + m4 + m8 > 0
    b1 = ~b0 & (m0 > m4) & (m0 > m8)
    b2 = ~b0 & ~b1 & (m4 > m8)
    b3 = ~(b0 | b1 | b2)
    with np.errstate(divide="ignore", invalid="ignore"):
        s = 0.5 * np.sqrt(np.maximum(1 + m0 + m4 + m8, 0))
        q[b0] = np.stack([s, 0.25 * (m7 - m5) / s, 0.25 * (m2 - m6) / s,
                          0.25 * (m3 - m1) / s], -1)[b0]  # fmt: skip
        s = 0.5 * np.sqrt(np.maximum(1 + m0 - m4 - m8, 0))
        q[b1] = np.stack([0.25 * (m7 - m5) / s, s, 0.25 * (m1 + m3) / s,
                          0.25 * (m2 + m6) / s], -1)[b1]  # fmt: skip
        s = 0.5 * np.sqrt(np.maximum(1 - m0 + m4 - m8, 0))
        q[b2] = np.stack([0.25 * (m2 - m6) / s, 0.25 * (m1 + m3) / s, s,
                          0.25 * (m5 + m7) / s], -1)[b2]  # fmt: skip
        s = 0.5 * np.sqrt(np.maximum(1 - m0 - m4 + m8, 0))
        q[b3] = np.stack([0.25 * (m3 - m1) / s, 0.25 * (m2 + m6) / s,
                          0.25 * (m5 + m7) / s, s], -1)[b3]  # fmt: skip
    return q / np.linalg.norm(q, axis=-1, keepdims=True)


def contact_capacity(task) -> tuple[int, int]:
    """(contacts, constraint rows) MJWarp allocates per world for ``task``'s scene. Its defaults
    (sized from the initial state) overflow once the fingers close on a block; a box touches
    another box at up to 8 points, each a 4-row pyramid (condim 3), so each block gets room for
    three such touches (table, a finger or two, another block or a bowl), plus the arm's joint
    limits. An overflow would drop contacts silently: `WarpEnv` treats it as a blow-up."""
    nconmax = 24 * max(task.n_blocks, 1) + 16
    return nconmax, 4 * nconmax + 32


def world_arrays(d) -> list:
    """The warp arrays of ``d`` with one entry per world, by the field specs of MJWarp's
    ``Data`` (leading dimension ``nworld``). The constraint block (``d.efc``, the largest) is
    left out: every step rebuilds it from the state before anything reads it."""
    out = []
    for f in dataclasses.fields(d):
        shape, arr = getattr(f.type, "shape", None), getattr(d, f.name, None)
        if shape and shape[0] == "nworld" and arr is not None and arr.ndim >= 1:
            if arr.shape[0] == d.nworld and arr.size > 0:
                out.append(arr)
    return out


def on_device(method):
    """Run a `WarpEnv` method with warp on the env's device and, on a GPU, on torch's current
    stream (the torch ops on the views and the warp kernels then stay in order)."""

    @functools.wraps(method)
    def wrapped(self, *args, **kwargs):
        with contextlib.ExitStack() as stack:
            stack.enter_context(self._wp.ScopedDevice(self.device))
            if self.device.is_cuda:
                stream = torch.cuda.current_stream(self.torch_device)
                stack.enter_context(self._wp.ScopedStream(self._wp.stream_from_torch(stream)))
            return method(self, *args, **kwargs)

    return wrapped


class _Data:
    """The ``MjData`` fields a scripted expert reads, for one world (host copies)."""

    def __init__(self, state: dict, i: int):
        self.qpos, self.site_xpos = state["qpos"][i], state["site_xpos"][i]
        self.site_xmat = state["site_xmat"][i]


class _RobotView:
    """`Robot`'s readers and controller targets for world ``i`` of ``env`` (a `WarpEnv`)."""

    yaw, tcp_pos, gripper_width = Robot.yaw, Robot.tcp_pos, Robot.gripper_width

    def __init__(self, env, i: int):
        r = env.host.robot
        self.cfg, self.tcp, self.finger_qadr = r.cfg, r.tcp, r.finger_qadr
        self._env, self._i = env, i

    @property
    def target_pos(self) -> np.ndarray:
        return self._env.host_state()["target_pos"][self._i]

    @property
    def target_yaw(self) -> float:
        return float(self._env.host_state()["target_yaw"][self._i])


class WorldView:
    """World ``i`` of a `WarpEnv` as a scripted expert sees an env (``sim.expert``): the task,
    ``world()``, ``data`` (qpos, site poses), ``robot`` (targets, readers), ``block_qadr``.
    Read-only."""

    def __init__(self, env, i: int):
        self._env, self._i = env, i
        self.cfg, self.task, self.block_qadr = env.cfg, env.task, env.host.block_qadr
        self.robot = _RobotView(env, i)

    @property
    def unwrapped(self) -> WorldView:
        return self

    @property
    def data(self) -> _Data:
        return _Data(self._env.host_state(), self._i)

    def world(self) -> World:
        w = self._env.host_state()["world"]
        return World(*(getattr(w, f.name)[self._i] for f in dataclasses.fields(World)))
