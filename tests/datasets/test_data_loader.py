"""User-data loader: schema normalisation, strict vs lenient, corrupt images, Parquet round trip."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from perceptrl.datasets import clevr
from perceptrl.datasets.loader import DataError, load_samples, save_samples

KEYS = {"id", "images", "question", "answer", "reward", "family", "meta"}


@pytest.fixture
def clevr_dir(tmp_path) -> Path:
    clevr.generate(tmp_path, {"train": 6}, families=["count_all", "attr_mcq", "grounding"], seed=2)
    return tmp_path


def _write_jsonl(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


def test_generated_jsonl_loads_with_absolute_paths(clevr_dir):
    samples, stats = load_samples(clevr_dir / "train.jsonl")
    raw = [json.loads(line) for line in open(clevr_dir / "train.jsonl")]
    assert stats == {"loaded": 6, "skipped_malformed": 0, "skipped_images": 0}
    for s, r in zip(samples, raw):
        assert set(s) == KEYS
        assert s["images"] == [str(clevr_dir / r["images"][0])]
        assert Path(s["images"][0]).is_absolute() and Path(s["images"][0]).is_file()
        assert {k: s[k] for k in KEYS - {"images"}} == {k: r[k] for k in KEYS - {"images"}}


def test_parquet_round_trip(clevr_dir):
    samples, _ = load_samples(clevr_dir / "train.jsonl")
    path = save_samples(samples, clevr_dir / "copy.parquet")
    import pyarrow.parquet as pq

    assert pq.read_table(path).column("images").to_pylist()[0] == [
        f"images/train/{samples[0]['id']}.png"
    ]  # stored relative to the file
    again, stats = load_samples(path)
    assert again == samples and stats["loaded"] == len(samples)
    jsonl, _ = load_samples(save_samples(samples, clevr_dir / "sub" / "copy.jsonl"))
    assert jsonl == samples  # paths outside the file's folder stay absolute


def test_malformed_line_strict_and_lenient(clevr_dir):
    lines = open(clevr_dir / "train.jsonl").read().splitlines()
    lines.insert(2, '{"id": "x", "images": ["a.png"], "question": "q"')  # cut-off JSON on line 3
    bad = _write_jsonl(clevr_dir / "bad.jsonl", lines)
    with pytest.raises(DataError, match=r"bad\.jsonl, line 3: invalid JSON.*strict=False"):
        load_samples(bad)
    samples, stats = load_samples(bad, strict=False)
    assert len(samples) == 6 and stats["skipped_malformed"] == 1 and stats["skipped_images"] == 0


def test_missing_keys_are_named(tmp_path):
    p = _write_jsonl(tmp_path / "d.jsonl", ['{"images": ["a.png"], "question": "How many?"}'])
    with pytest.raises(DataError, match=r"line 1: missing required keys \(answer: one of"):
        load_samples(p, check_images=False)
    p = _write_jsonl(
        tmp_path / "e.jsonl", ['{"image": "a.png", "question": "Describe it", "answer": "a cat"}']
    )
    with pytest.raises(DataError, match='no usable reward.*add a "reward" key'):
        load_samples(p, check_images=False)


def test_corrupt_and_missing_images(clevr_dir):
    raw = [json.loads(line) for line in open(clevr_dir / "train.jsonl")]
    (clevr_dir / raw[2]["images"][0]).write_bytes(b"\x89PNG not really an image" * 4)
    (clevr_dir / raw[4]["images"][0]).unlink()
    with pytest.raises(DataError, match=r"train\.jsonl, sample 2 \(line 3.*cannot be read"):
        load_samples(clevr_dir / "train.jsonl")
    samples, stats = load_samples(clevr_dir / "train.jsonl", strict=False)
    assert stats == {"loaded": 4, "skipped_malformed": 0, "skipped_images": 2}
    assert [s["id"] for s in samples] == [raw[i]["id"] for i in (0, 1, 3, 5)]
    unchecked, stats = load_samples(clevr_dir / "train.jsonl", check_images=False)
    assert len(unchecked) == 6 and stats["skipped_images"] == 0


def test_truncated_png_is_caught(tmp_path):
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (64, 64, 3), np.uint8)).save(
        tmp_path / "t.png"
    )
    data = (tmp_path / "t.png").read_bytes()
    (tmp_path / "t.png").write_bytes(data[: len(data) // 2])
    p = _write_jsonl(
        tmp_path / "d.jsonl", ['{"images": ["t.png"], "question": "q", "answer": "1"}']
    )
    with pytest.raises(DataError, match=r"sample 0 .*t\.png cannot be read"):
        load_samples(p)


def test_r1v_style_keys_are_normalised(tmp_path):
    Image.new("RGB", (40, 30), (128, 128, 128)).save(tmp_path / "img.png")
    recs = [
        {
            "image": "img.png",
            "problem": "How many cubes?",
            "solution": "<think>two cubes</think><answer> 2 </answer>",
        },
        {
            "image_path": str(tmp_path / "img.png"),
            "prompt": "Where?",
            "answer": [1, 2, 30, 20],
            "task": "ground",
            "source": "mine",
        },
        {
            "images": ["img.png"],
            "question": "Pick\nA. x\nB. y",
            "answer": "B",
            "id": "q3",
            "meta": {"options": ["x", "y"]},
        },
    ]
    p = _write_jsonl(tmp_path / "user.jsonl", [json.dumps(r) for r in recs])
    samples, _ = load_samples(p)
    a, b, c = samples
    assert (a["answer"], a["reward"], a["family"], a["id"]) == ("2", "numeric", "default", "user-1")
    assert a["images"] == [str(tmp_path / "img.png")] and a["question"] == "How many cubes?"
    assert (b["answer"], b["reward"], b["family"]) == ("[1, 2, 30, 20]", "iou", "ground")
    assert b["meta"] == {"source": "mine", "image_size": [40, 30]}
    assert (c["reward"], c["id"], c["meta"]) == ("mcq", "q3", {"options": ["x", "y"]})


def test_json_list_and_bad_container(tmp_path):
    Image.new("RGB", (8, 8)).save(tmp_path / "i.png")
    (tmp_path / "d.json").write_text(
        json.dumps([{"image": "i.png", "question": "q", "answer": "3"}])
    )
    samples, _ = load_samples(tmp_path / "d.json")
    assert samples[0]["answer"] == "3"
    (tmp_path / "e.json").write_text(json.dumps({"image": "i.png"}))
    with pytest.raises(DataError, match="must be a list"):
        load_samples(tmp_path / "e.json")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_samples(tmp_path / "nope.jsonl")


def test_unreadable_files_and_binary_lines(tmp_path):
    (tmp_path / "x.parquet").write_bytes(b"not parquet")
    with pytest.raises(DataError, match=r"x\.parquet: cannot read the file"):
        load_samples(tmp_path / "x.parquet")
    (tmp_path / "b.jsonl").write_bytes(
        b'{"image": "i.png", "question": "q", "answer": "1"}\n\xff\xfe\n'
    )
    with pytest.raises(DataError, match=r"line 2: not UTF-8 text"):
        load_samples(tmp_path / "b.jsonl", check_images=False)
    samples, stats = load_samples(tmp_path / "b.jsonl", strict=False, check_images=False)
    assert len(samples) == 1 and stats["skipped_malformed"] == 1


def test_json_error_names_the_column_of_the_line(tmp_path):
    """A line cut off at its end: the column is where the line ends, not 'column 1' of the
    newline the JSON parser saw after it (with LF and CRLF line ends alike)."""
    cut = '{"id": "x", "images": ["a.png"], "question": "q"'  # 48 characters
    for name, end in (("lf.jsonl", b"\n"), ("crlf.jsonl", b"\r\n")):
        (tmp_path / name).write_bytes(cut.encode() + end)
        with pytest.raises(
            DataError, match=r"line 1: invalid JSON: Expecting ',' delimiter at column 49\b"
        ):
            load_samples(tmp_path / name, check_images=False)
    (tmp_path / "mid.jsonl").write_text('{"a": 1,, "b": 2}\n')
    with pytest.raises(DataError, match=r"double quotes at column 9\b"):
        load_samples(tmp_path / "mid.jsonl", check_images=False)


@pytest.mark.parametrize(
    "name, content",
    [("empty.jsonl", b""), ("blank.jsonl", b"\n \n"), ("empty.json", b"[]")],
)
def test_an_empty_data_file_is_named(tmp_path, name, content):
    (tmp_path / name).write_bytes(content)
    with pytest.raises(DataError, match=rf"{re.escape(str(tmp_path / name))}: no samples"):
        load_samples(tmp_path / name, strict=False)


def test_a_file_whose_every_record_is_skipped_is_named(tmp_path):
    p = _write_jsonl(tmp_path / "bad.jsonl", ["{not json", '{"question": "q"}'])
    with pytest.raises(DataError, match=r"bad\.jsonl: all 2 records were skipped.*malformed"):
        load_samples(p, strict=False, check_images=False)


def test_strict_errors_name_the_recipe_key(clevr_dir, tmp_path):
    """The fix a strict error names is the recipe key a user of the command can set."""
    raw = [json.loads(line) for line in open(clevr_dir / "train.jsonl")]
    (clevr_dir / raw[1]["images"][0]).unlink()
    cut = _write_jsonl(tmp_path / "cut.jsonl", ['{"image": "a.png", "question": "q"'])
    missing = _write_jsonl(tmp_path / "m.jsonl", ['{"image": "a.png", "question": "q"}'])
    for path in (clevr_dir / "train.jsonl", cut, missing):
        with pytest.raises(DataError, match=r"set data\.strict=false") as e:
            load_samples(path)
        assert "\n" not in str(e.value), str(e.value)  # one paragraph
