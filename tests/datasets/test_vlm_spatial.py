"""3D spatial generator: determinism, exact geometry against closed forms and a fresh MuJoCo
compile, answers consistent with the rewards, multi-view prompts through the tiny VLM."""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path

import cv2
import numpy as np
import pytest

os.environ.setdefault("MUJOCO_GL", "egl")

from perceptrl.datasets import spatial  # noqa: E402
from perceptrl.datasets.loader import load_samples  # noqa: E402
from perceptrl.rewards import build_reward  # noqa: E402

SPLITS = {"train": 24, "val": 12}


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> tuple[Path, dict[str, list[dict]]]:
    out = tmp_path_factory.mktemp("spatial")
    paths = spatial.generate(out, SPLITS, seed=3, depth=True)
    rows = {s: [json.loads(line) for line in open(p)] for s, p in paths.items()}
    return out, rows


def _all(rows: dict[str, list[dict]]) -> list[dict]:
    return [s for split in rows.values() for s in split]


def _digest(out: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(out.rglob("*")):
        if p.is_file():
            h.update(p.relative_to(out).as_posix().encode() + p.read_bytes())
    return h.hexdigest()


def test_same_seed_same_bytes_and_splits_differ(data, tmp_path):
    out, rows = data
    again = spatial.generate(tmp_path / "again", SPLITS, seed=3, depth=True)
    assert again["train"].read_text() == (out / "train.jsonl").read_text()
    assert _digest(tmp_path / "again") == _digest(out)
    layouts = {json.dumps(s["meta"]["objects"]) for s in _all(rows)}
    assert len(layouts) == len(_all(rows))  # no scene repeats across or within splits


def test_schema_families_and_views(data):
    out, rows = data
    for s in _all(rows):
        assert len(s["images"]) == 4 and all((out / p).exists() for p in s["images"])
        assert s["reward"] == (
            "mra" if s["family"] in ("obj_count", "abs_distance", "obj_size") else "mcq"
        )
        assert s["meta"]["modality"] == "3d"
        img = cv2.imread(str(out / s["images"][0]))
        assert img.shape == (112, 112, 3) and img.std() > 5  # rendered, not blank
    fams = [s["family"] for s in rows["train"]]
    assert fams == [spatial.FAMILIES[i % 6] for i in range(len(fams))]


def _box_sphere(box: dict, sph: dict) -> float:
    yaw = math.radians(box["yaw"])
    d = np.subtract(sph["pos"], box["pos"])
    local = np.array([math.cos(yaw) * d[0] + math.sin(yaw) * d[1],
                      -math.sin(yaw) * d[0] + math.cos(yaw) * d[1], d[2]])  # fmt: skip
    nearest = np.clip(local, -np.array(box["size"]), box["size"])
    return float(np.linalg.norm(local - nearest)) - sph["size"][0]


def _closed_form(a: dict, b: dict) -> float | None:
    if a["shape"] == b["shape"] == "sphere":
        return float(np.linalg.norm(np.subtract(a["pos"], b["pos"]))) - a["size"][0] - b["size"][0]
    if {a["shape"], b["shape"]} == {"box", "sphere"}:
        return _box_sphere(a, b) if a["shape"] == "box" else _box_sphere(b, a)
    return None


def test_distances_sizes_directions_are_exact(data):
    _, rows = data
    checked = 0
    rng = np.random.default_rng(0)
    cfg = spatial.SpatialConfig()
    for _ in range(20):  # closed forms for sphere-sphere and box-sphere pairs
        scene = spatial.sample_scene(rng, 5, cfg)
        if scene is None:
            continue
        dist = spatial.render(scene, cfg)["distances"]
        objs = scene["objects"]
        for i in range(len(objs)):
            for j in range(i + 1, len(objs)):
                if (ref := _closed_form(objs[i], objs[j])) is not None:
                    assert dist[i, j] == pytest.approx(ref, abs=1e-6)
                    checked += 1
    assert checked >= 10
    for s in _all(rows):
        m, objs = s["meta"], s["meta"]["objects"]
        if s["family"] == "obj_size":
            assert int(s["answer"]) == round(100 * max(objs[m["target"]]["extent"]))
        if s["family"] == "rel_direction":  # recomputed with an independent rotation
            a, b, c = (np.array(objs[m[k]]["pos"][:2]) for k in ("standing", "facing", "target"))
            h = math.atan2(*(b - a)[::-1])
            rot = np.array([[math.cos(-h), -math.sin(-h)], [math.sin(-h), math.cos(-h)]]) @ (c - a)
            quad = f"{'front' if rot[0] > 0 else 'back'}-{'left' if rot[1] > 0 else 'right'}"
            assert m["options"]["ABCD".index(s["answer"])] == quad
        if s["family"] == "obj_count":
            shape = m["filter"].get("shape")
            assert int(s["answer"]) == sum(shape in (None, o["shape"]) for o in objs) >= 1


def test_rig_matches_a_fresh_compile_of_the_mjcf(data):
    import mujoco

    cfg = spatial.SpatialConfig()
    rng = np.random.default_rng(5)
    scene = None
    while scene is None:
        scene = spatial.sample_scene(rng, 5, cfg)
    views = spatial.render(scene, cfg)
    model = mujoco.MjModel.from_xml_string(spatial.scene_xml(scene, cfg))
    d = mujoco.MjData(model)
    mujoco.mj_forward(model, d)
    g = [mujoco.mj_name2id(model, mujoco.mjtObj.mjOBJ_GEOM, f"obj{i}") for i in range(5)]
    for i in range(5):
        for j in range(i + 1, 5):
            ref = mujoco.mj_geomDistance(model, d, g[i], g[j], 100.0, None)
            assert views["distances"][i, j] == pytest.approx(ref, abs=1e-9)
    with mujoco.Renderer(model, cfg.image_size, cfg.image_size) as r:
        for k in range(cfg.n_views):
            r.update_scene(d, camera=f"view{k}")
            differ = (np.abs(r.render().astype(int) - views["rgb"][k]).max(-1) > 8).mean()
            assert differ < 0.01, f"view {k}: {differ:.3%} pixels differ"


def test_visibility_and_appearance_order_follow_the_cameras(data):
    _, rows = data
    cfg = spatial.SpatialConfig()
    tan_half = math.tan(math.radians(cfg.fovy / 2))
    checked = {"in": 0, "out": 0}
    for s in _all(rows):
        objs, cams = s["meta"]["objects"], s["meta"]["cameras"]
        for o in objs:
            assert o["first_view"] is not None
            for k, px in enumerate(o["visible_px"]):
                # pinhole projection of the centre; slack: the bounding sphere's angular radius
                h = math.radians(cams[k]["heading"])
                fwd = np.array(cams[k]["forward"])
                right = np.array([math.sin(h), -math.cos(h), 0.0])
                up = np.cross(-fwd, right)
                rel = np.subtract(o["pos"], cams[k]["pos"])
                z = float(rel @ fwd)
                radius = float(np.linalg.norm(o["extent"])) / 2
                reach = tan_half + radius / max(z - radius, 0.05)
                uv = max(abs(rel @ right), abs(rel @ up)) / max(z, 1e-3)
                if px >= 40:  # clearly visible: the centre is in (or near) the frustum
                    assert z > -radius and uv <= reach
                    checked["in"] += 1
                elif z < -radius or uv > 1.5 * reach:  # far outside: not a single pixel
                    assert px == 0
                    checked["out"] += 1
        if s["family"] == "appearance_order":
            order = s["meta"]["order"]
            views = [objs[i]["first_view"] for i in order]
            assert views == sorted(views) and len(set(views)) == 3
            text = s["meta"]["options"]["ABCD".index(s["answer"])]
            assert text == ", ".join(spatial.name(objs[i]) for i in order)
    assert checked["in"] > 20 and checked["out"] > 20


def test_traces_score_full_marks_and_depth_is_metric(data):
    out, rows = data
    samples = _all(rows)
    reward = build_reward({"accuracy": 1.0})
    traces = [spatial.reasoning_trace(s) for s in samples]
    totals, _comps, _ = reward(traces, samples)
    assert totals == [1.0] * len(samples)
    assert reward(["<think></think><answer>999</answer>"] * 6, rows["train"][:6])[0][0] == 0.0
    s = rows["val"][0]
    depth = cv2.imread(str(out / s["meta"]["depth"][0]), cv2.IMREAD_UNCHANGED)
    assert depth.dtype == np.uint16 and depth.shape == (112, 112)
    assert 100 < depth.min() and depth.max() < 12000  # millimetres inside the room


def test_bad_config_and_family_errors(tmp_path):
    with pytest.raises(ValueError, match="valid"):
        spatial.generate(tmp_path, {"train": 1}, families=["room_size"])
    with pytest.raises(ValueError, match="colours are unique"):
        spatial.SpatialConfig(max_objects=9)
    with pytest.raises(TypeError, match="n_views"):
        spatial.generate(tmp_path, {"train": 1}, n_view=3)


def test_multi_view_prompt_reaches_the_tiny_vlm(data):
    """Four views become four image blocks in one prompt, and every view changes the scores."""
    import torch

    from perceptrl.vlm.policy import VLMPolicy
    from perceptrl.vlm.prompts import PromptConfig, encode_prompt

    out, _ = data
    samples, _ = load_samples(out / "val.jsonl")
    base = Path(__file__).resolve().parents[2] / "assets" / "vlm_base"
    policy = VLMPolicy.from_pretrained(base, prompt=PromptConfig(max_prompt_length=1024))
    enc = encode_prompt(policy.processor, samples[0], policy.prompt)
    grid = enc.vision["image_grid_thw"]
    assert grid.shape[0] == 4
    n_img_tokens = int((enc.input_ids == policy.processor.image_token_id).sum())
    assert n_img_tokens == enc.num_vision_tokens == int(grid.prod(-1).sum()) // 4
    trace = spatial.reasoning_trace(samples[0])
    swapped = {**samples[0], "images": [samples[0]["images"][k] for k in (0, 1, 3, 2)]}
    with torch.no_grad():
        logp = [
            policy.evaluate(policy.completions_batch([s], [trace])).logp
            for s in (samples[0], swapped)
        ]
    assert torch.isfinite(logp[0]).all() and not torch.allclose(logp[0], logp[1])


def test_cli_generate_sft_then_grpo_end_to_end(tmp_path):
    """`perceptrl data generate --kind spatial`, then SFT on its traces and one GRPO step from
    the SFT checkpoint on the 3D tasks: the GRPO update changes the weights."""
    from safetensors.torch import load_file

    from perceptrl.cli import main

    d = tmp_path / "d"
    assert main(["data", "generate", "--kind", "spatial", "--out", str(d), "--n-train", "4",
                 "--n-val", "2", "--n-test", "0"]) == 0  # fmt: skip
    assert len(load_samples(d / "train.jsonl")[0]) == 4 and not (d / "test.jsonl").exists()
    small = ["data.n_train=6", "data.n_val=2", "train.eval_samples=2", "log.progress=false",
             "rollout.prompts_per_step=2"]  # fmt: skip
    assert (
        main(["sft", "vlm_spatial", *small, "train.steps=2", "--run-dir", str(tmp_path / "s")]) == 0
    )
    sft_model = tmp_path / "s" / "checkpoints" / "step_000002" / "model"
    assert main(["train", "vlm_spatial", *small, "train.steps=1", "rollout.group_size=4",
                 f"model.path={sft_model}",
                 "--run-dir", str(tmp_path / "g")]) == 0  # fmt: skip
    rows = [json.loads(x) for x in (tmp_path / "g" / "metrics.jsonl").read_text().splitlines()]
    assert any("actor/pg_loss" in r for r in rows) and any(
        "eval/accuracy/abs_distance" in r for r in rows
    )
    before = load_file(sft_model / "model.safetensors")
    after = load_file(
        tmp_path / "g" / "checkpoints" / "step_000001" / "model" / "model.safetensors"
    )
    assert any(not np.allclose(before[k].numpy(), after[k].numpy()) for k in before)
