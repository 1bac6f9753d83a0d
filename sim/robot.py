"""The arm7 robot inside a compiled scene: indices, end-effector pose, and the two control modes.

Delta end-effector control maps an action ``(dx, dy, dz, dyaw, gripper)`` in [-1, 1] to a moving
target pose (the gripper always points down; yaw about world z is free) and solves one damped
least-squares IK step on ``mj_jacSite`` (6 x 7) per control step, with a null-space pull towards
the home posture. Joint-position control maps ``(q1..q7, gripper)`` in [-1, 1] onto the joint ranges.
Gripper: -1 opens fully, +1 closes.
"""

from __future__ import annotations

from dataclasses import dataclass

import mujoco
import numpy as np

ARM_JOINTS = tuple(f"joint{i}" for i in range(1, 8))
FINGER_JOINTS = ("finger_l", "finger_r")
HOME_Q = np.array([0.0, -0.3, 0.0, -2.2, 0.0, 1.9, 0.785])
"""home posture: the tool centre point about (0.46, 0, 0.40) pointing down, yaw 0"""
FINGER_OPEN = 0.04
"""finger opening (each side, metres) when fully open"""
R_DOWN = np.diag([1.0, -1.0, -1.0])
"""tcp orientation at yaw 0: x along world x, z pointing down"""


@dataclass(frozen=True)
class ControlConfig:
    """How actions become actuator targets."""

    pos_scale: float = 0.02
    """metres of end-effector target motion per step at |action| = 1"""
    yaw_scale: float = 0.15
    """radians of yaw target motion per step at |action| = 1"""
    damping: float = 0.05
    """lambda of the damped least-squares IK"""
    null_gain: float = 0.3
    """gain of the null-space pull towards the home posture"""
    max_lag: float = 0.06
    """the target may lead the actual tcp by at most this many metres (no wind-up on contact)"""
    workspace_low: tuple[float, float, float] = (0.22, -0.4, 0.02)
    """lower corner of the box the tcp target is kept in (world frame, metres)"""
    workspace_high: tuple[float, float, float] = (0.78, 0.4, 0.5)
    """upper corner of the box the tcp target is kept in"""


def yaw_matrix(yaw: float) -> np.ndarray:
    """Target tcp rotation (3, 3) for a downward gripper turned by ``yaw`` about world z."""
    c, s = np.cos(yaw), np.sin(yaw)
    rz = np.array([[c, -s, 0.0], [s, c, 0.0], [0.0, 0.0, 1.0]])
    return rz @ R_DOWN


class Robot:
    """Index bookkeeping and control for the arm in one ``(model, data)`` pair."""

    def __init__(self, model: mujoco.MjModel, cfg: ControlConfig | None = None):
        self.model, self.cfg = model, cfg or ControlConfig()
        joints = [model.joint(n) for n in ARM_JOINTS]
        self.qadr = np.array([j.qposadr[0] for j in joints])  # (7,)
        self.dadr = np.array([j.dofadr[0] for j in joints])  # (7,)
        self.q_low = np.array([j.range[0] for j in joints])
        self.q_high = np.array([j.range[1] for j in joints])
        self.finger_qadr = np.array([model.joint(n).qposadr[0] for n in FINGER_JOINTS])
        self.finger_dadr = np.array([model.joint(n).dofadr[0] for n in FINGER_JOINTS])
        self.arm_act = np.array([model.actuator(f"act{i}").id for i in range(1, 8)])
        self.finger_act = np.array([model.actuator(f"act_{n}").id for n in FINGER_JOINTS])
        self.tcp = model.site("tcp").id
        self.hand_body = model.body("hand").id
        self.finger_geoms = {
            model.geom(g).id
            for g in range(model.ngeom)
            if model.geom_bodyid[g] in (model.body("finger_l").id, model.body("finger_r").id)
        }
        self._jacp = np.zeros((3, model.nv))
        self._jacr = np.zeros((3, model.nv))
        self.target_pos = np.zeros(3)
        self.target_yaw = 0.0
        self._home: tuple[np.ndarray, float] | None = None

    # ---------------------------------------------------------------- state
    def home_pose(self) -> tuple[np.ndarray, float]:
        """(tcp position (3,), yaw) at the home posture, by forward kinematics (cached)."""
        if self._home is None:
            data = mujoco.MjData(self.model)
            data.qpos[self.qadr] = HOME_Q
            mujoco.mj_kinematics(self.model, data)
            self._home = (data.site_xpos[self.tcp].copy(), self.yaw(data))
        return self._home[0].copy(), self._home[1]

    def reset(self, data: mujoco.MjData, q: np.ndarray = HOME_Q) -> None:
        """Put the arm at posture ``q`` (7,), fingers open, targets on the current tcp pose."""
        data.qpos[self.qadr] = q
        data.qpos[self.finger_qadr] = FINGER_OPEN
        data.qvel[self.dadr] = 0.0
        data.qvel[self.finger_dadr] = 0.0
        data.ctrl[self.arm_act] = q
        data.ctrl[self.finger_act] = FINGER_OPEN
        mujoco.mj_forward(self.model, data)
        self.sync_target(data)

    def sync_target(self, data: mujoco.MjData) -> None:
        """Make the end-effector target equal the current tcp pose."""
        self.target_pos = data.site_xpos[self.tcp].copy()
        self.target_yaw = self.yaw(data)

    def tcp_pos(self, data: mujoco.MjData) -> np.ndarray:
        """Tool centre point position (3,) in world coordinates."""
        return data.site_xpos[self.tcp].copy()

    def tcp_quat(self, data: mujoco.MjData) -> np.ndarray:
        """Tool centre point orientation as a unit quaternion (4,) w, x, y, z."""
        quat = np.zeros(4)
        mujoco.mju_mat2Quat(quat, data.site_xmat[self.tcp])
        return quat

    def yaw(self, data: mujoco.MjData) -> float:
        """Yaw of the tcp x axis about world z, radians."""
        mat = data.site_xmat[self.tcp].reshape(3, 3)
        return float(np.arctan2(mat[1, 0], mat[0, 0]))

    def gripper_width(self, data: mujoco.MjData) -> float:
        """Distance between the finger pads, metres (0 closed .. 0.08 open)."""
        return float(data.qpos[self.finger_qadr].sum())

    def proprio(self, data: mujoco.MjData) -> np.ndarray:
        """(8,) float32: tcp position (3), tcp quaternion (4), gripper width (1)."""
        return np.concatenate(
            [self.tcp_pos(data), self.tcp_quat(data), [self.gripper_width(data)]]
        ).astype(np.float32)

    # ---------------------------------------------------------------- control
    def ik(self, data: mujoco.MjData, pos: np.ndarray, yaw: float) -> np.ndarray:
        """One damped least-squares step from the current posture towards the tcp pose
        (``pos`` (3,), downward gripper at ``yaw``). Returns joint targets (7,) within range."""
        mujoco.mj_jacSite(self.model, data, self._jacp, self._jacr, self.tcp)
        jac = np.concatenate([self._jacp[:, self.dadr], self._jacr[:, self.dadr]])  # (6, 7)
        mat = data.site_xmat[self.tcp].reshape(3, 3)
        target = yaw_matrix(yaw)
        skew = target @ mat.T
        skew = skew - skew.T  # sum_k mat[:, k] x target[:, k] = vee(skew)
        rot_err = 0.5 * np.array([skew[2, 1], skew[0, 2], skew[1, 0]])  # (3,)
        err = np.concatenate([pos - data.site_xpos[self.tcp], rot_err])  # (6,)
        lam2 = self.cfg.damping**2
        jjt = jac @ jac.T + lam2 * np.eye(6)
        pinv = jac.T @ np.linalg.solve(jjt, np.eye(6))  # (7, 6)
        q = data.qpos[self.qadr]
        dq = pinv @ err + (np.eye(7) - pinv @ jac) @ (self.cfg.null_gain * (HOME_Q - q))
        dq = np.clip(dq, -0.3, 0.3)
        return np.clip(q + dq, self.q_low, self.q_high)

    def apply_ee_action(self, data: mujoco.MjData, action: np.ndarray) -> None:
        """Delta end-effector action (5,) in [-1, 1] -> actuator targets in ``data.ctrl``."""
        cfg = self.cfg
        tcp = data.site_xpos[self.tcp]
        pos = self.target_pos + cfg.pos_scale * action[:3]
        pos = np.clip(pos, tcp - cfg.max_lag, tcp + cfg.max_lag)
        self.target_pos = np.clip(pos, cfg.workspace_low, cfg.workspace_high)
        self.target_yaw = float(np.clip(self.target_yaw + cfg.yaw_scale * action[3], -1.6, 1.6))
        data.ctrl[self.arm_act] = self.ik(data, self.target_pos, self.target_yaw)
        self.set_gripper(data, float(action[4]))

    def apply_joint_action(self, data: mujoco.MjData, action: np.ndarray) -> None:
        """Joint-position action (8,) in [-1, 1]: 7 normalised joint targets + gripper."""
        frac = (action[:7] + 1.0) / 2.0
        data.ctrl[self.arm_act] = self.q_low + frac * (self.q_high - self.q_low)
        self.set_gripper(data, float(action[7]))

    def set_gripper(self, data: mujoco.MjData, command: float) -> None:
        """Gripper command in [-1, 1]: -1 fully open, +1 fully closed."""
        data.ctrl[self.finger_act] = FINGER_OPEN * (1.0 - command) / 2.0

    def joint_action_for(self, q: np.ndarray, gripper: float) -> np.ndarray:
        """Inverse of ``apply_joint_action``: the action (8,) that commands posture ``q`` (7,)."""
        frac = (np.asarray(q) - self.q_low) / (self.q_high - self.q_low)
        return np.concatenate([2.0 * frac - 1.0, [gripper]]).astype(np.float32)
