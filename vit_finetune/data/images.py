"""Decoding images: to upright 8-bit RGB whatever their mode, shrunk on decode when asked, and probing a header
to tell a readable image from anything else. An image is a file (a path), encoded bytes, or an `ImageSource`
(an image that is not a file of its own: a row of an arrow table, a member of a tar shard). Imports no torch
(plots use it too)."""
from __future__ import annotations

import io
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol, Union

import cv2
import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError


class ImageSource(Protocol):
    """An image that is not a file of its own; str() names it in warnings and reports."""

    def read_bytes(self) -> bytes:
        """The encoded image (JPEG, PNG, ...)."""


ImageLike = Union[str, Path, bytes, ImageSource]


def open_image(image: ImageLike) -> Image.Image:
    """PIL's lazy image (header read, pixels not yet decoded) of a file, encoded bytes or an ImageSource."""
    if isinstance(image, (str, Path)):
        return Image.open(image)
    return Image.open(io.BytesIO(image if isinstance(image, bytes) else image.read_bytes()))


def load_rgb(path: ImageLike, max_short_side: int | None = None) -> np.ndarray:
    """Decode an image (a file, bytes or an ImageSource) to (H, W, 3) uint8 RGB, turned upright per EXIF; raises
    if it cannot be decoded.

    Transparent pixels are composited on white (a transparent background means "nothing here", and the colour
    hidden under it is arbitrary); 16-bit greyscale is scaled to 8 bits. With max_short_side, larger images are
    shrunk so their shorter side is that long (JPEGs decode at 1/2..1/8 scale directly, which is much faster).
    """
    with open_image(path) as im:
        w, h = im.size
        short, long = shrunk(w, h, max_short_side)
        size = (short, long) if w <= h else (long, short)  # (width, height) as stored in the file
        if size != (w, h):
            im.draft(None, size)
        ImageOps.exif_transpose(im, in_place=True)
        image = _to_rgb(im)
    if size != (w, h):
        upright = (image.shape[1] >= image.shape[0]) == (w >= h)
        image = cv2.resize(image, size if upright else size[::-1], interpolation=cv2.INTER_AREA)
    return image


def _to_rgb(im: Image.Image) -> np.ndarray:
    if im.mode.startswith("I"):  # 16-bit greyscale ("I;16", "I;16B", or "I" holding 16-bit values)
        grey = (np.asarray(im) / 257).round().clip(0, 255).astype(np.uint8)
        return np.repeat(grey[..., None], 3, axis=2)
    if im.has_transparency_data:  # RGBA, LA, PA, palette or RGB with a transparent colour
        im = Image.alpha_composite(Image.new("RGBA", im.size, "white"), im.convert("RGBA"))
    return np.asarray(im if im.mode == "RGB" else im.convert("RGB"))  # greyscale, palette, CMYK, ...


def shrunk(w: int, h: int, max_short_side: int | None) -> tuple[int, int]:
    """(short, long) side lengths once the shorter side is at most max_short_side; never enlarges."""
    short, long = min(w, h), max(w, h)
    if max_short_side is None or short <= max_short_side:
        return short, long
    return max_short_side, max(1, round(long * max_short_side / short))


def probe(path: ImageLike) -> tuple[int, int] | str:
    """(width, height) from the header alone, or why the file (bytes, ImageSource) is not a readable image."""
    try:
        with open_image(path) as im:
            return im.size
    except UnidentifiedImageError:
        return "empty file" if _is_empty(path) else "not an image"
    except Exception as e:  # unreadable for any other reason: permissions, a broken symlink, a decompression bomb...
        return f"unreadable ({type(e).__name__}: {e})"


def _is_empty(image: ImageLike) -> bool:
    if isinstance(image, (str, Path)):
        return Path(image).stat().st_size == 0
    return not (image if isinstance(image, bytes) else image.read_bytes())


def unreadable_reason(path: Path) -> str:
    """Why `path` is not a readable image (for a file left out of a dataset)."""
    found = probe(path)
    return found if isinstance(found, str) else "not a readable image"


def few(items: Sequence, k: int = 3) -> str:
    """The first k items and how many more: a warning names a few files, not thousands."""
    return ", ".join(map(str, items[:k])) + (f" and {len(items) - k} more" if len(items) > k else "")
