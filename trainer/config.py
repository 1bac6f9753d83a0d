"""Run configuration: one small dataclass per component, help beside each field.

A recipe is a YAML file whose top-level keys are the component names below; dotted overrides on
the command line (``algo.kl_coef=0.01``) are applied on top. Unknown keys and wrong types fail
with a message that names the nearest valid key or the expected type (the checks are
``perceptrl.schema``'s, the one mechanism every package checks its options with; its names are
re-exported here).
"""

from __future__ import annotations

import ast
import inspect
import re
import textwrap
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import yaml

from ..errors import parse_yaml, read_yaml
from ..registry import ADVANTAGES, AGG_MODES, CORRECTIONS, ENGINES, KL_ESTIMATORS, POLICY_LOSSES
from ..schema import (  # noqa: F401  (re-exported: the loader's names live there)
    ConfigError,
    all_keys,
    at_least,
    check_sections,
    choice,
    choices,
    did_you_mean,
    from_dict,
    leaf_fields,
    type_name,
)
from .files import atomic_write_text


@dataclass(frozen=True)
class Registry:
    """A table of names that config keys read (a `choice` field's valid values, or the names a
    free string may take), listed by the configuration reference."""

    title: str
    source: str
    """where the names are registered (a file and its table or decorator, in backticks)"""
    keys: tuple[str, ...]
    """the dotted config keys that name its entries (as their value, or a mapping's keys)"""
    names: Callable[[], Iterable[str] | Mapping[str, Iterable[str]]]
    """its names now (a mapping: names per group, e.g. each generator's question families)"""


@dataclass
class AlgoConfig:
    adv_estimator: str = choice("grpo", ADVANTAGES.names)
    """advantage estimator, a name registered in ADVANTAGES (built-ins in trainer/advantages.py:
    gae is for critic policies; treepo and treerl credit the segments of tree rollouts; prime
    keeps the process rewards apart)"""
    norm_by_std: bool = True
    """grpo: divide by the group std (False gives Dr.GRPO)"""
    gamma: float = 1.0
    """discount factor (gae, reinforce_pp)"""
    lam: float = 1.0
    """GAE lambda"""
    policy_loss: str = choice("ppo_clip", POLICY_LOSSES.names)
    """policy loss, a name registered in POLICY_LOSSES (built-ins in trainer/algos.py, each with
    its own clip settings below)"""
    clip_low: float = 0.2
    """PPO lower clip range: ratio >= 1 - clip_low"""
    clip_high: float = 0.2
    """PPO upper clip range: ratio <= 1 + clip_high (DAPO clip-higher uses 0.28)"""
    dual_clip_c: float = 3.0
    """dual-clip constant c > 1 bounding the loss of negative advantages at c |A| (ppo_clip), as
    verl, which always applies it with c = 3; 0 disables it"""
    gspo_clip_low: float = 3e-4
    """GSPO lower clip on the sequence-level ratio"""
    gspo_clip_high: float = 4e-4
    """GSPO upper clip on the sequence-level ratio"""
    cispo_clip_high: float = 5.0
    """CISPO: the stop-gradient importance weight is capped at 1 + cispo_clip_high"""
    cispo_clip_low: float = 0.0
    """CISPO: the importance weight is floored at 1 - cispo_clip_low (0 disables the floor)"""
    loss_agg_mode: str = choice("token-mean", AGG_MODES.names)
    """how per-token losses are averaged, as verl: token-mean over the batch's valid tokens; the
    seq-mean modes take a mean over rows with a valid token of each row's token sum or mean, but
    seq-mean-token-sum-norm divides the summed row sums by loss_norm_len (no division by rows);
    the policy, KL, entropy and value losses all use it"""
    loss_norm_len: int = 0
    """constant divisor for seq-mean-token-sum-norm (Dr.GRPO); 0 uses the batch's T"""
    kl_coef: float = 0.0
    """weight of the KL(policy || reference) term in the loss; 0 skips the reference model"""
    kl_estimator: str = choice("k3", KL_ESTIMATORS.names)
    """per-token KL estimator, a name registered in KL_ESTIMATORS (trainer/algos.py): k3 has low
    variance; a name ending in + takes the value of its estimator and the gradient of k2
    (straight-through); verl's kl / mse / low_var_kl are k1 / k2 / k3"""
    kl_in_reward: bool = False
    """fold the KL penalty into the per-token reward instead of the loss"""
    entropy_coef: float = 0.0
    """entropy bonus weight (subtracted from the loss)"""
    value_coef: float = 0.5
    """weight of the value loss (critic policies only)"""
    value_clip: float = 0.2
    """clip range of the value update around values_old; 0 disables clipping"""
    dynamic_sampling: bool = False
    """DAPO: drop groups whose rewards are all equal (no learning signal) and collect more"""
    max_collects: int = at_least(3, 1)
    """dynamic sampling: collections per step at most while refilling the batch with signal"""
    tis_cap: float = 0.0
    """upper bound of the rollout correction (a weight cap, or the ratio pi_prox / pi_behav past
    which tokens or rows are dropped); 0 disables the correction"""
    rollout_correction: str = choice("tis", CORRECTIONS.names)
    """how the rollout log-probs correct the loss when the behaviour policy (an inference
    engine, or older weights in an asynchronous pipeline) differs from the proximal one (the
    weights at the start of the update), a name registered in CORRECTIONS
    (trainer/corrections.py): decoupled is AReaL's decoupled PPO (a token past the bounds weighs
    0 and still counts; decoupled_seq per row), tis truncates the weight into the bounds, the mask
    forms remove tokens or rows, icepop masks tokens on both sides, none leaves the loss
    uncorrected"""
    correction_low: float = 0.0
    """lower bound on pi_prox / pi_behav of the rollout correction; 0 takes the correction's own
    (0.5 for the two-sided geo_mask and icepop, none for the others)"""
    passk_k: int = 0
    """grpo_passk: k of pass@k (0 uses half the group size; k must be below the group size to learn)"""
    treepo_weighting: str = choice("average", ("average", "group_size"))
    """treepo: how a leaf's subgroup entries combine, their plain mean (TreePO's released script)
    or their mean weighted by subgroup size (TreePO's code default)"""
    treepo_drop_uniform_subgroups: bool = False
    """treepo: skip the subgroups below the root whose rewards are all equal (TreePO's
    remove_no_std_subgroup; off in its released script)"""
    treerl_credit: str = choice("state_value", ("state_value", "local", "value", "ancestors"))
    """treerl: a segment's credit, its local value gain plus its value (TreeRL's released
    use_state_value_reward), the local gain alone, the value alone, or the mean gain over every
    ancestor (advantage_mix_allancestor)"""
    treerl_value_scale: str = choice("sqrt", ("sqrt", "count", "none"))
    """treerl: a node's mean leave-one-out reward is divided by the square root of its leaf
    count (TreeRL's released weighted_value_style), by the count, or by nothing"""
    outcome_coef: float = 1.0
    """prime: weight of the outcome RLOO term (PRIME's reward_gt_coef; its released 5 and 5
    equal 1 and 1 once the advantages are whitened)"""
    prime_whiten: bool = True
    """prime: whiten the returns over the batch's valid tokens, as PRIME"""
    process_coef: float = 1.0
    """weight of the process rewards (RolloutBatch.step_rewards) next to the outcome reward: prime
    (which reads them) weighs its process RLOO term with it (PRIME's reward_dpo_coef); an
    estimator that does not read them gets outcome + process_coef * process per token"""
    whiten_advantages: bool = False
    """normalise advantages to zero mean / unit std over the batch's valid tokens (PPO's norm_adv)"""
    eps: float = 1e-6
    """grpo: added to the group std before dividing (verl's epsilon); whitening adds a fixed
    1e-8 to the variance instead (as verl)"""

    def check(self, root) -> None:
        """The algorithm's rules across its keys (the policy losses and corrections read them
        without checking again)."""
        if 0 < self.dual_clip_c <= 1:
            raise ConfigError(
                f"algo.dual_clip_c={self.dual_clip_c}: dual clip bounds the loss of negative "
                "advantages at c * |A| and needs c > 1; set algo.dual_clip_c > 1, or 0 to turn "
                "it off"
            )
        low = self.correction_low or CORRECTIONS.meta(self.rollout_correction)["low"]
        if self.tis_cap > 0 and not (self.correction_low >= 0 and low < self.tis_cap):
            raise ConfigError(
                f"algo.correction_low={self.correction_low} (lower bound {low} of "
                f"{self.rollout_correction}) must be in [0, algo.tis_cap={self.tis_cap}); set "
                "algo.correction_low between them, or algo.tis_cap=0 to turn the rollout "
                "correction off"
            )


@dataclass
class TrainConfig:
    steps: int = at_least(100, 0)
    """training steps (one rollout batch and its update each)"""
    lr: float = 1e-5
    """AdamW learning rate"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    warmup_steps: int = 0
    """linear learning-rate warm-up steps"""
    lr_schedule: str = choice("constant", ("constant", "cosine"))
    """learning rate after the warm-up: constant | cosine (decays to ``lr * min_lr_ratio`` at
    ``train.steps``; the checkpoint a run ends on is then not one of a still-noisy stretch)"""
    min_lr_ratio: float = 0.0
    """the cosine schedule's final learning rate as a fraction of ``train.lr``"""
    grad_clip: float = 1.0
    """max global gradient norm (0 disables clipping)"""
    ppo_epochs: int = at_least(1, 1)
    """passes over each rollout batch"""
    minibatch_size: int = at_least(0, 0)
    """samples per optimizer step (0: the whole rollout batch is one minibatch)"""
    micro_batch_size: int = at_least(8, 1)
    """samples per forward/backward (gradient accumulation inside a minibatch)"""
    device: str = "auto"
    """auto | cpu | cuda | cuda:N (auto picks cuda when available)"""
    seed: int = 0
    """seed of everything (torch, numpy, python, data order)"""
    time_limit_min: float = 0.0
    """stop after this many minutes of training (evaluation and checkpoint still run); 0: no limit"""
    max_bad_steps: int = at_least(3, 1)
    """stop after this many consecutive steps with a non-finite loss or gradient"""
    eval_every: int = at_least(0, 0)
    """evaluate on held-out data every N steps (0: only before and after training)"""
    eval_samples: int = at_least(200, 0)
    """held-out questions per evaluation"""
    backend: str = choice("torch", ENGINES.names)
    """optimisation engine, a name registered in ENGINES (trainer/engine.py): torch trains in one
    process, deepspeed with ZeRO, data parallel under torchrun or the deepspeed launcher (bf16 on
    GPU, fp32 on CPU)"""
    zero_stage: int = choice(2, (2, 3))
    """DeepSpeed ZeRO stage when backend=deepspeed: 2 (optimizer state + gradients partitioned)
    | 3 (parameters too; rollouts gather the full weights)"""
    pipeline: str = choice("sync", ("sync", "one_step_off", "async"))
    """sync: rollout then update in this process (exact, the default) | one_step_off: the next
    step's rollout runs on Ray workers while this step trains (one version old) | async: workers
    produce continuously into a bounded buffer (see trainer/pipeline.py; rollout.workers)"""
    max_staleness: int = at_least(1, 0)
    """async: samples produced more than this many weight versions ago are dropped and counted"""
    pipeline_buffer: int = at_least(2, 1)
    """async: finished rollout chunks held at most (workers wait when it is full)"""
    pipeline_timeout_s: float = 1800.0
    """longest wait for rollout data from the workers before the run stops with their states"""
    ray_address: str = ""
    """Ray cluster for the pipeline's workers ("" starts a local one; "auto" joins `ray start`)"""


@dataclass
class LogConfig:
    dir: str = "runs"
    """parent directory of run directories"""
    name: str = ""
    """run name (default: recipe name + timestamp)"""
    tensorboard: bool = True
    """write TensorBoard event files beside metrics.jsonl"""
    progress: bool = True
    """show a progress bar with ETA"""
    rollouts_every: int = at_least(10, 0)
    """keep a sample of the rollouts every N steps (and at step 1) in ``<run>/rollouts`` for
    ``perceptrl view`` and ``perceptrl doctor`` (0: none)"""
    rollouts_groups: int = at_least(4, 1)
    """groups kept per recorded step (spread over the batch)"""
    rollouts_keep: int = at_least(50, 1)
    """recorded steps kept on disk: the first and the latest others"""
    wandb: bool = False
    """log to Weights & Biases too (pip extra ``tracking``): the resolved recipe as the run's
    config, every metric row, and the report files of ``perceptrl eval`` on the run's
    checkpoints as media; ``<run>/trackers.json`` keeps the run id, so ``--resume`` continues
    the same W&B run"""
    wandb_project: str = "perceptrl"
    """W&B project"""
    wandb_entity: str = ""
    """W&B entity, a team or user (empty: your default entity)"""
    wandb_name: str = ""
    """W&B run name (empty: the run directory's name)"""
    wandb_tags: list[str] = field(default_factory=list)
    """W&B run tags, e.g. ``[grpo, clevr]``"""
    wandb_mode: str = choice("online", ("online", "offline"))
    """online | offline: the run only on disk, in ``<run>/wandb/`` (upload it later with
    ``wandb sync``)"""
    mlflow: bool = False
    """log to MLflow too (pip extra ``tracking``): the flattened recipe as params, every metric
    with its step, and the recipe (``recipe.yaml``) and the report files of ``perceptrl eval``
    on the run's checkpoints as artifacts; ``--resume`` continues the same MLflow run"""
    mlflow_tracking_uri: str = ""
    """MLflow tracking URI, e.g. a server's ``http://host:5000`` (empty: a store in the run
    directory, ``<run>/mlflow.db`` with artifacts in ``<run>/mlartifacts``)"""
    mlflow_experiment: str = "perceptrl"
    """MLflow experiment (created when missing)"""

    def check(self, root) -> None:
        """A tracker the recipe enables must be installed (a run would otherwise log without it)."""
        from .trackers import EXTRA, missing_packages

        for name, packages in missing_packages(self).items():
            raise ConfigError(
                f"log.{name}=true needs {' and '.join(packages)}, not installed here: install "
                f"the trackers with pip install 'perceptrl[{EXTRA}]' (pip install -e "
                f"'.[{EXTRA}]' in a checkout), or set log.{name}=false"
            )


@dataclass
class CheckpointConfig:
    every: int = at_least(0, 0)
    """write a checkpoint every N steps (0: only at the end)"""
    keep_last: int = at_least(2, 1)
    """checkpoints kept on disk (older ones are deleted)"""
    best: str = ""
    """an evaluation metric (``eval/success_rate``, ``eval/accuracy``): after every evaluation
    that beats the best so far, the policy's weights are also written to ``<run>/best/model``
    with ``best/best.json`` (step, metric, value), kept whatever ``keep_last`` prunes"""
    best_mode: str = choice("max", ("max", "min"))
    """whether a higher (max) or lower (min) ``best`` metric is better"""


class TrainerConfig(Protocol):
    """What the trainer reads of a run's config: its own sections (the composed ``Config`` of
    wiring.py has them, beside the sides' sections)."""

    algo: AlgoConfig
    train: TrainConfig
    log: LogConfig
    checkpoint: CheckpointConfig


REGISTRIES = (
    Registry("Advantage estimators", "`ADVANTAGES`, entries in `trainer/advantages.py`",
             ("algo.adv_estimator",), ADVANTAGES.names),
    Registry("Policy losses", "`POLICY_LOSSES`, entries in `trainer/algos.py`",
             ("algo.policy_loss",), POLICY_LOSSES.names),
    Registry("KL estimators", "`KL_ESTIMATORS`, entries in `trainer/algos.py`",
             ("algo.kl_estimator",), KL_ESTIMATORS.names),
    Registry("Loss aggregation modes", "`AGG_MODES`, entries in `trainer/algos.py`",
             ("algo.loss_agg_mode",), AGG_MODES.names),
    Registry("Rollout corrections", "`CORRECTIONS`, entries in `trainer/corrections.py`",
             ("algo.rollout_correction",), CORRECTIONS.names),
    Registry("Training engines", "`ENGINES`, entries in `trainer/engine.py` and "
             "`trainer/deepspeed_engine.py`", ("train.backend",), ENGINES.names),
)  # fmt: skip
"""The registries the trainer's sections read (the sides' are added in wiring.py)."""


# ---------------------------------------------------------------------------------------------
# Loading, overrides, validation (for any root dataclass: the composed `Config` of wiring.py)
# ---------------------------------------------------------------------------------------------


def load(root: type, path: str | Path | None = None, overrides: Sequence[str] = ()) -> Any:
    """Build a ``root`` dataclass from a YAML recipe and ``key.sub=value`` overrides (applied
    in order): `read_recipe`, then `build`."""
    return build(root, read_recipe(path, overrides))


def read_recipe(path: str | Path | None = None, overrides: Sequence[str] = ()) -> dict[str, Any]:
    """The raw mapping of a YAML recipe with ``key.sub=value`` overrides applied in order.

    Override values are parsed as YAML scalars/lists/maps (``algo.kl_coef=0.01``,
    ``data.families=[count_all]``, ``rollout.reward={format: 0.5}``).
    """
    raw: dict[str, Any] = {}
    if path is not None:
        loaded = read_yaml(path) or {}  # a syntax error names the file, line and fix
        if not isinstance(loaded, dict):
            raise ConfigError(
                f"{path}: a recipe must be a YAML mapping, got {type(loaded).__name__}"
            )
        raw = loaded
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} is not of the form key.sub=value")
        parsed = parse_yaml(value, f"override {item!r}") if value.strip() else ""
        _set_dotted(raw, key.strip(), parsed)
    return raw


def build(root: type, raw: dict[str, Any]) -> Any:
    """The ``root`` dataclass from a raw recipe mapping: every key, type and name checked
    (`schema.from_dict`), then every section's rules across keys (`schema.check_sections`)."""
    cfg = from_dict(root, raw, where="", root=root)
    check_sections(cfg)
    return cfg


def save_config(cfg: Any, path: str | Path) -> None:
    """Write the resolved config (every field, defaults included) as YAML, atomically (a kill
    during the write leaves the old file or none, never a cut one)."""
    atomic_write_text(path, yaml.safe_dump(asdict(cfg), sort_keys=False))


def field_docs(cls: type) -> dict[str, str]:
    """Help text of each field: the string literal right below it in the class body."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def describe(cls: type, prefix: str = "") -> list[tuple[str, str, Any, str]]:
    """(dotted key, type, default, help) for every leaf field, for ``perceptrl config``."""
    rows = []
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    default = cls()
    for f in fields(cls):
        kind = hints[f.name]
        if is_dataclass(kind):
            rows += describe(kind, f"{prefix}{f.name}.")
        else:
            rows.append(
                (
                    f"{prefix}{f.name}",
                    type_name(kind),
                    getattr(default, f.name),
                    docs.get(f.name, ""),
                )
            )
    return rows


class Valid(NamedTuple):
    """The valid values of a key, as the reference and ``perceptrl config`` print them."""

    names: list[str] | dict[str, list[str]]
    """sorted names, or sorted names per group"""
    checked: bool
    """True: a `choice` field's values (any other fails to load); False: the names of a registry
    the key reads (its help says what else it takes, e.g. ``module:function``)"""


def valid_values(root: type, registries: Iterable[Registry] = ()) -> dict[str, Valid]:
    """Dotted key -> its valid values, read now: the choices of every `choice` field (a
    registry's sorted, a fixed tuple's in its order), and the names of ``registries`` for the
    free keys they list."""
    out: dict[str, Valid] = {}
    for reg in registries:
        names = reg.names()
        if isinstance(names, Mapping):
            grouped = {str(k): sorted(map(str, v)) for k, v in sorted(names.items())}
            for key in reg.keys:
                out[key] = Valid(grouped, False)
        else:
            for key in reg.keys:
                out[key] = Valid(sorted(map(str, names)), False)
    for key, f, _ in leaf_fields(root):
        valid = choices(f)
        if valid is not None:
            registry = callable(f.metadata["choices"])
            names = sorted(map(str, valid)) if registry else [str(v) for v in valid]
            out[key] = Valid(names, True)
    return out


def format_valid(valid: Valid, code: str = "", label: bool = False) -> str:
    """``valid`` on one line (``code`` quotes each name, e.g. a backtick for Markdown; ``label``
    starts a `choice` field's values with "valid:" as a registry's start with "registered:")."""

    def join(names: list[str]) -> str:
        return ", ".join(f"{code}{n}{code}" for n in names)

    if isinstance(valid.names, dict):
        text = "; ".join(f"{group}: {join(names)}" for group, names in valid.names.items())
    else:
        text = join(valid.names)
    if valid.checked:
        return f"valid: {text}" if label else text
    return f"registered: {text}"


def reference(root: type, registries: Sequence[Registry] = (), intro: str = "") -> str:
    """The configuration reference of ``root`` as Markdown: ``intro``, then one section per
    field of ``root`` in order, a table per section (key, type, default, help, valid values;
    nested sections follow as subsections), and a last section listing each registry's names.

    Deterministic: names are sorted and defaults are written as YAML; a default read from the
    machine or the environment must say so in its field's help and is written as the
    placeholder of the field's ``reference_default`` metadata instead."""
    valid = valid_values(root, registries)
    out = ["# Configuration reference", "", intro.strip(), ""]
    hints = typing.get_type_hints(root)
    docs = field_docs(root)
    links = ", ".join(f"[{f.name}](#{f.name})" for f in fields(root))
    out += [f"Sections: {links}, [registries](#registries).", ""]
    defaults = root()
    for f in fields(root):
        kind = hints[f.name]
        if is_dataclass(kind):
            _md_section(out, kind, f.name, docs.get(f.name, ""), valid, level=2)
        else:
            out += [f"## {f.name}", ""]
            out += _md_table([_md_row(f.name, f, kind, defaults, docs, valid)])
    out += ["## Registries", ""]
    out += [
        "The tables the valid values above come from, as registered when `perceptrl` is "
        "imported (a name that a user's own module registers joins them when that module is "
        "imported).",
        "",
    ]
    for reg in registries:
        keys = ", ".join(f"`{k}`" for k in reg.keys)
        names = reg.names()
        out += [f"### {reg.title}", "", f"{_md(reg.source)}; read by {keys}.", ""]
        if isinstance(names, Mapping):
            out += [f"- {k}: " + ", ".join(f"`{n}`" for n in sorted(map(str, v)))
                    for k, v in sorted(names.items())]  # fmt: skip
        else:
            out.append(", ".join(f"`{n}`" for n in sorted(map(str, names))))
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def _md_section(out: list[str], cls: type, key: str, help_: str, valid: dict, level: int) -> None:
    """Section ``key`` (dataclass ``cls``): its help, a table of its leaf fields, then its
    nested sections one level down."""
    out += [f"{'#' * level} {key}", ""]
    own = cls.__doc__ if cls.__doc__ and not cls.__doc__.startswith(f"{cls.__name__}(") else ""
    for text in (help_, " ".join(own.split())):
        if text:
            out += [_md(text), ""]
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    defaults = cls()
    rows, nested = [], []
    for f in fields(cls):
        if is_dataclass(hints[f.name]):
            nested.append(f)
        else:
            rows.append(_md_row(f"{key}.{f.name}", f, hints[f.name], defaults, docs, valid))
    out += _md_table(rows)
    for f in nested:
        _md_section(out, hints[f.name], f"{key}.{f.name}", docs.get(f.name, ""), valid, level + 1)


def _md_row(key: str, f, kind: Any, defaults: Any, docs: dict, valid: dict) -> list[str]:
    default = f.metadata.get("reference_default")
    if default is None:
        default = _yaml(getattr(defaults, f.name))
    values = format_valid(valid[key], code="`") if key in valid else ""
    return [
        f"`{key}`",
        _md(f"`{type_name(kind)}`"),
        _md(f"`{default}`"),
        _md(docs.get(f.name, "")),
        _md(values),
    ]


def _md_table(rows: list[list[str]]) -> list[str]:
    out = ["| Key | Type | Default | Help | Valid values |", "|---|---|---|---|---|"]
    out += ["| " + " | ".join(row) + " |" for row in rows]
    return out + [""]


def _md(text: str) -> str:
    """``text`` for a Markdown table cell: pipes escaped, and ``<`` outside code spans (a tag
    such as ``<answer>`` in prose would be read as HTML)."""
    parts = re.split(r"(`+[^`]*?`+)", text)
    for i in range(0, len(parts), 2):
        parts[i] = parts[i].replace("<", "\\<")
    return "".join(parts).replace("|", "\\|")


def _yaml(value: Any) -> str:
    """``value`` as a one-line YAML flow value (what a recipe would write)."""
    text = yaml.safe_dump(value, default_flow_style=True, width=1 << 30, sort_keys=False)
    return text.removesuffix("\n").removesuffix("\n...").strip()


def _set_dotted(raw: dict, key: str, value: Any) -> None:
    parts = key.split(".")
    node = raw
    for p in parts[:-1]:
        nxt = node.setdefault(p, {})
        if not isinstance(nxt, dict):
            raise ConfigError(f"override {key}: {p!r} is a value, not a section")
        node = nxt
    node[parts[-1]] = value
