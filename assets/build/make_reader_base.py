"""Make the instruction-reading executor's start: its encoder drilled to find what the words name.

`configs/plan_exec_reader.yaml` clones one policy for every subgoal family from the scripted
experts; it must find the subgoal's subject and goal among all the scene's entities by their
colour and kind words (`vla.compact.EntityReader`). Behaviour cloning alone does not teach that
within reach of 2 cores: with the recipe's auxiliary subject loss, after 1,000-1,500 BC steps
the policy's gripper still ended nearest the named block at chance (diagnosed on its
evaluation scenes) and no subgoal succeeded, because each BC batch holds a few scenes in
consecutive steps and the action loss says little about which block was meant. Here the same
policy (built from the recipe) reads a fresh initial state of the training scene per row: its
auxiliary head regresses the subject's position relative to the gripper, and a second head,
dropped afterwards, the goal's (a bowl, a zone or the block to stack on). Supervised, from
privileged simulator state, like the recipe's own auxiliary loss; the actor's action head is
untouched.

Measured on 2 cores (79 s alone, 800 steps, seed 0; assets/build/reader_base_drill.json):
held-out squared errors (workspace units of 10 cm) 0.0010 for the subject and 0.0016 for the
goal, against 1.25 and 1.62 on the same states with another row's instruction (a policy that
does not read stays equal on both); reading appears between steps 400 and 500. Printed and
written to ``<out>/drill.json``.

    python assets/build/make_reader_base.py --out runs/reader_base [--steps 800]
    perceptrl sft plan_exec_reader model.path=runs/reader_base --run-dir runs/exec_reader

The reader's start is not a committed asset: ``bench/bench_plan.py --executor reader`` runs this
into its own run folder (``reader_base_s<seed>``); ``make assets-reader-base`` writes
runs/reader_base. ``drill.json`` records the run's provenance (command, commit, machine).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from common import provenance  # noqa: E402


def states(env, n: int, first: int) -> dict:
    """``n`` initial states of the recipe's env (task ids ``first``...), each focused on one of
    its subgoals: observations, and the goal's index in the view (the subject is entity 0)."""
    from perceptrl.sim.composite import ENTITY_KINDS, GOAL_INDEX
    from perceptrl.sim.tasks import task_counts

    counts = task_counts(env.unwrapped.task)
    first_of = dict(zip(ENTITY_KINDS, np.cumsum([0, *[counts[k] for k in ENTITY_KINDS]])))
    objects, proprio, texts, goal = [], [], [], []
    for tid in range(first, first + n):
        obs, _ = env.reset(options={"task_id": tid, "trial_id": 0})
        sub = env.focused
        objects.append(obs["objects"])
        proprio.append(obs["proprio"])
        texts.append(obs["instruction"])
        goal.append(first_of[sub.goal_kind] + GOAL_INDEX[sub.family])  # the view's goal slot
    return {
        "objects": torch.as_tensor(np.array(objects)),
        "proprio": torch.as_tensor(np.array(proprio)),
        "texts": texts,
        "goal": torch.as_tensor(goal),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", default="plan_exec_reader")
    ap.add_argument("--steps", type=int, default=800)
    ap.add_argument("--states", type=int, default=4000, help="training initial states")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="runs/reader_base")
    ap.add_argument("overrides", nargs="*", help="recipe overrides (key=value)")
    args = ap.parse_args()

    from perceptrl.cli import CONFIGS
    from perceptrl.sim.composite import ENTITY_SIZE
    from perceptrl.sim.focus import make_env
    from perceptrl.vla.compact import build_compact, spec_from_config
    from perceptrl.vla.envs import env_kwargs
    from perceptrl.vla.language import encode_words
    from perceptrl.wiring import load_config

    cfg = load_config(CONFIGS / f"{args.recipe}.yaml", args.overrides)
    if cfg.vla.encoder != "entities" or cfg.vla.aux != "subject":
        raise SystemExit("the drill trains an entities encoder's subject head: vla.encoder="
                         "entities and vla.aux=subject in the recipe")  # fmt: skip
    torch.manual_seed(args.seed)
    t0 = time.perf_counter()
    env = make_env(cfg.env.id, **env_kwargs(cfg.env))  # a SubgoalFocus: env.subgoal_focus
    train = states(env, args.states, 2_000_000)
    held = states(env, 500, 3_000_000)  # neither the BC seeds nor the evaluation's
    made = time.perf_counter() - t0
    spaces = {"action": env.action_space, "observation": env.observation_space}
    policy = build_compact(spec_from_config(cfg.vla, spaces, cfg.env.action_chunk,
                                            cfg.env.image_size))  # fmt: skip
    goal_head = torch.nn.Linear(cfg.vla.hidden, 3)
    opt = torch.optim.Adam([*policy.parameters(), *goal_head.parameters()], lr=args.lr)
    vocab, words = policy.vocab, cfg.vla.max_words

    def losses(data: dict, rows, texts=None) -> tuple[torch.Tensor, torch.Tensor]:
        obs = {
            "objects": data["objects"][rows],
            "proprio": data["proprio"][rows],
            "words": encode_words(texts or [data["texts"][i] for i in rows], vocab, words),
        }
        h, _, subject = policy._features(obs)
        p, o = policy._normalise(obs["proprio"].float(), obs["objects"].float())
        ents = o.reshape(len(o), -1, ENTITY_SIZE)
        goal = ents[torch.arange(len(o)), data["goal"][rows], :3] - p[:, :3]
        return subject, (goal_head(h) - goal).square().mean(-1)

    def report() -> dict:
        rows = list(range(500))
        with torch.no_grad():
            s, g = losses(held, rows)
            shifted = [held["texts"][(i + 1) % 500] for i in rows]
            s2, g2 = losses(held, rows, shifted)
        return {"subject": float(s.mean()), "goal": float(g.mean()),
                "subject_other_words": float(s2.mean()), "goal_other_words": float(g2.mean())}  # fmt: skip

    curve = []
    t0 = time.perf_counter()
    for step in range(args.steps + 1):
        if step % 100 == 0:
            curve.append({"step": step, **report()})
            print(json.dumps(curve[-1]), flush=True)
        if step == args.steps:
            break
        rows = torch.randint(0, args.states, (args.batch,)).tolist()
        subject, goal = losses(train, rows)
        loss = (subject + goal).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    out = Path(args.out)
    policy.save(out)
    record = {
        "recipe": args.recipe, "overrides": args.overrides, "steps": args.steps,
        "states": args.states, "batch": args.batch, "lr": args.lr, "seed": args.seed,
        "seconds": {"states": made, "drill": time.perf_counter() - t0}, "held_out": curve,
    }  # fmt: skip
    record["provenance"] = provenance([args.seed])
    (out / "drill.json").write_text(json.dumps(record, indent=1))
    print(f"wrote {out} (drill.json: the held-out errors per 100 steps)")


if __name__ == "__main__":
    main()
