"""Load user datasets (JSONL, JSON or Parquet with image paths) into the sample schema.

Schema of one sample (what every generator writes and every consumer reads)::

    {"id": str, "images": [absolute paths], "question": str, "answer": str,
     "videos": [absolute paths],                 # only for video questions
     "reward": "numeric" | "mcq" | "iou" | ...,   # accuracy reward for this sample
     "family": str,                              # question family, for per-family metrics
     "tools": [names],                           # optional: the tools an episode may call
     "meta": dict}                               # e.g. "options", "image_size" for boxes

Input files:

- ``.jsonl``: one JSON object per line (blank lines are skipped); ``.json``: a list of objects;
  ``.parquet``: one row per sample (``meta`` may be a struct or a JSON string).
- Benchmark files (``datasets/benchmarks.py``): a VLMEvalKit ``.tsv``, or a ``.parquet`` export
  of MathVista, ScienceQA or MMStar, told apart by extension and columns (``layout="auto"``) or
  named (``data.format``); their rows become records of this schema, their embedded images
  files under ``media_dir``.
- Image and video paths are absolute or relative to the file's directory; a record needs images,
  videos or both (``video``/``video_path`` name one video).
- Accepted alternative keys, normalised to the schema:
  ``image``/``image_path`` (one path) for ``images``; ``problem``/``prompt``/``query`` for
  ``question``; ``solution`` for ``answer``, where an ``<answer>…</answer>`` inside is extracted
  (the R1-V format); ``task``/``type`` for ``family`` (default ``"default"``). Other keys are kept
  in ``meta``.
- Without ``reward`` it is inferred from the answer: a box ``[x1, y1, x2, y2]`` -> ``iou``, an
  option letter -> ``mcq``, a number -> ``numeric`` and, for a video question, a span
  ``[start, end]`` in seconds -> ``tiou``; anything else needs an explicit ``reward``.
- ``id`` defaults to ``<file stem>-<row>``. For ``iou`` samples, ``meta["image_size"]`` [w, h] is
  filled from the first image when absent (needed to map boxes from a resized model input).

Errors (:class:`DataError`, one paragraph each): with ``strict=True`` (the default) a malformed
line names the file, line and problem (an invalid JSON line the column), a missing or undecodable
image or video, or one of an aspect ratio no vision processor takes, names the file, sample index
and path; a question or answer holding a model's special token (``<|image_pad|>``) names the
token; each names the recipe key that skips such samples (``data.strict=false``). With
``strict=False`` they are skipped and counted in ``stats`` by reason. A file without any usable
sample is an error in both modes. Images are read as ``datasets/images.py`` reads them (upright,
so sizes are the upright ones).
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from PIL import Image

from ..errors import DataError  # ``vlm/`` errors about samples subclass it
from ..registry import REWARDS
from .benchmarks import columns, layouts_known, records
from .images import shape_problem, upright_size

log = logging.getLogger(__name__)

REQUIRED = ("images", "question", "answer")
_ALIASES = {
    "images": ("images", "image", "image_path", "image_paths"),
    "videos": ("videos", "video", "video_path", "video_paths"),
    "question": ("question", "problem", "prompt", "query"),
    "answer": ("answer", "solution", "ground_truth"),
    "family": ("family", "task", "type"),
}
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
_BOX = re.compile(r"^\[\s*-?[\d.]+\s*,\s*-?[\d.]+\s*,\s*-?[\d.]+\s*,\s*-?[\d.]+\s*\]$")
_LETTER = re.compile(r"^\(?[A-Z]\)?\.?$")
_NUMBER = re.compile(r"^[-+]?\d+(?:\.\d+)?$")
_SPAN = re.compile(r"^\[\s*[\d.]+\s*,\s*[\d.]+\s*\]$")

SPECIAL_TOKEN = re.compile(r"<\|[A-Za-z0-9_]{1,40}\|>")
"""a model's special token as the Qwen / ChatML / Llama families write them (``<|image_pad|>``)"""
IMAGE_MARK = "<image>"
"""where a question writes it, the next image goes (``vlm/prompts.py``)"""

LENIENT = "set data.strict=false to skip and count such samples"
"""The fix every strict data error names: the recipe key (``strict=False`` in Python)."""


def infer_reward(answer: str, video: bool = False) -> str | None:
    """Accuracy reward name for an answer string, or None when it cannot be told; ``video``: the
    question is about a video, where a span ``[start, end]`` is a time span (``tiou``)."""
    a = answer.strip()
    if _BOX.match(a):
        return "iou"
    if _LETTER.match(a):
        return "mcq"
    if a.lower() in ("yes", "no"):
        return "yesno"
    if _NUMBER.match(a.replace(",", "")):
        return "numeric"
    if video and _SPAN.match(a):
        return "tiou"
    return None


def _pick(rec: dict, field: str) -> tuple[str | None, Any]:
    for key in _ALIASES[field]:
        if key in rec and rec[key] is not None:
            return key, rec[key]
    return None, None


def _as_paths(value: Any, what: str = "images") -> list[str]:
    items = value if isinstance(value, (list, tuple)) else [value]
    out = []
    for it in items:
        if isinstance(it, dict) and isinstance(it.get("path"), str):  # HF datasets Image struct
            it = it["path"]
        if not isinstance(it, str) or not it:
            raise ValueError(f"{what} entries must be path strings, got {type(it).__name__}")
        out.append(it)
    if not out:
        raise ValueError(f"'{what}' is empty")
    return out


def _require_keys(rec: dict, has_video: bool) -> None:
    """Raise ValueError naming the accepted keys of every required field the record lacks (a
    record with a video needs no images) and the keys it has."""
    missing = [
        f for f in REQUIRED if _pick(rec, f)[0] is None and not (f == "images" and has_video)
    ]
    if missing:
        alts = "; ".join(f"{f}: one of {list(_ALIASES[f])}" for f in missing)
        raise ValueError(f"missing required keys ({alts}); present keys: {sorted(rec)}")


def _answer_text(answer: Any) -> str:
    """The reference answer as a string: a number as its text, a list of 2 or 4 values (a span
    or a box) as ``[a, b, ...]``, and of a solution only its last ``<answer>…</answer>``;
    ValueError for anything else."""
    if isinstance(answer, (int, float)) and not isinstance(answer, bool):
        answer = str(answer)
    if isinstance(answer, list) and len(answer) in (2, 4):  # a span (video) or a box
        answer = "[" + ", ".join(str(v) for v in answer) + "]"
    if not isinstance(answer, str):
        raise ValueError(f"'answer' must be a string, got {type(answer).__name__}")
    tags = _ANSWER_TAG.findall(answer)
    return (tags[-1] if tags else answer).strip()


def _meta(rec: dict) -> dict:
    """The record's ``meta`` as a dict ({} when absent; a JSON string is parsed); ValueError
    when it is not an object."""
    meta = rec.get("meta") or {}
    if isinstance(meta, str):
        meta = json.loads(meta)
    if not isinstance(meta, dict):
        raise ValueError(f"'meta' must be an object, got {type(meta).__name__}")
    return meta


def _resolve(paths: list[str], base_dir: Path) -> list[str]:
    """Absolute paths kept, relative ones joined to ``base_dir`` and normalised."""
    return [p if Path(p).is_absolute() else os.path.normpath(base_dir / p) for p in paths]


def normalise(rec: Any, base_dir: Path, default_id: str) -> dict:
    """One raw record -> a schema sample (image paths resolved). Raises ValueError on problems."""
    if not isinstance(rec, dict):
        raise ValueError(f"expected a JSON object, got {type(rec).__name__}")
    has_video = _pick(rec, "videos")[0] is not None
    _require_keys(rec, has_video)
    used = set()
    vals = {}
    for f in ("images", "videos", "question", "answer", "family"):
        key, vals[f] = _pick(rec, f)
        used.add(key)
    answer = _answer_text(vals["answer"])
    if not isinstance(vals["question"], str):
        raise ValueError(f"'question' must be a string, got {type(vals['question']).__name__}")
    reward = rec.get("reward") or infer_reward(answer, video=has_video)
    if not isinstance(reward, str):
        raise ValueError(
            f'no usable reward for answer {answer!r}: add a "reward" key naming '
            "the accuracy reward (e.g. numeric, mcq, iou, tiou)"
        )
    meta = _meta(rec)
    extra = {
        k: v
        for k, v in rec.items()
        if v is not None
        and k not in used
        and k not in ("id", "reward", "meta", "tools")
        and k not in meta
    }
    images = _resolve(
        [] if has_video and not vals["images"] else _as_paths(vals["images"]), base_dir
    )
    videos = {}
    if vals["videos"] is not None:
        videos["videos"] = _resolve(_as_paths(vals["videos"], "videos"), base_dir)
    return {
        "id": str(rec.get("id") or default_id),
        "images": images,
        "question": vals["question"],
        "answer": answer,
        "reward": reward,
        "family": str(vals["family"] or "default"),
        "meta": {**meta, **extra},
        **videos,
        **_tools(rec),
    }


def _tools(rec: dict) -> dict:
    """``{"tools": [names]}`` when the record lists the tools its episodes may call, else {}."""
    tools = rec.get("tools")
    if tools is None:
        return {}
    if not isinstance(tools, list) or not all(isinstance(t, str) and t for t in tools):
        raise ValueError(f"'tools' must be a list of tool names, got {tools!r}")
    return {"tools": list(tools)}


def _read_table(path: Path) -> list:
    """Rows of a .parquet file or items of a .json list; DataError when unreadable."""
    try:
        if path.suffix.lower() == ".parquet":
            import pyarrow.parquet as pq

            return pq.read_table(path).to_pylist()
        data = json.loads(path.read_text(encoding="utf-8"))
    except Exception as e:  # pyarrow, json and decoding errors alike
        raise DataError(f"{path}: cannot read the file ({type(e).__name__}: {e})") from e
    if not isinstance(data, list):
        raise DataError(
            f"{path}: a .json dataset must be a list of objects; use .jsonl for one object per line"
        )
    return data


def _records(path: Path) -> Iterator[tuple[str, Any]]:
    """(where, record or Exception) per record: where is "line N" (1-based) or "row N"."""
    if path.suffix.lower() in (".parquet", ".json"):
        for i, rec in enumerate(_read_table(path)):
            yield f"row {i}", rec
        return
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield f"line {n}", ValueError(f"not UTF-8 text ({e.reason} at byte {e.start})")
                continue
            line = line.rstrip("\r\n")  # else a line cut short is an error at "column 1" of
            if not line.strip():  # the line after it
                continue
            try:
                yield f"line {n}", json.loads(line)
            except json.JSONDecodeError as e:
                yield f"line {n}", ValueError(f"invalid JSON: {e.msg} at column {e.pos + 1}")


def check_image(path: str) -> tuple[int, int]:
    """(width, height) of a decodable image, upright (its EXIF orientation applied); raises
    OSError/ValueError otherwise."""
    with Image.open(path) as im:
        im.verify()
    with Image.open(path) as im:  # verify() leaves the file unusable; decode to catch truncation
        im.load()
        return upright_size(im)


def load_samples(
    path: str | Path,
    *,
    strict: bool = True,
    check_images: bool = True,
    media: dict[str, tuple] | None = None,
    layout: str = "auto",
    media_dir: str | Path | None = None,
) -> tuple[list[dict], dict[str, int]]:
    """Read a dataset file into schema samples.

    Args:
        path: ``.jsonl``, ``.json`` or ``.parquet`` file, or a benchmark file
            (``datasets/benchmarks.py``: a VLMEvalKit ``.tsv``, MathVista, ScienceQA, MMStar).
        strict: raise :class:`DataError` on the first bad line, image or video (default); else
            skip and count it.
        check_images: open and fully decode every image, open every video and decode its first
            and last frames (once per distinct path).
        media: filled with what the checks found, per path: ``(width, height)`` of an image,
            ``(width, height, frames, fps)`` of a video (prompt lengths need no second look).
        layout: ``auto`` (by extension and columns), ``perceptrl`` (this schema) or a
            benchmark layout (``benchmarks.LAYOUTS``).
        media_dir: where a benchmark file's embedded images are written (needed for those).
    Returns:
        (samples, stats) with stats ``{"loaded", "skipped_malformed", "skipped_images"}`` and,
        once a sample was skipped for them, ``"skipped_videos"``, ``"skipped_aspect_ratio"``
        (an image or video frame beyond ``images.MAX_ASPECT_RATIO``),
        ``"skipped_special_tokens"`` (a model's special token in the question or answer) and
        ``"skipped_no_image"`` (a benchmark row without an image).
    Raises:
        DataError: strict and a bad record or file, the file holds no usable sample, or a
            benchmark file lacks its layout's columns.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"dataset file {path} does not exist")
    base = path.parent.resolve()
    stats = {"loaded": 0, "skipped_malformed": 0, "skipped_images": 0}
    samples: list[dict] = []
    sizes: dict[str, tuple | Exception] = {}
    count = 0
    for idx, (where, rec) in enumerate(_source(path, layout, media_dir)):
        count += 1
        sample = _normalised(rec, path, where, base, strict, stats)
        if sample is None:
            continue
        bad = _special_tokens(sample) or _unscoreable(sample)
        bad = bad or (_check_media(sample, sizes) if check_images else None)
        if bad is not None:
            _refuse(bad, sample, f"{path}, sample {idx} ({where}, id {sample['id']!r})", strict)
            stats[f"skipped_{bad[0]}"] = stats.get(f"skipped_{bad[0]}", 0) + 1
            continue
        samples.append(sample)
    stats["loaded"] = len(samples)
    if not samples:
        raise _no_samples_error(path, count, stats)
    if media is not None:
        media.update({p: v for p, v in sizes.items() if not isinstance(v, Exception)})
    return samples, stats


def _normalised(
    rec: Any, path: Path, where: str, base: Path, strict: bool, stats: dict
) -> dict | None:
    """The record of ``path`` at ``where`` as a sample; a malformed one (or the Exception
    ``_records`` yielded for it) raises DataError naming the place when ``strict``, else it is
    logged, counted in ``stats["skipped_malformed"]`` and gives None."""
    try:
        if isinstance(rec, Exception):
            raise rec
        return normalise(rec, base, f"{path.stem}-{where.split()[-1]}")
    except (ValueError, TypeError) as e:
        if strict:
            raise DataError(
                f"{path}, {where}: {e}. Fix the record, or {LENIENT} "
                "(strict=False when calling load_samples)."
            ) from e
        log.warning("skipping %s, %s: %s", path, where, e)
        reason = f"skipped_{getattr(e, 'reason', 'malformed')}"  # a benchmark row's RowError
        stats[reason] = stats.get(reason, 0) + 1
        return None


def _source(path: Path, layout: str, media_dir: str | Path | None) -> Iterator[tuple[str, Any]]:
    """(where, record or Exception) per record of ``path``: a benchmark file's rows
    (``benchmarks.records``) or, in this schema, `_records`."""
    rows = records(path, layout, Path(media_dir) if media_dir else None)
    if rows is not None:
        return rows
    if path.suffix.lower() == ".parquet":
        _check_own_columns(path)
    return _records(path)


def _check_own_columns(path: Path) -> None:
    """A DataError naming the columns found and the layouts known when a Parquet file is
    neither a benchmark layout nor this schema (no question, answer, or images and videos)."""
    cols = {c: "" for c in columns(path)}
    lacks = [f for f in REQUIRED if _pick(cols, f)[0] is None]
    if lacks and not (lacks == ["images"] and _pick(cols, "videos")[0] is not None):
        raise DataError(
            f"{path}: its columns {list(cols)} match no known layout (this schema lacks "
            f"{lacks}). Known layouts: {layouts_known()}. Set data.format to the file's layout, "
            "or rename its columns"
        )


def _refuse(bad: tuple[str, str], sample: dict, where: str, strict: bool) -> None:
    """A sample refused for reason ``bad`` = (reason, what is wrong and the fix): a DataError
    naming ``where`` (file, sample index, line, id) when ``strict``, else a warning (the caller
    counts it as ``skipped_<reason>``)."""
    msg = f"{where}: {bad[1]}, or {LENIENT}."
    if strict:
        raise DataError(msg)
    log.warning("skipping: %s", msg)


def _no_samples_error(path: Path, records: int, stats: dict) -> DataError:
    """The error for a file without a usable sample: it is empty, or all ``records`` were
    skipped (the counts per reason from ``stats``)."""
    why = ", ".join(f"{k[8:]} {v}" for k, v in stats.items() if k.startswith("skip") and v)
    return DataError(
        f"{path}: no samples: the file is empty"
        if not records
        else f"{path}: all {records} records were skipped ({why}); the warnings name each "
        "one, or set data.strict=true to stop at the first with its reason"
    )


def _special_tokens(sample: dict) -> tuple[str, str] | None:
    """("special_tokens", problem) when the question or answer holds a model's special token
    (``<|image_pad|>``, ``<|im_start|>`` ...): the processor would count it as a vision
    placeholder or a turn marker, and the first prompt with it breaks the model."""
    for field_ in ("question", "answer"):
        found = SPECIAL_TOKEN.search(str(sample.get(field_, "")))
        if found:
            return "special_tokens", (
                f"the {field_} holds {found.group()!r}, a model's special token (the chat "
                "template and the processor write those); remove it from the text (write "
                f"{IMAGE_MARK} where an image goes)"
            )
    return None


def _unscoreable(sample: dict) -> tuple[str, str] | None:
    """("unscoreable", problem) when no completion can ever score on the sample: its reward is
    no registered reward, or the reward's declared ``check_answer`` finds the answer one it
    cannot score (an ``mcq`` answer that is not an option, a ``numeric`` answer without a
    number, an inverted box ...). Such a sample would train at 0 forever."""
    name = sample["reward"]
    if ":" in name:  # a module:function the run imports; it declares nothing to check here
        return None
    if name not in REWARDS:
        return "unscoreable", (
            f'its "reward" is {name!r}, which no registered reward is (valid: '
            f"{', '.join(REWARDS.names())}); name one of them"
        )
    check = REWARDS.meta(name).get("check_answer")
    why = check(sample) if check is not None else None
    if why:
        return "unscoreable", (
            f"its answer {sample['answer']!r} can never score under reward {name!r}: {why}; "
            'fix the answer or name another "reward"'
        )
    return None


def _check_media(sample: dict, sizes: dict) -> tuple[str, str] | None:
    """None when the sample's images and videos decode and have a shape the vision processors
    take, else (reason: "images" | "videos" | "aspect_ratio", problem and fix)."""
    for kind, paths in (("image", sample["images"]), ("video", sample.get("videos") or [])):
        for p in paths:
            if p not in sizes:
                sizes[p] = _media_size(kind, p)
            got = sizes[p]
            if isinstance(got, Exception):
                why = f"{type(got).__name__}: {got}" if kind == "image" else str(got)
                return f"{kind}s", f"{kind} {p} cannot be read ({why}). Fix or remove the {kind}"
            problem = shape_problem(got)
            if problem is not None:
                return "aspect_ratio", f"{kind} {p} {problem}"
    if sample["reward"] == "iou" and sample["images"] and "image_size" not in sample["meta"]:
        sample["meta"]["image_size"] = list(sizes[sample["images"][0]])
    return None


def _media_size(kind: str, p: str) -> tuple | Exception:
    """The size `check_image` / `check_video` finds, or the exception that says why not."""
    try:
        if kind == "image":
            return check_image(p)
        from .video import check_video

        return check_video(p)
    except FileNotFoundError:
        return FileNotFoundError("file not found")
    except Exception as e:  # PIL raises many types for bad files (check_video: ValueError)
        return e


def save_samples(samples: list[dict], path: str | Path) -> Path:
    """Write samples as ``.jsonl`` or ``.parquet`` (meta as a JSON string), with image paths
    relative to the file's directory where they lie under it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    base = path.parent.resolve()

    def rel(p: str) -> str:
        try:
            return Path(p).resolve().relative_to(base).as_posix()
        except ValueError:
            return p

    rows = [
        {**s, "images": [rel(p) for p in s["images"]]}
        | ({"videos": [rel(p) for p in s["videos"]]} if "videos" in s else {})
        for s in samples
    ]
    if path.suffix.lower() == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        table = pa.Table.from_pylist([{**r, "meta": json.dumps(r["meta"])} for r in rows])
        pq.write_table(table, path)
    else:
        with open(path, "w", encoding="utf-8") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    return path
