"""Parsing of model completions: answer tags, ``\\boxed{}``, option letters, numbers, boxes.

Every parser returns None on anything it cannot read; none raises on any string input.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
_TAGS = r"<think>|</think>|<answer>|</answer>"
_FORMAT = re.compile(
    rf"<think>(?:(?!{_TAGS}).)*</think>\s*<answer>(?:(?!{_TAGS}).)*</answer>", re.DOTALL
)

_BOXED_FORMAT = re.compile(rf"<think>(?:(?!{_TAGS}).)*</think>((?:(?!{_TAGS}).)*)", re.DOTALL)

_NUMBER_WORDS = {
    w: i
    for i, w in enumerate(
        "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen "
        "fifteen sixteen seventeen eighteen nineteen twenty".split()
    )
}
_NUM = r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|[-+]?\.\d+"
_NUMBER = re.compile(rf"(?<![\w.])(?:{_NUM})|\b(?:{'|'.join(_NUMBER_WORDS)})\b", re.IGNORECASE)
_BOX = re.compile(rf"[\[(]\s*({_NUM})\s*,\s*({_NUM})\s*,\s*({_NUM})\s*,\s*({_NUM})\s*[\])]")
_ANY_NUM = re.compile(_NUM)

# option letter patterns, tried in order on the answer text
_LETTER_ALONE = re.compile(r"^\(?([A-Za-z])\)?[.:)]?$")
_CUE = r"(?i:\b(?:answer|option|choice))\s*(?i:is)?\s*:?\s*"
_LETTER_CUED = re.compile(_CUE + r"\(?([A-Z])\)?(?![A-Za-z])")
_LETTER_CUED_LOWER = re.compile(_CUE + r"\(?([a-z])\)?[\s.!]*$")  # "answer is b", not "is a red"
_LETTER_LEAD = re.compile(r"^\(?([A-Z])\)?[.:)](?:\s|$)")
_LETTER_TOKEN = re.compile(r"(?<![A-Za-z'])\(?([A-Z])\)?(?![A-Za-z'])")


def extract_answer(text: str) -> str | None:
    """Stripped content of the last ``<answer>…</answer>``, or None without a closed tag."""
    if not isinstance(text, str):
        return None
    found = _ANSWER.findall(text)
    return found[-1].strip() if found else None


def extract_boxed(text: str) -> str | None:
    """Stripped content of the last ``\\boxed{…}`` (braces balanced), or None.

    ``"so \\boxed{\\frac{1}{2}}"`` gives ``"\\frac{1}{2}"``; an unclosed box gives None.
    """
    if not isinstance(text, str):
        return None
    start = text.rfind("\\boxed{")
    while start >= 0:
        i, depth = start + len("\\boxed{"), 1
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            return text[start + len("\\boxed{") : i - 1].strip()
        start = text.rfind("\\boxed{", 0, start)
    return None


def answer_or_text(text: str) -> str:
    """The answer tag's content if present, else the last ``\\boxed{}`` content, else the whole
    completion, stripped."""
    if not isinstance(text, str):
        return ""
    ans = extract_answer(text)
    if ans is None:
        ans = extract_boxed(text)
    return ans if ans is not None else text.strip()


def is_formatted(text: str) -> bool:
    """The whole string (bar outer whitespace) is ``<think>…</think>\\s*<answer>…</answer>``.

    Each tag appears exactly once; the contents may not contain any of the four tags.
    """
    return isinstance(text, str) and _FORMAT.fullmatch(text.strip()) is not None


def is_boxed_formatted(text: str) -> bool:
    """``<think>…</think>`` then a final part holding a closed, non-empty ``\\boxed{…}``.

    Neither part may contain a think or answer tag; the reasoning tag opens the completion.
    """
    if not isinstance(text, str):
        return False
    m = _BOXED_FORMAT.fullmatch(text.strip())
    return m is not None and bool(extract_boxed(m.group(1)))


def yes_or_no(text: str) -> str | None:
    """``"yes"`` or ``"no"`` when the text's words hold one of them and not the other, else None
    (VLMEvalKit's Y/N extraction: lower case, punctuation as spaces, whole words)."""
    words = set(re.sub(r"[^0-9a-z]+", " ", str(text).lower()).split())
    if ("yes" in words) == ("no" in words):
        return None
    return "yes" if "yes" in words else "no"


def extract_letter(text: str, options: Sequence[str] | None = None) -> str | None:
    """Option letter in an answer: "B", "(B)", "B.", "B) blue", "Answer: B", "the answer is b".

    With ``options`` (the option texts, A first), only their letters count and an answer equal
    to one option's text ("blue") maps to its letter. Several different bare capitals
    ("A or C") are ambiguous and give None. Returns the upper-case letter or None.
    """
    if not isinstance(text, str):
        return None
    s = text.strip()
    valid = (
        {chr(65 + i) for i in range(len(options))} if options else {chr(c) for c in range(65, 91)}
    )

    def ok(letter: str | None) -> str | None:
        return letter.upper() if letter and letter.upper() in valid else None

    m = _LETTER_ALONE.match(s)
    if m:
        return ok(m.group(1))
    cued = _LETTER_CUED.findall(s) or _LETTER_CUED_LOWER.findall(s)
    if cued:
        return ok(cued[-1])
    m = _LETTER_LEAD.match(s)
    if m:
        return ok(m.group(1))
    if options:
        norm = s.lower().rstrip(".").strip()
        hits = [i for i, o in enumerate(options) if str(o).strip().lower() == norm]
        if len(hits) == 1:
            return chr(65 + hits[0])
    tokens = {t for t in _LETTER_TOKEN.findall(s) if t in valid}
    return tokens.pop() if len(tokens) == 1 else None


def _to_float(tok: str) -> float | None:
    low = tok.lower()
    if low in _NUMBER_WORDS:
        return float(_NUMBER_WORDS[low])
    try:
        v = float(tok.replace(",", ""))
    except ValueError:
        return None
    return v if math.isfinite(v) else None


def parse_number(text: str) -> float | None:
    """The one number in ``text`` (digits or the words zero..twenty), else None.

    "3", "3.0", "three", "There are 3 objects", "1,200" parse; "2 or 3" (two different values)
    and text without a number give None, so hedging earns nothing.
    """
    if not isinstance(text, str):
        return None
    values = {v for t in _NUMBER.findall(text) if (v := _to_float(t)) is not None}
    return values.pop() if len(values) == 1 else None


def parse_box(text: str) -> list[float] | None:
    """First ``[x1, y1, x2, y2]`` (or ``(…)``) box in ``text``, else 4 bare numbers, else None.

    Non-finite values give None; degenerate boxes are returned as written (the caller decides).
    """
    if not isinstance(text, str):
        return None
    m = _BOX.search(text)
    toks = list(m.groups()) if m else _ANY_NUM.findall(text)
    if len(toks) != 4:
        return None
    vals = [_to_float(t) for t in toks]
    return None if any(v is None for v in vals) else vals  # type: ignore[return-value]


def box_iou(a: Sequence[float], b: Sequence[float]) -> float:
    """IoU of two [x1, y1, x2, y2] boxes (x2 > x1, y2 > y1); 0 when either is degenerate."""
    if a[2] <= a[0] or a[3] <= a[1] or b[2] <= b[0] or b[3] <= b[1]:
        return 0.0
    iw = min(a[2], b[2]) - max(a[0], b[0])
    ih = min(a[3], b[3]) - max(a[1], b[1])
    inter = max(iw, 0.0) * max(ih, 0.0)
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return float(inter / union) if union > 0 else 0.0
