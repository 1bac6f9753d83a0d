"""Synthetic video tasks: exact ground truth checked on the rendered frames, mp4 round trip with
decord, SFT traces that the rewards score 1, the loader's video checks, the CLI and the recipe."""

from __future__ import annotations

import json

import numpy as np
import pytest

from perceptrl.cli import CONFIGS, main
from perceptrl.datasets.clevr import COLORS
from perceptrl.datasets.loader import DataError, load_samples, save_samples
from perceptrl.datasets.video import (
    FAMILIES,
    VideoTaskConfig,
    check_video,
    generate,
    make_sample,
    reasoning_trace,
    write_mp4,
)
from perceptrl.rewards import build_reward
from perceptrl.wiring import load_config

CFG = VideoTaskConfig()


def _present(frames: np.ndarray, colour: str) -> np.ndarray:
    """[T] bool: the colour covers some pixels of frame t (exact: frames are not compressed)."""
    return (frames == np.array(COLORS[colour], np.uint8)).all(-1).reshape(len(frames), -1).sum(
        1
    ) > 8


def _centroid(frame: np.ndarray, colour: str) -> np.ndarray:
    ys, xs = np.nonzero((frame == np.array(COLORS[colour], np.uint8)).all(-1))
    return np.array([xs.mean(), ys.mean()])


def _segments(present: np.ndarray) -> list[tuple[int, int]]:
    out, start = [], None
    for t, p in enumerate([*present.tolist(), False]):
        if p and start is None:
            start = t
        elif not p and start is not None:
            out.append((start, t))
            start = None
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_ground_truth_matches_the_frames(family):
    for i in range(12):
        s, frames = make_sample("train", i, family, seed=5)
        assert frames.shape == (16, 112, 112, 3) and frames.dtype == np.uint8
        objs, ans = s["meta"]["objects"], s["answer"]
        if family == "temporal_order":
            first = [int(np.argmax(_present(frames, o["color"]))) for o in objs]
            named = s["meta"]["options"]["ABCD".index(ans)]
            winner = objs[int(np.argmin(first))]
            assert named == f"{winner['color']} {winner['shape']}" and sorted(first) == sorted(
                set(first)
            )
        elif family == "direction":
            mover = objs[0]["color"]
            step = _centroid(frames[-1], mover) - _centroid(frames[0], mover)
            d = s["meta"]["options"]["ABCD".index(ans)]
            axis, sign = {"left": (0, -1), "right": (0, 1), "up": (1, -1), "down": (1, 1)}[d]
            assert step[axis] * sign > 20 and abs(step[1 - axis]) < 1
        elif family == "event_count":
            segs = _segments(_present(frames, objs[0]["color"]))
            assert len(segs) == int(ans)
            assert all(b - a >= CFG.fps * CFG.min_event_s for a, b in segs)
        else:  # grounding: the visible frames are exactly [start, end) seconds
            ((a, b),) = _segments(_present(frames, objs[0]["color"]))
            start, end = json.loads(ans)
            assert (a / CFG.fps, b / CFG.fps) == (start, end) and end - start >= CFG.min_event_s
        for o in objs[1:]:  # distractors never vanish
            assert _present(frames, o["color"]).all() or family == "temporal_order"


@pytest.mark.parametrize("family", FAMILIES)
def test_traces_score_one_under_the_sample_reward(family):
    reward = build_reward({"format": 0.5, "accuracy": 1.0})
    samples = [make_sample("train", i, family, seed=2)[0] for i in range(8)]
    traces = [reasoning_trace(s) for s in samples]
    totals, comps, _ = reward(traces, samples)
    assert comps["accuracy"] == [1.0] * 8 and comps["format"] == [1.0] * 8
    wrong = reward(["<think>x</think><answer>[0, 0.5]</answer>"] * 8, samples)[1]["accuracy"]
    assert max(wrong) < 1.0


def test_generate_writes_mp4s_decord_reads_and_jsonl_is_deterministic(tmp_path):
    a = generate(tmp_path / "a", {"train": 8, "test": 4}, seed=1)
    b = generate(tmp_path / "b", {"train": 8, "test": 4}, seed=1)
    assert a["train"].read_text() == b["train"].read_text()
    rows = [json.loads(x) for x in a["train"].read_text().splitlines()]
    assert [r["family"] for r in rows[:4]] == list(FAMILIES)
    assert {r["reward"] for r in rows} == {"mcq", "count", "tiou"}
    w, h, n, fps = check_video(tmp_path / "a" / rows[0]["videos"][0])
    assert (w, h, n, fps) == (112, 112, 16, pytest.approx(4.0))
    import decord

    vr = decord.VideoReader(str(tmp_path / "a" / rows[1]["videos"][0]))
    _, frames = make_sample("train", 1, rows[1]["family"], seed=1)
    decoded = vr.get_batch(list(range(16))).asnumpy().astype(int)
    assert np.abs(decoded - frames).mean() < 6  # lossy codec, same picture


def test_loader_checks_videos_strict_and_lenient(tmp_path):
    path = generate(tmp_path, {"train": 6}, seed=0)["train"]
    samples, stats = load_samples(path)
    assert len(samples) == 6 and stats == {"loaded": 6, "skipped_malformed": 0, "skipped_images": 0}
    assert samples[0]["images"] == [] and samples[0]["videos"][0].startswith(str(tmp_path))
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    (tmp_path / rows[2]["videos"][0]).write_bytes(b"not a video" * 10)
    write_mp4(np.zeros((1, 16, 16, 3), np.uint8), tmp_path / rows[4]["videos"][0], 4)  # 1 frame
    with pytest.raises(
        DataError, match=r"sample 2 \(line 3, id 'video-train-000002'\): video .*mp4"
    ):
        load_samples(path)
    ok, stats = load_samples(path, strict=False)
    assert len(ok) == 4 and stats["skipped_videos"] == 2
    out = save_samples(ok, tmp_path / "copy" / "kept.jsonl")
    back, _ = load_samples(out)
    assert [s["videos"] for s in back] == [s["videos"] for s in ok]


def test_loader_accepts_a_single_video_key(tmp_path):
    generate(tmp_path, {"train": 1}, seed=0)
    rec = {"video": "videos/train/video-train-000000.mp4", "problem": "Q?", "solution": "[1, 2]",
           "reward": "tiou"}  # fmt: skip
    (tmp_path / "one.jsonl").write_text(json.dumps(rec) + "\n")
    (s,), _ = load_samples(tmp_path / "one.jsonl")
    assert s["videos"] == [str(tmp_path / rec["video"])] and s["images"] == []
    (tmp_path / "none.jsonl").write_text(json.dumps({"question": "Q?", "answer": "1"}) + "\n")
    with pytest.raises(DataError, match="missing required keys"):
        load_samples(tmp_path / "none.jsonl")


def test_cli_generates_video_data(tmp_path, capsys):
    rc = main(["data", "generate", "--kind", "video", "--out", str(tmp_path), "--n-train", "3",
               "--n-val", "0", "--n-test", "0", "--families", "direction", "--fps", "6"])  # fmt: skip
    assert rc == 0 and "train:" in capsys.readouterr().out
    rows = [json.loads(x) for x in (tmp_path / "train.jsonl").read_text().splitlines()]
    assert {r["family"] for r in rows} == {"direction"}
    assert check_video(tmp_path / rows[0]["videos"][0])[2:] == (24, pytest.approx(6.0))


def test_video_recipe_loads():
    cfg = load_config(CONFIGS / "vlm_video.yaml", ["rollout.tgrpo_alpha=0.3"])
    assert cfg.data.generator == "video" and set(cfg.data.families) == set(FAMILIES)
    assert cfg.video.fps == 2.0 and cfg.video.frame_factor == 2 and cfg.rollout.tgrpo_alpha == 0.3


def test_train_and_sft_video_recipe_end_to_end(tiny_dirs, tmp_path):
    """`perceptrl sft` then `perceptrl train` (T-GRPO on) on generated clips, one step each."""
    small = [
        f"model.path={tiny_dirs['qwen2_5_vl']}", "train.device=cpu", "data.n_train=4",
        "data.n_val=4", "train.eval_samples=4", "rollout.prompts_per_step=2",
        "rollout.group_size=2", "rollout.max_new_tokens=8", "train.steps=1", "log.progress=false",
        "log.tensorboard=false",
    ]  # fmt: skip
    assert main(["sft", "vlm_video", *small, "--run-dir", str(tmp_path / "sft")]) == 0
    rc = main(
        ["train", "vlm_video", *small, "rollout.tgrpo_alpha=0.3", "--run-dir", str(tmp_path / "rl")]
    )
    assert rc == 0
    rows = [json.loads(x) for x in (tmp_path / "rl" / "metrics.jsonl").read_text().splitlines()]
    step = next(r for r in rows if "reward/tgrpo_bonus_rate" in r)
    assert step["reward/tgrpo_groups"] == 2.0 and step["reward/tgrpo_shuffled_samples"] == 4.0
    assert any("eval/accuracy/temporal_order" in r for r in rows)


def test_video_samples_without_a_reward_get_the_video_checks(tmp_path):
    """A video question answered by a span and written without "reward" is a tiou sample (as
    the generator writes it); its video is checked like any other, so a bad file is reported as
    a bad video, not as an unusable answer."""
    generate(tmp_path, {"train": 2}, families=["grounding"], seed=0)
    good, bad = "videos/train/video-train-000000.mp4", "videos/train/video-train-000001.mp4"
    (tmp_path / bad).write_bytes(b"not a video" * 10)
    recs = [
        {"video": good, "question": "When is the red circle visible?", "answer": "[1.0, 2.5]"},
        {"video": good, "question": "When?", "answer": [0.5, 1.5], "id": "as-list"},
        {"video": bad, "question": "When is it visible?", "answer": "[1.0, 2.5]", "id": "broken"},
    ]
    path = tmp_path / "user.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    with pytest.raises(
        DataError, match=r"sample 2 \(line 3, id 'broken'\): video .*cannot be read"
    ):
        load_samples(path)
    ok, stats = load_samples(path, strict=False)
    assert stats["skipped_videos"] == 1 and stats["skipped_malformed"] == 0
    assert [(s["reward"], s["answer"]) for s in ok] == [
        ("tiou", "[1.0, 2.5]"),
        ("tiou", "[0.5, 1.5]"),
    ]
    assert build_reward({"accuracy": 1.0})(["<answer>[1.0, 2.5]</answer>"], ok[:1])[0] == [1.0]
    image_span = tmp_path / "img.jsonl"  # a span means nothing for an image: still no reward
    image_span.write_text(
        json.dumps({"image": "a.png", "question": "q", "answer": "[1, 2]"}) + "\n"
    )
    with pytest.raises(DataError, match="no usable reward"):
        load_samples(image_span, check_images=False)


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen3_vl"])
def test_video_prompt_lengths_without_decoding_equal_the_encoding(tiny_dirs, tmp_path, arch):
    """Video prompts are counted from the loader's record of each file (size, frames, fps):
    one encoding per distinct kind of clip (Qwen3-VL's timestamps included)."""

    from perceptrl.vlm.model import load_vlm
    from perceptrl.vlm.prompts import PromptConfig, PromptLengths, encode_prompt

    processor = load_vlm(tiny_dirs[arch])[1]
    generate(tmp_path / "a", {"train": 3}, seed=0)
    generate(tmp_path / "b", {"train": 1}, seed=1, seconds=3.0, fps=6)
    media = {}
    data = [
        s for d in ("a", "b") for s in load_samples(tmp_path / d / "train.jsonl", media=media)[0]
    ]
    assert media[data[-1]["videos"][0]] == (112, 112, 18, pytest.approx(6.0))
    cfg = PromptConfig(max_prompt_length=0)
    lengths = PromptLengths(processor, cfg, media=media)
    for s in data:
        enc = encode_prompt(processor, s, cfg)
        assert lengths(s) == (enc.input_ids.numel(), enc.num_vision_tokens), s["id"]
    assert lengths.encodes == 2
