"""Make the planner's base: the shipped tiny VLM after a text-only drill on planner dialogues.

A planner's subgoals name the entities of the instruction it was given ("first put the pink
block in the red bowl then ..." -> ``<subgoal> put the pink block in the red bowl</subgoal>``):
it must copy words from its prompt, a skill any pretrained VLM has and the shipped tiny base
(`assets/vlm_base`, trained on counting only) has not. SFT on executed planner episodes does not
teach it within reach of 2 cores: after 1,150 steps on 2,000 traces the planner wrote
well-formed turns with the wrong colours (0 valid subgoals; the issue's notes), probably
because a few hundred scenes, each shown many times, are learnt by heart before copying is
found. Here the language model reads a fresh scene every time: dialogues drawn from the
long-horizon tasks' layouts and instruction templates (`sim.tasks.layout`, no simulation, no
image), in exactly the episode's token format (the recipe's system prompt, each subgoal turn
ended by the stop token, the executor's outcome message as the observation turn, ``<done/>``
last), with the loss on the policy's turns only.

Measured on 2 cores (about 1.3 s a step): the held-out dialogues' turn tokens stay near 0.93
right for about 450 steps (verbs and nouns copied, colours guessed) until copying appears;
after 900 steps 0.986 of the turn tokens and 0.44 of whole dialogues are exact. The shipped
``assets/vlm_plan_base`` (with its tokenizer and processor; the vision tower is the shipped one,
untouched) was made by these two runs, deterministic in ``--seed``:

    python assets/build/make_plan_base.py --steps 600 --out runs/plan_base_600
    python assets/build/make_plan_base.py --steps 300 --seed 2 --base runs/plan_base_600

(``make assets-plan-base`` runs both.) It is the base of ``configs/plan_grpo.yaml``. It has
never seen a scene: with the image in its prompt it writes no valid subgoal until the recipe's
SFT on executed oracle plans (bench/results/plan.md).
"""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path

import numpy as np
import torch


def dialogue(rng: np.random.Generator, families) -> tuple[str, list[str], list[str]]:
    """A planner dialogue of a fresh layout: (instruction, policy turns, outcome messages)."""
    from perceptrl.datasets.plan import phrase
    from perceptrl.sim.tasks import get_task, layout
    from perceptrl.vla.plan import _outcome

    task = get_task(families[int(rng.integers(len(families)))])
    lay = layout(task, rng, rng)
    turns = [f"<subgoal> {phrase(s, lay)}</subgoal>" for s in task.subgoals] + ["<done/>"]
    steps = rng.integers(20, 120, size=len(task.subgoals))
    said = [
        _outcome(s.text(lay.colours), True, False, int(n)) for s, n in zip(task.subgoals, steps)
    ]
    return lay.instruction, turns, said


def encode(policy, template, prompt_cfg, instruction, turns, said) -> tuple[list[int], list[int]]:
    """Token ids and labels (-100 outside the policy's turns), as the episode rollout lays them
    out: prompt, then each turn and its stop token, then the outcome as an observation turn."""
    from perceptrl.vlm.prompts import build_messages
    from perceptrl.vlm.tools import Observation

    tok = policy.processor.tokenizer
    prompt = policy.processor.apply_chat_template(
        build_messages({"question": instruction}, prompt_cfg.system_prompt),
        tokenize=False,
        add_generation_prompt=True,
    )
    ids = tok(prompt)["input_ids"]
    labels = [-100] * len(ids)
    for k, turn in enumerate(turns):
        t = tok(turn, add_special_tokens=False)["input_ids"] + [policy.stop_ids[0]]
        ids, labels = ids + t, labels + t
        if k < len(said):
            o = tok(template.text(Observation(said[k])), add_special_tokens=False)["input_ids"]
            ids, labels = ids + o, labels + [-100] * len(o)
    return ids, labels


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--batch", type=int, default=32, help="dialogues per step")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--base", default="assets/vlm_base")
    ap.add_argument("--out", default="assets/vlm_plan_base")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    from perceptrl.cli import CONFIGS
    from perceptrl.datasets.plan_tasks import FAMILIES
    from perceptrl.trainer.runtime import resolve_path
    from perceptrl.vlm.builder import build_policy
    from perceptrl.vlm.episode import ObservationTemplate
    from perceptrl.vlm.run_plan import resolve
    from perceptrl.wiring import load_config, side

    torch.manual_seed(args.seed)
    cfg = load_config(CONFIGS / "plan_grpo.yaml", [f"model.path={resolve_path(args.base)}"])
    side(cfg)
    plan = resolve(cfg)
    policy = build_policy(plan, Path("runs/make_plan_base"))
    template = ObservationTemplate(policy.processor, policy.stop_text, policy.episode)
    prompt_cfg = plan.prompt
    model = policy.model.float().train()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    rng, val_rng = np.random.default_rng(args.seed), np.random.default_rng(args.seed + 10_000)

    def batch(r: np.random.Generator, n: int):
        rows = [encode(policy, template, prompt_cfg, *dialogue(r, FAMILIES)) for _ in range(n)]
        width = max(len(i) for i, _ in rows)
        ids = torch.full((n, width), policy.pad_id)
        labels = torch.full((n, width), -100)
        mask = torch.zeros((n, width), dtype=torch.long)
        for j, (i, y) in enumerate(rows):
            ids[j, : len(i)], labels[j, : len(y)], mask[j, : len(i)] = (
                torch.tensor(i), torch.tensor(y), 1,
            )  # fmt: skip
        return ids, labels, mask

    val = batch(val_rng, 64)
    start = time.time()
    for step in range(1, args.steps + 1):
        ids, labels, mask = batch(rng, args.batch)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        if step % 50 == 0 or step == args.steps:
            with torch.no_grad():
                ids, labels, mask = val
                pred = model(input_ids=ids, attention_mask=mask).logits[:, :-1].argmax(-1)
                y = labels[:, 1:]
                right = (pred == y) | (y == -100)
                exact = right.all(1).float().mean().item()
                tokens = (pred == y)[y != -100].float().mean().item()
            print(f"step {step}: loss {loss.item():.4f}, held-out turn tokens {tokens:.3f}, "
                  f"dialogues exact {exact:.3f}, {time.time() - start:.0f} s", flush=True)  # fmt: skip
    out = resolve_path(args.out)
    if out.exists():
        shutil.rmtree(out)
    model.save_pretrained(out)
    policy.processor.save_pretrained(out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
