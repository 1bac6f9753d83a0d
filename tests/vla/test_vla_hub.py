"""VLA policy folders (`vla.hub`, `vla.model_card`): round trips of each policy kind, the spec
and the model card a run writes, the errors a damaged or foreign folder gives, and folders
written before the format (no model_type, no policy_spec.json) still loading."""

from __future__ import annotations

import dataclasses
import json
import os

os.environ.setdefault("MUJOCO_GL", "egl")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402  (import torch before any rendering)
import yaml  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from perceptrl.errors import ConfigError, ModelError  # noqa: E402
from perceptrl.vla import hub  # noqa: E402
from perceptrl.vla.builder import build_trainer, load_policy, run_sft  # noqa: E402
from perceptrl.vla.compact import (  # noqa: E402
    GRIPPER_SCALE,
    POS_SCALE,
    WORKSPACE_CENTRE,
    CompactSpec,
    CompactVLA,
)
from perceptrl.vla.config import EnvConfig, VLAConfig  # noqa: E402
from perceptrl.vla.flow import FlowVLA  # noqa: E402
from perceptrl.wiring import load_config  # noqa: E402

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
QUIET = ["log.tensorboard=false", "log.progress=false", "train.device=cpu"]
FILES = {"config.json", "model.safetensors", "policy_spec.json", "README.md"}


def state_policy(head: str = "gaussian", chunk: int = 1) -> CompactVLA:
    torch.manual_seed(0)
    vla = VLAConfig(encoder="state", hidden=16, head=head, flow_steps=2)
    spec = CompactSpec(action_dim=5, chunk=chunk, objects_dim=21, vla=vla)
    return FlowVLA(spec) if head == "flow" else CompactVLA(spec)


def obs(n: int = 3) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {"proprio": torch.randn(n, 8, generator=g), "objects": torch.randn(n, 21, generator=g),
            "words": torch.randint(2, 20, (n, 16), generator=g)}  # fmt: skip


def spec_of(path: Path) -> dict:
    return json.loads((path / hub.SPEC_FILE).read_text())


def edit_json(file: Path, **changes) -> None:
    file.write_text(json.dumps({**json.loads(file.read_text()), **changes}))


@pytest.mark.parametrize(("head", "kind"), [("gaussian", CompactVLA), ("flow", FlowVLA)])
def test_round_trip_of_each_compact_head(tmp_path, head, kind):
    policy = state_policy(head, chunk=2)
    policy.save(tmp_path)
    assert {p.name for p in tmp_path.iterdir()} == FILES
    config = json.loads((tmp_path / "config.json").read_text())
    assert (
        config["model_type"]
        == hub.model_type(head)
        == f"perceptrl-{head}-vla".replace("gaussian", "compact")
    )
    assert config["version"] == hub.FORMAT_VERSION and config["policy"] == "compact"
    again = load_policy(tmp_path)
    assert type(again) is kind and again.spec == policy.spec
    torch.testing.assert_close(again.act(obs(), True)[0], policy.act(obs(), True)[0])


def test_the_spec_says_what_the_policy_reads_and_emits(tmp_path):
    policy = state_policy(chunk=2)
    env = EnvConfig(id="perceptrl/Pick-v0", obs_mode="state", action_chunk=2)
    policy.origin = hub.Origin(hub.env_facts(env))
    policy.save(tmp_path)
    spec = spec_of(tmp_path)
    action = spec["output_features"]["action"]
    assert action == {"type": "ACTION", "shape": [5], "chunk": 2, "low": -1.0, "high": 1.0,
                      "control": "ee", "names": ["dx", "dy", "dz", "dyaw", "gripper"],
                      "head": "gaussian"}  # fmt: skip
    inputs = spec["input_features"]
    assert inputs["observation.state"]["shape"] == [8]
    assert inputs["observation.state"]["names"][-1] == "gripper"
    assert inputs["observation.objects"] == {"type": "ENV", "shape": [21], "entity_size": 7,
                                             "read_by": "actor", "any_entity_count": False}  # fmt: skip
    state = spec["normalization"]["observation.state"]  # (x - mean) / std is what the net does
    assert state["mean"][:3] == list(WORKSPACE_CENTRE) and state["std"][:3] == [POS_SCALE] * 3
    assert state["std"][7] == 1 / GRIPPER_SCALE
    assert spec["instruction"]["encoder"] == "bag"
    assert spec["instruction"]["vocabulary"] == policy.spec.words
    assert spec["env"]["id"] == "perceptrl/Pick-v0" and spec["env"]["task"] == "pick"
    assert spec["env"]["max_episode_steps"] == 80


def test_camera_policy_spec_and_minilm_encoder():
    vla = VLAConfig(encoder="keypoint", critic="state", instruction_encoder="minilm")
    spec = CompactSpec(action_dim=8, objects_dim=21, image_size=48, cameras=2, vla=vla)
    env = EnvConfig(cameras=["agentview", "wrist"], image_size=48, control="joint",
                    privileged_state=True)  # fmt: skip
    desc = hub.compact_description(spec, hub.Origin(hub.env_facts(env)), (0, 0, 0), 1.0, 1.0)
    images = {k: v for k, v in desc["input_features"].items() if v["type"] == "VISUAL"}
    assert list(images) == ["observation.images.agentview", "observation.images.wrist"]
    assert all(v["shape"] == [48, 48, 3] and v["dtype"] == "uint8" for v in images.values())
    assert desc["input_features"]["observation.objects"]["read_by"].startswith("critic")
    assert desc["output_features"]["action"]["names"][:2] == ["q1", "q2"]
    assert desc["instruction"]["model"] == "sentence-transformers/all-MiniLM-L6-v2"
    assert "vocabulary" not in desc["instruction"] and desc["instruction"]["frozen"]
    hub.check_env(desc, env)  # the env it was described on fits
    bad = dataclasses.replace(env, cameras=["wrist", "agentview"], image_size=64, control="ee")
    with pytest.raises(ConfigError) as e:
        hub.check_env(desc, bad)
    assert "env.cameras=['wrist', 'agentview']" in str(e.value)
    assert "env.image_size=64" in str(e.value) and "env.control=ee" in str(e.value)
    with pytest.raises(ConfigError, match="env.obs_mode=state"):
        hub.check_env(desc, dataclasses.replace(env, obs_mode="state"))


def test_folder_errors_name_what_is_wrong(tmp_path):
    policy = state_policy()
    policy.save(tmp_path / "m")
    model = tmp_path / "m"
    edit_json(model / "config.json", version=hub.FORMAT_VERSION + 1)
    with pytest.raises(ModelError, match=r"version 2, newer .*upgrade perceptrl"):
        load_policy(model)
    edit_json(model / "config.json", version=1, model_type="perceptrl-diffusion-vla")
    with pytest.raises(ModelError, match="unknown model_type 'perceptrl-diffusion-vla'") as e:
        load_policy(model)
    assert "perceptrl-flow-vla" in str(e.value) and hub.TOKEN_TYPE in str(e.value)
    edit_json(model / "config.json", model_type="qwen2_5_vl")  # an HF VLM's folder
    with pytest.raises(ModelError, match="not a perceptrl VLA policy"):
        load_policy(model)
    edit_json(model / "config.json", model_type="perceptrl-flow-vla")
    with pytest.raises(ModelError, match="model_type perceptrl-flow-vla but vla.head=gaussian"):
        load_policy(model)
    edit_json(model / "config.json", model_type="perceptrl-compact-vla")
    spec = spec_of(model)
    spec["output_features"]["action"]["shape"] = [7]
    (model / hub.SPEC_FILE).write_text(json.dumps(spec))
    with pytest.raises(ModelError, match=r"action.shape is \[7\] there, \[5\] in the config"):
        load_policy(model)
    (model / hub.SPEC_FILE).write_text("{not json")
    with pytest.raises(ModelError, match="policy_spec.json does not parse"):
        load_policy(model)
    (model / "model.safetensors").unlink()
    with pytest.raises(ModelError, match=r"missing model.safetensors\)"):
        load_policy(model)
    with pytest.raises(ModelError, match="is not a folder"):
        load_policy(tmp_path / "nowhere")


def test_folders_from_before_the_format_still_load(tmp_path):
    """A folder exactly as the code before model_type wrote it: model.safetensors and a
    config.json of {"policy": "compact", **CompactSpec}, nothing else."""
    policy = state_policy()
    state = {k: v.detach().cpu().contiguous() for k, v in policy.state_dict().items()}
    save_file(state, str(tmp_path / "model.safetensors"))
    legacy = {"policy": "compact", **dataclasses.asdict(policy.spec)}
    (tmp_path / "config.json").write_text(json.dumps(legacy, indent=1))
    assert hub.read_manifest(tmp_path) == hub.Manifest("perceptrl-compact-vla", 0)
    again = load_policy(tmp_path, env=EnvConfig(obs_mode="state"))
    assert again.spec == policy.spec and again.origin is None
    torch.testing.assert_close(again.act(obs(), True)[0], policy.act(obs(), True)[0])
    with pytest.raises(ConfigError, match="perceptrl/Push-v0 gives 28"):
        load_policy(tmp_path, env=EnvConfig(id="perceptrl/Push-v0", obs_mode="state"))
    again.save(tmp_path / "resaved")  # saving again writes today's folder
    assert {p.name for p in (tmp_path / "resaved").iterdir()} == FILES


def _sft(run_dir: Path, *overrides: str) -> Path:
    cfg = load_config(
        CONFIGS / "vla_bc_pick.yaml",
        ["env.id=perceptrl/Reach-v0", "env.num_envs=2", "env.steps_per_rollout=4",
         "env.max_episode_steps=5", "train.steps=2", *overrides, *QUIET],
    )  # fmt: skip
    run_sft(cfg, run_dir)
    return sorted((run_dir / "checkpoints").iterdir())[-1] / "model"


def test_a_run_writes_its_card_with_the_recipe_task_and_figures(tmp_path):
    run = tmp_path / "bc_reach"
    model = _sft(run, "env.eval_episodes=2", "train.eval_every=1",
                 "checkpoint.best=eval/success_rate")  # fmt: skip
    card = (model / "README.md").read_text()
    meta = yaml.safe_load(card.split("---\n")[1])
    assert meta["library_name"] == "perceptrl" and meta["env"] == "perceptrl/Reach-v0"
    assert {"robotics", "reinforcement-learning", "perceptrl-compact-vla"} <= set(meta["tags"])
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in rows if "eval/success_rate" in r][-1]
    index = meta["model-index"][0]["results"][0]["metrics"][0]
    assert index["value"] == last["eval/success_rate"] and last["step"] == 2
    assert "`perceptrl sft`" in card and "behaviour cloning of the scripted experts" in card
    assert "| steps | 2 (train.steps); this save after step 2 |" in card
    assert "`perceptrl/Reach-v0` (task `reach`, 5 steps per episode" in card
    assert f"| `eval/success_rate` | {last['eval/success_rate']:.3f} |" in card
    assert "from `metrics.jsonl` of run `bc_reach`, its row of step 2" in card
    assert str(tmp_path) not in card + (model / hub.SPEC_FILE).read_text()  # no local paths
    spec = spec_of(model)
    assert spec["trained_with"]["steps"] == 2 and spec["trained_with"]["eval_episodes"] == 2
    assert spec["env"]["id"] == "perceptrl/Reach-v0"
    assert "eval/success_rate" in (run / "best" / "model" / "README.md").read_text()
    assert load_policy(model).origin.env == spec["env"]  # read back


def test_a_run_without_evaluation_says_so_and_a_warm_start_is_checked(tmp_path):
    model = _sft(tmp_path / "bc", "env.eval_episodes=0")
    card = (model / "README.md").read_text()
    assert "Not evaluated: run `bc` logged no evaluation before this save." in card
    assert "model-index" not in card
    cfg = load_config(
        CONFIGS / "vla_grpo.yaml",
        ["env.id=perceptrl/Push-v0", f"model.path={model}", "env.num_envs=2",
         "env.eval_episodes=0", *QUIET],
    )  # fmt: skip
    with pytest.raises(ConfigError, match="it reads 21 pose numbers, perceptrl/Push-v0 gives 28"):
        build_trainer(cfg, tmp_path / "rl")


def test_eval_of_a_damaged_folder_is_a_model_error_not_a_traceback(tmp_path, capsys):
    from perceptrl.cli import main

    state_policy().save(tmp_path / "m")
    edit_json(tmp_path / "m" / "config.json", version=99)
    status = main(["eval", "vla_bc_pick", "--model", str(tmp_path / "m"),
                   "--out", str(tmp_path / "eval")])  # fmt: skip
    assert status == ModelError.exit_status
    assert "newer than this perceptrl reads" in capsys.readouterr().err


def test_token_vla_round_trip_and_its_legacy_folder(tmp_path):
    from perceptrl.vla.token_vla import TokenSpec, TokenVLA
    from perceptrl.vlm.tiny import build_tiny

    tiny = build_tiny("qwen2_5_vl", tmp_path / "tiny", layers=1, vision_depth=1)
    policy = TokenVLA.from_pretrained(tiny, TokenSpec(action_dim=5, chunk=2, bins=31))
    env = EnvConfig(cameras=["agentview", "wrist"], image_size=56, action_chunk=2)
    policy.origin = hub.Origin(hub.env_facts(env))
    policy.save(tmp_path / "m")
    model = tmp_path / "m"
    assert json.loads((model / "token_vla.json").read_text())["model_type"] == hub.TOKEN_TYPE
    assert json.loads((model / "config.json").read_text())["model_type"] == "qwen2_5_vl"
    spec = spec_of(model)
    assert spec["output_features"]["action"]["bins"] == 31
    assert spec["output_features"]["action"]["chunk"] == 2
    assert [k for k in spec["input_features"] if "images" in k] == [
        "observation.images.agentview", "observation.images.wrist"]  # fmt: skip
    assert "perceptrl-token-vla" in (model / "README.md").read_text()
    again = load_policy(model, env=dataclasses.replace(env, image_size=64))  # resized: fine
    assert isinstance(again, TokenVLA) and again.spec == policy.spec
    assert again.origin.env == spec["env"]
    first = next(iter(policy.state_dict()))
    torch.testing.assert_close(again.state_dict()[first], policy.state_dict()[first])
    with pytest.raises(ConfigError, match=r"reads the cameras \['agentview', 'wrist'\]"):
        load_policy(model, env=dataclasses.replace(env, cameras=["agentview"]))
    # as the code before model_type wrote it: token_vla.json = the TokenSpec, no spec, no card
    legacy = dataclasses.asdict(policy.spec)
    (model / "token_vla.json").write_text(json.dumps(legacy, indent=1))
    (model / hub.SPEC_FILE).unlink()
    (model / hub.CARD_FILE).unlink()
    assert hub.read_manifest(model) == hub.Manifest(hub.TOKEN_TYPE, 0)
    old = load_policy(model)
    assert old.spec == policy.spec and old.origin is None
