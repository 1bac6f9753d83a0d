"""Benchmark files in the layouts VLMEvalKit and lmms-eval read, as the loader's records.

``datasets/loader.py`` reads a file through `records` when its layout (``data.format``, or
``auto``: a ``.tsv`` is VLMEvalKit's, a ``.parquet`` whose columns hold a layout's signature
column is that layout's) is one of `LAYOUTS`; each row becomes one record of the sample schema,
which the loader then checks like any other (special tokens, an answer its reward can score,
every image decoded). Images stored inside the file (base64 text, Parquet bytes) are written
as files, unchanged, under the folder the caller names (``media_dir``; a run puts it under its
run directory), named by the row's index.

Where each schema comes from (read from the public code, none copied):

- ``vlmevalkit``: VLMEvalKit's TSV files. ``vlmeval/smp/file.py`` ``load`` reads them with
  ``pandas.read_csv(sep="\\t")`` (here: the standard library's ``csv``, tab-separated, the same
  quoting; an empty cell is a missing value). ``vlmeval/dataset/image_base.py``
  ``ImageBaseDataset``: ``index``; ``image`` is base64 text, a list of them written as a Python
  list (``vlmeval/smp/misc.py`` ``toliststr``; read here with ``ast.literal_eval``), or, when
  64 characters or fewer, the ``index`` of another row whose image it shares; without ``image``,
  ``image_path`` names the files (here relative to the TSV's folder). ``vlmeval/smp/vlm.py``
  ``decode_base64_to_image_file`` decodes them. ``vlmeval/dataset/image_mcq.py``
  ``ImageMCQDataset.build_prompt``: options are the columns ``A``, ``B``, ... that are not
  empty, ``hint`` is optional, and the prompt reads ``Hint: ...``, ``Question: ...``,
  ``Options:``, ``A. ...`` lines; ``answer`` is the letter; ``category``, ``l2-category`` and
  ``split`` group the scores (``vlmeval/dataset/utils/multiple_choice.py`` ``report_acc``).
  Circular copies of a question (``mcq_circular_eval``) have ``g_index``, else an index whose
  value modulo 1,000,000 is the question's. Y/N files (``vlmeval/dataset/image_yorn.py``, MME,
  POPE, HallusionBench) have no options and a ``Yes``/``No`` answer; ``utils/yorn.py``'s
  ``MME_rating`` scores a category's questions on one ``image_path`` together (accuracy+).
- ``mathvista``: Hugging Face ``AI4Math/MathVista`` (lmms-eval
  ``lmms_eval/tasks/mathvista/utils.py`` and ``mathvista_evals.py``: ``pid``, ``question``,
  ``decoded_image`` (an image struct ``{bytes, path}``; ``image`` is the file's name),
  ``choices``, ``unit``, ``precision``, ``answer`` (a choice's text for ``multi_choice``),
  ``question_type`` (``multi_choice`` | ``free_form``), ``answer_type`` (``text`` | ``integer``
  | ``float`` | ``list``), ``metadata`` (``task``, ``category``, ``skills``, ``source`` ...)).
  Free-form questions get the hint lines of its ``format-prompt`` queries.
- ``scienceqa``: Hugging Face ScienceQA (``derek-thomas/ScienceQA``, lmms-eval
  ``lmms_eval/tasks/scienceqa/utils.py``): ``image`` (struct, null for a text-only question),
  ``question``, ``choices``, ``answer`` (the choice's index), ``hint`` (its context),
  ``subject``, ``topic``, ``category``, ``grade``.
- ``mmstar``: Hugging Face ``Lin-Chen/MMStar`` (lmms-eval ``lmms_eval/tasks/mmstar/utils.py``):
  ``index``, ``question`` with its options inside (``Options: A: ..., B: ...``), ``image``
  (struct), ``answer`` (the letter), ``category``, ``l2_category``.

Every multiple-choice question is rendered one way, VLMEvalKit's (`mcq_prompt`), ending with
lmms-eval's letter instruction (`LETTER_INSTRUCTION`), and scored by the ``mcq`` reward with
the options in ``meta["options"]``; MathVista's numbers by ``numeric`` (a float within half a
unit of its ``precision``-th decimal, as MathVista rounds), its lists by ``math``. A sample's
family (the rows of ``perceptrl eval``'s table) is ``category`` (VLMEvalKit, MMStar), MathVista's
``metadata.task`` or ScienceQA's ``subject``; the other groupings stay in ``meta``. A VLMEvalKit
row's ``meta["group"]`` names the rows scored together (`_vlmevalkit_group`: a question and its
circular copies, or an MME image's questions); `vlm.source.evaluate_accuracy` reports the share
of groups wholly right. Yes/No answers get the ``yesno`` reward (``datasets/loader.py``).

A row that cannot become a sample yields a `RowError` (its ``reason`` names the count it is
skipped under with ``data.strict=false``: ``malformed``, ``images`` for an image that does not
decode, ``no_image`` for a row without one); a file without a layout's columns is a
``DataError`` naming the file, the missing columns and the layouts.
"""

from __future__ import annotations

import ast
import base64
import binascii
import csv
import io
import json
import math
import os
import re
import string
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from PIL import Image

from ..errors import DataError

LETTER_INSTRUCTION = "Answer with the option's letter from the given choices directly."
"""The last line of a multiple-choice prompt (lmms-eval's and LLaVA's post-prompt)."""


class RowError(ValueError):
    """A row that cannot become a sample; ``reason``: the count it is skipped under."""

    reason = "malformed"


class ImageRowError(RowError):
    """The row's image does not decode (bad base64, bytes that are no image)."""

    reason = "images"


class NoImageError(RowError):
    """The row holds no image (a text-only question)."""

    reason = "no_image"


def mcq_prompt(question: str, options: dict[str, str], hint: str = "") -> str:
    """A multiple-choice question as VLMEvalKit's ``ImageMCQDataset.build_prompt`` lays it out
    (``Hint:``, ``Question:``, ``Options:`` and one ``A. text`` line per option), ending with
    `LETTER_INSTRUCTION`. ``options``: letter -> text, in order."""
    lines = [f"Hint: {hint}"] if hint else []
    lines += [f"Question: {question}", "Options:"]
    lines += [f"{letter}. {text}" for letter, text in options.items()]
    return "\n".join([*lines, LETTER_INSTRUCTION])


def _mcq(question: str, options: dict[str, str], hint: str = "") -> dict:
    """The record fields of a multiple-choice question: its prompt, the ``mcq`` reward and,
    when the letters run A, B, C ... (what ``mcq`` maps option texts by), ``meta["options"]``."""
    meta = {}
    if list(options) == list(string.ascii_uppercase[: len(options)]):
        meta["options"] = list(options.values())
    return {"question": mcq_prompt(question, options, hint), "reward": "mcq", "meta": meta}


def _text(value: Any) -> str:
    """A cell as stripped text; a missing value (None, NaN, empty) is ""."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    return str(value).strip()


class ImageFiles:
    """Writes the images a file holds as files under ``folder`` (their bytes unchanged, the
    extension of their format), and resolves the paths it names against ``base``."""

    def __init__(self, folder: Path, base: Path):
        self.folder, self.base = folder, base

    def from_bytes(self, data: bytes, name: str, what: str = "image") -> str:
        """The path of ``data`` written as ``<name>.<format>``; ImageRowError when it is no
        image Pillow can open."""
        try:
            with Image.open(io.BytesIO(data)) as im:
                fmt = im.format or "img"
        except (OSError, ValueError):  # Pillow's UnidentifiedImageError is an OSError
            raise ImageRowError(
                f"its {what} is no image Pillow can open ({len(data)} bytes, beginning "
                f"{data[:8]!r})"
            ) from None
        except Image.DecompressionBombError as e:
            raise ImageRowError(f"its {what} is too large to open ({e})") from None
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / f"{re.sub(r'[^A-Za-z0-9_.-]', '_', name)}.{_EXT.get(fmt, fmt.lower())}"
        path.write_bytes(data)
        return str(path)

    def from_base64(self, text: str, name: str) -> str:
        """The path of base64 ``text``'s image (see `from_bytes`)."""
        try:
            data = base64.b64decode(text)
        except (binascii.Error, ValueError) as e:
            raise ImageRowError(f"its image is no valid base64 ({e})") from e
        return self.from_bytes(data, name, "base64 image")

    def cell(self, value: Any, name: str) -> list[str]:
        """Paths of a Parquet image cell: an image struct ``{bytes, path}`` (Hugging Face's),
        bytes, a path (relative to ``base``), base64 text, or a list of these."""
        if isinstance(value, (list, tuple)):
            paths = [p for k, v in enumerate(value) for p in self.cell(v, f"{name}_{k}")]
            if paths:
                return paths
            value = None
        if isinstance(value, dict):
            value = value.get("bytes") or value.get("path")
        if value is None or value == "":
            raise NoImageError("it has no image (a text-only question)")
        if isinstance(value, (bytes, bytearray)):
            return [self.from_bytes(bytes(value), name)]
        if not isinstance(value, str):
            raise ImageRowError(f"its image cell holds a {type(value).__name__}")
        named = Path(value).suffix.lower() in Image.registered_extensions()  # not base64
        if named or os.path.isfile(self.base / value):
            return [str(self.base / value)]  # a file the loader reads (and names if missing)
        return [self.from_base64(value, name)]


_EXT = {"JPEG": "jpg", "MPO": "jpg", "TIFF": "tif"}
"""file extension of a Pillow format, where it is not the format's name in lower case"""


# ---------------------------------------------------------------------------------------------
# one row -> one record, per layout
# ---------------------------------------------------------------------------------------------


def _vlmevalkit(row: dict, images: list[str]) -> dict:
    """A VLMEvalKit row (cells as text) and its image paths -> a record."""
    options = {c: _text(row.get(c)) for c in string.ascii_uppercase if _text(row.get(c))}
    question, hint = _text(row.get("question")), _text(row.get("hint"))
    meta = {k: row[k] for k in ("category", "l2-category", "split") if _text(row.get(k))}
    rec = {"id": row["index"], "images": images, "answer": _text(row.get("answer"))}
    if options:
        rec |= _mcq(question, options, hint)
    else:  # a VLMEvalKit file of open questions: the loader infers the reward from the answer
        rec |= {"question": f"Hint: {hint}\n{question}" if hint else question, "meta": {}}
    rec["meta"] |= {"benchmark": "vlmevalkit", **meta}
    group = _vlmevalkit_group(row, images, bool(options))
    if group is not None:
        rec["meta"]["group"] = group
    rec["family"] = _text(row.get("category")) or "default"
    return rec


CIRCULAR_OFFSET = 1_000_000
"""VLMEvalKit's circular copies of a multiple-choice question (its options rotated) have the
index of the question plus a multiple of this (``g_index = index % 1e6``)"""


def _vlmevalkit_group(row: dict, images: list[str], choice: bool) -> str | None:
    """The question group a VLMEvalKit row scores in (`vlm.source` counts a group correct only
    when all its rows are): a multiple-choice row's ``g_index`` (else its index modulo
    `CIRCULAR_OFFSET`: MMBench's circular evaluation), a Yes/No row's image within its category
    (``image_path``, else its image files: MME's accuracy+, both questions on an image right)."""
    if choice:
        g = _text(row.get("g_index")) or _text(row.get("index"))
        return str(int(g) % CIRCULAR_OFFSET) if g.lstrip("-").isdigit() else None
    if _text(row.get("answer")).lower() not in ("yes", "no"):
        return None
    image = _text(row.get("image_path")) or "|".join(images)
    return f"{_text(row.get('category'))}/{image}"


_FLOAT_PLACES = {1: "one decimal place", 2: "two decimal places"}


def _mathvista(row: dict, files: ImageFiles, key: str) -> dict:
    """A MathVista row -> a record: a multiple-choice question (its answer a choice's text) or
    a free-form one with the answer type's hint."""
    image = row.get("decoded_image")
    images = files.cell(image if image is not None else row.get("image"), key)
    info = row.get("metadata") or {}
    info = json.loads(info) if isinstance(info, str) else info
    question, unit, answer = _text(row["question"]), _text(row.get("unit")), _text(row["answer"])
    if unit:
        question += f" (Unit: {unit})"
    meta = {"benchmark": "mathvista", "question_type": row["question_type"],
            "answer_type": row["answer_type"]}  # fmt: skip
    meta |= {k: info[k] for k in ("task", "category", "skills", "source", "grade") if k in info}
    rec = {"id": key, "images": images, "family": str(info.get("task") or "default")}
    if row["question_type"] == "multi_choice":
        choices = [_text(c) for c in row.get("choices") or []]
        if answer not in choices:
            raise RowError(f"its answer {answer!r} is none of its choices {choices}")
        letters = string.ascii_uppercase[: len(choices)]
        rec |= _mcq(question, dict(zip(letters, choices)))
        rec["answer"] = letters[choices.index(answer)]
    else:
        rec |= _free_form(question, row["answer_type"], row.get("precision"))
        rec["answer"] = answer
    rec["meta"] = {**rec["meta"], **meta}
    return rec


def _free_form(question: str, answer_type: str, precision: Any) -> dict:
    """A MathVista free-form question's prompt (its ``format-prompt`` hint), reward and
    tolerance."""
    places = int(float(precision)) if _text(precision) else 0
    if answer_type == "integer":
        hint, reward, meta = "a single integer number", "numeric", {}
    elif answer_type == "float":
        what = _FLOAT_PLACES.get(places, f"{places} decimal places")
        hint, reward = f"a single floating-point number with {what}", "numeric"
        meta = {"abs_tol": 0.5 * 10.0**-places} if places else {}
    elif answer_type == "list":
        hint, reward, meta = "a Python list", "math", {}
    else:
        raise RowError(f"its free-form answer_type {answer_type!r} is none of integer, float, list")
    return {"question": f"{question}\nAnswer the question using {hint}.", "reward": reward,
            "meta": meta}  # fmt: skip


def _scienceqa(row: dict, files: ImageFiles, key: str) -> dict:
    """A ScienceQA row -> a multiple-choice record (its answer the choice's index)."""
    images = files.cell(row.get("image"), key)
    choices = [_text(c) for c in row.get("choices") or []]
    answer = row["answer"]
    if isinstance(answer, bool) or not isinstance(answer, int) or not 0 <= answer < len(choices):
        raise RowError(f"its answer {answer!r} is no index of its {len(choices)} choices")
    letters = string.ascii_uppercase[: len(choices)]
    family = _text(row.get("subject")) or "default"
    rec = {"images": images, "answer": letters[answer], "family": family}
    rec |= _mcq(_text(row["question"]), dict(zip(letters, choices)), _text(row.get("hint")))
    fields = ("subject", "topic", "category", "grade", "skill")
    rec["meta"] |= {"benchmark": "scienceqa", **{k: row[k] for k in fields if _text(row.get(k))}}
    return rec


def inline_options(question: str) -> tuple[str, dict[str, str]] | None:
    """(the question before ``Options:``, letter -> text) of a question that lists its options
    inside as MMStar's do (``...?\\nOptions: A: red, B: blue``); None when it does not (the
    letters must run A, B, ...)."""
    head, sep, tail = question.rpartition("Options:")
    if not sep:
        return None
    parts = re.split(r"(?:^|,)\s*([A-Z]):\s*", tail.strip())
    letters, texts = parts[1::2], [t.strip().rstrip(",").strip() for t in parts[2::2]]
    if (
        parts[0].strip()
        or len(letters) < 2
        or letters != list(string.ascii_uppercase[: len(letters)])
    ):
        return None
    return head.strip(), dict(zip(letters, texts))


def _mmstar(row: dict, files: ImageFiles, key: str) -> dict:
    """An MMStar row -> a multiple-choice record (options parsed out of the question; when
    they cannot be, the question is kept whole with the letter instruction)."""
    images = files.cell(row.get("image"), key)
    question = _text(row["question"])
    found = inline_options(question)
    rec = {"id": key, "images": images, "answer": _text(row["answer"])}
    if found:
        rec |= _mcq(*found)
    else:
        rec |= {"question": f"{question}\n{LETTER_INSTRUCTION}", "reward": "mcq", "meta": {}}
    rec["meta"] |= {"benchmark": "mmstar", "l2_category": _text(row.get("l2_category"))}
    rec["family"] = _text(row.get("category")) or "default"
    return rec


# ---------------------------------------------------------------------------------------------
# files -> rows
# ---------------------------------------------------------------------------------------------


def _tsv_header(path: Path) -> list[str]:
    """The column names of a tab-separated file (its first row)."""
    with open(path, newline="", encoding="utf-8-sig") as f:
        return next(csv.reader(f, delimiter="\t"), [])


def _tsv_rows(path: Path) -> Iterator[dict]:
    """The rows of a tab-separated file with pandas' quoting, as {column: text}."""
    csv.field_size_limit(min(sys.maxsize, 2**31 - 1))  # one cell holds a whole base64 image
    with open(path, newline="", encoding="utf-8-sig") as f:
        reader = csv.reader(f, delimiter="\t")
        header = next(reader, [])
        for cells in reader:
            yield dict(zip(header, cells))


def _list_cell(text: str) -> list[str]:
    """VLMEvalKit's ``toliststr``: ``"[...]"`` is a list of strings, anything else one string."""
    if len(text) > 1 and text[0] == "[" and text[-1] == "]":
        try:
            return [str(x) for x in ast.literal_eval(text)]
        except (ValueError, SyntaxError) as e:
            raise ImageRowError(f"its image list does not parse ({e})") from e
    return [text]


def _read_vlmevalkit(path: Path, files: ImageFiles) -> Iterator[tuple[str, dict | Exception]]:
    """(where, record or RowError) per row of a VLMEvalKit TSV; a row whose ``image`` is
    another row's index shares that row's files (decoded once)."""
    rows = list(_tsv_rows(path))
    cells = {r.get("index", ""): r.get("image", "") for r in rows}
    done: dict[str, list[str] | RowError] = {}
    for i, row in enumerate(rows):
        where = f"row {i}, index {row.get('index', '')}"
        try:
            yield where, _vlmevalkit(row, _vlmevalkit_images(row, cells, done, files))
        except RowError as e:
            yield where, e


def _vlmevalkit_images(row: dict, cells: dict, done: dict, files: ImageFiles) -> list[str]:
    """The image paths of a VLMEvalKit row, decoding its (or the referenced row's) base64
    images once per index; ``image_path`` names them when the row has no ``image``."""
    key, cell = row.get("index", ""), row.get("image", "")
    if not cell:
        named = _list_cell(row.get("image_path", ""))
        if not any(named):
            raise NoImageError("it has neither an image nor an image_path")
        return [str(files.base / p) for p in named]
    if len(cell) <= 64:  # VLMEvalKit stores a repeated image once: the cell is an index
        if len(cells.get(cell, "")) <= 64:
            raise ImageRowError(f"its image refers to index {cell!r}, and no row of that index "
                                "holds an image")  # fmt: skip
        key, cell = cell, cells[cell]
    if key not in done:
        try:
            many = _list_cell(cell)
            names = [key] if len(many) == 1 else [f"{key}_{k}" for k in range(len(many))]
            done[key] = [files.from_base64(b, n) for b, n in zip(many, names)]
        except RowError as e:
            done[key] = e
    if isinstance(done[key], RowError):
        ref = "" if key == row.get("index") else f" (that of index {key}, which it refers to)"
        raise type(done[key])(f"{done[key]}{ref}")
    return done[key]


def _read_parquet(
    path: Path, files: ImageFiles, *, convert: Callable, key: str | None
) -> Iterator[tuple[str, dict | Exception]]:
    """(where, record or RowError) per row of a Parquet file, read in batches; ``key``: the
    column that names a row (its id and image files), else the row number."""
    import pyarrow.parquet as pq

    i = 0
    for batch in pq.ParquetFile(path).iter_batches(batch_size=64):
        for row in batch.to_pylist():
            name = _text(row.get(key)) if key else ""
            where = f"row {i}, {key} {name}" if key else f"row {i}"
            try:
                yield where, convert(row, files, name or str(i))
            except RowError as e:
                yield where, e
            except (KeyError, TypeError, ValueError) as e:  # a cell of an unexpected type
                yield where, RowError(f"{type(e).__name__}: {e}")
            i += 1


# ---------------------------------------------------------------------------------------------
# layouts
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Layout:
    """A benchmark file layout: how it is told apart, what it needs, how it is read."""

    name: str
    suffix: str
    """the file's extension (``.tsv`` or ``.parquet``)"""
    signature: str
    """the column that tells a Parquet file of this layout apart (``auto``)"""
    required: tuple[str, ...]
    """the columns a row needs; ``a|b``: either"""
    read: Callable[[Path, ImageFiles], Iterator[tuple[str, dict | Exception]]]

    def missing(self, columns: list[str]) -> list[str]:
        """The required columns (or alternatives ``a|b``) that ``columns`` lacks."""
        return [r for r in self.required if not set(r.split("|")) & set(columns)]

    def describe(self) -> str:
        return f"{self.name} ({self.suffix}: {', '.join(self.required)})"


def _parquet_layout(name: str, signature: str, required: tuple, convert, key=None) -> Layout:
    def read(path: Path, files: ImageFiles):
        return _read_parquet(path, files, convert=convert, key=key)

    return Layout(name, ".parquet", signature, required, read)


LAYOUTS: dict[str, Layout] = {
    "vlmevalkit": Layout("vlmevalkit", ".tsv", "index",
                         ("index", "question", "answer", "image|image_path"), _read_vlmevalkit),
    "mathvista": _parquet_layout(
        "mathvista", "pid",
        ("pid", "question", "decoded_image|image", "question_type", "answer_type", "answer"),
        _mathvista, key="pid",
    ),
    "scienceqa": _parquet_layout(
        "scienceqa", "choices", ("image", "question", "choices", "answer"), _scienceqa
    ),
    "mmstar": _parquet_layout(
        "mmstar", "l2_category",
        ("index", "question", "image", "answer", "category", "l2_category"), _mmstar,
        key="index",
    ),
}  # fmt: skip
"""The benchmark layouts by ``data.format`` name; ``auto`` tries the Parquet ones in this order
(MathVista's files also hold ``choices``)."""

FORMATS: tuple[str, ...] = ("auto", "perceptrl", *LAYOUTS)
"""``data.format``'s values: ``perceptrl`` is this project's own JSONL/JSON/Parquet schema."""

OWN = "perceptrl (.jsonl/.json/.parquet: images, question, answer; datasets/loader.py)"


def columns(path: Path) -> list[str]:
    """The column names of a ``.tsv`` (its header) or ``.parquet`` file (its schema)."""
    try:
        if path.suffix.lower() == ".tsv":
            return _tsv_header(path)
        import pyarrow.parquet as pq

        return list(pq.read_schema(path).names)
    except Exception as e:  # pyarrow, csv and decoding errors alike
        raise DataError(f"{path}: cannot read the file ({type(e).__name__}: {e})") from e


def layouts_known() -> str:
    """Every layout with its file type and columns, for messages."""
    return "; ".join([*(lay.describe() for lay in LAYOUTS.values()), OWN])


def detect(path: Path, fmt: str = "auto") -> Layout | None:
    """The benchmark layout of ``path`` (None: this project's own schema).

    ``fmt`` names one (``data.format``) or is ``auto``: a ``.tsv`` file is VLMEvalKit's, a
    ``.parquet`` file the first layout whose signature column it has; other files, and Parquet
    files without one, are the project's own.

    Raises:
        DataError: the layout's file type is not the file's, or the file lacks its columns
            (naming the file, the columns missing and found, and the layouts known).
    """
    suffix = path.suffix.lower()
    if fmt == "perceptrl" or (fmt == "auto" and suffix not in (".tsv", ".parquet")):
        return None
    if fmt != "auto":
        layout = LAYOUTS[fmt]
    elif suffix == ".tsv":
        layout = LAYOUTS["vlmevalkit"]
    else:
        names = columns(path)
        layout = next((lay for lay in LAYOUTS.values()
                       if lay.suffix == suffix and lay.signature in names), None)  # fmt: skip
        if layout is None:
            return None
    if layout.suffix != suffix:
        raise DataError(
            f"{path}: data.format={layout.name} reads {layout.suffix} files, this is a {suffix} "
            f"file; set data.format to its layout (known: {layouts_known()})"
        )
    cols = columns(path)
    missing = layout.missing(cols)
    if missing:
        raise DataError(
            f"{path}: a {layout.name} file needs the columns {missing}, which it lacks (its "
            f"columns: {cols}). Known layouts: {layouts_known()}. Fix the file, or set "
            "data.format to its layout"
        )
    return layout


def records(
    path: Path, fmt: str, media_dir: Path | None
) -> Iterator[tuple[str, dict | Exception]] | None:
    """(where, record or `RowError`) per row of a benchmark file, its images written under
    ``media_dir``; None when the file is in this project's own schema (see `detect`)."""
    layout = detect(path, fmt)
    if layout is None:
        return None
    if media_dir is None:
        raise ValueError(
            f"{path} is a {layout.name} file whose images are decoded into files: pass "
            "media_dir, the folder to write them to"
        )
    return layout.read(path, ImageFiles(Path(media_dir), path.parent.resolve()))
