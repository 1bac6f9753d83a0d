"""Benchmark files (datasets/benchmarks.py) through the loader: each layout read into samples,
the multiple-choice prompt, scoring with the reward catalogue, and the error paths (missing
columns, bad base64, rows without images; strict and lenient). The files are written by
benchmark_files.py in the published schemas (its docstring says where each comes from)."""

from __future__ import annotations

import base64
import sys
from pathlib import Path

import pyarrow as pa
import pytest

from perceptrl.datasets.benchmarks import LETTER_INSTRUCTION, inline_options, mcq_prompt
from perceptrl.datasets.loader import load_samples
from perceptrl.errors import DataError
from perceptrl.rewards import build_reward
from perceptrl.rewards.builtin import yesno
from perceptrl.trainer.config import ConfigError
from perceptrl.wiring import CONFIGS, load_config

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchmark_files as bf  # noqa: E402


def _load(path: Path, tmp_path: Path, **kw):
    return load_samples(path, media_dir=tmp_path / "media", **kw)


def _accuracy(samples: list[dict], completions: list[str]) -> list[float]:
    """The held-out score `perceptrl eval` uses: the accuracy reward alone."""
    return build_reward({"accuracy": 1.0})(completions, samples)[0]


def test_vlmevalkit_rows_become_multiple_choice_samples(tmp_path):
    rows = bf.vlmevalkit_rows()
    got, stats = _load(bf.write_tsv(tmp_path / "MMBench_DEV_EN.tsv", rows), tmp_path)
    assert stats["loaded"] == 5 and [s["id"] for s in got] == ["1", "2", "3", "4", "5"]
    first = got[0]
    assert first["question"] == (
        "Hint: Look at the centre.\nQuestion: What colour is the square?\nOptions:\nA. red\n"
        f"B. blue\nC. green\nD. grey\n{LETTER_INSTRUCTION}"
    )
    assert (first["reward"], first["answer"], first["family"]) == ("mcq", "A", "colour")
    assert first["meta"]["options"] == ["red", "blue", "green", "grey"]
    assert first["meta"]["l2-category"] == "perception" and first["meta"]["split"] == "dev"
    # empty option cells are no options; no hint, no hint line
    assert got[1]["meta"]["options"] == ["yes", "no"] and "Hint" not in got[1]["question"]
    # the image is written unchanged under media_dir, named by the index
    assert Path(first["images"][0]) == tmp_path / "media" / "1.png"
    assert Path(first["images"][0]).read_bytes() == base64.b64decode(rows[0]["image"])
    # a short image cell is another row's index: that row's file, decoded once
    assert got[2]["images"] == first["images"]
    # a list of images: one file each; a JPEG keeps its format
    assert [Path(p).name for p in got[3]["images"]] == ["4_0.png", "4_1.jpg"]
    assert Path(got[4]["images"][0]).suffix == ".jpg"


def test_mcq_prompt_lays_options_out_as_vlmevalkit_does():
    text = mcq_prompt("Which?", {"A": "one", "B": "two"}, hint="a hint")
    assert text.splitlines() == [
        "Hint: a hint", "Question: Which?", "Options:", "A. one", "B. two", LETTER_INSTRUCTION
    ]  # fmt: skip


def test_multiple_choice_answers_score_by_their_letter(tmp_path):
    got, _ = _load(bf.write_tsv(tmp_path / "b.tsv", bf.vlmevalkit_rows()), tmp_path)
    first, second = got[0], got[1]
    completions = ["<think>.</think><answer>A</answer>", "The answer is B", "red", "(A) yes"]
    assert _accuracy([first, second, first, second], completions) == [1.0, 0.0, 1.0, 1.0]


def test_yes_no_rows_score_by_yesno_grouped_by_image(tmp_path):
    """MME's rows: open questions whose answer is Yes or No get the ``yesno`` reward, and the
    two questions on an image form one group (MME's accuracy+)."""
    tsv = bf.write_tsv(tmp_path / "MME.tsv", bf.mme_rows(), bf.MME_COLUMNS)
    got, stats = _load(tsv, tmp_path)
    assert stats["loaded"] == 4 and {s["reward"] for s in got} == {"yesno"}
    assert got[0]["question"] == "Is the square red? Please answer yes or no."
    assert [s["meta"]["group"] for s in got] == ["color/color/red.png"] * 2 + [
        "color/color/blue.png"
    ] * 2
    assert got[1]["images"] == got[0]["images"]
    completions = ["Yes.", "<answer>no</answer>", "Yes and no", "No, it is not."]
    assert _accuracy(got, completions) == [1.0, 1.0, 0.0, 1.0]


def test_yesno_reads_the_words_and_refuses_other_answers():
    sample = {"id": "q", "answer": "No", "reward": "yesno"}
    texts = ["no", "NO!", "It is not, no.", "Not at all", "yes", "noon", ""]
    assert _accuracy([sample] * len(texts), texts) == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="answer 'maybe' is neither Yes nor No"):
        yesno(["yes"], [{"id": "q", "answer": "maybe"}], None)


def test_circular_copies_of_a_question_share_its_group(tmp_path):
    got, _ = _load(bf.write_tsv(tmp_path / "MMBench_DEV_EN.tsv", bf.circular_rows()), tmp_path)
    assert [s["meta"]["group"] for s in got] == ["7", "7", "8"]
    assert [s["answer"] for s in got] == ["A", "B", "B"]
    # a g_index column names the group itself
    rows = [{**r, "g_index": 9} for r in bf.circular_rows()]
    tsv = bf.write_tsv(tmp_path / "g.tsv", rows, [*bf.MMBENCH_COLUMNS, "g_index"])
    assert {s["meta"]["group"] for s in _load(tsv, tmp_path)[0]} == {"9"}


def test_mathvista_questions_by_question_and_answer_type(tmp_path):
    got, _ = _load(bf.write_parquet(tmp_path / "testmini.parquet", bf.mathvista_table()), tmp_path)
    mc, integer, flt = got
    assert (mc["id"], mc["reward"], mc["answer"]) == ("1", "mcq", "C")  # "90°" is choice C
    assert mc["meta"]["options"] == ["30°", "60°", "90°"] and "C. 90°" in mc["question"]
    assert mc["family"] == "geometry problem solving" and mc["meta"]["skills"] == [
        "arithmetic reasoning"
    ]
    assert integer["reward"] == "numeric" and integer["question"].endswith(
        "Answer the question using a single integer number."
    )
    assert "(Unit: cm)" in flt["question"] and "one decimal place" in flt["question"]
    assert flt["meta"]["abs_tol"] == pytest.approx(0.05)
    assert {s["family"] for s in (integer, flt)} == {"figure question answering"}
    scores = _accuracy([mc, integer, flt, flt], ["C", "1", "2.54", "2.6"])
    assert scores == [1.0, 1.0, 1.0, 0.0]  # MathVista rounds to the precision: 2.54 -> 2.5


def test_scienceqa_answer_index_and_text_only_rows(tmp_path):
    path = bf.write_parquet(tmp_path / "test.parquet", bf.scienceqa_table())
    with pytest.raises(DataError, match=r"test\.parquet, row 2: it has no image .*data\.strict"):
        _load(path, tmp_path)
    got, stats = _load(path, tmp_path, strict=False)
    assert stats["skipped_no_image"] == 1 and len(got) == 2
    colour, maps = got
    assert (colour["answer"], maps["answer"]) == ("A", "C")
    assert colour["question"].startswith("Hint: The square is warm.\nQuestion: Which colour")
    assert [s["family"] for s in got] == ["natural science", "social science"]
    assert colour["meta"]["topic"] == "colours" and colour["id"] == "test-0"


def test_mmstar_options_come_out_of_the_question(tmp_path):
    got, _ = _load(bf.write_parquet(tmp_path / "mmstar.parquet", bf.mmstar_table()), tmp_path)
    rel, count = got
    assert rel["meta"]["options"][2] == "The square is beside it, left or right."
    assert rel["question"].splitlines()[:3] == [
        "Question: Which option describe the object relationship in the image correctly?",
        "Options:",
        "A. The square is on the grey.",
    ]
    assert count["meta"]["options"] == ["1", "2", "3", "4"]
    assert (rel["family"], rel["meta"]["l2_category"]) == (
        "instance reasoning", "cross-instance relation reasoning"
    )  # fmt: skip
    assert inline_options("How many?") is None
    assert inline_options("How many?\nOptions: B: 1, C: 2") is None  # letters must run A, B


def test_missing_columns_name_the_file_the_columns_and_the_layouts(tmp_path):
    cols = [c for c in bf.MMBENCH_COLUMNS if c != "answer"]
    tsv = bf.write_tsv(tmp_path / "noanswer.tsv", bf.vlmevalkit_rows(), cols)
    with pytest.raises(DataError) as e:
        _load(tsv, tmp_path)
    msg = str(e.value)
    assert "noanswer.tsv" in msg and "['answer']" in msg
    assert all(name in msg for name in ("vlmevalkit", "mathvista", "scienceqa", "mmstar"))
    # a Parquet file with MathVista's signature but not its columns
    mv = bf.mathvista_table().drop_columns(["question_type"])
    with pytest.raises(DataError, match=r"a mathvista file needs the columns \['question_type'\]"):
        _load(bf.write_parquet(tmp_path / "mv.parquet", mv), tmp_path)
    # columns of no layout, not even this project's
    odd = pa.table({"foo": ["x"], "bar": ["y"]})
    with pytest.raises(DataError, match=r"columns \['foo', 'bar'\] match no known layout"):
        _load(bf.write_parquet(tmp_path / "odd.parquet", odd), tmp_path)
    # a named layout of another file type
    with pytest.raises(DataError, match="data.format=mmstar reads .parquet files"):
        _load(tsv, tmp_path, layout="mmstar")


def test_bad_base64_names_the_row_strict_and_is_counted_lenient(tmp_path):
    rows = bf.vlmevalkit_rows()
    rows[1]["image"] = "@@ not base64 at all " * 4  # longer than an index (64 characters)
    rows[3]["image"] = base64.b64encode(b"these bytes are no image" * 4).decode()
    rows[4]["image"] = "A" * 65  # a base64 length no encoder writes
    path = bf.write_tsv(tmp_path / "bad.tsv", rows)
    with pytest.raises(DataError, match=r"bad\.tsv, row 1, index 2: its base64 image is no image"):
        _load(path, tmp_path)
    got, stats = _load(path, tmp_path, strict=False)
    assert stats["skipped_images"] == 3 and [s["id"] for s in got] == ["1", "3"]
    # a reference to an index that holds no image
    rows = bf.vlmevalkit_rows()
    rows[2]["image"] = "99"
    with pytest.raises(DataError, match=r"row 2, index 3: its image refers to index '99'"):
        _load(bf.write_tsv(tmp_path / "ref.tsv", rows), tmp_path)


def test_project_files_and_named_formats_still_read_as_before(tmp_path):
    """A Parquet file of this project's schema is not mistaken for a benchmark; a benchmark
    file needs a folder for its images."""
    (tmp_path / "a.png").write_bytes(bf.image_bytes())
    own = pa.table({"images": [["a.png"]], "question": ["How many?"], "answer": ["1"]})
    got, _ = load_samples(bf.write_parquet(tmp_path / "own.parquet", own))
    assert got[0]["reward"] == "numeric"
    with pytest.raises(ValueError, match="pass media_dir"):
        load_samples(bf.write_tsv(tmp_path / "b.tsv", bf.vlmevalkit_rows()))


def test_data_format_is_checked_when_the_recipe_loads():
    recipe = CONFIGS / "vlm_clevr.yaml"
    with pytest.raises(ConfigError, match="data.format=mmstar names the layout"):
        load_config(recipe, ["data.format=mmstar"])
    with pytest.raises(ConfigError, match="vlmevalkit"):
        load_config(recipe, ["data.format=mmbench", "data.val=x.tsv"])
    assert load_config(recipe, ["data.format=mmstar", "data.val=x.parquet"]).data.format == "mmstar"
