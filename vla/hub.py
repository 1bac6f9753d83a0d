"""A saved VLA policy as a folder a user can share, in the style of Hugging Face model folders
and LeRobot's pretrained policies.

Layout of a compact policy (``vla.head`` gaussian, flow, ...; written by ``CompactVLA.save``)::

    model/
        config.json          model_type ("perceptrl-compact-vla", "perceptrl-flow-vla", ...),
                             version (the folder format) and the `CompactSpec` that rebuilds
                             the network (``policy``, the ``vla`` section, sizes, vocabulary)
        model.safetensors    the weights (safetensors only)
        policy_spec.json     what the policy reads and emits (`compact_description`)
        README.md            the model card (`vla.model_card`)

A token VLA's folder is its VLM's Hugging Face folder (config.json there is the VLM's, with
the VLM's own ``model_type``), so its model_type and version are in ``token_vla.json`` beside
the `TokenSpec`; it has the same ``policy_spec.json`` and ``README.md``.

``policy_spec.json`` holds, with LeRobot's names: ``input_features`` and ``output_features``
(type, shape, and what else a user must match: camera names, proprio and action component
names, bounds, control mode, action chunk, what reads each feature), ``normalization`` (the
fixed constants the network applies: it uses no data statistics), ``instruction`` (the bag/gru
vocabulary, or the frozen MiniLM encoder's name), ``env`` (the env id, task and options the
policy was trained on) and ``trained_with`` (the recipe summary the card shows).

Loading (`read_manifest`, `read_origin`) names what is missing or inconsistent as a
`ModelError`: no weights or config, an unknown model_type, a format version newer than this
code, a ``policy_spec.json`` that disagrees with the weights' config. `check_env` compares a
policy's description with a recipe's env (`ConfigError`). Folders written before the format
had a version (no model_type, no ``policy_spec.json``) load as version 0.

This module knows no policy class (they import it); `vla.builder.load_policy` dispatches on
the model_type `read_manifest` returns.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError, ModelError
from ..registry import VLA_HEADS
from ..sim.composite import ENTITY_SIZE, POSE_SIZE
from .config import IMAGE_ENCODERS, EnvConfig
from .language import MINILM_INSTALL

FORMAT_VERSION = 1
"""the folder format this code writes and the newest it reads (0: folders from before it)"""
CONFIG, WEIGHTS, TOKEN_SPEC = "config.json", "model.safetensors", "token_vla.json"
SPEC_FILE, CARD_FILE = "policy_spec.json", "README.md"
TOKEN_TYPE = "perceptrl-token-vla"
MINILM_MODEL = "sentence-transformers/all-MiniLM-L6-v2"
PROPRIO_NAMES = ("tcp_x", "tcp_y", "tcp_z", "tcp_qw", "tcp_qx", "tcp_qy", "tcp_qz", "gripper")
"""the sim's proprio vector (metres, unit quaternion, finger opening in metres)"""
ACTION_NAMES = {
    "ee": ("dx", "dy", "dz", "dyaw", "gripper"),
    "joint": ("q1", "q2", "q3", "q4", "q5", "q6", "q7", "gripper"),
}
"""``env.control`` -> the action's components, each in [-1, 1]"""
ACTION_BOUNDS = (-1.0, 1.0)


def model_type(head: str) -> str:
    """The model_type of a compact policy with action head ``head`` (gaussian: the compact VLA)."""
    return "perceptrl-compact-vla" if head == "gaussian" else f"perceptrl-{head}-vla"


def model_types() -> list[str]:
    """Every model_type this code loads: one per registered head, and the token VLA."""
    return [model_type(h) for h in VLA_HEADS.names()] + [TOKEN_TYPE]


@dataclass(frozen=True)
class Manifest:
    """What a policy folder is: its model_type and its format version (0 before versions)."""

    model_type: str
    version: int

    @property
    def head(self) -> str | None:
        """The compact action head of this model_type (None: the token VLA)."""
        return next((h for h in VLA_HEADS.names() if model_type(h) == self.model_type), None)


@dataclass(frozen=True)
class Origin:
    """What a policy folder records of where the policy was trained: given to the policy by the
    VLA builder for a run, or read back from a folder's ``policy_spec.json``."""

    env: dict
    """`env_facts` of the env it was trained on"""
    trained_with: dict | None = None
    """`vla.model_card.training_summary` of the recipe (None: unknown)"""
    run_dir: Path | None = None
    """the run whose evaluations the model card cites (None: not saved by a run)"""


# ---------------------------------------------------------------------------- reading a folder


def read_manifest(path: str | Path) -> Manifest:
    """The model_type and version of the policy folder ``path``, after checking that it holds
    its config and weights; a `ModelError` says what is missing or unknown."""
    path = Path(path)
    if not path.is_dir():
        raise ModelError(
            f"{path} is not a folder; pass the `model` folder of a VLA checkpoint "
            "(<run>/checkpoints/step_N/model or <run>/best/model)"
        )
    token = (path / TOKEN_SPEC).is_file()
    missing = [] if (path / CONFIG).is_file() else [CONFIG]
    if token and not any(path.glob("*.safetensors")):
        missing.append("the VLM's *.safetensors weights")
    elif not token and not (path / WEIGHTS).is_file():
        missing.append(WEIGHTS)
    if missing:
        raise ModelError(
            f"{path} is not a whole VLA policy folder (missing {', '.join(missing)}); copy the "
            "whole folder again, or pass the `model` folder of a checkpoint written by "
            "policy.save"
        )
    raw = _json(path / (TOKEN_SPEC if token else CONFIG))
    found = raw.get("model_type")
    if token:
        manifest = Manifest(found or TOKEN_TYPE, raw.get("version", 0))
    elif found is None and raw.get("policy") == "compact":  # written before model_type
        head = raw.get("vla", {}).get("head", raw.get("head", "gaussian"))
        manifest = Manifest(model_type(head), 0)
    elif not str(found).startswith("perceptrl-"):
        raise ModelError(
            f"{path / CONFIG} has model_type {found!r}: not a perceptrl VLA policy (an HF model "
            f"folder, with no {TOKEN_SPEC}?); pass the `model` folder of a VLA checkpoint "
            "written by policy.save"
        )
    else:
        manifest = Manifest(found, raw.get("version", 0))
    _check_manifest(path, manifest)
    return manifest


def _check_manifest(path: Path, m: Manifest) -> None:
    known = model_types()
    if m.model_type not in known:
        raise ModelError(
            f"{path}: unknown model_type {m.model_type!r} (this perceptrl loads "
            f"{', '.join(known)}); a newer perceptrl, or a plugin that registers its head, "
            "wrote it"
        )
    if not isinstance(m.version, int) or m.version < 0:
        raise ModelError(f"{path}: format version {m.version!r} is not a whole number >= 0")
    if m.version > FORMAT_VERSION:
        raise ModelError(
            f"{path} is in folder format version {m.version}, newer than this perceptrl reads "
            f"(up to {FORMAT_VERSION}); upgrade perceptrl to load it"
        )


def _json(path: Path) -> dict:
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as e:  # JSONDecodeError is a ValueError
        raise ModelError(f"{path} does not parse ({type(e).__name__}: {e}); copy it again") from e
    if not isinstance(raw, dict):
        raise ModelError(f"{path} holds {type(raw).__name__}, not a JSON object; copy it again")
    return raw


def read_origin(path: str | Path, describe: Callable[[Origin | None], dict]) -> Origin | None:
    """The `Origin` the folder's ``policy_spec.json`` records (None: a folder written before
    the file existed), after comparing the file with ``describe(origin)``, the description
    rebuilt from the folder's config (`compact_description` / `token_description`): both must
    name the same features, with the same shapes, and the same action chunk, bounds and
    control; a `ModelError` names every difference."""
    file = Path(path) / SPEC_FILE
    if not file.exists():
        return None
    recorded = _json(file)
    env = recorded.get("env")
    origin = Origin(env, recorded.get("trained_with")) if isinstance(env, dict) else None
    derived, problems = describe(origin), []
    for side in ("input_features", "output_features"):
        mine, theirs = derived[side], recorded.get(side)
        if not isinstance(theirs, dict):
            problems.append(f"it has no {side}")
            continue
        for name in sorted(mine.keys() ^ theirs.keys()):
            problems.append(f"{name} is {'only there' if name in theirs else 'not there'}")
        for name in sorted(mine.keys() & theirs.keys()):
            for key in ("shape", "chunk", "low", "high", "control"):
                a, b = mine[name].get(key), theirs[name].get(key)
                if a != b:
                    problems.append(f"{name}.{key} is {b} there, {a} in the config")
    if problems:
        raise ModelError(
            f"{file} does not match the folder's config ({'; '.join(problems)}): the folder was "
            "edited or mixed from two policies; copy the whole folder again"
        )
    return origin


# ---------------------------------------------------------------------------- descriptions


def env_facts(env: EnvConfig) -> dict:
    """What a policy folder records of the env a policy was trained on (from the recipe)."""
    from ..sim import task_of

    task = task_of(env.id)
    return {
        "id": env.id, "task": task.name, "obs_mode": env.obs_mode,
        "cameras": list(env.cameras) if env.obs_mode == "rgb" else [],
        "image_size": env.image_size, "control": env.control,
        "privileged_state": env.privileged_state, "entity_features": env.entity_features,
        "action_chunk": env.action_chunk,
        "max_episode_steps": env.max_episode_steps or task.max_episode_steps,
        "wording": env.wording,
    }  # fmt: skip


def _action(action_dim: int, chunk: int, env: dict, **more) -> dict:
    control = env.get("control") or next(
        (c for c, names in ACTION_NAMES.items() if len(names) == action_dim), None
    )
    names = ACTION_NAMES.get(control)
    return {
        "type": "ACTION", "shape": [action_dim], "chunk": chunk,
        "low": ACTION_BOUNDS[0], "high": ACTION_BOUNDS[1], "control": control,
        "names": list(names) if names and len(names) == action_dim else None, **more,
    }  # fmt: skip


def _cameras(count: int | None, env: dict) -> list[tuple[str, str | None]]:
    """(feature name, camera name) of each camera a policy reads, in order: the env's cameras,
    or numbered ones with no name when the policy was saved without its env."""
    named = list(env.get("cameras") or [])
    if count is None or len(named) == count:
        return [(f"observation.images.{c}", c) for c in named]
    return [(f"observation.images.{i}", None) for i in range(count)]


def compact_description(spec, origin: Origin | None, centre, pos_scale, gripper_scale) -> dict:
    """The features, normalisation and instruction encoder of a compact policy (a
    `CompactSpec`); ``centre``, ``pos_scale`` and ``gripper_scale`` are the network's fixed
    input normalisation (`vla.compact`), written as the mean and std it amounts to."""
    vla, env = spec.vla, (origin.env if origin else {})
    S, P, n_obj = spec.image_size, spec.proprio_dim, spec.objects_dim
    inputs, norm = {}, {}
    if vla.encoder in IMAGE_ENCODERS:
        for key, cam in _cameras(spec.cameras, env):
            inputs[key] = {"type": "VISUAL", "camera": cam, "shape": [S, S, 3], "dtype": "uint8",
                           "read_by": "actor"}  # fmt: skip
        norm["observation.images"] = {"mode": "MEAN_STD", "mean": 127.5, "std": 255.0}
    names = list(PROPRIO_NAMES) if P == len(PROPRIO_NAMES) else None
    inputs["observation.state"] = {"type": "STATE", "shape": [P], "names": names,
                                   "read_by": "actor"}  # fmt: skip
    std = [pos_scale] * 3 + [1.0] * (P - 3)
    if names:
        std[-1] = 1.0 / gripper_scale
    norm["observation.state"] = {
        "mode": "MEAN_STD",
        "mean": [*centre] + [0.0] * (P - 3),
        "std": std,
    }
    reader = "actor" if vla.encoder not in IMAGE_ENCODERS else None
    if reader is None and (vla.critic == "state" or vla.aux != "none"):
        reader = "critic and auxiliary loss (training only)"
    if n_obj > 0 and reader is not None:
        size = ENTITY_SIZE if vla.encoder == "entities" else POSE_SIZE
        inputs["observation.objects"] = {
            "type": "ENV", "shape": [n_obj], "entity_size": size, "read_by": reader,
            "any_entity_count": vla.encoder == "entities",
        }  # fmt: skip
        norm["observation.objects"] = {
            "mode": "MEAN_STD", "per_entity": True, "mean": [*centre] + [0.0] * (size - 3),
            "std": [pos_scale] * 3 + [1.0] * (size - 3),
        }  # fmt: skip
    inputs["observation.instruction"] = {"type": "LANGUAGE", "max_tokens": vla.max_words}
    norm["action"] = {"mode": "IDENTITY", "note": "raw samples; the env clips them to the bounds"}
    if vla.instruction_encoder == "minilm":
        instruction = {"encoder": "minilm", "model": MINILM_MODEL, "install": MINILM_INSTALL,
                       "frozen": True, "projection": vla.instruction_projection}  # fmt: skip
    else:
        instruction = {"encoder": vla.instruction_encoder, "vocabulary": list(spec.words),
                       "ids": "0 padding, 1 unknown, vocabulary[i] is i + 2"}  # fmt: skip
    return {
        "input_features": inputs,
        "output_features": {"action": _action(spec.action_dim, spec.chunk, env, head=vla.head)},
        "normalization": {"statistics": "fixed constants of the network, not data", **norm},
        "instruction": {**instruction, "max_tokens": vla.max_words},
    }


def token_description(spec, origin: Origin | None) -> dict:
    """The features, action binning and prompt of a token VLA (a `TokenSpec`)."""
    env = origin.env if origin else {}
    S = env.get("image_size")
    inputs = {
        key: {"type": "VISUAL", "camera": cam, "shape": [S, S, 3], "dtype": "uint8",
              "read_by": "actor", "resized_by": "the VLM's image processor"}
        for key, cam in _cameras(None, env)
    }  # fmt: skip
    inputs["observation.instruction"] = {"type": "LANGUAGE"}
    bins = {"mode": "BINS", "bins": spec.bins, "first_token_id": spec.first_id}
    return {
        "input_features": inputs,
        "output_features": {"action": _action(spec.action_dim, spec.chunk, env, bins=spec.bins)},
        "normalization": {
            "statistics": "no data statistics",
            "observation.images": {"mode": "the VLM's image processor (preprocessor_config.json)"},
            "action": {**bins, "note": "uniform bins on the bounds; a token decodes to its centre"},
        },
        "instruction": {"encoder": "vlm", "prompt": spec.question, "tokenizer": "the VLM's"},
    }


# ---------------------------------------------------------------------------- against an env


def check_env(description: dict, env: EnvConfig, training: bool = False) -> None:
    """A `ConfigError` naming every way the recipe's ``env`` differs from what the policy of
    ``description`` acts on and emits: control, cameras, image size, and the entity count of
    each task it runs on (``env.id`` and ``env.eval_tasks`` when ``training``, else the tasks
    ``perceptrl eval`` runs) for a policy that reads the poses by their order. What only a
    training signal reads (a state critic's poses) is not checked: a run without it still acts."""
    inputs = description.get("input_features", {})
    action = description.get("output_features", {}).get("action", {})
    problems = []
    if action.get("control") not in (None, env.control):
        problems.append(f"its actions are {action['control']} control; env.control={env.control}")
    images = [f.get("camera") for f in inputs.values() if f.get("type") == "VISUAL"]
    if images and env.obs_mode != "rgb":
        problems.append("it reads camera images; env.obs_mode=state")
    elif images and None not in images and images != list(env.cameras):
        problems.append(f"it reads the cameras {images}; env.cameras={list(env.cameras)}")
    elif images and len(images) != len(env.cameras):
        problems.append(f"it reads {len(images)} camera(s); env.cameras={list(env.cameras)}")
    sizes = {f["shape"][0] for f in inputs.values()
             if f.get("type") == "VISUAL" and "resized_by" not in f}  # fmt: skip
    if images and env.obs_mode == "rgb" and sizes - {env.image_size}:
        problems.append(f"its images are {sizes.pop()} px; env.image_size={env.image_size}")
    objects = inputs.get("observation.objects")
    if objects is not None and objects["read_by"] == "actor" and not objects["any_entity_count"]:
        tasks = [env.id, *env.eval_tasks] if training else env.eval_tasks or [env.id]
        problems += _objects_problems(objects["shape"][0], env, dict.fromkeys(tasks))
    if problems:
        raise ConfigError(
            f"model.path holds a policy that does not fit the recipe's env ({'; '.join(problems)}"
            "); set the env section to match the policy (its policy_spec.json), or train a "
            "policy for this env"
        )


def _objects_problems(want: int, env: EnvConfig, tasks) -> list[str]:
    """The entity-pose vector of ``want`` numbers against the one each of ``tasks`` gives."""
    from ..sim import task_of
    from ..sim.tasks import task_counts

    if env.obs_mode != "state":
        return ["it acts on the entity poses; env.obs_mode=rgb"]
    size = ENTITY_SIZE if env.entity_features else POSE_SIZE
    out = []
    for env_id in tasks:
        got = sum(task_counts(task_of(env_id)).values()) * size
        if got != want:
            out.append(f"it reads {want} pose numbers, {env_id} gives {got} (other entities)")
    return out
