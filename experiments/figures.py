"""The lab's figures: the stamp, the legend and the missing points every plot draws the same way,
and saving one that may be committed as a 256-colour PNG (no dithering) with its text chunks.

Line plots on white use a few dozen colours, so the palette loses nothing visible and the file is
about a third of matplotlib's full-colour PNG."""

from __future__ import annotations

import io
import textwrap
from pathlib import Path


def legend_outside(ax, fontsize: float = 7) -> None:
    """The legend right of the axes: it never covers a point."""
    ax.legend(fontsize=fontsize, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)


def mark_missing(ax, points: list[tuple[float, str]], color, marker: str = "x") -> None:
    """Points without a number: a marker on the x axis and why above it (side by side when several
    series miss the same x)."""
    stacked = ax.__dict__.setdefault("_missing_at", {})
    for xv, why in points:
        level = stacked[xv] = stacked.get(xv, -1) + 1
        ax.plot([xv], [0.0], marker=marker, color=color, markersize=9, transform=ax.get_xaxis_transform(),
                clip_on=False, linestyle="none")
        ax.annotate(why, (xv, 0.0), xycoords=("data", "axes fraction"), xytext=(-4 + 9 * level, 9),
                    textcoords="offset points", ha="center", va="bottom", rotation=90, fontsize=7, color=color)


def finish(fig, path: str | Path, title: str, stamp: str, dpi: int = 110) -> Path:
    """The title, the stamp under it (what the numbers depend on: device, versions, commit, ...) broken
    to the figure's width (``wrap=True`` does nothing under the tight bounding box; a character is
    about 0.6 of the font size wide), then `save_png` with both as the file's Title and Description."""
    fig.suptitle(title, fontsize=11)
    text = textwrap.fill(stamp, width=int(fig.get_figwidth() * 72 / (0.6 * 8)))
    fig.text(0.5, 0.94, text, ha="center", va="top", fontsize=8, color="dimgray")
    fig.tight_layout(rect=(0, 0, 1, 0.92 - 0.025 * text.count("\n")))
    return save_png(fig, path, dpi, {"Title": title, "Description": stamp})


def save_png(fig, path: str | Path, dpi: int, metadata: dict[str, str] | None = None) -> Path:
    """Write `fig` to `path` as a palette PNG with `metadata` as its text chunks (``Title``,
    ``Description``, ...); the figure is closed."""
    import matplotlib.pyplot as plt  # only where a plot is written; the caller chose the backend
    from PIL import Image, PngImagePlugin

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi, metadata=metadata, bbox_inches="tight")
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
