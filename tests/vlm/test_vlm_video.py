"""Video input: frame-count and pixel conventions, decord loading and its errors, video prompts
through both tiny processors, and log-probs of video prompts (evaluate == generation)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from perceptrl.datasets.video import generate, write_mp4
from perceptrl.trainer.batch import RolloutBatch
from perceptrl.vlm import rollout
from perceptrl.vlm.prompts import (
    PromptConfig,
    PromptTooLongError,
    build_messages,
    encode_prompt,
    encode_prompts,
)
from perceptrl.vlm.video import (
    VideoConfig,
    VideoLoadError,
    frame_size,
    load_video,
    num_frames,
    sample_indices,
    shuffle_frames,
    spatial_factor,
)

CFG = VideoConfig()  # 2 fps, 4..16 frames, factor 2


@pytest.fixture(scope="module")
def clips(tmp_path_factory) -> list[dict]:
    """Eight generated samples (two per family), video paths absolute."""
    root = tmp_path_factory.mktemp("video_data")
    path = generate(root, {"train": 8}, seed=0)["train"]
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return [{**r, "videos": [str(root / v) for v in r["videos"]]} for r in rows]


@pytest.mark.parametrize(
    "total, fps, want",
    [
        (16, 4.0, 8),  # 4 s at 2 fps
        (300, 30.0, 16),  # 10 s -> 20 frames, capped at max_frames
        (8, 30.0, 4),  # 0.27 s -> below min_frames, raised to 4
        (3, 1.0, 2),  # only 3 frames: floored to the frame factor
        (17, 4.0, 8),  # 4.25 s -> 8.5, floored to a multiple of 2
    ],
)
def test_num_frames_follows_qwen_conventions(total, fps, want):
    assert num_frames(total, fps, CFG) == want


def test_num_frames_rounds_bounds_to_the_factor_and_rejects_short_clips():
    cfg = VideoConfig(min_frames=5, max_frames=11)
    assert num_frames(40, 40.0, cfg) == 6  # 1 s -> 2, min 5 rounded up to 6
    assert num_frames(400, 4.0, cfg) == 10  # max 11 rounded down to 10
    with pytest.raises(ValueError, match="too short: 1 frame"):
        num_frames(1, 4.0, CFG)
    with pytest.raises(ValueError, match="frame rate"):
        num_frames(10, 0.0, CFG)


def test_sample_indices_span_the_clip():
    assert sample_indices(16, 8) == [0, 2, 4, 6, 9, 11, 13, 15]
    assert sample_indices(5, 2) == [0, 4]


def test_frame_size_respects_per_frame_cap_and_total_budget():
    # a total budget of 4 temporal patches of 112x112 shared by 16 frames (8 patches): halved
    cfg = VideoConfig(max_pixels=224 * 224, total_pixels=4 * 112 * 112)
    h, w = frame_size(448, 448, 16, cfg, 28)
    assert h % 28 == 0 and w % 28 == 0 and h * w <= 112 * 112 // 2 * 1.05
    # plenty of budget: the per-frame cap decides
    cfg = VideoConfig(max_pixels=112 * 112, total_pixels=10**9)
    h, w = frame_size(448, 224, 8, cfg, 28)
    assert h * w <= 112 * 112 and h > w  # aspect ratio kept up to the 28-pixel rounding
    # never below one merged patch
    assert frame_size(20, 20, 8, VideoConfig(), 28) == (28, 28)


def test_load_video_samples_and_sizes_frames(clips):
    v = load_video(clips[0]["videos"][0], CFG, factor=28)
    assert v.frames.dtype == np.uint8 and v.frames.shape == (8, 112, 112, 3)
    assert v.indices == [0, 2, 4, 6, 9, 11, 13, 15] and v.total_frames == 16
    assert v.source_fps == pytest.approx(4.0) and v.duration == pytest.approx(4.0)
    assert v.timestamps[1] == pytest.approx(0.5) and v.sampled_fps == pytest.approx(2.0)
    md = v.metadata()
    assert md.frames_indices == v.indices and md.fps == pytest.approx(4.0)
    small = load_video(clips[0]["videos"][0], VideoConfig(max_pixels=56 * 56), factor=28)
    assert small.frames.shape[1:3] == (56, 56)


def test_shuffle_frames_moves_content_not_timestamps(clips):
    v = load_video(clips[0]["videos"][0], CFG, factor=28)
    for seed in range(5):
        s = shuffle_frames(v, np.random.default_rng(seed))
        assert s.order != list(range(8)) and sorted(s.order) == list(range(8))
        assert s.indices == v.indices and s.timestamps == v.timestamps
        for k, j in enumerate(s.order):
            assert np.array_equal(s.frames[k], v.frames[j])


@pytest.mark.parametrize("kind", ["missing", "empty", "corrupt", "short"])
def test_bad_videos_name_file_and_sample(tmp_path, kind):
    p = tmp_path / f"{kind}.mp4"
    if kind == "empty":
        p.write_bytes(b"")
    elif kind == "corrupt":
        p.write_bytes(b"\x00\x00\x00\x18ftypmp42 definitely not a video" * 20)
    elif kind == "short":
        write_mp4(np.full((1, 32, 32, 3), 128, np.uint8), p, fps=4)
    want = {"missing": "not found", "empty": "empty", "corrupt": "decodable", "short": "short"}
    with pytest.raises(VideoLoadError, match=want[kind]) as e:
        load_video(p, CFG, 28, sample_id="clip-7", index=7)
    assert str(p) in str(e.value) and "'clip-7' (index 7)" in str(e.value)


def test_messages_place_videos_before_text_or_inline():
    s = {"videos": ["a.mp4", "b.mp4"], "question": "Compare the clips."}
    user = build_messages(s, None)[0]["content"]
    assert [c["type"] for c in user] == ["video", "video", "text"]
    s = {"videos": ["a.mp4"], "images": ["x.png"], "question": "See <video> then <image> now"}
    user = build_messages(s, None)[0]["content"]
    assert [c["type"] for c in user] == ["text", "video", "text", "image", "text"]


def test_encode_video_prompt(policy, clips):
    proc = policy.processor
    enc = encode_prompt(proc, clips[0], PromptConfig(video=VideoConfig(max_frames=8)), index=0)
    f = spatial_factor(proc)
    side = -(-112 // f) * f if f == 32 else 112  # Qwen3-VL rounds 112 to a multiple of 32
    grid = enc.vision["video_grid_thw"]
    patch = proc.video_processor.patch_size
    assert grid.tolist() == [[4, side // patch, side // patch]]
    merge = proc.video_processor.merge_size
    assert enc.num_vision_tokens == int(grid.prod()) // merge**2
    assert enc.vision["pixel_values_videos"].shape[0] == int(grid.prod())
    meta = enc.sample["meta"]
    assert meta["video_frames"] == [8] and meta["video_seconds"] == [4.0]
    assert meta["video_timestamps"][0][:3] == [0.0, 0.5, 1.0]
    text = proc.tokenizer.decode(enc.input_ids)
    if "second_per_grid_ts" in enc.vision:  # Qwen2.5-VL: temporal M-RoPE step
        assert enc.vision["second_per_grid_ts"].tolist() == [pytest.approx(1.0)]
    else:  # Qwen3-VL writes the frame timestamps into the prompt
        assert "<0.2 seconds>" in text and "<3.5 seconds>" in text


def test_shuffled_prompt_has_same_tokens_other_pixels(policy, clips):
    cfg = PromptConfig(video=VideoConfig(max_frames=8))
    a = encode_prompt(policy.processor, clips[1], cfg)
    b = encode_prompt(policy.processor, clips[1], cfg, shuffle_seed=11)
    c = encode_prompt(policy.processor, clips[1], cfg, shuffle_seed=11)
    assert torch.equal(a.input_ids, b.input_ids)
    assert not torch.equal(a.vision["pixel_values_videos"], b.vision["pixel_values_videos"])
    assert torch.equal(b.vision["pixel_values_videos"], c.vision["pixel_values_videos"])
    assert sorted(b.sample["meta"]["frame_order"][0]) == list(range(8))


def test_two_videos_and_an_image_in_one_prompt(policy, clips, images):
    s = {**clips[0], "videos": clips[0]["videos"] + clips[1]["videos"], "images": [images[0]]}
    enc = encode_prompt(policy.processor, s, PromptConfig(video=VideoConfig(max_frames=4)))
    assert enc.vision["video_grid_thw"].shape == (2, 3)
    assert enc.vision["video_grid_thw"][:, 0].tolist() == [2, 2]
    assert enc.vision["image_grid_thw"].shape == (1, 3)


def test_strict_and_lenient_video_errors(policy, clips, tmp_path):
    bad = tmp_path / "bad.mp4"
    bad.write_bytes(b"garbage" * 50)
    batch = [clips[0], {**clips[1], "id": "broken", "videos": [str(bad)]}, clips[2]]
    with pytest.raises(VideoLoadError, match=r"sample 'broken' \(index 1\)"):
        encode_prompts(policy.processor, batch, PromptConfig(), strict=True)
    enc, skipped = encode_prompts(policy.processor, batch, PromptConfig(), strict=False)
    assert (
        len(enc) == 2 and [s["index"] for s in skipped] == [1] and "bad.mp4" in skipped[0]["error"]
    )


def test_too_long_video_prompt_names_the_video_settings(policy, clips):
    cfg = PromptConfig(max_prompt_length=64)
    with pytest.raises(PromptTooLongError, match="video.max_frames"):
        encode_prompt(policy.processor, clips[0], cfg)


def test_video_logprobs_evaluate_equals_generation(policy, clips):
    """Sampling scores of video prompts (two videos in one row too) equal ``evaluate``'s."""
    cfg = PromptConfig(video=VideoConfig(max_frames=8))
    two = {**clips[3], "videos": clips[3]["videos"] + clips[4]["videos"]}
    prompts = [encode_prompt(policy.processor, s, cfg) for s in (clips[0], clips[2], two)]
    kwargs = rollout.collate(rollout.prompt_inputs(prompts, 2), policy.pad_id, policy.device)
    torch.manual_seed(5)
    with torch.no_grad():
        out = policy.model.generate(
            **kwargs,
            do_sample=True, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=12,
            eos_token_id=policy.stop_ids, pad_token_id=policy.pad_id,
            suppress_tokens=policy.banned_ids, output_scores=True, return_dict_in_generate=True,
        )  # fmt: skip
    tokens = out.sequences[:, kwargs["input_ids"].shape[1] :]
    mask = rollout.completion_mask(tokens, policy.stop_ids)
    scores = torch.stack(out.scores, 1).log_softmax(-1)
    gen_logp = scores.gather(-1, tokens[..., None]).squeeze(-1) * mask
    index = rollout.repeated_index(3, 2)
    b = RolloutBatch(
        tokens=tokens, mask=mask, group_id=index, prompts=rollout.prompt_table(prompts),
        prompt_index=index,
    )  # fmt: skip
    policy.eval()
    with torch.no_grad():
        logp = policy.evaluate(b).logp
        part = policy.evaluate(b.select([5, 0])).logp  # minibatch composition does not matter
    torch.testing.assert_close(logp, gen_logp, atol=1e-4, rtol=0)
    torch.testing.assert_close(part, logp[[5, 0], : part.shape[1]], atol=1e-4, rtol=0)


def test_output_depends_on_the_video(policy, clips):
    cfg = PromptConfig(video=VideoConfig(max_frames=8))
    a = encode_prompt(policy.processor, clips[0], cfg)
    b = encode_prompt(policy.processor, clips[0], cfg, shuffle_seed=1)
    outs = []
    for p in (a, b):
        kw = rollout.collate(rollout.prompt_inputs([p]), policy.pad_id, policy.device)
        with torch.no_grad():
            outs.append(policy.model(**kw).logits[0, -1])
    assert (outs[0] - outs[1]).abs().max() > 1e-4
