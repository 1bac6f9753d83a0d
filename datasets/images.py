"""Images as a person sees them: the one way every image of a sample is read (the data checks
and the prompts alike).

* **Orientation**: a photo's EXIF orientation is applied (a phone's portrait shot is upright,
  and its size is the upright one: boxes and prompt lengths use that size).
* **Transparency** (RGBA, LA, a palette or RGB image with a transparent colour) is composited
  over `BACKGROUND`, mid-grey: the background the synthetic sets draw on and the tiny models
  were trained on (on black, a from-scratch vision tower with the default CLIP normalisation
  was measured to go blind; white would be a bright frame the sets never show).
* **High bit depth**: 16-bit (and 32-bit integer) grayscale is scaled to 8 bits by its range
  (65535 -> 255), not clipped (clipping made a 16-bit PNG almost all white); float images in
  [0, 1] are scaled by 255. Palette, bilevel and CMYK images convert as Pillow converts them.
* **Shape**: an aspect ratio beyond `MAX_ASPECT_RATIO` is refused (`shape_problem`): the
  Qwen-VL processors raise on it, and no resize keeps such an image readable.

Decoding errors are the caller's to report (they name the sample): `open_image` raises what
Pillow raises (OSError, ValueError, ``Image.DecompressionBombError``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image, ImageOps

BACKGROUND: tuple[int, int, int] = (128, 128, 128)
"""RGB that transparent pixels are composited over (the synthetic generators' background)"""
MAX_ASPECT_RATIO = 200.0
"""longest side / shortest side the Qwen-VL image processors accept (``smart_resize``)"""
ORIENTATION = 0x0112
"""the EXIF tag of the orientation; values 5-8 turn the image by a quarter (width <-> height)"""
_QUARTER_TURNS = (5, 6, 7, 8)
_HIGH_DEPTH = ("I;16", "I;16B", "I;16L", "I;16N", "I")


def open_image(image: str | Path | Image.Image, background=BACKGROUND) -> Image.Image:
    """The image (a path or an open PIL image) as 8-bit RGB, upright, transparency composited
    over ``background``, high bit depths scaled (see the module docstring)."""
    if isinstance(image, Image.Image):
        return to_rgb(image, background)
    with Image.open(Path(image)) as im:
        return to_rgb(im, background)


def to_rgb(im: Image.Image, background=BACKGROUND) -> Image.Image:
    """``im`` as 8-bit RGB (a new image; see `open_image`)."""
    if im.getexif().get(ORIENTATION, 1) != 1:
        im = ImageOps.exif_transpose(im)
    if im.mode in _HIGH_DEPTH or im.mode == "F":
        im = Image.fromarray(_to_uint8(np.asarray(im), im.mode))
    if _has_alpha(im):
        rgba = im.convert("RGBA")
        base = Image.new("RGBA", rgba.size, (*background, 255))
        return Image.alpha_composite(base, rgba).convert("RGB")
    return im.convert("RGB")


def image_size(path: str | Path) -> tuple[int, int]:
    """(width, height) of the upright image, from its header (no pixel decoding)."""
    with Image.open(Path(path)) as im:
        return upright_size(im)


def upright_size(im: Image.Image) -> tuple[int, int]:
    """(width, height) of an open image once its EXIF orientation is applied."""
    w, h = im.size
    return (h, w) if im.getexif().get(ORIENTATION, 1) in _QUARTER_TURNS else (w, h)


def shape_problem(size: tuple[int, ...]) -> str | None:
    """Why an image (or video frame) of ``size`` = (width, height, ...) cannot reach the model,
    None when it can."""
    w, h = int(size[0]), int(size[1])
    if min(w, h) < 1:
        return f"is {w}x{h} pixels (empty)"
    ratio = max(w, h) / min(w, h)
    if ratio > MAX_ASPECT_RATIO:
        return (
            f"is {w}x{h} pixels, an aspect ratio of {ratio:.0f}:1, beyond the "
            f"{MAX_ASPECT_RATIO:.0f}:1 the vision processors take; crop or pad it"
        )
    return None


def _has_alpha(im: Image.Image) -> bool:
    return im.mode in ("RGBA", "LA", "PA", "RGBa", "La") or "transparency" in im.info


def _to_uint8(a: np.ndarray, mode: str) -> np.ndarray:
    """A high-depth grayscale array [H, W] of Pillow mode ``mode`` as uint8: 16-bit modes by
    /257; a 32-bit integer image (``I``, as Pillow opens some 16-bit files) likewise when it
    exceeds 255, else as it is; a float image (``F``) in [0, 1] by 255, else clipped."""
    a = np.nan_to_num(a.astype(np.float64))
    top = float(a.max()) if a.size else 0.0
    if mode.startswith("I;16") or (mode == "I" and top > 255):
        a = a / 257.0
    elif mode == "F" and top <= 1.0 and (a.min() if a.size else 0.0) >= 0.0:
        a = a * 255.0
    return np.clip(a.round(), 0, 255).astype(np.uint8)
