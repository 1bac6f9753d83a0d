"""Episodes through the shared trainer: GRPO, RLOO and GSPO steps with every loss aggregation
mode and DAPO dynamic sampling, reward terms over episodes, micro-batch invariance with
observation holes, and SFT on multi-turn tool traces."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from perceptrl.datasets.loader import load_samples
from perceptrl.datasets.zoom import generate
from perceptrl.registry import GENERATORS
from perceptrl.rewards import build_reward
from perceptrl.trainer.engine import TorchEngine, build_engine
from perceptrl.trainer.loop import Trainer
from perceptrl.trainer.segments import OBSERVATION
from perceptrl.vlm.episode import EpisodeSettings
from perceptrl.vlm.policy import VLMPolicy
from perceptrl.vlm.run_plan import resolve
from perceptrl.vlm.sft import VLMSFTSource
from perceptrl.vlm.source import VLMRolloutSource
from perceptrl.vlm.tool_env import ToolEnv, resolve_tools
from perceptrl.vlm.tools import Observation
from perceptrl.wiring import Config

G = 4


class GroupedEnv:
    """Even prompts: every episode gets one observation (no signal inside the group); odd
    prompts: alternate rows get one or two (signal). Rows of a prompt are adjacent (G each)."""

    def reset(self, samples):
        self.turns = [0] * len(samples)

    def respond(self, row, text):
        self.turns[row] += 1
        calls = 1 if (row // G) % 2 == 0 else 1 + row % 2
        if self.turns[row] > calls:
            return None
        return Observation("More.", [_image(row)], info={"calls": calls})


def _image(row):
    from PIL import Image

    return Image.new("RGB", (56, 56 + 28 * (row % 2)), (100, 150, 200))


def config(estimator, loss, agg, dynamic=False) -> Config:
    cfg = Config()
    r = cfg.rollout
    r.prompts_per_step, r.group_size, r.max_new_tokens = 4, G, 24
    cfg.algo.adv_estimator, cfg.algo.policy_loss, cfg.algo.loss_agg_mode = estimator, loss, agg
    cfg.algo.dynamic_sampling, cfg.algo.max_collects = dynamic, 3
    cfg.train.lr, cfg.train.steps, cfg.train.device, cfg.train.micro_batch_size = 1e-3, 1, "cpu", 8
    cfg.log.progress = cfg.log.tensorboard = False
    return cfg


def stop_bias(policy, bias=6.0):
    stop = torch.tensor([policy.stop_ids[0]])
    policy.model.lm_head.register_forward_hook(
        lambda m, a, out: out.index_add(-1, stop, torch.full((*out.shape[:-1], 1), bias))
    )
    return policy


def episode_policy(tiny_dirs, cfg) -> VLMPolicy:
    settings = EpisodeSettings(env=GroupedEnv, max_tokens=200)
    pol = VLMPolicy.from_pretrained(
        tiny_dirs["qwen2_5_vl"], sampling=resolve(cfg).sampling, episode=settings
    )
    return stop_bias(pol)


REWARD = {"tool_calls": {"weight": 1.0, "cap": 2}, "turn_cost": 0.1, "tool_format": 0.1}


@pytest.mark.parametrize(
    "estimator,loss,agg,dynamic",
    [
        ("grpo", "ppo_clip", "token-mean", True),
        ("rloo", "gspo", "seq-mean-token-sum", False),
        ("grpo", "cispo", "seq-mean-token-mean", False),
        ("rloo", "ppo_clip", "seq-mean-token-sum-norm", False),
    ],
)
def test_rl_steps_on_episodes(tiny_dirs, samples, tmp_path, estimator, loss, agg, dynamic):
    cfg = config(estimator, loss, agg, dynamic)
    pol = episode_policy(tiny_dirs, cfg)
    before = [p.detach().clone() for p in pol.parameters()]
    source = VLMRolloutSource(samples, build_reward(REWARD), cfg.rollout, seed=0)
    m = Trainer(cfg, pol, source, tmp_path, engine=build_engine(pol, cfg.train)).train_step()
    changed = sum(not torch.equal(a, b) for a, b in zip(before, pol.parameters()))
    assert changed > len(before) // 2
    assert m["episode/turns_mean"] > 1 and m["episode/stop/answer"] == 1.0
    assert m["episode/valid_call_rate"] == 1.0 and m["reward/tool_calls"] > 0
    assert all(torch.isfinite(torch.tensor(v)) for k, v in m.items() if k.startswith("actor/"))
    if dynamic:  # the even prompts carry no signal: kept half, collected again to refill
        assert m["dynamic_sampling/kept_frac"] == pytest.approx(0.5)
        assert m["dynamic_sampling/collects"] >= 2


class RecordingEngine(TorchEngine):
    def step(self):
        self.grads = torch.cat([p.grad.flatten() for p in self.params if p.grad is not None])
        return super().step()


def test_micro_batches_accumulate_exactly_over_observation_holes(tiny_dirs, samples, tmp_path):
    grads = []
    for micro in (3, 16):
        cfg = config("grpo", "ppo_clip", "seq-mean-token-mean")
        cfg.train.micro_batch_size = micro
        pol = episode_policy(tiny_dirs, cfg)
        source = VLMRolloutSource(samples, build_reward(REWARD), cfg.rollout, seed=0)
        engine = RecordingEngine(pol.parameters(), cfg.train)
        Trainer(cfg, pol, source, tmp_path / str(micro), engine=engine).train_step()
        grads.append(engine.grads)
    assert grads[0].abs().max() > 0
    torch.testing.assert_close(grads[0], grads[1], atol=1e-6, rtol=1e-4)


def test_sft_on_tool_traces(tiny_dirs, tmp_path):
    paths = generate(tmp_path / "zoom", {"train": 4}, seed=0, image_size=448)
    data, _ = load_samples(paths["train"])
    tools = resolve_tools(["zoom"])
    settings = EpisodeSettings(
        env=lambda: ToolEnv(tools, {"zoom": {"size": 112}}), max_pixels=112 * 112
    )
    pol = VLMPolicy.from_pretrained(tiny_dirs["qwen2_5_vl"], max_pixels=112 * 112)
    pol.episode = settings
    pol.prompt = dataclasses.replace(pol.prompt, tools={"zoom": tools["zoom"].usage})
    traces = [GENERATORS.get("zoom").reasoning_trace(s, ["zoom"]) for s in data]
    from perceptrl.cli import CONFIGS
    from perceptrl.wiring import load_config

    limit = load_config(CONFIGS / "vlm_zoom.yaml").rollout.max_new_tokens
    tok = pol.processor.tokenizer
    longest = max(
        len(tok(t)["input_ids"]) for tr in traces for t in ([tr] if isinstance(tr, str) else tr)
    )
    assert longest + 1 <= limit - 8  # every turn and its stop token fit a turn, with headroom
    b = pol.completions_batch(data, traces)
    image_pad = pol.banned_ids[0]
    for row, (trace, m) in enumerate(zip(traces, b.meta)):
        turns = trace if isinstance(trace, list) else [trace]
        texts = [pol.processor.tokenizer(t, add_special_tokens=False)["input_ids"] for t in turns]
        assert int(b.mask[row].sum()) == sum(len(t) + 1 for t in texts)  # turns + stop tokens
        obs_images = int(
            ((b.tokens[row] == image_pad) & (b.segments.mask(OBSERVATION)[row] > 0)).sum()
        )
        assert obs_images == (16 if len(turns) == 2 else 0)  # a 112-px zoom: 16 vision tokens
        assert m["episode"]["turns"] == len(turns) and m["episode"]["valid_calls"] == len(turns) - 1
    assert "zoom(box=" in pol.processor.decode(b.prompts["prompt_ids"][0])  # tools in the prompt
    cfg = config("grpo", "ppo_clip", "token-mean")
    source = VLMSFTSource(pol, data, traces, batch_size=4)
    m = Trainer(
        cfg, pol, source, tmp_path / "run", engine=build_engine(pol, cfg.train), objective="sft"
    ).train_step()
    assert torch.isfinite(torch.tensor(m["sft/loss"]))


SMALL = [
    "train.device=cpu", "data.n_train=4", "data.n_val=2", "train.eval_samples=2",
    "rollout.prompts_per_step=2", "rollout.group_size=2", "train.steps=1", "log.progress=false",
    "log.tensorboard=false", "checkpoint.every=0",
]  # fmt: skip


def test_zoom_recipe_end_to_end(tiny_dirs, tmp_path):
    """`perceptrl sft` on the tool traces then `perceptrl train` on episodes, one step each."""
    import json

    from perceptrl.cli import main

    small = [f"model.path={tiny_dirs['qwen2_5_vl']}", *SMALL]
    assert main(["sft", "vlm_zoom", *small, "--run-dir", str(tmp_path / "sft")]) == 0
    assert main(["train", "vlm_zoom", *small, "--run-dir", str(tmp_path / "rl")]) == 0
    rows = [json.loads(x) for x in (tmp_path / "rl" / "metrics.jsonl").read_text().splitlines()]
    step = next(r for r in rows if "actor/pg_loss" in r or "dynamic_sampling/collects" in r)
    assert "episode/turns_mean" in step and "reward/tool_format" in step
    assert any("eval/episode/turns_mean" in r for r in rows)


def test_user_samples_list_the_tools_they_allow(tiny_dirs, tmp_path, capsys):
    import json

    from perceptrl.cli import main

    paths = generate(tmp_path / "zoom", {"train": 2}, seed=0, image_size=448)
    rows = [json.loads(x) for x in paths["train"].read_text().splitlines()]
    rows[0]["tools"], rows[1]["tools"] = ["zoom"], ["depth"]
    user = tmp_path / "zoom" / "user.jsonl"
    user.write_text("".join(json.dumps(r) + "\n" for r in rows))
    data, _ = load_samples(user)
    assert data[0]["tools"] == ["zoom"] and "tools" not in data[0]["meta"]
    args = [f"model.path={tiny_dirs['qwen2_5_vl']}", *SMALL, f"data.train={user}",
            f"data.val={user}", "--run-dir", str(tmp_path / "run")]  # fmt: skip
    assert main(["train", "vlm_zoom", *args]) == 3
    err = capsys.readouterr().err
    assert "allows tools ['depth']" in err and "rollout.episode.tools is ['zoom']" in err
