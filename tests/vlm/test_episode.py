"""Multi-turn episodes: the training forward scores the policy's tokens as sampling did (both
Qwen families, 1, 2 and 4 turns with tool images, shared-prefix forward on and off), images are
encoded once, observations are chat turns, budgets stop episodes with their reason."""

from __future__ import annotations

import contextlib
import re

import pytest
import torch
from PIL import Image, ImageDraw

from perceptrl.trainer.segments import OBSERVATION
from perceptrl.vlm.episode import EpisodeSettings, episode_metrics, stop_string_end
from perceptrl.vlm.policy import VLMPolicy
from perceptrl.vlm.rollout import SamplingParams
from perceptrl.vlm.sampler import Rollouts
from perceptrl.vlm.tiny import ARCHS
from perceptrl.vlm.tools import Observation

TOL = 1e-5
"""float32 on the CPU: training-forward log-probs equal the sampled ones to this"""


def obs_image(row: int, turn: int) -> Image.Image:
    """A different size per row and turn, so image token counts differ across rows."""
    im = Image.new("RGB", (56 + 28 * ((row + turn) % 3), 56 + 28 * (turn % 2)), (128, 128, 128))
    ImageDraw.Draw(im).ellipse([4, 4, 30, 30], fill=(200, 30 + 40 * turn, 30))
    return im


class ScriptedEnv:
    """Answers the first ``turns - 1`` policy turns of every episode with an observation (an
    image and text, or text alone), then ends the episode."""

    def __init__(self, turns: int, image: bool = True):
        self.k, self.image = turns, image

    def reset(self, samples):
        self.turns = [0] * len(samples)

    def respond(self, row, text):
        self.turns[row] += 1
        if self.turns[row] >= self.k:
            return None
        images = [obs_image(row, self.turns[row])] if self.image else []
        return Observation(f"Look {self.turns[row]}.", images)


@contextlib.contextmanager
def short_turns(policy: VLMPolicy, bias: float = 6.0):
    """Raise the stop token's logit (in sampling and in training alike: a hook on the LM head)
    so a random tiny model ends its turns after a few tokens."""
    stop = torch.tensor([policy.stop_ids[0]])

    def hook(module, args, out):
        return out.index_add(-1, stop, torch.full((*out.shape[:-1], 1), bias))

    handle = policy.model.lm_head.register_forward_hook(hook)
    try:
        yield policy
    finally:
        handle.remove()


@pytest.fixture(scope="module", params=ARCHS)
def pol(request, tiny_dirs) -> VLMPolicy:
    p = VLMPolicy.from_pretrained(tiny_dirs[request.param])
    p.arch = request.param
    return p


def run(policy, samples, env, n=2, seed=0, **settings) -> object:
    policy.episode = EpisodeSettings(env=lambda: env, **{"max_tokens": 400, **settings})
    prompts, _ = policy.encode(samples)
    torch.manual_seed(seed)
    sp = SamplingParams(max_new_tokens=40, return_logprobs=True)
    return Rollouts(policy).sample(prompts, n, sp)


def forwards(policy, batch, share: bool):
    """Evaluate with the shared prefix on or off; returns (logp, number of model calls)."""
    calls = []
    handle = policy.model.register_forward_pre_hook(lambda m, a: calls.append(1))
    policy.share_prefix = share
    try:
        with torch.no_grad():
            logp = policy.evaluate(batch).logp
    finally:
        handle.remove()
        policy.share_prefix = True
    return logp, len(calls)


@pytest.mark.parametrize("turns,image", [(1, True), (2, True), (4, True), (2, False)])
def test_training_forward_matches_the_sampled_logprobs(pol, samples, turns, image):
    with short_turns(pol):
        b = run(pol, samples[:3], ScriptedEnv(turns, image), seed=turns)
        assert [m["episode"]["turns"] for m in b.meta] == [turns] * 6
        assert {m["episode"]["stop"] for m in b.meta} == {"answer"}
        n_img = int(torch.isin(b.tokens, torch.tensor(pol.banned_ids)).sum())
        assert (n_img > 0) == (image and turns > 1)  # tool images sit inside the completions
        assert torch.equal(b.segments.mask(OBSERVATION) * b.mask, torch.zeros_like(b.mask))
        for share in (True, False):
            logp, calls = forwards(pol, b, share)
            gap = ((logp - b.logp_rollout) * b.mask).abs().max()
            assert gap <= TOL, (share, float(gap))
            # Qwen2.5-VL runs the prefix pass + the completions; Qwen3-VL falls back to one
            assert calls == (2 if share and pol.arch == "qwen2_5_vl" else 1)


def test_shared_prefix_gradients_equal_one_forward_on_episodes(tiny_dirs, samples):
    pol = VLMPolicy.from_pretrained(tiny_dirs["qwen2_5_vl"])
    with short_turns(pol):
        b = run(pol, samples[:2], ScriptedEnv(3), n=3, seed=1)
        grads = []
        for share in (True, False):
            pol.share_prefix = share
            pol.model.zero_grad()
            ev = pol.evaluate(b)
            adv = torch.linspace(-1, 1, len(b))[:, None]
            ((ev.logp * adv).sum() / b.mask.sum() + 0.01 * ev.entropy.sum()).backward()
            grads.append(torch.cat([p.grad.flatten() for p in pol.parameters()]))
    assert grads[0].abs().max() > 0
    torch.testing.assert_close(grads[0], grads[1], atol=1e-6, rtol=1e-4)


def test_each_image_goes_through_the_vision_tower_once(pol, samples):
    images = []
    visual = next(m for n, m in pol.model.named_modules() if n.endswith("visual"))

    def count(module, args, kwargs):
        grid = kwargs.get("grid_thw", args[1] if len(args) > 1 else None)
        images.append(int(grid.shape[0]))

    handle = visual.register_forward_pre_hook(count, with_kwargs=True)
    try:
        with short_turns(pol):
            b = run(pol, samples[:3], ScriptedEnv(4), n=2)
    finally:
        handle.remove()
    obs_images = sum(m["episode"]["images"] for m in b.meta)
    assert obs_images == 6 * 3
    # prefill: 3 distinct prompt images (not 6 rows); then one call per round of observations
    assert images == [3, 6, 6, 6]
    m = episode_metrics(b)
    assert m["episode/turns_mean"] == 4 and m["episode/images_mean"] == 3
    assert all(m[f"time/turn_{k}"] > 0 for k in range(1, 5))


def test_observations_are_turns_of_the_chat_template(pol, samples):
    with short_turns(pol):
        b = run(pol, samples[:1], ScriptedEnv(3), n=1)
    ep = b.meta[0]["episode"]
    ids = torch.cat(
        [
            b.prompts["prompt_ids"][0],
            b.tokens[0, : int((b.mask + b.segments.mask(OBSERVATION)).sum())],
        ]
    )
    decoded = pol.processor.tokenizer.decode(ids)
    decoded = re.sub(r"(<\|image_pad\|>)+", "<|image_pad|>", decoded)
    msgs = [
        {"role": "system", "content": [{"type": "text", "text": pol.prompt.system_prompt}]},
        {
            "role": "user",
            "content": [{"type": "image"}, {"type": "text", "text": samples[0]["question"]}],
        },
    ]
    for k, text in enumerate(ep["texts"]):
        msgs.append({"role": "assistant", "content": [{"type": "text", "text": text}]})
        if k < len(ep["observations"]):
            content = [{"type": "image"}, {"type": "text", "text": ep["observations"][k]}]
            msgs.append({"role": "user", "content": content})
    rendered = pol.processor.apply_chat_template(msgs, tokenize=False)
    assert rendered == decoded + "\n"


def test_a_stop_string_ends_the_turn_and_the_observation_closes_it(pol, samples, first_stop):
    """rollout.episode.stop: the turn ends right after the string (vLLM's stop strings), the
    episode goes on, the stop token opens the observation (out of the loss), the sequence still
    renders as the chat template's turns and scores as sampled."""
    tok = pol.processor.tokenizer

    def decode(ids):
        return tok.decode(ids, skip_special_tokens=True)

    free = run(pol, samples[:2], ScriptedEnv(2, image=False), seed=3)
    n_turn = int(free.mask[0].cumprod(0).sum())
    ids = free.tokens[0, :n_turn].tolist()
    j, stop = first_stop(decode, ids)
    b = run(pol, samples[:2], ScriptedEnv(2, image=False), seed=3, stop=(stop,))
    ep = b.meta[0]["episode"]
    assert b.tokens[0, :j].tolist() == ids[:j] and ep["texts"][0] == decode(ids[:j])
    assert ep["texts"][0].endswith(stop)
    assert int(b.tokens[0, j]) == pol.stop_ids[0]  # closed by the observation, not sampled
    assert float(b.mask[0, j]) == 0.0 and float(b.segments.mask(OBSERVATION)[0, j]) == 1.0
    assert ep["turns"] == 2 and ep["observations"] == ["Look 1."]
    used = int((b.mask + b.segments.mask(OBSERVATION)).sum(1)[0])
    decoded = tok.decode(torch.cat([b.prompts["prompt_ids"][0], b.tokens[0, :used]]))
    decoded = re.sub(r"(<\|image_pad\|>)+", "<|image_pad|>", decoded)
    question = [{"type": "image"}, {"type": "text", "text": samples[0]["question"]}]
    msgs = [
        {"role": "system", "content": [{"type": "text", "text": pol.prompt.system_prompt}]},
        {"role": "user", "content": question},
        {"role": "assistant", "content": [{"type": "text", "text": ep["texts"][0]}]},
        {"role": "user", "content": [{"type": "text", "text": "Look 1."}]},
        {"role": "assistant", "content": [{"type": "text", "text": ep["texts"][1]}]},
    ]
    closed = int(b.tokens[0, used - 1]) == pol.stop_ids[0]  # the last turn: token or string
    rendered = pol.processor.apply_chat_template(msgs, tokenize=False)
    assert rendered == decoded + ("" if closed else pol.stop_text) + "\n"
    for share in (True, False):
        logp, _ = forwards(pol, b, share)
        assert ((logp - b.logp_rollout) * b.mask).abs().max() <= TOL


def test_stop_string_end_is_where_a_per_token_check_stops():
    def decode(ids):
        return "".join(chr(i) for i in ids)

    ids = [ord(c) for c in "ab</sub>cd</sub>"]
    assert stop_string_end(decode, ids, ("</sub>",)) == 8
    assert stop_string_end(decode, ids, ("cd", "b<")) == 3
    assert stop_string_end(decode, ids, ("zz",)) == 0 and stop_string_end(decode, ids, ()) == 0


@pytest.mark.parametrize(
    "settings,sp,stop",
    [
        ({"max_turns": 2}, {}, "max_turns"),
        ({"max_images": 1}, {}, "max_images"),
        ({"max_vision_tokens": 3}, {}, "max_vision_tokens"),
        ({"max_tokens": 12}, {}, "max_tokens"),
        ({}, {"max_new_tokens": 1}, "turn_length"),
    ],
)
def test_budgets_end_episodes_with_their_reason(tiny_dirs, samples, settings, sp, stop):
    pol = VLMPolicy.from_pretrained(tiny_dirs["qwen2_5_vl"])
    pol.episode = EpisodeSettings(env=lambda: ScriptedEnv(10), **{"max_tokens": 300, **settings})
    prompts, _ = pol.encode(samples[:2])
    torch.manual_seed(0)
    bias = 0.0 if stop == "turn_length" else 8.0
    with short_turns(pol, bias):
        b = Rollouts(pol).sample(prompts, 2, SamplingParams(**{"max_new_tokens": 20, **sp}))
    logs = [m["episode"] for m in b.meta]
    assert {e["stop"] for e in logs} == {stop}
    assert all(e["images"] <= settings.get("max_images", 9) for e in logs)
    assert int((b.mask + b.segments.mask(OBSERVATION)).sum(1).max()) <= settings.get(
        "max_tokens", 300
    )
    m = episode_metrics(b)
    assert m[f"episode/stop/{stop}"] == 1.0
    if stop == "max_turns":
        assert all(e["turns"] == 2 and e["calls"] == 2 for e in logs)


class FirstPromptOnly(ScriptedEnv):
    """Observations only for the episodes of sample ``s0`` (rows are those of the samples the
    environment was reset with: one chunk of prompts)."""

    def reset(self, samples):
        super().reset(samples)
        self.ids = [s["id"] for s in samples]

    def respond(self, row, text):
        return super().respond(row, text) if self.ids[row] == "s0" else None


def test_batches_keep_their_keys_when_only_some_rows_observe(tiny_dirs, samples):
    """Prompts sampled in separate chunks (a small token budget), only the first chunk's
    episodes get observations: the chunks still concatenate, as batches of different
    collections do under dynamic sampling, and the training forward matches the sampling."""
    pol = VLMPolicy.from_pretrained(tiny_dirs["qwen2_5_vl"])
    pol.episode = EpisodeSettings(env=lambda: FirstPromptOnly(2), max_tokens=200)
    prompts, _ = pol.encode(samples[:3])
    torch.manual_seed(0)
    with short_turns(pol):
        b = Rollouts(pol).sample(
            prompts, 2, SamplingParams(max_new_tokens=30, token_budget=600, return_logprobs=True)
        )
        assert [m["episode"]["turns"] for m in b.meta] == [2, 2, 1, 1, 1, 1]
        pixels = b.segments.row_vision()["pixel_values"]
        assert pixels[2] is None and pixels[0] is not None
        assert b.group_id.tolist() == [0, 0, 1, 1, 2, 2]
        logp, _ = forwards(pol, b, share=True)
    assert ((logp - b.logp_rollout) * b.mask).abs().max() <= TOL


class SliverEnv(ScriptedEnv):
    """A tool that answers with an image of aspect ratio 224 (what ``zoom`` returns for a 2-px
    wide box at size 448): Qwen's resizer refuses it."""

    def respond(self, row, text):
        self.turns[row] += 1
        if self.turns[row] >= self.k:
            return None
        return Observation("Zoomed.", [Image.new("RGB", (2, 448))], tool="zoom")


def test_an_image_the_processor_refuses_is_an_error_observation(tiny_dirs, samples):
    """The episode goes on with an error turn the model sees, counted under the tool's name
    (before: the processor's ValueError ended the training run)."""
    pol = VLMPolicy.from_pretrained(tiny_dirs["qwen2_5_vl"])
    pol.episode = EpisodeSettings(env=lambda: SliverEnv(2), max_tokens=300)
    prompts, _ = pol.encode(samples[:1])
    torch.manual_seed(0)
    with short_turns(pol):
        b = Rollouts(pol).sample(
            prompts, 2, SamplingParams(max_new_tokens=20, return_logprobs=True)
        )
        logp, _ = forwards(pol, b, share=True)
    logs = [m["episode"] for m in b.meta]
    assert all(e["turns"] == 2 and e["images"] == 0 for e in logs)
    assert all(e["errors"] == {"zoom": 1} and not e["tools"] for e in logs)
    assert all("cannot take" in e["observations"][0] for e in logs)
    assert episode_metrics(b)["tool/errors/zoom"] == 2.0
    assert ((logp - b.logp_rollout) * b.mask).abs().max() <= TOL


class ForkingEnv(ScriptedEnv):
    """`ScriptedEnv` that can fork an episode (tree rollouts): the copy continues its count."""

    def fork(self, src, dst):
        self.turns.extend([0] * (dst + 1 - len(self.turns)))
        self.turns[dst] = self.turns[src]


@pytest.mark.parametrize("branches", [(2, 2), (1, 2, 2)])
def test_episode_trees_fork_after_a_turn_and_score_as_sampled(pol, samples, branches):
    """Episodes of 3 turns grown as a tree that forks after turns: 4 leaves per prompt, rows
    below a fork share its turns and observations token for token, segments name the turns,
    and the training forward matches the sampled log-probs."""
    from perceptrl.vlm.sampler import sampled_tokens
    from perceptrl.vlm.schedule import TreeShape

    pol.tree = TreeShape(branches, segment_tokens=1)
    images = []  # images through the vision tower while scoring
    encode = pol.model.get_image_features

    def counted(pixels, grids, **kw):
        images.append(len(grids))
        return encode(pixels, grids, **kw)

    try:
        with short_turns(pol):
            b = run(pol, samples[:2], ForkingEnv(3), n=4, seed=len(branches))
            pol.model.get_image_features = counted
            scored = [forwards(pol, b, share)[0] for share in (True, False)]
    finally:
        pol.tree = None
        del pol.model.get_image_features
    shared = pol.model.config.model_type == "qwen2_5_vl"  # features handed to rows (Qwen2.5-VL)
    distinct = sum(int(v["image_grid_thw"].shape[0]) for v in b.segments.vision if v)
    held = sum(int(g.shape[0]) for g in b.segments.row_vision()["image_grid_thw"] if g is not None)
    assert b.segments.shares_vision() and distinct < held  # rows below a fork share images
    if shared:  # each shared observation's image once, in both forwards (prompts: 2 images)
        assert images == [distinct, 2 + distinct]
    assert len(b) == 8 and b.group_id.tolist() == [0] * 4 + [1] * 4
    assert [m["episode"]["turns"] for m in b.meta] == [3] * 8
    obs = b.segments.mask(OBSERVATION)
    for g in range(2):
        rows = list(range(4 * g, 4 * g + 4))
        first = b.segments.node[rows, 0]  # a completion starts with its first turn
        assert len(set(first.tolist())) == branches[0]
        for i in rows:
            for j in rows:
                if (
                    b.segments.node[i, 0] == b.segments.node[j, 0]
                ):  # the same first turn: same history
                    end = int((b.segments.node[i] == b.segments.node[i, 0]).nonzero().max()) + 1
                    end += int(obs[i, end:].cumprod(0).sum())  # and its observation
                    assert torch.equal(b.tokens[i, :end], b.tokens[j, :end])
    decoded, leaf = sampled_tokens(b)
    assert decoded < leaf  # shared turns were sampled once
    for logp in scored:
        assert ((logp - b.logp_rollout) * b.mask).abs().max() <= TOL
