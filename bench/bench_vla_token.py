"""Why the token VLA learns slowly on 2 cores: action resolution against perception.

Issue 19 asks the token VLA (a VLM emitting action tokens, OpenVLA's architecture) to gain 20
points with GRPO over a behaviour-cloning warm start, and, if it does not learn at this size, to
find out why (action-token resolution, sampling, scenes per batch). Three measurements on reach:

1. **Resolution bound**: the scripted expert with its actions binned to ``b`` tokens per
   dimension (encode, decode to bin centres, execute), and with uniform noise of ``±n`` bins on
   every token, on ``--episodes`` held-out initial states. If the binned expert succeeds, the
   bins are not what limits the policy.
2. **Warm start**: behaviour cloning with the shipped recipe (``configs/vla_bc_token.yaml``,
   overrides from the command line) for ``--bc-steps``; held-out success with the most likely
   tokens and with sampled tokens.
3. **Perception**: the cloned policy's loss (nats per policy step, the sum over its action
   tokens) on fresh expert data, with each step's own camera images and with the images of
   another step of the batch (another scene), and per action dimension. If the loss with other
   scenes' images is no worse, the policy ignores the images; if it is worse but the loss on the
   position dimensions stays high, it sees the scene but cannot place the target precisely.
4. **The instruction**: the same loss with the named target's colour in the instruction replaced
   by another target's (same scenes, same expert actions). If it is no worse, the policy does
   not read which target the instruction names.
5. **Where it goes**: on the held-out episodes (greedy), the gripper's start distance to the named
   target, the closest it came to it and to the nearest other target, and how often the target
   it came closest to is the named one (chance: one in the number of targets). A policy that
   has learnt the task homes in on the named target; one that has learnt only the motion
   statistics wanders between them.

``--alone`` clones the expert on reach without distractors (one target, registered here as
``perceptrl/ReachAlone-v0``): the instruction is then not needed to find the target, which
separates reading the instruction from seeing where the target is. ``--reuse`` keeps the behaviour-cloning run under ``--out`` and the figures of the result file
``--name`` measured from it, and adds the read-outs the file lacks (3-5). ``--eval-every E``
also evaluates during behaviour cloning (``env.eval_episodes`` held-out
episodes, most likely tokens) and keeps the curve; scenes per batch are the recipe's
``env.num_envs`` (one episode per env is in progress at a time, ``env.steps_per_rollout`` steps
of each per batch), e.g. ``env.num_envs=64 env.steps_per_rollout=2`` for 64 scenes per batch
at the same batch size.

    MUJOCO_GL=egl python bench/bench_vla_token.py [--bc-steps 150] [--eval-every E] [--name N]
        [overrides ...]

Writes bench/results/<--name>.{json,md} (default vla_token_diagnosis).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from pathlib import Path

os.environ.setdefault("MUJOCO_GL", "egl")

import numpy as np  # noqa: E402
import torch  # noqa: E402  (import torch before any rendering)
from common import last_model, machine, metrics, write_results  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
BINS = (3, 9, 31, 256)
NOISE = ((31, 2), (256, 16))
"""(bins, ±noise in bins) of the noisy binned expert"""


def binned_expert(task: str, bins: int, episodes: int, seed0: int, noise: int = 0) -> float:
    """Success of the scripted expert whose every action goes through ``bins`` action tokens
    (`sim.expert.rollout_expert` on the env wrapped to bin, and perturb, what it receives)."""
    import gymnasium as gym
    from gymnasium.wrappers import TransformAction

    import perceptrl.sim  # noqa: F401  (registers the tasks)
    from perceptrl.sim.expert import rollout_expert
    from perceptrl.vla.tokenizer import ActionTokenizer

    tok = ActionTokenizer(first_id=0, bins=bins)
    rng = np.random.default_rng(0)

    def binned(action: np.ndarray) -> np.ndarray:
        ids = tok.encode(torch.as_tensor(action, dtype=torch.float32)[None, None])  # (1, D)
        if noise:
            ids = ids + torch.as_tensor(rng.integers(-noise, noise + 1, size=ids.shape))
            ids = ids.clamp(0, bins - 1)
        return tok.decode(ids, ids.shape[-1])[0, 0].numpy()

    raw = gym.make(task, obs_mode="state")
    env = TransformAction(raw, binned, raw.action_space)
    try:
        wins = [rollout_expert(env, seed=seed0 + e)["success"] for e in range(episodes)]
    finally:
        env.close()
    return sum(wins) / episodes


@torch.no_grad()
def perception(policy, env_cfg, batches: int = 4) -> dict:
    """Loss of ``policy`` on fresh expert steps with their own images and with another step's."""
    from perceptrl.vla.bc import ExpertSource
    from perceptrl.vla.envs import VecRunner

    runner = VecRunner(env_cfg, seed=777)  # scenes neither BC nor evaluation drew
    source = ExpertSource(policy, runner, batch_steps=16)
    own, other, per_dim = [], [], []
    try:
        for step in range(batches):
            flat = policy.flat_batch(source.next_batch(step))
            nll = -policy.vlm.evaluate(flat).logp  # (N, K*D)
            own.append(float(nll.sum(-1).mean()))
            per_dim.append(nll.mean(0))
            prompts = dict(flat.prompts)
            pixels = prompts["pixel_values"]  # half the batch away: another scene's images
            prompts["pixel_values"] = pixels[len(pixels) // 2 :] + pixels[: len(pixels) // 2]
            shuffled = policy.vlm.evaluate(dataclasses.replace(flat, prompts=prompts))
            other.append(float(-shuffled.logp.sum(-1).mean()))
    finally:
        runner.close()
    return {
        "loss_own_images": float(np.mean(own)),
        "loss_other_scenes_images": float(np.mean(other)),
        "loss_per_token": torch.stack(per_dim).mean(0).tolist(),
    }


ALONE = "perceptrl/ReachAlone-v0"
"""reach with its named target only (``--alone``)"""


def register_alone() -> None:
    """Register reach without distractors as `ALONE` in this process (idempotent)."""
    import perceptrl.sim as sim
    from perceptrl.sim.tasks import TASKS, reach_task

    if "reach_alone" not in TASKS:
        sim.register_task(reach_task("reach_alone", n_distractors=0))
    sim.register_envs()


class _OtherColour:
    """``policy.observe`` with the named target's colour in every instruction replaced by the
    next target's (the reach task names ``targets[0]``)."""

    def __init__(self, policy, runner):
        self.policy, self.runner = policy, runner

    def observe(self, batch):
        texts = []
        for env, text in zip(self.runner.envs, batch.instructions, strict=True):
            colours = env.unwrapped.layout.colours["targets"]
            texts.append(text.replace(colours[0], colours[1]))
        return self.policy.observe(dataclasses.replace(batch, instructions=texts))


@torch.no_grad()
def instruction_loss(policy, env_cfg, batches: int = 4) -> dict:
    """Loss of ``policy`` on fresh expert steps with the true instruction and with another
    target's colour in it: two expert streams from the same seeds (identical scenes and
    actions, checked), prompted differently."""
    from perceptrl.vla.bc import ExpertSource
    from perceptrl.vla.envs import VecRunner

    losses, actions = {}, {}
    for name in ("named", "other_colour"):
        runner = VecRunner(dataclasses.replace(env_cfg, async_envs=False), seed=778)
        if runner.envs[0].unwrapped.task.n_targets < 2:
            runner.close()
            return None
        reader = policy if name == "named" else _OtherColour(policy, runner)
        source = ExpertSource(reader, runner, batch_steps=16)
        try:
            flats = [policy.flat_batch(source.next_batch(step)) for step in range(batches)]
        finally:
            runner.close()
        actions[name] = torch.cat([f.tokens for f in flats])
        losses[name] = float(np.mean([-policy.vlm.evaluate(f).logp.sum(-1).mean() for f in flats]))
    if not torch.equal(actions["named"], actions["other_colour"]):
        raise RuntimeError("the two expert streams differ; the comparison needs identical scenes")
    return {"loss_named_colour": losses["named"], "loss_other_colour": losses["other_colour"]}


@torch.no_grad()
def approach(policy, env_cfg, episodes: int, seed0: int) -> dict:
    """Greedy held-out episodes (seeds ``seed0 + j``): the gripper's distance to the named
    target at the start, the closest it came to it and to the nearest other target, and the
    share of episodes whose closest target is the named one (targets[0] of the reach task; the
    last two None without other targets). None for a task without targets."""
    from perceptrl.vla.envs import VecRunner

    runner = VecRunner(dataclasses.replace(env_cfg, async_envs=False), seed=seed0)
    envs = [e.unwrapped for e in runner.envs]
    if envs[0].task.n_targets < 1:
        runner.close()
        return None
    start, named, other, right = [], [], [], []
    try:
        for first in range(0, episodes, runner.n):
            n = min(runner.n, episodes - first)
            batch = runner.reset(seeds=[seed0 + first + i for i in range(runner.n)])
            gaps = [np.linalg.norm(e.world().targets - e.world().tcp, axis=-1) for e in envs]
            closest = np.stack(gaps)  # (N, targets)
            start.extend(closest[:n, 0].tolist())
            live = np.ones(runner.n, bool)
            while live.any():
                actions, _, _ = policy.act(policy.observe(batch), deterministic=True)
                res = runner.step(actions.numpy().reshape(runner.n, -1, runner.action_dim))
                batch = res.batch
                for i, e in enumerate(envs):
                    if live[i]:
                        w = e.world()
                        gap = np.linalg.norm(w.targets - w.tcp, axis=-1)
                        closest[i] = np.minimum(closest[i], gap)
                live &= ~(res.terminated | res.truncated)
            named.extend(closest[:n, 0].tolist())
            if closest.shape[1] > 1:
                other.extend(closest[:n, 1:].min(-1).tolist())
                right.extend((closest[:n].argmin(-1) == 0).tolist())
    finally:
        runner.close()
    return {
        "start_distance": float(np.mean(start)),
        "closest_to_named": float(np.mean(named)),
        "closest_to_other": float(np.mean(other)) if other else None,
        "closest_is_named": float(np.mean(right)) if right else None,
        "targets": int(closest.shape[1]),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--task", default="perceptrl/Reach-v0")
    ap.add_argument("--bc-steps", type=int, default=150)
    ap.add_argument("--episodes", type=int, default=64, help="held-out episodes per figure")
    ap.add_argument("--eval-every", type=int, default=0, help="evaluate during BC (0: only after)")
    ap.add_argument("--out", default="runs/bench_vla_token")
    ap.add_argument("--name", default="vla_token_diagnosis", help="result file under bench/results")
    ap.add_argument("--alone", action="store_true", help="reach without distractors (see above)")
    ap.add_argument("--reuse", action="store_true",
                    help="keep the BC run and the result file's figures; add what it lacks")  # fmt: skip
    ap.add_argument("overrides", nargs="*", help="dotted overrides for the BC recipe")
    args = ap.parse_args()
    if args.alone or args.task == ALONE:
        register_alone()
        args.task = ALONE
    if args.reuse:
        return add_readouts(args)

    from perceptrl.vla.evaluate import evaluate_policy
    from perceptrl.vla.run import load_policy, run_sft

    cfg = bc_config(args.task, args.bc_steps, args.eval_every, args.overrides)
    seed0 = cfg.env.eval_seed
    t = time.perf_counter()
    bound = {str(b): binned_expert(args.task, b, args.episodes, seed0) for b in BINS}
    noisy = {f"{b}±{n}": binned_expert(args.task, b, args.episodes, seed0, n) for b, n in NOISE}
    expert_s = time.perf_counter() - t
    out = Path(args.out)
    t = time.perf_counter()
    run_sft(cfg, out)
    bc_s = time.perf_counter() - t
    policy = load_policy(last_model(out))
    torch.manual_seed(0)
    sampled = evaluate_policy(policy, cfg.env, episodes=args.episodes, deterministic=False)
    det = evaluate_policy(policy, cfg.env, episodes=args.episodes)
    seen = perception(policy, cfg.env)
    went = approach(policy, cfg.env, args.episodes, seed0)
    curve = [(r["step"], r["eval/success_rate"]) for r in metrics(out) if "eval/success_rate" in r]
    data = {
        "machine": machine(),
        "task": args.task,
        "settings": {
            "bc_steps": args.bc_steps,
            "episodes": args.episodes,
            "eval_seed": seed0,
            "overrides": args.overrides,
            "action_bins": cfg.vla.action_bins,
            "cameras": list(cfg.env.cameras),
            "image_size": cfg.env.image_size,
            "scenes_per_batch": cfg.env.num_envs,
            "steps_per_scene": cfg.env.steps_per_rollout,
        },  # fmt: skip
        "binned_expert_success": bound,
        "noisy_binned_expert_success": noisy,
        "expert_seconds": round(expert_s, 1),
        "bc_seconds": round(bc_s, 1),
        "bc_success": {"deterministic": det["success_rate"], "sampled": sampled["success_rate"]},
        "perception": seen,
        "approach": went,
        "bc_curve": curve,
        "bc_loss": loss_curve(out),
    }
    data["instruction"] = instruction_loss(policy, cfg.env)
    md = markdown(data)
    js, mdp = write_results(args.name, data, md)
    print(md)
    print(f"\nwrote {js} and {mdp}")


def bc_config(task: str, steps: int, eval_every: int, overrides: list[str]):
    """The behaviour-cloning recipe as this benchmark runs it."""
    from perceptrl.wiring import load_config

    return load_config(
        ROOT / "configs" / "vla_bc_token.yaml",
        [f"env.id={task}", f"train.steps={steps}", f"train.eval_every={eval_every}",
         "checkpoint.every=0", "log.progress=false", "log.tensorboard=false",
         f"env.eval_episodes={32 if eval_every else 0}", *overrides],  # full evaluation: below
    )  # fmt: skip


def add_readouts(args) -> None:
    """``--reuse``: the result file ``--name`` of a run under ``--out``, with the read-outs it
    lacks measured on that run's model."""
    from perceptrl.vla.run import load_policy

    out = Path(args.out)
    data = json.loads((ROOT / "bench" / "results" / f"{args.name}.json").read_text())
    s = data["settings"]
    if data["task"] == ALONE:
        register_alone()
    cfg = bc_config(data["task"], s["bc_steps"], 0, s["overrides"])
    policy = load_policy(last_model(out))
    if "instruction" not in data:
        data["instruction"] = instruction_loss(policy, cfg.env)
    if not data.get("approach"):
        data["approach"] = approach(
            policy, cfg.env, data["settings"]["episodes"], cfg.env.eval_seed
        )
        data["bc_loss"] = loss_curve(out)
    md = markdown(data)
    js, mdp = write_results(args.name, data, md)
    print(md)
    print(f"\nwrote {js} and {mdp}")


def loss_curve(run_dir: Path, points: int = 6) -> list[tuple[int, float]]:
    """The BC loss (nats per policy step) averaged over ``points`` equal blocks of steps:
    (last step of the block, mean loss)."""
    rows = [(r["step"], r["sft/loss"]) for r in metrics(run_dir) if "sft/loss" in r]
    size = max(1, len(rows) // points)
    blocks = [rows[i : i + size] for i in range(0, len(rows), size)]
    return [(b[-1][0], round(float(np.mean([x for _, x in b])), 3)) for b in blocks]


def markdown(data: dict) -> str:
    s, m, p = data["settings"], data["machine"], data["perception"]
    dims = " / ".join(f"{x:.2f}" for x in p["loss_per_token"])
    return "\n".join([
        f"# Token VLA on {data['task']}: resolution against perception",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores, torch {m['torch']}. {s['episodes']} held-out "
        f"episodes from seed {s['eval_seed']} per figure.",
        "",
        "Scripted expert with binned actions (success): "
        + ", ".join(f"{b} bins {v:.2f}" for b, v in data["binned_expert_success"].items())
        + "; with uniform noise on every token: "
        + ", ".join(f"{b} bins {v:.2f}" for b, v in data["noisy_binned_expert_success"].items())
        + ".",
        "",
        f"Behaviour cloning ({s['bc_steps']} steps, {data['bc_seconds'] / 60:.1f} min; "
        f"{s['action_bins']} bins, cameras {', '.join(s['cameras'])} at {s['image_size']} px): "
        f"held-out success {data['bc_success']['deterministic']:.3f} with the most likely "
        f"tokens, {data['bc_success']['sampled']:.3f} sampled. Recipe overrides: "
        f"{' '.join(s['overrides']) or 'none (the tiny VLM from random weights)'}.",
        "",
        f"Loss on fresh expert steps, nats per policy step: {p['loss_own_images']:.2f} with "
        f"each step's own images, {p['loss_other_scenes_images']:.2f} with another scene's; "
        f"per action token (x / y / z / yaw / gripper): {dims}.",
        *approach_lines(data),
    ])  # fmt: skip


def approach_lines(data: dict) -> list[str]:
    """The read-outs older result files lack: scenes per batch, the BC curves, the instruction,
    where it goes."""
    s, out = data["settings"], []
    if "scenes_per_batch" in s:
        out += ["", f"Scenes per BC batch: {s['scenes_per_batch']} episodes in progress, "
                f"{s['steps_per_scene']} consecutive steps of each."]  # fmt: skip
    if data.get("bc_loss"):
        out += ["", "BC loss (nats per step, mean over blocks of steps): "
                + ", ".join(f"to step {k} {v:.2f}" for k, v in data["bc_loss"]) + "."]  # fmt: skip
    if data.get("bc_curve"):
        out += ["", "Held-out success during BC (32 episodes, most likely tokens): "
                + ", ".join(f"step {k} {v:.3f}" for k, v in data["bc_curve"]) + "."]  # fmt: skip
    if data.get("instruction"):
        i = data["instruction"]
        out += ["", f"The instruction: {i['loss_named_colour']:.2f} nats per step with the named "
                f"target's colour, {i['loss_other_colour']:.2f} with another target's colour in "
                "its place (same scenes and expert actions)."]  # fmt: skip
    a = data.get("approach")
    if a:
        said = (f"Where the greedy policy goes ({s['episodes']} held-out episodes, "
                f"{a['targets']} target{'s' if a['targets'] > 1 else ''}): it starts "
                f"{a['start_distance']:.3f} m from the named target and comes within "
                f"{a['closest_to_named']:.3f} m of it (success needs 0.03 m)")  # fmt: skip
        if a["closest_to_other"] is not None:
            said += (f", within {a['closest_to_other']:.3f} m of the nearest other target; the "
                     f"target it comes closest to is the named one in {a['closest_is_named']:.2f} "
                     f"of episodes (chance {1 / a['targets']:.2f})")  # fmt: skip
        out += ["", said + "."]
    return out


if __name__ == "__main__":
    main()
