"""Drawing with PIL: our own cards (rank + suit), text lines and the formula line.

Fonts are the DejaVu files that matplotlib ships, so every machine draws identical pixels (the
reference loaded them from a relative path, and users without it got different images). All
sizes are fractions of the canvas side S, so a 64 px frame keeps big, legible digits.
"""

from __future__ import annotations

import hashlib
import importlib.util
import io
import threading
from collections import OrderedDict
from functools import lru_cache
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFont

# matplotlib's own data folder (what ``matplotlib.get_data_path()`` returns), found without
# importing matplotlib: that import costs a second at every env service and ``gtr train`` start.
_MPL = importlib.util.find_spec("matplotlib")
if _MPL is None or not _MPL.submodule_search_locations:
    raise ImportError("the renderers need matplotlib installed: it ships their fonts")
FONT_DIR = Path(_MPL.submodule_search_locations[0]) / "mpl-data" / "fonts" / "ttf"
FELT = (53, 101, 77)  # the reference's table green, #35654d
WHITE = (255, 255, 255)
BLACK = (0, 0, 0)
RED = (200, 16, 32)
SUIT_GLYPHS = {"S": "\u2660", "H": "\u2665", "D": "\u2666", "C": "\u2663"}
RANK_TEXT = {"T": "10"}


@lru_cache(maxsize=256)
def font(size: int, bold: bool = False) -> ImageFont.FreeTypeFont:
    """DejaVu Sans (Bold) at ``size`` px, cached."""
    name = "DejaVuSans-Bold.ttf" if bold else "DejaVuSans.ttf"
    return ImageFont.truetype(str(FONT_DIR / name), max(int(size), 4))


@lru_cache(maxsize=4096)
def fit_font(
    text: str, max_width: int, max_size: int, bold: bool = False
) -> ImageFont.FreeTypeFont:
    """The largest font (up to ``max_size``) in which ``text`` fits ``max_width``."""
    size = max(max_size, 4)
    width = font(size, bold).getlength(text)
    if width > max_width:  # text width grows about linearly with size: jump close, then step
        size = max(int(size * max_width / width), 4)
    while size > 4 and font(size, bold).getlength(text) > max_width:
        size -= 1
    return font(size, bold)


def canvas(
    size: int, color: tuple[int, int, int] = FELT
) -> tuple[Image.Image, ImageDraw.ImageDraw]:
    """A blank square canvas and its drawing handle."""
    img = Image.new("RGB", (size, size), color)
    return img, ImageDraw.Draw(img)


def to_array(img: Image.Image) -> np.ndarray:
    """H x W x 3 uint8 observation."""
    return np.asarray(img, dtype=np.uint8).copy()


_PNGS: OrderedDict[bytes, bytes] = OrderedDict()  # frame digest -> PNG, most recent last
_PNGS_LOCK = threading.Lock()


def display_png(image: np.ndarray, cache: int = 256) -> bytes:
    """A display frame as PNG: fast (level 1) and deterministic, so the same frame always
    hashes to the same blob. Encoding is most of a frame's cost and frames repeat (NumberLine
    has 36, an ALFWorld room a few per receptacle): the last ``cache`` are kept."""
    key = hashlib.blake2b(image.tobytes(), digest_size=16).digest() + repr(image.shape).encode()
    with _PNGS_LOCK:
        if key in _PNGS:
            _PNGS.move_to_end(key)
            return _PNGS[key]
    buf = io.BytesIO()
    Image.fromarray(image).save(buf, format="PNG", compress_level=1)
    with _PNGS_LOCK:
        _PNGS[key] = buf.getvalue()
        while len(_PNGS) > cache:
            _PNGS.popitem(last=False)
    return buf.getvalue()


@lru_cache(maxsize=1024)
def card_image(card: str, w: int, h: int) -> Image.Image:
    """A face-up card such as 'HK' or 'ST': the rank large, the suit below it."""
    suit, rank = card[0], card[1:]
    img = Image.new("RGB", (w, h), FELT)
    draw = ImageDraw.Draw(img)
    draw.rounded_rectangle((0, 0, w - 1, h - 1), radius=max(1, w // 8), fill=WHITE, outline=BLACK)
    color = RED if suit in "HD" else BLACK
    # One size for every rank (sized on "10", the widest), so the glyph size carries no hint.
    size = min(w * 0.6, h * 0.5)
    draw.text(
        (w / 2, h * 0.36),
        RANK_TEXT.get(rank, rank),
        fill=color,
        font=font(int(size), True),
        anchor="mm",
    )
    draw.text(
        (w / 2, h * 0.77), SUIT_GLYPHS[suit], fill=color, font=font(int(h * 0.34)), anchor="mm"
    )
    return img


@lru_cache(maxsize=64)
def card_back(w: int, h: int) -> Image.Image:
    """The face-down card: a blue back with a white inner frame."""
    img = Image.new("RGB", (w, h), FELT)
    draw = ImageDraw.Draw(img)
    draw.rounded_rectangle(
        (0, 0, w - 1, h - 1), radius=max(1, w // 8), fill=(30, 60, 150), outline=WHITE
    )
    inset = max(2, w // 6)
    draw.rectangle((inset, inset, w - 1 - inset, h - 1 - inset), outline=WHITE)
    return img


def draw_card_row(img: Image.Image, cards: list[str], top: float) -> None:
    """Cards side by side, 0.9 * S / n wide, 5:7, centred horizontally (as the reference)."""
    s = img.width
    w = int(s / len(cards) * 0.9)
    h = int(w * 7 / 5)
    gap = (s - w * len(cards)) / (len(cards) + 1)
    for i, card in enumerate(cards):
        img.paste(card_image(card, w, h), (int(gap + i * (w + gap)), int(top)))


def draw_formula(
    img: Image.Image, draw: ImageDraw.ImageDraw, tokens: list[str], top: float
) -> None:
    """A small "Formula:" label over the tokens, as large as fits; spaced like the reference
    unless that would shrink the glyphs below 0.1 S (long Points24 formulas at 64 px)."""
    s = img.width
    draw.text((s * 0.04, top), "Formula:", fill=WHITE, font=font(int(s * 0.075)))
    text = " ".join(tokens)
    if not text.strip():
        return
    f = fit_font(text, int(s * 0.92), int(s * 0.15), bold=True)
    if f.size < s * 0.1:
        text = "".join(tokens)  # blanks left by used-up numbers stay as single spaces
        f = fit_font(text, int(s * 0.92), int(s * 0.15), bold=True)
    draw.text((s * 0.04, top + s * 0.09), text, fill=WHITE, font=f)
