"""Small benchmark files in the published schemas, written by the tests (no benchmark can be
downloaded here); imported by test_benchmarks.py and tests/vlm/test_vlm_benchmark_eval.py.

Where each schema comes from:

- VLMEvalKit TSV: the columns of its MCQ files (MMBench_DEV_EN.tsv: ``index``, ``question``,
  ``hint``, ``A`` .. ``D``, ``answer``, ``category``, ``image``, ``source``, ``l2-category``,
  ``comment``, ``split``), read by ``vlmeval/dataset/image_base.py`` (base64 ``image``, a list
  written as a Python list, or a short cell holding another row's ``index``) and
  ``vlmeval/dataset/image_mcq.py``; written as ``DataFrame.to_csv(sep="\\t", index=False)``
  writes (the standard ``csv`` writer with a tab and ``\\n`` gives the same bytes; an empty
  cell is NaN).
- VLMEvalKit Y/N TSV (MME.tsv): ``index``, ``category``, ``image``, ``question``, ``answer``
  (``Yes`` | ``No``), ``image_path`` (two questions per image; ``vlmeval/dataset/image_yorn.py``
  and ``utils/yorn.py``'s ``MME_rating``, which scores a category's images by ``image_path``).
  MMBench's circular copies of a question have its index plus 1,000,000 and its options
  rotated (``utils/multiple_choice.py``'s ``mcq_circular_eval``: ``g_index = index % 1e6``).
- MathVista: Hugging Face ``AI4Math/MathVista`` (testmini): ``pid``, ``question``, ``image``
  (the file's name), ``decoded_image`` (an image struct ``{bytes, path}``), ``choices``,
  ``unit``, ``precision``, ``answer``, ``question_type``, ``answer_type``, ``metadata`` (a struct
  with ``task``, ``category``, ``skills``, ``source`` ...), ``query``; as lmms-eval's
  ``lmms_eval/tasks/mathvista/utils.py`` reads them.
- ScienceQA: Hugging Face ``derek-thomas/ScienceQA``: ``image`` (struct or null), ``question``,
  ``choices``, ``answer`` (an index), ``hint``, ``task``, ``grade``, ``subject``, ``topic``,
  ``category``, ``skill``, ``lecture``, ``solution``; lmms-eval's
  ``lmms_eval/tasks/scienceqa/utils.py``.
- MMStar: Hugging Face ``Lin-Chen/MMStar``: ``index``, ``question`` (its options inside:
  ``...\\nOptions: A: ..., B: ...``), ``image`` (struct), ``answer``, ``category``,
  ``l2_category``; lmms-eval's ``lmms_eval/tasks/mmstar/utils.py``.
"""

from __future__ import annotations

import base64
import csv
import io
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image

IMAGE_STRUCT = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
"""the Hugging Face ``Image`` feature as Parquet stores it"""


def image_bytes(colour=(200, 60, 60), fmt="PNG", size=56) -> bytes:
    """A small mid-grey image with a coloured square, encoded as ``fmt``."""
    im = Image.new("RGB", (size, size), (128, 128, 128))
    im.paste(colour, (size // 4, size // 4, 3 * size // 4, 3 * size // 4))
    buf = io.BytesIO()
    im.save(buf, format=fmt)
    return buf.getvalue()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


MMBENCH_COLUMNS = ["index", "question", "hint", "A", "B", "C", "D", "answer", "category",
                   "image", "source", "l2-category", "comment", "split"]  # fmt: skip


def vlmevalkit_rows() -> list[dict]:
    """Five MMBench-style rows over two categories: a four-option and a two-option question
    with a hint, a row sharing row 1's image by index, a row of two images (a list) and a
    JPEG."""
    red, blue = b64(image_bytes()), b64(image_bytes((40, 80, 230), "JPEG"))
    return [
        {"index": 1, "question": "What colour is the square?", "hint": "Look at the centre.",
         "A": "red", "B": "blue", "C": "green", "D": "grey", "answer": "A",
         "category": "colour", "image": red, "l2-category": "perception", "split": "dev"},
        {"index": 2, "question": "Is there a square?", "A": "yes", "B": "no", "answer": "A",
         "category": "shape", "image": red, "l2-category": "perception", "split": "dev"},
        {"index": 3, "question": "Which shape is shown?", "A": "circle", "B": "square",
         "answer": "B", "category": "shape", "image": "1", "l2-category": "perception",
         "split": "dev"},
        {"index": 4, "question": "Do the two images match?", "A": "yes", "B": "no",
         "answer": "B", "category": "shape", "image": str([red, blue]), "split": "dev"},
        {"index": 5, "question": "What colour is the square?", "A": "red", "B": "blue",
         "C": "green", "answer": "B", "category": "colour", "image": blue, "split": "dev"},
    ]  # fmt: skip


def circular_rows() -> list[dict]:
    """MMBench rows with circular copies: question 7 and its copy with the options rotated
    (the answer rotates with them), and question 8 alone."""
    red = b64(image_bytes())
    base = {"question": "What colour is the square?", "category": "colour", "image": red}
    return [
        {**base, "index": 7, "A": "red", "B": "blue", "answer": "A"},
        {**base, "index": 1_000_007, "A": "blue", "B": "red", "answer": "B", "image": "7"},
        {**base, "index": 8, "A": "green", "B": "red", "answer": "B", "image": "7"},
    ]  # fmt: skip


MME_COLUMNS = ["index", "category", "image", "question", "answer", "image_path"]


def mme_rows() -> list[dict]:
    """MME-style Y/N rows: two questions on each of two images of one category, the second
    question of each image sharing the first's image by index."""
    red, blue = b64(image_bytes()), b64(image_bytes((40, 80, 230)))
    q = "Is the square {}? Please answer yes or no."
    return [
        {"index": 0, "category": "color", "image": red, "question": q.format("red"),
         "answer": "Yes", "image_path": "color/red.png"},
        {"index": 1, "category": "color", "image": "0", "question": q.format("blue"),
         "answer": "No", "image_path": "color/red.png"},
        {"index": 2, "category": "color", "image": blue, "question": q.format("blue"),
         "answer": "Yes", "image_path": "color/blue.png"},
        {"index": 3, "category": "color", "image": "2", "question": q.format("red"),
         "answer": "No", "image_path": "color/blue.png"},
    ]  # fmt: skip


def write_tsv(path: Path, rows: list[dict], columns: list[str] = MMBENCH_COLUMNS) -> Path:
    """``rows`` as pandas' ``to_csv(sep="\\t", index=False)`` writes them (missing: empty)."""
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f, delimiter="\t", lineterminator="\n")
        w.writerow(columns)
        for r in rows:
            w.writerow(["" if r.get(c) is None else r[c] for c in columns])
    return path


def mathvista_table(n_free: int = 2) -> pa.Table:
    """A multiple-choice row (its answer a choice's text), an integer row and a float row with
    a unit and a precision, over two tasks."""
    png = image_bytes()
    rows = [
        {"pid": "1", "question": "Which angle is the largest?", "image": "images/1.jpg",
         "decoded_image": {"bytes": png, "path": "1.jpg"}, "choices": ["30°", "60°", "90°"],
         "unit": None, "precision": None, "answer": "90°", "question_type": "multi_choice",
         "answer_type": "text", "metadata": _mv_meta("geometry problem solving", "math-targeted-vqa"),
         "query": "..."},
        {"pid": "2", "question": "How many squares are there?", "image": "images/2.jpg",
         "decoded_image": {"bytes": png, "path": "2.jpg"}, "choices": None, "unit": None,
         "precision": None, "answer": "1", "question_type": "free_form",
         "answer_type": "integer", "metadata": _mv_meta("figure question answering", "general-vqa"),
         "query": "..."},
        {"pid": "3", "question": "How long is the side?", "image": "images/3.jpg",
         "decoded_image": {"bytes": png, "path": "3.jpg"}, "choices": None, "unit": "cm",
         "precision": 1.0, "answer": "2.5", "question_type": "free_form",
         "answer_type": "float", "metadata": _mv_meta("figure question answering", "general-vqa"),
         "query": "..."},
    ][: 1 + n_free]  # fmt: skip
    meta = pa.struct([("category", pa.string()), ("context", pa.string()), ("grade", pa.string()),
                      ("img_height", pa.int64()), ("img_width", pa.int64()),
                      ("language", pa.string()), ("skills", pa.list_(pa.string())),
                      ("source", pa.string()), ("split", pa.string()), ("task", pa.string())])  # fmt: skip
    schema = pa.schema([("pid", pa.string()), ("question", pa.string()), ("image", pa.string()),
                        ("decoded_image", IMAGE_STRUCT), ("choices", pa.list_(pa.string())),
                        ("unit", pa.string()), ("precision", pa.float64()),
                        ("answer", pa.string()), ("question_type", pa.string()),
                        ("answer_type", pa.string()), ("metadata", meta),
                        ("query", pa.string())])  # fmt: skip
    return pa.Table.from_pylist(rows, schema=schema)


def _mv_meta(task: str, category: str) -> dict:
    return {"category": category, "context": "geometry diagram", "grade": "high school",
            "img_height": 56, "img_width": 56, "language": "english",
            "skills": ["arithmetic reasoning"], "source": "Geometry3K", "split": "testmini",
            "task": task}  # fmt: skip


def scienceqa_table(text_only: bool = True) -> pa.Table:
    """Two questions with images over two subjects and, when ``text_only``, one without an
    image (ScienceQA's text-only questions)."""
    png = image_bytes()
    rows = [
        {"image": {"bytes": png, "path": None}, "question": "Which colour is shown?",
         "choices": ["red", "blue"], "answer": 0, "hint": "The square is warm.",
         "task": "closed choice", "grade": "grade2", "subject": "natural science",
         "topic": "colours", "category": "Colours", "skill": "Identify colours", "lecture": "",
         "solution": ""},
        {"image": {"bytes": png, "path": None}, "question": "Which map is this?",
         "choices": ["a map", "a photo", "a chart"], "answer": 2, "hint": "",
         "task": "closed choice", "grade": "grade4", "subject": "social science",
         "topic": "geography", "category": "Maps", "skill": "Read a map", "lecture": "",
         "solution": ""},
        {"image": None, "question": "Which word rhymes with cat?", "choices": ["hat", "dog"],
         "answer": 0, "hint": "", "task": "closed choice", "grade": "grade1",
         "subject": "language science", "topic": "phonology", "category": "Rhyming",
         "skill": "Rhymes", "lecture": "", "solution": ""},
    ][: 3 if text_only else 2]  # fmt: skip
    schema = pa.schema([("image", IMAGE_STRUCT), ("question", pa.string()),
                        ("choices", pa.list_(pa.string())), ("answer", pa.int8()),
                        *((k, pa.string()) for k in ("hint", "task", "grade", "subject", "topic",
                                                     "category", "skill", "lecture",
                                                     "solution"))])  # fmt: skip
    return pa.Table.from_pylist(rows, schema=schema)


def mmstar_table() -> pa.Table:
    """Two MMStar questions over two categories, one with commas inside its options."""
    png = image_bytes()
    rows = [
        {"index": 0, "question": "Which option describe the object relationship in the image "
         "correctly?\nOptions: A: The square is on the grey., B: The square is beneath the "
         "grey., C: The square is beside it, left or right., D: There is no square.",
         "image": {"bytes": png, "path": None}, "answer": "A",
         "category": "instance reasoning", "l2_category": "cross-instance relation reasoning"},
        {"index": 1, "question": "How many squares are there?\nOptions: A: 1, B: 2, C: 3, D: 4",
         "image": {"bytes": png, "path": None}, "answer": "A",
         "category": "fine-grained perception", "l2_category": "object counting"},
    ]  # fmt: skip
    schema = pa.schema([("index", pa.int64()), ("question", pa.string()), ("image", IMAGE_STRUCT),
                        ("answer", pa.string()), ("category", pa.string()),
                        ("l2_category", pa.string())])  # fmt: skip
    return pa.Table.from_pylist(rows, schema=schema)


def write_parquet(path: Path, table: pa.Table) -> Path:
    pq.write_table(table, path)
    return path
