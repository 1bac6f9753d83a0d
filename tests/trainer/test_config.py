from pathlib import Path

import pytest
import yaml

from perceptrl.trainer.config import (
    AlgoConfig,
    ConfigError,
    all_keys,
    describe,
    field_docs,
    save_config,
)
from perceptrl.wiring import Config, load_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def test_yaml_recipe_then_dotted_overrides(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("algo:\n  kl_coef: 0.1\n  clip_high: 0.28\ntrain:\n  steps: 7\n")
    cfg = load_config(recipe, ["algo.kl_coef=0.01", "train.steps=50", "data.families=[count_all]"])
    assert cfg.algo.kl_coef == 0.01 and cfg.algo.clip_high == 0.28
    assert cfg.train.steps == 50 and cfg.data.families == ["count_all"]
    assert cfg.algo.clip_low == AlgoConfig().clip_low  # untouched default


@pytest.mark.parametrize(
    "override, nearest",
    [
        ("algo.kl_coeff=0.1", "algo.kl_coef"),
        ("trian.steps=3", "train"),
        ("train.step=3", "train.steps"),
    ],
)
def test_unknown_key_names_the_nearest_valid_key(override, nearest):
    with pytest.raises(ConfigError, match=f"did you mean '{nearest}'"):
        load_config(None, [override])


@pytest.mark.parametrize(
    "override, expected",
    [
        ("train.steps=abc", "train.steps: expected int"),
        ("algo.clip_low=true", "algo.clip_low: expected float"),
        ("algo.norm_by_std=3", "expected bool"),
        ("data.families=count_all", "expected list"),
    ],
)
def test_wrong_type_names_field_and_expected_type(override, expected):
    with pytest.raises(ConfigError, match=expected):
        load_config(None, [override])


def test_int_and_yaml11_exponents_are_accepted_for_float_fields():
    assert load_config(None, ["train.lr=1"]).train.lr == 1.0
    assert load_config(None, ["train.lr=2e-3"]).train.lr == 2e-3  # YAML 1.1 parses this as a str


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config(None, ["algo.kl_coef=0.02", "rollout.reward={format: 0.5, accuracy: 1.0}"])
    save_config(cfg, tmp_path / "config.yaml")
    again = load_config(tmp_path / "config.yaml")
    assert again == cfg
    assert yaml.safe_load((tmp_path / "config.yaml").read_text())["algo"]["kl_coef"] == 0.02


def test_every_field_has_help():
    rows = describe(Config)
    assert {r[0] for r in rows} == set(all_keys(Config))
    missing = [key for key, _, _, help_ in rows if not help_]
    assert not missing, f"fields without a docstring: {missing}"
    assert "Dr.GRPO" in field_docs(AlgoConfig)["norm_by_std"]


@pytest.mark.parametrize("recipe", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.stem)
def test_shipped_recipes_load(recipe):
    load_config(recipe)


@pytest.mark.parametrize(
    "override, valid",
    [
        ("algo.adv_estimator=grpoo", "did you mean 'grpo'.*valid: gae, grpo"),
        ("algo.policy_loss=ppo", "valid: cispo, gspo, ppo_clip"),
        ("algo.kl_estimator=k4", "valid: .*k3"),
        ("algo.loss_agg_mode=token_mean", "did you mean 'token-mean'"),
        ("rollout.engine=sglang", "valid: hf, vllm"),
        ("data.generator=kitti", "valid: clevr, plan, spatial, video, zoom"),
        ("vla.encoder=resnet", "valid: cnn, keypoint, state"),
        ("vla.critic=twin", "valid: shared, state"),
        ("train.backend=fsdp", "valid: deepspeed, torch"),
        ("side=vision", "valid: plan, vla, vlm"),
    ],
)
def test_names_with_a_fixed_set_of_values_are_checked_at_load(override, valid):
    with pytest.raises(ConfigError, match=f"{override.split('=')[0]}=.*{valid}"):
        load_config(None, [override])


@pytest.mark.parametrize("recipe", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.stem)
def test_shipped_recipes_list_every_key_in_perceptrl_config(recipe, capsys):
    """``perceptrl config <recipe>`` prints every key with its value and help."""
    from perceptrl.cli import main

    assert main(["config", str(recipe)]) == 0
    out = capsys.readouterr().out
    for key in all_keys(Config):
        assert f"\n{key} = " in "\n" + out, key


def test_sections_live_with_their_owners():
    """The trainer's config module holds the trainer's sections; each side holds its own."""
    from perceptrl.trainer import config as trainer_config
    from perceptrl.vla import config as vla_config
    from perceptrl.vlm import config as vlm_config

    for name in ("ModelConfig", "DataConfig", "RolloutConfig", "VideoConfig", "VLLMConfig"):
        assert hasattr(vlm_config, name) and not hasattr(trainer_config, name)
    for name in ("EnvConfig", "VLAConfig"):
        assert hasattr(vla_config, name) and not hasattr(trainer_config, name)
    assert not hasattr(trainer_config, "Config")


def test_reading_a_recipe_loads_no_model_library():
    """``perceptrl config`` and recipe validation read the registries (so the sides' modules,
    torch and MuJoCo load: every name and rule across keys is checked when a recipe loads) but
    no model library or run-time engine: transformers, DeepSpeed, Ray and vLLM load only when a
    run is built."""
    import subprocess
    import sys

    code = (
        "import sys; from perceptrl.wiring import CONFIGS, load_config; "
        "load_config(CONFIGS / 'vla_grpo.yaml'); load_config(CONFIGS / 'plan_grpo.yaml'); "
        "heavy = [m for m in ('transformers', 'deepspeed', 'ray', 'vllm') if m in sys.modules]; "
        "assert not heavy, heavy"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
