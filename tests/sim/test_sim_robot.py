"""The arm7 model and its two control modes."""

from __future__ import annotations

import mujoco
import numpy as np

from perceptrl.sim.robot import HOME_Q, Robot
from perceptrl.sim.scene import SceneSpec, build_model


def _robot():
    model = build_model(SceneSpec(n_blocks=1, width=64, height=64))
    data = mujoco.MjData(model)
    robot = Robot(model)
    robot.reset(data)
    return model, data, robot


def _run(model, data, robot, action, steps, ee=True):
    for _ in range(steps):
        (robot.apply_ee_action if ee else robot.apply_joint_action)(data, action)
        for _ in range(25):
            mujoco.mj_step(model, data)


def test_home_pose_points_down_and_holds_still():
    model, data, robot = _robot()
    tcp0 = robot.tcp_pos(data)
    mat = data.site_xmat[robot.tcp].reshape(3, 3)
    assert mat[2, 2] < -0.999  # tcp z axis points at the table
    _run(model, data, robot, np.zeros(5), 40)  # 2 s of zero action: gravity compensated
    assert np.linalg.norm(robot.tcp_pos(data) - tcp0) < 2e-3
    assert np.allclose(data.qpos[robot.qadr], HOME_Q, atol=0.02)


def test_delta_ee_reaches_target_pose():
    model, data, robot = _robot()
    goal, goal_yaw = np.array([0.55, -0.12, 0.12]), 0.6
    for _ in range(60):
        err = (goal - robot.target_pos) / robot.cfg.pos_scale
        dyaw = (goal_yaw - robot.target_yaw) / robot.cfg.yaw_scale
        robot.apply_ee_action(data, np.clip([*err, dyaw, -1.0], -1, 1))
        for _ in range(25):
            mujoco.mj_step(model, data)
    assert np.linalg.norm(robot.tcp_pos(data) - goal) < 0.01
    assert abs(robot.yaw(data) - goal_yaw) < 0.03
    assert data.site_xmat[robot.tcp].reshape(3, 3)[2, 2] < -0.99  # still pointing down


def test_ee_target_stays_in_workspace():
    model, data, robot = _robot()
    _run(model, data, robot, np.array([0, 0, -1.0, 0, -1]), 40)  # push down into the table
    assert robot.target_pos[2] >= robot.cfg.workspace_low[2] - 1e-9
    assert robot.tcp_pos(data)[2] > 0.0


def test_joint_mode_reaches_commanded_posture_and_gripper_closes():
    model, data, robot = _robot()
    q = HOME_Q + np.array([0.3, 0.2, -0.2, 0.3, 0.1, -0.2, 0.4])
    action = robot.joint_action_for(q, gripper=1.0)
    assert np.all(np.abs(action) <= 1)
    _run(model, data, robot, action, 40, ee=False)
    assert np.allclose(data.qpos[robot.qadr], q, atol=0.02)
    assert robot.gripper_width(data) < 0.005
