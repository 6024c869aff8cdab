"""Saving a plot that may be committed: a 256-colour PNG (no dithering), its text chunks kept.

Line plots on white use a few dozen colours, so the palette loses nothing visible and the file is
about a third of matplotlib's full-colour PNG.
"""

from __future__ import annotations

import io
import textwrap
from pathlib import Path


def fit_to_width(fig, text: str, fontsize: float) -> str:
    """`text` broken into lines as wide as the figure (matplotlib's ``wrap=True`` does nothing under
    the tight bounding box `save_png` uses); a character is about 0.6 of the font size wide."""
    return textwrap.fill(text, width=int(fig.get_figwidth() * 72 / (0.6 * fontsize)))


def save_png(fig, path: str | Path, dpi: int, metadata: dict[str, str] | None = None,
             tight: bool = True) -> Path:
    """Write `fig` to `path` as a palette PNG with `metadata` as its text chunks (``Title``,
    ``Description``, ...); the figure is closed."""
    import matplotlib.pyplot as plt  # only where a plot is written; the caller chose the backend
    from PIL import Image, PngImagePlugin

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi, metadata=metadata, bbox_inches="tight" if tight else None)
    plt.close(fig)
    buffer.seek(0)
    with Image.open(buffer) as full:
        text = dict(full.text)  # matplotlib's Software line and the metadata
        image = full.convert("RGB").quantize(256, dither=Image.Dither.NONE)
    info = PngImagePlugin.PngInfo()
    for key, value in text.items():
        info.add_text(key, value)
    image.save(path, format="png", pnginfo=info, optimize=True)
    return Path(path)
