"""``ManipEnv``: one gymnasium env for every registered task (tasks are data, not subclasses).

Observation (``obs_mode="rgb"``): Dict of ``agentview`` and ``wrist`` uint8 images (H, W, 3),
``proprio`` float32 (8,) = tcp position, tcp quaternion (w, x, y, z), gripper width, and
``instruction`` (gymnasium ``Text``). ``obs_mode="state"`` renders nothing and gives ``objects``
float32 (n_entities * 7,) = position + quaternion of every block, bowl, zone and target, in that
order, task-relevant entity first of each kind (see ``sim.tasks``), plus ``proprio`` and
``instruction``. With ``entity_features`` each entity's pose is followed by its kind and colour
(one-hot; `composite.ENTITY_SIZE` numbers per entity): a policy that is blind to the order of
the entities (`vla.compact.EntityReader`) finds the ones an instruction names by reading it.

Reward: ``reward_mode="sparse"`` gives 1.0 on the step that succeeds (the episode terminates);
``"dense"`` adds the mean of the shaping terms. Every term is in ``info["reward/<term>"]``.
Faults: invalid actions are clipped (NaN -> 0) or raise, per ``invalid_action``; a physics blow-up
truncates the episode with ``info["sim_unstable"] = True`` and leaves a valid, finite state (the
episode's initial state: the observation that comes with it is *not* a successor of the last one,
so a learner must not bootstrap from it).

Long-horizon tasks (``sim.composite``): ``subgoals_done()`` counts the task's subgoals that hold
in order; `sim.focus.SubgoalFocus` wraps the env to show one subgoal as its primitive task.

Snapshots: ``get_state()`` returns everything ``step`` and ``reset`` read besides their arguments
(MuJoCo's full integration state, the layout, the controller's targets, ``np_random``), and
``set_state`` on another env built with the same options continues the episode bit for bit (the
time-limit wrapper's count is not the env's; the vector envs carry it, `sim.backends.VectorSlot`).
"""

from __future__ import annotations

from dataclasses import dataclass

import gymnasium as gym
import mujoco
import numpy as np
from gymnasium import spaces

from ..schema import choice, from_dict
from .composite import ENTITY_KINDS, ENTITY_SIZE, POSE_SIZE, progress
from .render import make_renderer
from .robot import ControlConfig, Robot
from .scene import COLOURS, SceneSpec, build_model
from .spaces import InstructionText
from .tasks import Layout, Task, World, get_task, layout, task_counts
from .wording import WORDINGS

CHARSET = " abcdefghijklmnopqrstuvwxyz"
"""characters an instruction may contain"""
MAX_INSTRUCTION = 160
"""maximum instruction length (characters; a long-horizon task's run to about 130)"""
OBS_MODES = ("rgb", "state")
CONTROLS = ("ee", "joint")
REWARD_MODES = ("sparse", "dense")
INVALID_ACTIONS = ("clip", "raise")
OBJ_BOUND = 10.0
"""bound of the state-mode entity poses (positions are clipped to +-10 m)"""
PROPRIO_LOW = np.array([-2, -2, -2, -1, -1, -1, -1, 0], np.float32)
PROPRIO_HIGH = np.array([2, 2, 2, 1, 1, 1, 1, 0.1], np.float32)
PHYSICS_STATE = mujoco.mjtState.mjSTATE_INTEGRATION
"""what ``get_state`` snapshots of ``mjData``: everything ``mj_step`` reads (time, qpos, qvel,
act, history, warm start, controls, applied forces, mocap poses, equality flags, user data)"""
_BAD_WARNINGS = tuple(
    int(getattr(mujoco.mjtWarning, n))
    for n in ("mjWARN_BADQPOS", "mjWARN_BADQVEL", "mjWARN_BADQACC", "mjWARN_BADCTRL")
)


@dataclass(frozen=True)
class ManipEnvConfig:
    """Options of ``ManipEnv`` (all keyword arguments of ``gymnasium.make``), checked by the
    one option loader (`perceptrl.schema.from_dict`: unknown options name the nearest one,
    values must fit their types and choices)."""

    task: str = "reach"
    """registered task name (``sim.tasks.TASKS``)"""
    obs_mode: str = choice("rgb", OBS_MODES)
    """"rgb": cameras + proprio + instruction; "state": entity poses + proprio + instruction"""
    width: int = 128
    """camera image width (64 to 224 are sensible)"""
    height: int = 128
    """camera image height"""
    cameras: tuple[str, ...] = ("agentview", "wrist")
    """cameras rendered into the observation, in order"""
    privileged_state: bool = False
    """rgb mode also returns the entity poses as ``objects`` (as in state mode), for an
    asymmetric critic that learns values from the true state; a policy must not act on them"""
    entity_features: bool = False
    """``objects`` lists each entity's pose, kind and colour (`composite.ENTITY_SIZE` numbers):
    for a policy that reads which entities the instruction names instead of taking them from
    the order"""
    control: str = choice("ee", CONTROLS)
    """"ee": (dx, dy, dz, dyaw, gripper); "joint": (q1..q7, gripper), all in [-1, 1]"""
    reward_mode: str = choice("sparse", REWARD_MODES)
    """"sparse": 1 on success; "dense": success + mean of the shaping terms"""
    invalid_action: str = choice("clip", INVALID_ACTIONS)
    """"clip": NaN -> 0 then clip to [-1, 1]; "raise": ValueError on NaN or out of range"""
    frame_skip: int = 25
    """physics steps (2 ms each) per env step: 25 -> 20 Hz control"""
    wording: str = choice("train", WORDINGS)
    """instructions from the task's training templates, or in a held-out wording
    (`sim.wording`: paraphrase, synonym, distractor) for the same scenes"""
    terminate_on_success: bool = True
    """end the episode (terminated=True) on the first success"""
    max_qvel: float = 1e3
    """any |qvel| above this counts as a physics blow-up"""


class ManipEnv(gym.Env):
    """Tabletop manipulation with a language instruction; see the module docstring."""

    metadata = {"render_modes": ["rgb_array"], "render_fps": 20}

    def __init__(self, render_mode: str | None = None, **kwargs):
        self.cfg = cfg = from_dict(ManipEnvConfig, kwargs, where="ManipEnv")
        self.task: Task = get_task(cfg.task)
        self.render_mode = render_mode
        self.scene_spec = SceneSpec(
            self.task.n_blocks,
            self.task.n_bowls,
            self.task.n_zones,
            self.task.n_targets,
            cfg.width,
            cfg.height,
        )
        self.model = build_model(self.scene_spec)
        self.data = mujoco.MjData(self.model)
        self.robot = Robot(self.model, ControlConfig())
        self._index_entities()
        self._renderer: mujoco.Renderer | None = None  # created lazily (EGL after fork)
        self.metadata = {**self.metadata, "render_fps": round(1.0 / self.dt)}
        act_dim = 5 if cfg.control == "ee" else 8
        self.action_space = spaces.Box(-1.0, 1.0, (act_dim,), np.float32)
        self.observation_space = self._obs_space()
        self.layout: Layout | None = None
        self.layout_rng: np.random.Generator | None = None
        """the generator the episode's layout was drawn from (``np_random``, or for an indexed
        initial state one seeded by its ids), where the layout's draws left it: whatever else an
        episode start draws (`sim.focus.SubgoalFocus`'s subgoal) continues it, so an indexed
        initial state fixes that too"""
        self._warnings = 0
        self.unstable_count = 0
        """number of physics blow-ups seen by this env (over all episodes)"""
        self._state_size = mujoco.mj_stateSize(self.model, PHYSICS_STATE)
        self._before_last_substep: np.ndarray | None = None
        """physics state before the last ``mj_step`` of the last ``step`` (None after a reset):
        ``mjData``'s derived quantities (site poses, contacts) date from that substep, and the
        controller reads them, so ``set_state`` replays it to restore them exactly"""

    @property
    def dt(self) -> float:
        """Seconds of simulated time per env step."""
        return self.model.opt.timestep * self.cfg.frame_skip

    # ---------------------------------------------------------------- setup
    def _index_entities(self) -> None:
        m, t = self.model, self.task
        self.block_qadr = np.array(
            [m.joint(f"block{i}").qposadr[0] for i in range(t.n_blocks)], dtype=int
        )
        self.block_dadr = np.array(
            [m.joint(f"block{i}").dofadr[0] for i in range(t.n_blocks)], dtype=int
        )
        self.block_geom = np.array([m.geom(f"block{i}").id for i in range(t.n_blocks)], dtype=int)
        self.mocap = {
            kind: np.array([m.body(f"{kind}{i}").mocapid[0] for i in range(n)], dtype=int)
            for kind, n in (("bowl", t.n_bowls), ("zone", t.n_zones), ("target", t.n_targets))
        }
        self.entity_geoms = {
            (kind, i): [g for g in range(m.ngeom) if m.geom_bodyid[g] == m.body(f"{kind}{i}").id]
            for kind, n in (
                ("block", t.n_blocks),
                ("bowl", t.n_bowls),
                ("zone", t.n_zones),
                ("target", t.n_targets),
            )
            for i in range(n)
        }
        self.n_entities = t.n_blocks + t.n_bowls + t.n_zones + t.n_targets
        fingers = np.array(sorted(self.robot.finger_geoms))
        left = m.geom_bodyid[fingers] == m.body("finger_l").id
        # geom -> block index (n_blocks = none) and geom -> finger side (0 none, 1 left, 2 right)
        self._block_of = np.full(m.ngeom, t.n_blocks, dtype=int)
        self._block_of[self.block_geom] = np.arange(t.n_blocks)
        self._side_of = np.zeros(m.ngeom, dtype=int)
        self._side_of[fingers] = np.where(left, 1, 2)

    def _obs_space(self) -> spaces.Dict:
        cfg = self.cfg
        obs = {}
        if cfg.obs_mode == "rgb":
            for cam in cfg.cameras:
                obs[cam] = spaces.Box(0, 255, (cfg.height, cfg.width, 3), np.uint8)
        if cfg.obs_mode == "state" or cfg.privileged_state:
            size = ENTITY_SIZE if cfg.entity_features else POSE_SIZE
            obs["objects"] = spaces.Box(
                -OBJ_BOUND, OBJ_BOUND, (self.n_entities * size,), np.float32
            )
        obs["proprio"] = spaces.Box(PROPRIO_LOW, PROPRIO_HIGH, (8,), np.float32)
        obs["instruction"] = InstructionText(MAX_INSTRUCTION, min_length=1, charset=CHARSET)
        return spaces.Dict(obs)

    # ---------------------------------------------------------------- reset
    def reset(self, *, seed: int | None = None, options: dict | None = None):
        """Start an episode. ``options={"task_id": i, "trial_id": j}`` replays exactly the
        initial state (i, j): colours and instruction depend on ``task_id`` only, positions on
        both; without them the layout comes from ``self.np_random``."""
        super().reset(seed=seed)
        options = options or {}
        tid = trial = None
        if "task_id" in options or "trial_id" in options:
            tid, trial = int(options.get("task_id", 0)), int(options.get("trial_id", 0))
            colour_rng = np.random.default_rng([tid])
            pos_rng = np.random.default_rng([tid, trial])
        else:
            colour_rng = pos_rng = self.np_random
        self.layout = layout(self.task, colour_rng, pos_rng, self.cfg.wording)
        self.layout_rng = pos_rng
        self._apply_layout(self.layout)
        self._warnings = self._warning_count()
        _, _, info = self.score(self.task, self.world())
        info["instruction"] = self.layout.instruction
        if tid is not None:
            info["task_id"], info["trial_id"] = tid, trial
        return self.observe(), info

    def _apply_layout(self, lay: Layout) -> None:
        m, d = self.model, self.data
        mujoco.mj_resetData(m, d)
        for i, (pos, yaw) in enumerate(zip(lay.blocks, lay.block_yaw, strict=True)):
            adr = self.block_qadr[i]
            d.qpos[adr : adr + 3] = pos
            d.qpos[adr + 3 : adr + 7] = [np.cos(yaw / 2), 0.0, 0.0, np.sin(yaw / 2)]
        for kind, arr in (("bowl", lay.bowls), ("zone", lay.zones), ("target", lay.targets)):
            for i, pos in enumerate(arr):
                d.mocap_pos[self.mocap[kind][i]] = pos
        self._apply_colours(lay)
        self.robot.reset(d)  # also runs mj_forward
        self._before_last_substep = None

    def _apply_colours(self, lay: Layout) -> None:
        for kind, names in lay.colours.items():
            for i, name in enumerate(names):
                rgb = COLOURS[name]
                for g in self.entity_geoms[(kind[:-1], i)]:
                    self.model.geom_rgba[g] = (*rgb, 1.0)

    # ---------------------------------------------------------------- step
    def step(self, action):
        """Apply one action for ``frame_skip`` physics steps; see the module docstring."""
        action = self._check_action(action)
        if self.cfg.control == "ee":
            self.robot.apply_ee_action(self.data, action)
        else:
            self.robot.apply_joint_action(self.data, action)
        for i in range(self.cfg.frame_skip):
            if i == self.cfg.frame_skip - 1:
                self._before_last_substep = self._physics_state()
            mujoco.mj_step(self.model, self.data)
        if self._unstable():
            return self._fail_unstable()
        reward, terminated, info = self.score(self.task, self.world())
        return self.observe(), reward, terminated, False, info

    def score(self, task: Task, world: World, unstable: bool = False) -> tuple[float, bool, dict]:
        """(reward, terminated, info) of ``task`` in ``world`` under this env's reward options:
        info has every shaping term (``reward/<term>``), ``reward/success``, ``success`` and
        ``sim_unstable``; the reward is the success (plus the mean shaping term when dense), and
        a physics blow-up (``unstable``) scores 0 and does not terminate."""
        success = task.success(world)
        info = {f"reward/{k}": float(v) for k, v in task.shaping(world).items()}
        info["reward/success"] = float(success)
        info["success"] = bool(success)
        info["sim_unstable"] = unstable
        if unstable:
            return 0.0, False, info
        reward = float(success)
        if self.cfg.reward_mode == "dense":
            terms = [
                v for k, v in info.items() if k.startswith("reward/") and k != "reward/success"
            ]
            reward += float(np.mean(terms)) if terms else 0.0
        return reward, bool(success and self.cfg.terminate_on_success), info

    def _check_action(self, action) -> np.ndarray:
        a = np.asarray(action, dtype=np.float64).reshape(-1)
        if a.shape != self.action_space.shape:
            raise ValueError(
                f"ManipEnv({self.cfg.task}) got an action of shape {a.shape}; expected "
                f"{self.action_space.shape} for control={self.cfg.control!r}"
            )
        finite = np.isfinite(a)
        if self.cfg.invalid_action == "raise":
            if not finite.all() or np.abs(a).max() > 1.0:
                raise ValueError(
                    f"ManipEnv({self.cfg.task}) got an invalid action {a.tolist()} (NaN/inf or "
                    "outside [-1, 1]); fix the policy output or make the env with "
                    "invalid_action='clip'"
                )
            return a
        return np.clip(np.where(finite, a, 0.0), -1.0, 1.0)

    def _warning_count(self) -> int:
        return int(sum(self.data.warning[w].number for w in _BAD_WARNINGS))

    def _unstable(self) -> bool:
        d = self.data
        count = self._warning_count()
        bad = count > self._warnings
        self._warnings = count
        return bool(
            bad
            or not np.isfinite(d.qpos).all()
            or not np.isfinite(d.qvel).all()
            or np.abs(d.qvel).max() > self.cfg.max_qvel
        )

    def _fail_unstable(self):
        """Truncate after a blow-up: restore the episode's initial state so obs stay finite."""
        self.unstable_count += 1
        self._apply_layout(self.layout)
        self._warnings = self._warning_count()
        _, _, info = self.score(self.task, self.world(), unstable=True)
        return self.observe(), 0.0, False, True, info

    # ---------------------------------------------------------------- snapshots
    def _physics_state(self) -> np.ndarray:
        """(nstate,) float64 `PHYSICS_STATE` of ``self.data``."""
        out = np.empty(self._state_size)
        mujoco.mj_getState(self.model, self.data, out, PHYSICS_STATE)
        return out

    def get_state(self) -> dict | None:
        """A snapshot of the episode in flight (None before the first reset): numpy arrays and
        plain Python values. See the module docstring and `set_state`."""
        if self.layout is None:
            return None
        lay = self.layout
        return {
            "physics": self._physics_state(),
            "before_last_substep": self._before_last_substep,
            "layout": {
                "blocks": lay.blocks, "block_yaw": lay.block_yaw, "bowls": lay.bowls,
                "zones": lay.zones, "targets": lay.targets,
                "colours": {k: list(v) for k, v in lay.colours.items()},
                "instruction": lay.instruction,
            },
            "target_pos": self.robot.target_pos.copy(),
            "target_yaw": float(self.robot.target_yaw),
            "np_random": self.np_random.bit_generator.state,
            "unstable_count": self.unstable_count,
        }  # fmt: skip

    def set_state(self, state: dict | None) -> None:
        """Continue the episode ``state`` (from `get_state` of an env built with the same
        options) exactly where it was; None leaves the env as it is. Raises RuntimeError when
        the restored physics does not reproduce the snapshot bit for bit."""
        if state is None:
            return
        lay = state["layout"]
        self.layout = Layout(
            np.asarray(lay["blocks"], float).reshape(-1, 3), np.asarray(lay["block_yaw"], float),
            np.asarray(lay["bowls"], float).reshape(-1, 3),
            np.asarray(lay["zones"], float).reshape(-1, 3),
            np.asarray(lay["targets"], float).reshape(-1, 3),
            {k: list(v) for k, v in lay["colours"].items()}, str(lay["instruction"]),
        )  # fmt: skip
        self._apply_colours(self.layout)
        m, d = self.model, self.data
        want = np.asarray(state["physics"], np.float64)
        before = state["before_last_substep"]
        if before is None:  # right after a reset: derived quantities are those of mj_forward
            mujoco.mj_setState(m, d, want, PHYSICS_STATE)
            mujoco.mj_forward(m, d)
        else:  # replay the last substep: its derived quantities are what the controller reads
            mujoco.mj_setState(m, d, np.asarray(before, np.float64), PHYSICS_STATE)
            mujoco.mj_step(m, d)
        self._before_last_substep = None if before is None else np.array(before, np.float64)
        if not np.array_equal(self._physics_state(), want):
            raise RuntimeError(
                f"ManipEnv({self.cfg.task}).set_state did not reproduce the snapshot's physics "
                "exactly (was it taken by an env with other options or another MuJoCo build?)"
            )
        self.robot.target_pos = np.array(state["target_pos"], np.float64)
        self.robot.target_yaw = float(state["target_yaw"])
        self.np_random.bit_generator.state = state["np_random"]
        self.unstable_count = int(state["unstable_count"])
        self._warnings = self._warning_count()

    # ---------------------------------------------------------------- observation
    def subgoals_done(self) -> int:
        """How many of the task's subgoals hold, in order (0 for a primitive task)."""
        return int(progress(self.world(), self.task.subgoals))

    def world(self) -> World:
        """Privileged snapshot of the task state (for success, shaping and scripted experts)."""
        d, t = self.data, self.task
        blocks = np.array([d.qpos[a : a + 3] for a in self.block_qadr]).reshape(-1, 3)
        vel = np.array([np.linalg.norm(d.qvel[a : a + 3]) for a in self.block_dadr])
        g1, g2 = d.contact.geom1[: d.ncon], d.contact.geom2[: d.ncon]  # (ncon,)
        touch = np.zeros((t.n_blocks + 1, 3), bool)  # [block (+1 for "none"), finger side]
        touch[self._block_of[g1], self._side_of[g2]] = True
        touch[self._block_of[g2], self._side_of[g1]] = True
        touch_l, touch_r = touch[:-1, 1], touch[:-1, 2]
        mocap = {k: d.mocap_pos[v].copy().reshape(-1, 3) for k, v in self.mocap.items()}
        return World(
            self.robot.tcp_pos(d),
            self.robot.gripper_width(d),
            blocks,
            mocap["bowl"],
            mocap["zone"],
            mocap["target"],
            vel,
            touch_l & touch_r,
            touch_l | touch_r,
        )

    def observe(self) -> dict:
        """The observation of the current state (what ``reset`` and ``step`` return)."""
        d = self.data
        obs = {}
        if self.cfg.obs_mode == "rgb":
            for cam in self.cfg.cameras:
                obs[cam] = self._render(cam)
        if self.cfg.obs_mode == "state" or self.cfg.privileged_state:
            obs["objects"] = self._objects()
        obs["proprio"] = np.clip(self.robot.proprio(d), PROPRIO_LOW, PROPRIO_HIGH)
        obs["instruction"] = self.layout.instruction
        return obs

    def _objects(self) -> np.ndarray:
        """The state observation's entities in the scene's order: position and quaternion
        each, and with ``entity_features`` its kind and colour (one-hot over `ENTITY_KINDS` and
        `COLOURS`)."""
        d, names = self.data, list(COLOURS)
        counts, rows = task_counts(self.task), []
        for kind in ENTITY_KINDS:
            at = np.arange(counts[kind])
            if kind == "blocks":
                poses = [d.qpos[a : a + 7] for a in self.block_qadr[at]]
            else:
                ids = self.mocap[kind[:-1]][at]
                poses = [np.concatenate([d.mocap_pos[i], d.mocap_quat[i]]) for i in ids]
            for i, pose in zip(at, poses, strict=True):
                if not self.cfg.entity_features:
                    rows.append(pose)
                    continue
                row = np.zeros(ENTITY_SIZE)
                row[:POSE_SIZE] = pose
                row[POSE_SIZE + ENTITY_KINDS.index(kind)] = 1.0
                row[POSE_SIZE + len(ENTITY_KINDS) + names.index(self.layout.colours[kind][i])] = 1
                rows.append(row)
        return np.clip(np.concatenate(rows), -OBJ_BOUND, OBJ_BOUND).astype(np.float32)

    def _render(self, camera: str) -> np.ndarray:
        if self._renderer is None:
            self._renderer = make_renderer(self.model, self.cfg.height, self.cfg.width)
        self._renderer.update_scene(self.data, camera)
        return self._renderer.render().copy()

    def render(self):
        """``render_mode="rgb_array"``: the agent-view image (H, W, 3) uint8."""
        if self.render_mode == "rgb_array":
            return self._render("agentview")
        return None

    def close(self):
        if self._renderer is not None:
            self._renderer.close()
            self._renderer = None
