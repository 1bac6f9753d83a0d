"""Images as a person sees them (datasets/images.py) and the loader's checks of them: each case
is a small file of that kind, made here."""

from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image

from perceptrl.datasets.images import BACKGROUND, image_size, open_image, shape_problem
from perceptrl.datasets.loader import load_samples
from perceptrl.errors import DataError

RED, BLUE = (220, 30, 30), (30, 30, 220)


def _exif_rotated(path, orientation: int = 6) -> Image.Image:
    """A 40x20 image stored sideways: left half red, right half blue, with an EXIF orientation
    (6: the viewer turns it 90 degrees clockwise). Returns what a person sees (20x40)."""
    im = Image.new("RGB", (40, 20), BLUE)
    im.paste(RED, (0, 0, 20, 20))
    exif = im.getexif()
    exif[0x0112] = orientation
    im.save(path, exif=exif.tobytes())
    return im.transpose(Image.Transpose.ROTATE_270)


def test_exif_orientation_is_applied_to_pixels_and_size(tmp_path):
    seen = _exif_rotated(tmp_path / "r.png")
    got = open_image(tmp_path / "r.png")
    assert got.size == seen.size == image_size(tmp_path / "r.png") == (20, 40)
    assert np.array_equal(np.asarray(got), np.asarray(seen))  # top red, bottom blue
    assert tuple(np.asarray(got)[0, 0]) == RED and tuple(np.asarray(got)[-1, 0]) == BLUE


@pytest.mark.parametrize("mode", ["RGBA", "LA", "P"])
def test_transparency_is_composited_over_mid_grey(tmp_path, mode):
    im = Image.new("RGBA", (16, 16), (0, 0, 0, 0))  # transparent black everywhere
    im.paste((*RED, 255), (0, 0, 8, 16))  # an opaque red left half
    if mode == "LA":
        im = im.convert("LA")
    if mode == "P":
        im = im.convert("P")  # the transparent colour as the palette's transparency
    im.save(tmp_path / "t.png")
    got = np.asarray(open_image(tmp_path / "t.png"))
    assert tuple(got[0, -1]) == BACKGROUND == (128, 128, 128)
    red = (
        RED if mode != "LA" else (Image.new("RGB", (1, 1), RED).convert("L").getpixel((0, 0)),) * 3
    )
    assert tuple(got[0, 0]) == red


def test_half_transparent_pixels_blend_with_the_background(tmp_path):
    Image.new("RGBA", (4, 4), (255, 255, 255, 128)).save(tmp_path / "h.png")
    assert tuple(np.asarray(open_image(tmp_path / "h.png"))[0, 0]) == (192, 192, 192)


def test_16_bit_grayscale_is_scaled_not_clipped(tmp_path):
    ramp = np.linspace(0, 65535, 64 * 16).reshape(16, 64).astype(np.uint16)
    Image.fromarray(ramp).save(tmp_path / "g16.png")
    assert Image.open(tmp_path / "g16.png").mode.startswith("I")
    got = np.asarray(open_image(tmp_path / "g16.png"))[..., 0].astype(int)
    want = np.round(ramp / 257).astype(int)
    assert np.abs(got - want).max() <= 1 and 120 < got.mean() < 135  # not almost all white


def test_32_bit_integer_and_float_images(tmp_path):
    small = np.full((4, 4), 100, np.int32)  # an 8-bit range in a 32-bit image: as it is
    assert np.asarray(open_image(Image.fromarray(small, mode="I")))[0, 0, 0] == 100
    unit = np.full((4, 4), 0.5, np.float32)  # a float image in [0, 1]
    assert np.asarray(open_image(Image.fromarray(unit, mode="F")))[0, 0, 0] == 128


def test_a_palette_image_keeps_its_colours(tmp_path):
    im = Image.new("RGB", (8, 8), RED)
    im.paste(BLUE, (0, 0, 4, 8))
    im.convert("P", palette=Image.Palette.ADAPTIVE, colors=4).save(tmp_path / "p.png")
    got = np.asarray(open_image(tmp_path / "p.png"))
    assert tuple(got[0, 0]) == BLUE and tuple(got[0, -1]) == RED


def test_rgb_images_are_unchanged(tmp_path):
    pixels = np.random.default_rng(0).integers(0, 256, (12, 20, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(tmp_path / "c.png")
    assert np.array_equal(np.asarray(open_image(tmp_path / "c.png")), pixels)


def test_extreme_aspect_ratios_are_named():
    assert shape_problem((401, 2)) is not None and "200:1" in shape_problem((401, 2))
    assert shape_problem((200, 1)) is None and shape_problem((112, 112)) is None


# ---- the loader: strict errors name the reason, lenient skips count it -----------------------


def _data(tmp_path, records: list[dict]):
    Image.new("RGB", (32, 32), (128, 128, 128)).save(tmp_path / "ok.png")
    Image.new("RGB", (1000, 4), (128, 128, 128)).save(tmp_path / "strip.png")
    _exif_rotated(tmp_path / "rot.jpg")
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


OK = {"image": "ok.png", "question": "How many?", "answer": "2"}
STRIP = {"image": "strip.png", "question": "How many?", "answer": "2"}
SPECIAL = {"image": "ok.png", "question": "How many <|image_pad|> are there?", "answer": "2"}


@pytest.mark.parametrize(
    ("record", "reason", "words"),
    [(STRIP, "aspect_ratio", "1000x4 pixels"), (SPECIAL, "special_tokens", "'<|image_pad|>'")],
)
def test_strict_refuses_and_lenient_counts(tmp_path, record, reason, words):
    path = _data(tmp_path, [OK, record, OK])
    with pytest.raises(DataError, match="line 2") as err:
        load_samples(path)
    assert words in str(err.value) and "data.strict=false" in str(err.value)
    samples, stats = load_samples(path, strict=False)
    assert len(samples) == 2 and stats[f"skipped_{reason}"] == 1


def test_box_samples_take_the_upright_image_size(tmp_path):
    record = {"image": "rot.jpg", "question": "Where?", "answer": "[1, 2, 3, 4]"}
    samples, _ = load_samples(_data(tmp_path, [record]))
    assert samples[0]["reward"] == "iou" and samples[0]["meta"]["image_size"] == [20, 40]
