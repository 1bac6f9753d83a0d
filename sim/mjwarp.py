"""`WarpEnv`: N worlds of one task in one MJWarp model, stepped, scored and rendered as a batch.

``env.backend=warp`` makes `sim.vector.VecEnv` drive this backend instead of the CPU one
(`sim.backends.GymBackend`, one ``MjData`` per env in a Python loop). It offers the same backend
surface (``reset(mask, options, seeds)``, ``step(actions [N, A])``, ``get_state``/``set_state``,
the single spaces; see `sim.backends`), so the vector layer's masked resets, chunks, restarts and
snapshots and everything above them run unchanged, and it keeps `ManipEnv`'s semantics:

* **Reset** builds each reset world's initial state on the host with the task's own `ManipEnv`
  (the same layout sampling, colours, instruction and home posture, hence the same initial state
  for the same ``task_id``/``trial_id`` or seed as the CPU backend's env ``i``), then writes it
  into the batch with ``mujoco_warp.set_state`` on those worlds only and their colours into the
  batched ``geom_rgba``. This is the only per-world Python; it runs once per episode.
* **Step** runs on the simulation's device: the delta end-effector controller (damped
  least-squares IK on ``mujoco_warp.jac`` of the tcp site, in float64 on [N] arrays) or joint
  targets, ``frame_skip`` calls of ``mujoco_warp.step`` (captured once as a CUDA graph on a GPU),
  the physics-instability guard per world (non-finite or runaway ``qvel``, or an MJWarp contact /
  constraint overflow, which would drop contacts silently): a world that blows up is truncated and
  restored to its episode's initial state, as `ManipEnv` does.
* **Scoring**: the task's success and shaping functions (`sim.tasks`, written for any leading batch
  shape) score all worlds at once from one host copy of the small world state (tcp, entity
  poses, contacts: a few hundred bytes per world); rewards and flags go to the collector as [N]
  numpy arrays, like the CPU backend's.
* **Rendering**: MJWarp's ray tracer renders every camera of every world into its buffers; the
  images are unpacked into ``uint8`` torch tensors ``[N, H, W, 3]`` on the simulation's device
  (``warp.to_torch``, no host copy), a fresh tensor per observation (the next render overwrites
  MJWarp's buffers). They differ from the CPU renderer's shading (another lighting model); the
  same objects are in the same places.

Derived quantities follow ``mj_step``'s convention: after a step they date from before the last
substep, after a reset from ``mj_forward`` of the reset state (the controller reads them). A
masked reset or restore must not move the other worlds, so it runs on all worlds and puts the
other worlds' per-world arrays back (`WarpEnv._only`).

Precision: MJWarp computes in float32 where MuJoCo uses float64, so trajectories agree with the
CPU backend closely at first and drift apart where contacts amplify differences (measured by the
equivalence tests, see ``tests/sim/test_sim_warp.py``). Not supported here: `sim.focus.SubgoalFocus`
(``subgoal_focus`` and the planner's subgoal view, which wrap one env object), ``entity_features``
and ``render_mode``. The helpers (warp import, `WorldView` for the scripted experts) are in
`sim.warp_support`.
"""

from __future__ import annotations

import logging

import gymnasium as gym
import mujoco
import numpy as np
import torch
from gymnasium.utils import seeding

from .backends import MUJOCO_ONLY, Batch
from .env import OBJ_BOUND, PROPRIO_HIGH, PROPRIO_LOW, ManipEnv
from .robot import FINGER_OPEN, HOME_Q, R_DOWN
from .scene import COLOURS
from .tasks import World
from .warp_support import (
    WorldView,
    contact_capacity,
    import_warp,
    mat_to_quat,
    on_device,
    world_arrays,
)

log = logging.getLogger(__name__)

PHYSICS_SIG = int(mujoco.mjtState.mjSTATE_INTEGRATION)
"""the state ``get_state``/``set_state`` move: MuJoCo's integration state (as `ManipEnv`)"""


class WarpEnv:
    """``n`` worlds of ``env_id`` on one MJWarp model; see the module docstring.

    Args:
        env_id: a registered id (``perceptrl/<Task>-v0``).
        n: number of worlds.
        device: warp device of the simulation ("cpu", "cuda", "cuda:1", ...; "auto": the first
            CUDA device warp sees, else the CPU); the observation images are torch tensors on
            the matching torch device.
        max_episode_steps: time limit (default: the task's registered one).
        **kwargs: `ManipEnv` options (``obs_mode``, ``width``, ``cameras``, ``control``, ...).
    """

    async_ = False

    def __init__(
        self, env_id: str, n: int, device: str = "cpu", max_episode_steps: int | None = None,
        **kwargs,
    ):  # fmt: skip
        if n < 1:
            raise ValueError(f"WarpEnv needs n >= 1 worlds, got {n}")
        if kwargs.get("render_mode") is not None:
            raise ValueError("WarpEnv has no render_mode; its observations carry the images")
        for name in MUJOCO_ONLY:
            if kwargs.get(name):
                raise ValueError(f"WarpEnv has no {name}; use env.backend=mujoco for it")
        spec = gym.spec(env_id)
        self.env_id, self.n = env_id, n
        self.host = ManipEnv(**{**spec.kwargs, **kwargs})
        """one CPU env of the task: layouts, initial states, indices and spaces"""
        self.cfg, self.task = self.host.cfg, self.host.task
        self.time_limit = max_episode_steps or spec.max_episode_steps
        self.single_action_space = self.host.action_space
        self.single_observation_space = self.host.observation_space
        wp, mjw = import_warp()
        self._wp, self._mjw = wp, mjw
        if device == "auto":
            device = "cuda" if wp.get_cuda_device_count() > 0 else "cpu"
        self.device = wp.get_device(device)
        self.torch_device = wp.device_to_torch(self.device)
        self._nstate = mujoco.mj_stateSize(self.host.model, PHYSICS_SIG)
        with wp.ScopedDevice(self.device):
            self._put()
        self._views()
        self._per_world = world_arrays(self.d)
        self._graph = None
        self._graph_failed = False
        # per-world bookkeeping (host): layouts, RNGs, time-limit counts, blow-up counts
        self.layouts: list = [None] * n
        self._rngs = [None] * n
        self.elapsed = np.zeros(n, int)
        self.unstable_count = np.zeros(n, int)
        self._initial = np.zeros((n, self._nstate))
        """each world's episode-initial physics state (restored after a blow-up)"""
        self.host.robot.reset(self.host.data)
        self._home_target = np.array([*self.host.robot.target_pos, self.host.robot.target_yaw])
        """the controller's targets at reset: the tcp pose of the home posture"""
        self._stepped = np.zeros(n, bool)
        """the world's derived quantities date from a step (else from a reset's forward)"""
        self._host: dict | None = None

    # ------------------------------------------------------------------ setup
    def _put(self) -> None:
        """The batched model and data on the device, the work arrays and the renderer."""
        wp, mjw, mjm, n = self._wp, self._mjw, self.host.model, self.n
        self.m = mjw.put_model(mjm, batch_sizes={"geom_rgba": n})
        nconmax, njmax = contact_capacity(self.task)
        self.d = mjw.put_data(mjm, self.host.data, nworld=n, nconmax=nconmax, njmax=njmax)
        self._state = wp.zeros((n, self._nstate), dtype=float)
        self._before_wp = wp.zeros((n, self._nstate), dtype=float)
        self._mask = wp.zeros(n, dtype=bool)
        self._jacp = wp.zeros((n, 3, mjm.nv), dtype=float)
        self._jacr = wp.zeros((n, 3, mjm.nv), dtype=float)
        self._point = wp.zeros(n, dtype=wp.vec3)
        self._body = wp.full(n, self.host.robot.hand_body, dtype=int)
        self.rc = None
        if self.cfg.obs_mode == "rgb":
            self.rc = mjw.create_render_context(
                mjm, nworld=n, cam_res=(self.cfg.width, self.cfg.height), render_rgb=True,
                render_depth=False, cam_active=list(self.cfg.cameras), use_textures=False,
                use_shadows=False,
            )  # fmt: skip

    def _views(self) -> None:
        """Torch views (no copies) of the warp arrays this class reads and writes."""
        T, d, m, h = self._wp.to_torch, self.d, self.m, self.host
        self.t_qpos, self.t_qvel, self.t_ctrl = T(d.qpos), T(d.qvel), T(d.ctrl)
        self.t_site_xpos, self.t_site_xmat = T(d.site_xpos), T(d.site_xmat)
        self.t_mocap_pos, self.t_mocap_quat = T(d.mocap_pos), T(d.mocap_quat)
        self.t_overflow, self.t_rgba = T(d.overflow), T(m.geom_rgba)
        self.t_jacp, self.t_jacr, self.t_point = T(self._jacp), T(self._jacr), T(self._point)
        self.t_state, self.t_mask = T(self._state), T(self._mask)
        self._before = T(self._before_wp)
        """[N, nstate] each world's physics state before its last substep"""
        self.t_nacon = T(d.nacon)
        self.t_con_geom, self.t_con_world = T(d.contact.geom), T(d.contact.worldid)
        dev = self.torch_device
        r = h.robot
        self.i_arm_q = torch.as_tensor(r.qadr, device=dev)
        self.i_arm_v = torch.as_tensor(r.dadr, device=dev)
        self.i_arm_act = torch.as_tensor(r.arm_act, device=dev)
        self.i_finger_act = torch.as_tensor(r.finger_act, device=dev)
        f64 = dict(dtype=torch.float64, device=dev)
        self.q_low, self.q_high = torch.tensor(r.q_low, **f64), torch.tensor(r.q_high, **f64)
        self.home = torch.tensor(HOME_Q, **f64)
        self.ws_low = torch.tensor(r.cfg.workspace_low, **f64)
        self.ws_high = torch.tensor(r.cfg.workspace_high, **f64)
        self.target_pos = torch.zeros(self.n, 3, **f64)
        self.target_yaw = torch.zeros(self.n, **f64)
        self._entity_geoms = {
            key: torch.as_tensor(g, device=dev) for key, g in h.entity_geoms.items()
        }
        self._cam_slices = []
        if self.rc is not None:
            adr = self.rc.rgb_adr.numpy()
            hw = self.cfg.height * self.cfg.width
            for cam in self.cfg.cameras:
                a = int(adr[h.model.camera(cam).id])
                self._cam_slices.append((cam, slice(a, a + hw)))
            self.t_rgb = T(self.rc.rgb_data).view(torch.int32)

    @property
    def envs(self) -> list[WorldView]:
        """One read-only `WorldView` per world: what a scripted expert reads of an env (its
        privileged state, the controller's targets), for demonstrations and oracle checks.
        Each reads a host copy of the batch taken once per step, so N experts cost one copy."""
        return [WorldView(self, i) for i in range(self.n)]

    def host_state(self) -> dict:
        """Host copies (float64 numpy) of the small per-world state, taken once per step or
        reset and shared by scoring, the observations and the experts' views: ``qpos``,
        ``qvel``, ``site_xpos``, ``site_xmat`` [N, nsite, 9], ``mocap_pos``, ``mocap_quat``,
        ``target_pos``, ``target_yaw`` and the batched `World` (``world``)."""
        if self._host is None:
            n = self.n
            hs = {k: getattr(self, "t_" + k).double().cpu().numpy()
                  for k in ("qpos", "qvel", "site_xpos", "mocap_pos", "mocap_quat")}  # fmt: skip
            hs["site_xmat"] = self.t_site_xmat.double().cpu().numpy().reshape(n, -1, 9)
            hs["target_pos"] = self.target_pos.cpu().numpy()
            hs["target_yaw"] = self.target_yaw.cpu().numpy()
            hs["world"] = self._world(hs)
            self._host = hs
        return self._host

    # ------------------------------------------------------------------ masked ops
    def _only(self, mask: np.ndarray, fn) -> None:
        """Run ``fn()`` (an op over all worlds) so that only the worlds of ``mask`` [N] change:
        the other worlds' per-world arrays are put back afterwards."""
        if mask.all():
            fn()
            return
        keep = torch.as_tensor(np.flatnonzero(~mask), device=self.torch_device)
        saved = []
        for arr in self._per_world:
            x = self._wp.to_torch(arr)
            saved.append((x, x[keep].clone()))
        fn()
        for x, old in saved:
            x[keep] = old

    def _set_physics(self, mask: np.ndarray, states: np.ndarray) -> None:
        """Write physics states [k, nstate] (MuJoCo's integration layout) into the worlds of
        ``mask`` (k True entries)."""
        idx = torch.as_tensor(np.flatnonzero(mask), device=self.torch_device)
        self.t_state[idx] = torch.as_tensor(states, dtype=torch.float32, device=self.torch_device)
        self.t_mask.copy_(torch.as_tensor(mask, device=self.torch_device))
        self._mjw.set_state(self.m, self.d, self._state, PHYSICS_SIG, self._mask)

    def _physics(self) -> np.ndarray:
        """[N, nstate] float64: every world's integration state."""
        self._mjw.get_state(self.m, self.d, self._state, PHYSICS_SIG)
        return self.t_state.double().cpu().numpy()

    # ------------------------------------------------------------------ reset
    @on_device
    def reset(self, mask: np.ndarray, options: list, seeds: list) -> tuple[Batch, dict]:
        """Reset the worlds of ``mask`` [N], world i with reset options ``options[i]`` and seed
        ``seeds[i]`` (the backend surface of `sim.backends`). Returns the observations of all N
        worlds and the infos."""
        self._host = None
        idx = np.flatnonzero(mask)
        states = np.zeros((len(idx), self._nstate))
        h = self.host
        for j, i in enumerate(idx.tolist()):
            h._np_random = self._rngs[i]  # None: the host env draws a fresh generator
            h.reset(seed=seeds[i], options=options[i] or None)
            self._rngs[i] = h.np_random
            self.layouts[i] = h.layout
            states[j] = h._physics_state()
            self._colour(i, h.layout)
        self._initial[idx] = states
        self.elapsed[idx] = 0
        self._stepped[idx] = False
        self._restart(mask, states)
        success, terms = self._score(self.host_state()["world"])
        info = self._infos(success, terms, np.zeros(self.n, bool))
        info["instruction"] = np.array([lay.instruction if lay else "" for lay in self.layouts])
        return self._observe(), info

    def _colour(self, i: int, lay) -> None:
        for kind, names in lay.colours.items():
            for e, name in enumerate(names):
                rgba = torch.tensor([*COLOURS[name], 1.0], device=self.torch_device)
                self.t_rgba[i, self._entity_geoms[(kind[:-1], e)]] = rgba

    def _restart(self, mask: np.ndarray, states: np.ndarray, targets=None) -> None:
        """Worlds of ``mask`` start from ``states`` [k, nstate] with fresh solver state,
        derived quantities from a forward pass (as `ManipEnv`'s reset) and the controller's
        ``targets`` [k, 4] (position, yaw; default: the home tcp pose)."""
        wmask = self._wp.array(mask, dtype=bool, device=self.device)

        def fn():
            self._mjw.reset_data(self.m, self.d, wmask)
            self._set_physics(mask, states)
            self._mjw.forward(self.m, self.d)

        self._only(mask, fn)
        self._set_targets(mask, self._home_target[None] if targets is None else targets)

    def _set_targets(self, mask: np.ndarray, targets: np.ndarray) -> None:
        idx = torch.as_tensor(np.flatnonzero(mask), device=self.torch_device)
        t = torch.as_tensor(np.asarray(targets, np.float64), device=self.torch_device)
        self.target_pos[idx] = t[:, :3].expand(len(idx), 3)
        self.target_yaw[idx] = t[:, 3].expand(len(idx))

    # ------------------------------------------------------------------ step
    @on_device
    def step(self, actions):
        """actions [N, A] in [-1, 1] (clipped; NaN -> 0 as `ManipEnv` with
        ``invalid_action="clip"``) -> (Batch, rewards [N], terminated [N], truncated [N],
        infos)."""
        if any(lay is None for lay in self.layouts):
            raise RuntimeError("WarpEnv.step before every world was reset; call reset() first")
        a = torch.as_tensor(np.asarray(actions), device=self.torch_device).double()
        if a.shape != (self.n, *self.single_action_space.shape):
            raise ValueError(
                f"WarpEnv.step got actions of shape {tuple(a.shape)}; expected "
                f"{(self.n, *self.single_action_space.shape)}"
            )
        if self.cfg.invalid_action == "raise" and (
            not torch.isfinite(a).all() or a.abs().max() > 1
        ):
            raise ValueError(
                f"WarpEnv({self.cfg.task}) got an invalid action (NaN/inf or outside [-1, 1]); "
                "fix the policy output or make the env with invalid_action='clip'"
            )
        a = torch.nan_to_num(a, nan=0.0, posinf=0.0, neginf=0.0).clamp(-1.0, 1.0)
        self._host = None
        if self.cfg.control == "ee":
            arm = self._ee_targets(a)
        else:
            arm = self.q_low + (a[:, :7] + 1.0) / 2.0 * (self.q_high - self.q_low)
        ctrl = self.t_ctrl
        ctrl[:, self.i_arm_act] = arm.to(ctrl.dtype)
        grip = FINGER_OPEN * (1.0 - a[:, -1]) / 2.0
        ctrl[:, self.i_finger_act] = grip[:, None].to(ctrl.dtype).expand(-1, 2)
        self._substeps()
        self._stepped[:] = True
        self.elapsed += 1
        unstable = self._unstable()
        if unstable.any():
            self._blow_up(unstable)
        success, terms = self._score(self.host_state()["world"])
        success &= ~unstable
        reward = success.astype(np.float32)
        if self.cfg.reward_mode == "dense" and terms:
            reward += np.mean(np.stack(list(terms.values())), axis=0).astype(np.float32)
        reward[unstable] = 0.0
        terminated = success & self.cfg.terminate_on_success
        truncated = unstable | (self.elapsed >= self.time_limit if self.time_limit else False)
        info = self._infos(success, terms, unstable)
        return self._observe(), reward, terminated, truncated, info

    def _ee_targets(self, a: torch.Tensor) -> torch.Tensor:
        """`Robot.apply_ee_action` on every world: move the targets, one damped least-squares
        IK step -> joint targets [N, 7] (float64)."""
        cfg, tcp_id = self.host.robot.cfg, self.host.robot.tcp
        tcp = self.t_site_xpos[:, tcp_id].double()  # (N, 3)
        pos = self.target_pos + cfg.pos_scale * a[:, :3]
        pos = torch.minimum(torch.maximum(pos, tcp - cfg.max_lag), tcp + cfg.max_lag)
        self.target_pos = torch.minimum(torch.maximum(pos, self.ws_low), self.ws_high)
        self.target_yaw = (self.target_yaw + cfg.yaw_scale * a[:, 3]).clamp(-1.6, 1.6)
        self.t_point.copy_(self.t_site_xpos[:, tcp_id])
        self._mjw.jac(self.m, self.d, self._jacp, self._jacr, self._point, self._body)
        jac = torch.cat([self.t_jacp[:, :, self.i_arm_v], self.t_jacr[:, :, self.i_arm_v]], 1)
        jac = jac.double()  # (N, 6, 7)
        mat = self.t_site_xmat[:, tcp_id].double().reshape(-1, 3, 3)
        c, s = torch.cos(self.target_yaw), torch.sin(self.target_yaw)
        rz = torch.zeros(self.n, 3, 3, dtype=torch.float64, device=self.torch_device)
        rz[:, 0, 0], rz[:, 0, 1], rz[:, 1, 0], rz[:, 1, 1], rz[:, 2, 2] = c, -s, s, c, 1.0
        target = rz @ torch.as_tensor(R_DOWN, device=self.torch_device)
        skew = target @ mat.transpose(1, 2)
        skew = skew - skew.transpose(1, 2)
        rot_err = 0.5 * torch.stack([skew[:, 2, 1], skew[:, 0, 2], skew[:, 1, 0]], -1)
        err = torch.cat([self.target_pos - tcp, rot_err], -1)  # (N, 6)
        eye6 = torch.eye(6, dtype=torch.float64, device=self.torch_device)
        jjt = jac @ jac.transpose(1, 2) + cfg.damping**2 * eye6
        pinv = jac.transpose(1, 2) @ torch.linalg.solve(jjt, eye6.expand(self.n, 6, 6))
        q = self.t_qpos[:, self.i_arm_q].double()
        eye7 = torch.eye(7, dtype=torch.float64, device=self.torch_device)
        null = (eye7 - pinv @ jac) @ (cfg.null_gain * (self.home - q))[..., None]
        dq = (pinv @ err[..., None] + null)[..., 0].clamp(-0.3, 0.3)
        return torch.minimum(torch.maximum(q + dq, self.q_low), self.q_high)

    def _substeps(self) -> None:
        """``frame_skip`` physics steps of every world; the state before the last one is kept
        (`get_state`). On a CUDA device the steps are captured once as a graph."""
        wp, k = self._wp, self.cfg.frame_skip
        if self.device.is_cuda and not self._graph_failed:
            if self._graph is None:
                try:
                    with wp.ScopedCapture(device=self.device) as cap:
                        self._steps(k)
                    self._graph = cap.graph
                except Exception as e:  # noqa: BLE001 - capture is an optimisation only
                    log.warning("CUDA graph capture of the MJWarp step failed (%r); stepping "
                                "without a graph", e)  # fmt: skip
                    self._graph_failed = True
                    self._steps(k)
                    return
            wp.capture_launch(self._graph)
            return
        self._steps(k)

    def _steps(self, k: int) -> None:
        for i in range(k):
            if i == k - 1:  # warp ops only: this may run inside a CUDA graph capture
                self._mjw.get_state(self.m, self.d, self._before_wp, PHYSICS_SIG)
            self._mjw.step(self.m, self.d)

    def _unstable(self) -> np.ndarray:
        """[N] bool: worlds whose physics blew up (non-finite or runaway velocities) or
        overflowed MJWarp's contact or constraint buffers."""
        q, v = self.t_qpos, self.t_qvel
        bad = ~torch.isfinite(q).all(1) | ~torch.isfinite(v).all(1)
        bad |= torch.nan_to_num(v.abs(), nan=0.0).amax(1) > self.cfg.max_qvel
        bad |= self.t_overflow != 0
        return bad.cpu().numpy()

    def _blow_up(self, mask: np.ndarray) -> None:
        """Restore the episode-initial state of the worlds of ``mask`` (`ManipEnv`'s guard)."""
        self.unstable_count += mask
        log.warning(
            "%s: physics blew up in world(s) %s; truncated and restored to the episode's initial "
            "state", self.env_id, np.flatnonzero(mask).tolist(),
        )  # fmt: skip
        self.t_overflow[torch.as_tensor(mask, device=self.torch_device)] = 0
        self._restart(mask, self._initial[mask])
        self._stepped[mask] = False

    # ------------------------------------------------------------------ observation
    def _world(self, hs: dict) -> World:
        """The task state of every world as one batched `World` (host numpy, float64), from
        the host copies ``hs`` and the contact list."""
        h, r = self.host, self.host.robot
        qpos, qvel, mocap = hs["qpos"], hs["qvel"], hs["mocap_pos"]
        site = hs["site_xpos"][:, r.tcp]
        blocks = qpos[:, h.block_qadr[:, None] + np.arange(3)]  # (N, nb, 3)
        vel = np.linalg.norm(qvel[:, h.block_dadr[:, None] + np.arange(3)], axis=-1)
        nb = self.task.n_blocks
        touch = np.zeros((self.n, nb + 1, 3), bool)
        ncon = min(int(self.t_nacon[0]), self.t_con_world.shape[0])
        if ncon and nb:
            g = self.t_con_geom[:ncon].cpu().numpy()
            w = self.t_con_world[:ncon].cpu().numpy()
            touch[w, h._block_of[g[:, 0]], h._side_of[g[:, 1]]] = True
            touch[w, h._block_of[g[:, 1]], h._side_of[g[:, 0]]] = True
        touch_l, touch_r = touch[:, :-1, 1], touch[:, :-1, 2]
        kinds = {k: mocap[:, v].reshape(self.n, -1, 3) for k, v in h.mocap.items()}
        return World(
            site, qpos[:, r.finger_qadr].sum(-1), blocks, kinds["bowl"], kinds["zone"],
            kinds["target"], vel, touch_l & touch_r, touch_l | touch_r,
        )  # fmt: skip

    def _score(self, world: World) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        task = self.task
        success = np.broadcast_to(np.asarray(task.success(world), bool), (self.n,)).copy()
        terms = {
            k: np.broadcast_to(np.asarray(v, np.float64), (self.n,))
            for k, v in task.shaping(world).items()
        }
        return success, terms

    def _infos(self, success, terms, unstable) -> dict:
        info = {f"reward/{k}": v.astype(np.float32) for k, v in terms.items()}
        info["reward/success"] = success.astype(np.float32)
        info["success"] = success
        info["sim_unstable"] = unstable
        return info

    def _observe(self) -> Batch:
        h, r = self.host, self.host.robot
        cfg = self.cfg
        images = {}
        if self.rc is not None:
            self._mjw.refit_bvh(self.m, self.d, self.rc)
            self._mjw.render(self.m, self.d, self.rc)
            for cam, sl in self._cam_slices:
                px = self.t_rgb[:, sl]  # (N, H*W) packed ARGB
                rgb = torch.stack([(px >> 16) & 0xFF, (px >> 8) & 0xFF, px & 0xFF], -1)
                images[cam] = rgb.to(torch.uint8).reshape(self.n, cfg.height, cfg.width, 3)
        hs = self.host_state()
        qpos, tcp = hs["qpos"], hs["site_xpos"][:, r.tcp]
        quat = mat_to_quat(hs["site_xmat"][:, r.tcp].reshape(-1, 3, 3))
        width = qpos[:, r.finger_qadr].sum(-1, keepdims=True)
        proprio = np.concatenate([tcp, quat, width], -1).astype(np.float32)
        objects = None
        if cfg.obs_mode == "state" or cfg.privileged_state:
            blocks = qpos[:, h.block_qadr[:, None] + np.arange(7)]  # (N, nb, 7)
            mp, mq = hs["mocap_pos"], hs["mocap_quat"]
            poses = [blocks] + [
                np.concatenate([mp[:, h.mocap[k]], mq[:, h.mocap[k]]], -1)
                for k in ("bowl", "zone", "target")
            ]
            objects = np.concatenate([p.reshape(self.n, -1) for p in poses], -1)
            objects = np.clip(objects, -OBJ_BOUND, OBJ_BOUND).astype(np.float32)
        instructions = [lay.instruction if lay else "" for lay in self.layouts]
        return Batch(images, np.clip(proprio, PROPRIO_LOW, PROPRIO_HIGH), objects, instructions)

    # ------------------------------------------------------------------ snapshots
    @on_device
    def get_state(self) -> list[dict]:
        """Per world ``{"env": state, "elapsed_steps": t}``, with ``state`` in
        `ManipEnv.get_state`'s format (physics in MuJoCo's integration layout, as float64);
        ``state`` None for a world never reset."""
        now = self._physics()
        before = self._before.double().cpu().numpy()
        targets = torch.cat([self.target_pos, self.target_yaw[:, None]], 1).cpu().numpy()
        out = []
        for i, lay in enumerate(self.layouts):
            if lay is None:
                out.append({"env": None, "elapsed_steps": int(self.elapsed[i])})
                continue
            state = {
                "physics": now[i], "before_last_substep": before[i] if self._stepped[i] else None,
                "layout": {
                    "blocks": lay.blocks, "block_yaw": lay.block_yaw, "bowls": lay.bowls,
                    "zones": lay.zones, "targets": lay.targets,
                    "colours": {k: list(v) for k, v in lay.colours.items()},
                    "instruction": lay.instruction,
                },
                "target_pos": targets[i, :3].copy(), "target_yaw": float(targets[i, 3]),
                "np_random": self._rngs[i].bit_generator.state,
                "unstable_count": int(self.unstable_count[i]),
            }  # fmt: skip
            out.append({"env": state, "elapsed_steps": int(self.elapsed[i])})
        return out

    @on_device
    def set_state(self, states: list[dict | None]) -> None:
        """Continue the episodes of `get_state`'s ``states`` [N] (None entries leave their world
        as it is). A world stepped before its snapshot replays its last substep, so the
        controller reads the derived quantities it read before (as `ManipEnv.set_state`)."""
        if len(states) != self.n:
            raise ValueError(f"WarpEnv.set_state got {len(states)} states for {self.n} worlds")
        from .tasks import Layout

        self._host = None
        fresh, replay = np.zeros(self.n, bool), np.zeros(self.n, bool)
        now = np.zeros((self.n, self._nstate))
        before = np.zeros((self.n, self._nstate))
        targets = np.zeros((self.n, 4))
        for i, s in enumerate(states):
            if s is None or s["env"] is None:
                continue
            e = s["env"]
            if e.get("focus") is not None:
                raise ValueError("WarpEnv cannot restore a focused (subgoal) episode")
            lay = e["layout"]
            self.layouts[i] = Layout(
                np.asarray(lay["blocks"], float).reshape(-1, 3),
                np.asarray(lay["block_yaw"], float),
                np.asarray(lay["bowls"], float).reshape(-1, 3),
                np.asarray(lay["zones"], float).reshape(-1, 3),
                np.asarray(lay["targets"], float).reshape(-1, 3),
                {k: list(v) for k, v in lay["colours"].items()}, str(lay["instruction"]),
            )  # fmt: skip
            self._colour(i, self.layouts[i])
            rng = seeding.np_random(0)[0]
            rng.bit_generator.state = e["np_random"]
            self._rngs[i] = rng
            self.unstable_count[i] = int(e["unstable_count"])
            self.elapsed[i] = int(s["elapsed_steps"] or 0)
            self.host._apply_layout(self.layouts[i])  # the episode's initial state
            self._initial[i] = self.host._physics_state()
            targets[i] = (*np.asarray(e["target_pos"]), float(e["target_yaw"]))
            now[i] = e["physics"]
            if e["before_last_substep"] is None:
                fresh[i] = True
            else:
                replay[i], before[i] = True, e["before_last_substep"]
        if fresh.any():
            self._restart(fresh, now[fresh], targets[fresh])
            self._stepped[fresh] = False
        if replay.any():
            wmask = self._wp.array(replay, dtype=bool, device=self.device)

            def fn():
                self._mjw.reset_data(self.m, self.d, wmask)
                self._set_physics(replay, before[replay])
                self._mjw.step(self.m, self.d)

            self._only(replay, fn)
            self._before[torch.as_tensor(replay, device=self.torch_device)] = torch.as_tensor(
                before[replay], dtype=torch.float32, device=self.torch_device
            )
            self._stepped[replay] = True
            self._set_targets(replay, targets[replay])

    def close(self, force: bool = False) -> None:
        """Release the device arrays (the model, data and render buffers); ``force`` is the
        backend surface's (no workers to end here)."""
        self.rc = self.m = self.d = None
        self._per_world = []
