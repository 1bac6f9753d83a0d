"""Evaluation of reason-then-act planners side by side (``perceptrl eval plan_grpo --model a=..
--model b=..``).

Every planner answers the same held-out initial states greedily, with the recipe's executor
(``plan.executor``); next to them stands the oracle plan (the generator's subgoals,
`datasets.plan_tasks.reasoning_trace`) run by the same executor: the upper bound of planning with it.
The oracle plan also measures the executor alone, subgoal by subgoal (``executor/<family>``: the
share of that family's subgoals it finished in the composite scenes), so that a planner's
failures can be split into planning errors and execution errors.

Writes ``compare.json``, ``compare.md`` (success per long-horizon task and planner, the
episodes' subgoal counts, the executor per subgoal family), ``compare.png`` (bars per task and
planner) and, per planner and for the oracle plan, mp4s of the first ``plan.eval_videos``
episodes with the current subgoal drawn on the frames (`plan.replay_video`).
"""

from __future__ import annotations

import json
from pathlib import Path

from .plan_env import SUBGOAL, PlanEnv, plan_settings, replay_video
from .run_plan import resolve_executor

ORACLE = "oracle_plan"
"""name of the oracle plan's row"""
EPISODE_KEYS = ("planner/progress", "planner/valid", "planner/invalid", "planner/on_plan",
                "planner/executed", "episode/turns_mean")  # fmt: skip
"""episode means shown beside the success table"""


def oracle_plan(settings, samples: list[dict], retries: int = 0) -> tuple[dict, dict]:
    """The generator's plan of every sample, executed as planner turns by ``settings``'s
    executor; with ``retries`` a subgoal the executor did not finish is issued again, up to that
    many more times, before the plan goes on (the closed-loop oracle plan: the upper bound of a
    planner that retries). Returns (scores: ``accuracy``, ``accuracy/<task>``, ``count``,
    ``executor/<family>`` and ``count/executor/<family>`` from each subgoal's first attempt,
    ``retries`` and ``retries/finished``: repeat attempts and those that finished; records:
    sample id -> {"texts": the turns, "info": the episode's record})."""
    from ..datasets.plan_tasks import reasoning_trace
    from ..sim.composite import parse_subgoal

    env = PlanEnv(settings)
    by_task: dict[str, list[float]] = {}
    by_family: dict[str, list[int]] = {}
    records: dict[str, dict] = {}
    repeats = [0, 0]  # repeat attempts, of which finished
    for i, s in enumerate(samples):
        env.reset([s])
        colours = env.scene(0).unwrapped.layout.colours
        texts = []
        for turn in reasoning_trace(s):
            sub = SUBGOAL.search(turn)
            for attempt in range(1 + (retries if sub else 0)):
                texts.append(turn)
                before = env.rows[0].record["planner/executed"]
                if env.respond(0, turn) is None:
                    break
                finished = env.rows[0].record["planner/executed"] > before
                if attempt:
                    repeats[0] += 1
                    repeats[1] += int(finished)
                else:
                    family = parse_subgoal(sub.group(1), colours).family
                    tally = by_family.setdefault(family, [0, 0])
                    tally[0] += int(finished)
                    tally[1] += 1
                if finished:
                    break
        rec = env.rows[0].record
        by_task.setdefault(str(s.get("family", "all")), []).append(rec["planner/success"])
        records[str(s.get("id", f"#{i}"))] = {"texts": texts, "info": dict(rec)}
    every = [v for vs in by_task.values() for v in vs]
    scores = {"accuracy": sum(every) / max(1, len(every)), "count": float(len(every))}
    for task, vs in sorted(by_task.items()):
        scores[f"accuracy/{task}"] = sum(vs) / len(vs)
    for family, (ok, tried) in sorted(by_family.items()):
        scores[f"executor/{family}"] = ok / tried
        scores[f"count/executor/{family}"] = float(tried)
    if retries:
        scores["retries"], scores["retries/finished"] = float(repeats[0]), float(repeats[1])
    return scores, records


def executor_alone(settings, samples: list[dict]) -> tuple[dict, dict]:
    """The executor given the whole long instruction, with no planner: from each sample's
    initial state the instruction-reading policy (``plan.policies.all``) acts on the task's own
    instruction for as many env steps as the oracle plan's subgoals get together (each its
    primitive's time limit, or ``plan.subgoal_steps``), until the task succeeds or the physics
    blows up. Returns (scores: ``accuracy``, ``accuracy/<task>``, ``progress`` (the share of
    subgoals that hold in order at the end), ``count``; records: sample id -> {"info": success,
    progress, env steps})."""
    from ..sim.tasks import get_task

    env = PlanEnv(settings)
    by_task: dict[str, list[float]] = {}
    progress: list[float] = []
    records: dict[str, dict] = {}
    for i, s in enumerate(samples):
        env.reset([s])
        scene = env.scene(0)
        obs = scene.focus(None)
        act = settings.executor.start(scene)
        subs = scene.unwrapped.task.subgoals
        limit = sum(settings.subgoal_steps or get_task(g.family).max_episode_steps for g in subs)
        steps, ok, unstable = 0, False, False
        while steps < limit and not (ok or unstable):
            for a in act(obs):
                obs, _, _, _, info = scene.step(a)  # the env clips, NaN -> 0
                steps += 1
                ok, unstable = bool(info["success"]), bool(info["sim_unstable"])
                if ok or unstable or steps >= limit:
                    break
        done = scene.unwrapped.subgoals_done() / len(subs)
        by_task.setdefault(str(s.get("family", "all")), []).append(float(ok))
        progress.append(done)
        records[str(s.get("id", f"#{i}"))] = {
            "info": {"success": float(ok), "progress": done, "env_steps": steps,
                     "unstable": float(unstable)},
        }  # fmt: skip
    every = [v for vs in by_task.values() for v in vs]
    scores = {
        "accuracy": sum(every) / max(1, len(every)),
        "progress": sum(progress) / max(1, len(progress)),
        "count": float(len(every)),
    }
    for task, vs in sorted(by_task.items()):
        scores[f"accuracy/{task}"] = sum(vs) / len(vs)
    return scores, records


def compare(cfgs: dict, out_dir: Path) -> dict:
    """Planners (name -> recipe whose ``model.path`` is one) and the oracle plan on the first
    recipe's held-out states; see the module docstring. Returns ``{"table", "files"}``."""
    from ..vlm import builder as vlm_builder
    from ..vlm.run_plan import resolve

    out_dir.mkdir(parents=True, exist_ok=True)
    first = next(iter(cfgs.values()))
    data = vlm_builder.eval_data(resolve(first), out_dir)
    settings = plan_settings(resolve_executor(first))
    metrics, records, samples = {}, {}, []
    for i, (name, c) in enumerate(cfgs.items()):
        plan = resolve(c)
        policy = vlm_builder.build_policy(plan, out_dir / f"model_{i}")
        val = vlm_builder.fit_prompts(plan.prompt, policy.processor, data, splits=("val",)).val
        samples = samples or val[: plan.evaluation.samples]
        records[name] = {}
        evaluate = vlm_builder.build_evaluator(plan.evaluation, samples)
        metrics[name] = evaluate(policy, prompt=plan.prompt, records=records[name])
    metrics[ORACLE], records[ORACLE] = oracle_plan(settings, samples)
    tasks = sorted(k.split("/", 1)[1] for k in metrics[ORACLE] if k.startswith("accuracy/"))
    table = markdown(metrics, tasks)
    files = [out_dir / "compare.json", out_dir / "compare.md", out_dir / "compare.png"]
    record = {
        "states": len(samples), "executor": first.plan.executor,
        "policies": dict(first.plan.policies),
        "models": {n: str(c.model.path) for n, c in cfgs.items()}, "metrics": metrics,
    }  # fmt: skip
    files[0].write_text(json.dumps(record, indent=1))
    files[1].write_text(table + "\n")
    bar_chart(metrics, tasks, files[2], title=f"held-out task success ({len(samples)} states)")
    for name, recs in records.items():
        for k, s in enumerate(samples[: first.plan.eval_videos]):
            key = str(s.get("id", f"#{k}"))
            if key in recs:
                path = out_dir / f"{name}_{k}.mp4"
                strip = path.with_suffix(".png")
                replay_video(settings, s, recs[key]["texts"], path, sheet=strip)
                files += [path, strip]
    return {"table": table, "files": files}


def markdown(metrics: dict[str, dict], tasks: list[str]) -> str:
    """Success per task and planner (the oracle plan last), the planners' episode means, and the
    executor's success per subgoal family on the oracle plan."""
    lines = ["| planner | all | " + " | ".join(tasks) + " |", "|---|---|" + "---|" * len(tasks)]
    for name, m in metrics.items():
        cells = [f"{m.get(f'accuracy/{t}', float('nan')):.3f}" for t in tasks]
        lines.append(f"| {name} | {m['accuracy']:.3f} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "| planner | " + " | ".join(EPISODE_KEYS) + " |",
        "|---|" + "---|" * len(EPISODE_KEYS),
    ]
    for name, m in metrics.items():
        if name != ORACLE:
            lines.append(f"| {name} | " + " | ".join(_cell(m.get(k)) for k in EPISODE_KEYS) + " |")
    oracle = metrics[ORACLE]
    families = [k.split("/", 1)[1] for k in oracle if k.startswith("executor/")]
    lines += [
        "",
        "| executor on the oracle plan's subgoals | finished | subgoals |",
        "|---|---|---|",
    ]
    for f in families:
        lines.append(
            f"| {f} | {oracle[f'executor/{f}']:.3f} | {int(oracle[f'count/executor/{f}'])} |"
        )
    return "\n".join(lines)


def _cell(v) -> str:
    return "-" if v is None else f"{v:.3f}"


def bar_chart(metrics: dict[str, dict], tasks: list[str], path: Path, title: str = "") -> Path:
    """Grouped bars: task success per long-horizon task (and overall), one bar per planner."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ..vlm.report import save_figure

    groups, names = [*tasks, "all"], list(metrics)
    width = 0.8 / len(names)
    fig, ax = plt.subplots(figsize=(max(5.0, 1.1 * len(groups) * len(names) / 2 + 2), 3.6))
    for j, name in enumerate(names):
        m = metrics[name]
        ys = [m.get(f"accuracy/{t}", 0.0) for t in tasks] + [m["accuracy"]]
        xs = [i + (j - (len(names) - 1) / 2) * width for i in range(len(groups))]
        ax.bar(xs, ys, width=width, label=name)
        for x, y in zip(xs, ys):
            ax.text(x, y + 0.01, f"{y:.2f}", ha="center", fontsize=6)
    ax.set_xticks(range(len(groups)), groups, rotation=20, ha="right", fontsize=8)
    ax.set_ylim(0, 1.08)
    ax.set_ylabel("task success")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return save_figure(fig, ax, path, title)
