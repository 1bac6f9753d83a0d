"""The model card (``README.md``) and ``policy_spec.json`` of a saved VLA policy folder
(`vla.hub` describes the folder).

The card is a Hugging Face model card: YAML front matter (``library_name: perceptrl``, tags,
the env, and a ``model-index`` with the success rate when the run evaluated), then the task,
the recipe (command, algorithm, steps, seed), the results and how to load the folder. Results
are the run's held-out evaluations up to the save, read from its ``metrics.jsonl`` (the rows
with ``eval/*`` keys), each figure with the step and the file it comes from; a policy saved
without a run, or before its run evaluated, says "not evaluated".

Every checkpoint's ``model/`` and ``best/model`` get a card: writing it reads the eval lines
of ``metrics.jsonl`` once and draws no random number, so a run's metrics do not change.
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from .config import per_step
from .hub import CARD_FILE, SPEC_FILE, TOKEN_TYPE, Manifest, Origin, env_facts

RESULT_FILE = "metrics.jsonl"
HISTORY = 10
"""evaluations listed in the card's success-rate history (the latest)"""


def training_summary(cfg, objective: str, warm_start: Origin | None = None) -> dict:
    """What the card and ``policy_spec.json`` record of the recipe that trains the policy:
    the command, the algorithm, its steps and seed, the evaluation protocol; ``warm_start`` is
    the `Origin` of the saved policy ``model.path`` held, if it recorded one."""
    algo, train, env = cfg.algo, cfg.train, cfg.env
    if objective == "sft":
        algorithm = "behaviour cloning of the scripted experts"
    elif objective != "rl":  # e.g. offpolicy: the head names the algorithm (sac, dsrl)
        algorithm = f"{objective} training of the {cfg.vla.head} head"
    elif per_step(algo.adv_estimator):
        algorithm = f"PPO ({algo.adv_estimator} advantages, {algo.policy_loss} loss)"
    else:
        algorithm = (
            f"{algo.adv_estimator} on groups of {cfg.rollout.group_size} whole episodes "
            f"({algo.policy_loss} loss)"
        )
    return {
        "command": "perceptrl sft" if objective == "sft" else "perceptrl train",
        "objective": objective, "algorithm": algorithm,
        "adv_estimator": algo.adv_estimator if objective == "rl" else None,
        "policy_loss": algo.policy_loss if objective == "rl" else None,
        "steps": train.steps, "time_limit_min": train.time_limit_min, "lr": train.lr,
        "seed": train.seed, "num_envs": env.num_envs, "eval_episodes": env.eval_episodes,
        "eval_seed": env.eval_seed, "eval_tasks": list(env.eval_tasks or [env.id]),
        "warm_start": (warm_start.trained_with or {"env": warm_start.env}) if warm_start else None,
    }  # fmt: skip


def run_origin(cfg, run_dir: str | Path, objective: str, warm_start: Origin | None) -> Origin:
    """The `Origin` a run gives its policy: the recipe's env, its summary, the run directory."""
    summary = training_summary(cfg, objective, warm_start)
    return Origin(env_facts(cfg.env), summary, Path(run_dir))


def write_extras(path: str | Path, description: dict, manifest: Manifest, origin: Origin | None):
    """Write ``policy_spec.json`` (``description`` with the env and recipe of ``origin``) and
    the model card ``README.md`` into the folder ``path``, beside the config and weights."""
    path = Path(path)
    spec = {
        **description,
        "env": origin.env if origin else None,
        "trained_with": origin.trained_with if origin else None,
    }
    (path / SPEC_FILE).write_text(json.dumps(spec, indent=1))
    (path / CARD_FILE).write_text(model_card(spec, manifest, origin))


def model_card(spec: dict, manifest: Manifest, origin: Origin | None) -> str:
    """The ``README.md`` of a folder whose ``policy_spec.json`` is ``spec``."""
    run = origin.run_dir if origin else None
    evals, last_step = evaluations(run / RESULT_FILE) if run else ([], None)
    env = spec.get("env") or {}
    title = f"{manifest.model_type} on {env['id']}" if env else manifest.model_type
    parts = [
        front_matter(manifest, env, evals),
        f"# {title}\n",
        "A vision-language-action policy trained with perceptrl, a reinforcement-learning "
        "platform for VLMs and VLA policies in MuJoCo. Its folder: `config.json`"
        + (" and `token_vla.json`" if manifest.model_type == TOKEN_TYPE else "")
        + ", the safetensors weights, `policy_spec.json` (what it reads and emits) and this "
        f"card (folder format version {manifest.version}).\n",
        _task(spec, env),
        _training(spec.get("trained_with"), run, last_step),
        _results(evals, run, spec.get("trained_with") or {}),
        _usage(),
    ]
    return "\n".join(parts)


def front_matter(manifest: Manifest, env: dict, evals: list[dict]) -> str:
    """Hugging Face model-card metadata (YAML between ``---`` lines)."""
    meta = {
        "library_name": "perceptrl",
        "pipeline_tag": "robotics",
        "tags": [
            "robotics",
            "reinforcement-learning",
            "vision-language-action",
            "perceptrl",
            manifest.model_type,
            *([env["task"]] if env else []),
        ],  # fmt: skip
        "model_name": manifest.model_type,
    }
    if env:
        meta["env"] = env["id"]
    if evals and env:
        last = evals[-1]
        meta["model-index"] = [{
            "name": manifest.model_type,
            "results": [{
                "task": {"type": "reinforcement-learning", "name": "reinforcement-learning"},
                "dataset": {"type": env["id"], "name": env["id"]},
                "metrics": [{"type": "success_rate", "value": last["eval/success_rate"],
                             "name": f"eval/success_rate at step {last['step']}"}],
            }],
        }]  # fmt: skip
    return "---\n" + yaml.safe_dump(meta, sort_keys=False) + "---\n"


def _task(spec: dict, env: dict) -> str:
    inputs = spec.get("input_features", {})
    action = spec.get("output_features", {}).get("action", {})
    seen = ", ".join(f"`{k}` {f.get('shape') or '(text)'}" for k, f in inputs.items())
    instruction = spec.get("instruction", {})
    reads = instruction.get("model") or (
        f"{len(instruction['vocabulary'])}-word vocabulary" if "vocabulary" in instruction
        else "its prompt"
    )  # fmt: skip
    names = ", ".join(action.get("names") or []) or f"{action.get('shape')}"
    rows = [
        ("env", f"`{env['id']}` (task `{env['task']}`, {env['max_episode_steps']} steps per "
         f"episode, {env['obs_mode']} observations)" if env else "not recorded (saved without "
         "a run)"),
        ("observation", seen),
        ("instruction", f"{instruction.get('encoder')} encoder ({reads})"),
        ("action", f"{action.get('control') or '?'} control: {names} in [{action.get('low')}, "
         f"{action.get('high')}], {action.get('chunk')} action(s) per policy step"),
    ]  # fmt: skip
    return "## Task\n\n" + _table(rows)


def _training(summary: dict | None, run: Path | None, last_step: int | None) -> str:
    if not summary:
        return "## Training\n\nNot recorded: the policy was saved outside a perceptrl run.\n"
    rows = [
        ("command", f"`{summary['command']}`"),
        ("algorithm", summary["algorithm"]),
        ("steps", f"{summary['steps']} (train.steps)"
         + (f"; this save after step {last_step}" if last_step is not None else "")),
        ("seed", str(summary["seed"])),
        ("envs", str(summary["num_envs"])),
    ]  # fmt: skip
    if summary.get("warm_start"):
        prior = summary["warm_start"]
        rows.append(("warm start", f"a saved policy ({prior.get('algorithm', 'recipe unknown')})"))
    if run is not None:
        rows.append(("run", f"`{run.name}` (its `config.yaml` holds the whole recipe)"))
    return "## Training\n\n" + _table(rows)


def _results(evals: list[dict], run: Path | None, summary: dict) -> str:
    if not evals:
        why = (
            f"run `{run.name}` logged no evaluation before this save"
            if run
            else ("saved outside a perceptrl run")
        )
        return f"## Results\n\nNot evaluated: {why}.\n"
    last = evals[-1]
    where = f"`{RESULT_FILE}` of run `{run.name}`"
    figures = [(f"`{k}`", f"{v:.3f}") for k, v in last.items() if k.startswith("eval/success")]
    best = max(evals, key=lambda r: r["eval/success_rate"])
    history = ", ".join(f"{r['step']}: {r['eval/success_rate']:.3f}" for r in evals[-HISTORY:])
    return (
        "## Results\n\n"
        f"Held-out success with deterministic actions, {summary.get('eval_episodes', '?')} "
        f"episodes per task from seed {summary.get('eval_seed', '?')} on, at step "
        f"{last['step']}, the last evaluation before this save (from {where}, its row of "
        f"step {last['step']}):\n\n" + _table(figures, ("metric", "value")) + "\n"
        f"`eval/success_rate` by step (from {where}): {history}. Best: "
        f"{best['eval/success_rate']:.3f} at step {best['step']}.\n"
    )


def _usage() -> str:
    return (
        "## Use\n\n```python\nfrom perceptrl.vla.builder import load_policy\n\n"
        'policy = load_policy("path/to/this/folder")  # checks the folder first\n'
        "obs = policy.observe(batch)  # a perceptrl.sim.vector.Batch of N envs\n"
        "action, logp, value = policy.act(obs, deterministic=True)\n```\n\n"
        "```bash\nperceptrl eval <recipe> --model path/to/this/folder\n"
        "perceptrl train <recipe> model.path=path/to/this/folder   # fine-tune it\n```\n"
    )


def evaluations(metrics: Path) -> tuple[list[dict], int | None]:
    """(the rows of ``metrics`` that hold ``eval/success_rate``, oldest first; the step of its
    last row). Only those lines and the last one are parsed; a damaged line is skipped."""
    if not metrics.is_file():
        return [], None
    lines = metrics.read_text(errors="replace").splitlines()
    evals = []
    for line in (x for x in lines if '"eval/success_rate"' in x):
        row = _row(line)
        if row is not None and isinstance(row.get("eval/success_rate"), (int, float)):
            evals.append(row)
    last = next((r for r in map(_row, reversed(lines)) if r is not None), None)
    return evals, last.get("step") if last else None


def _row(line: str) -> dict | None:
    try:
        row = json.loads(line)
    except ValueError:
        return None
    return row if isinstance(row, dict) and isinstance(row.get("step"), int) else None


def _table(rows: list[tuple[str, str]], header: tuple[str, str] = ("", "")) -> str:
    lines = [f"| {header[0]} | {header[1]} |", "|---|---|"]
    return "\n".join(lines + [f"| {a} | {b} |" for a, b in rows]) + "\n"
