"""The one point where a launcher's hand-rule configuration may be replaced by a measured one.

Every launcher passes its hand-rule launch dict through :func:`tuned` with the family's shape
features (:data:`FAMILIES`): unchanged without a table for this GPU, else updated from the table's
entry (looked up once per family and features, then cached). :func:`forced` and :func:`use_table`
override it (the sweep, tests). How: docs/kernels.md#launch-tables."""

from __future__ import annotations

import contextlib
import threading
from pathlib import Path

from kernels.launch_table import LaunchTable, table_path

# family -> its shape features, in the order launchers pass them. B sequences, N max_seq_len,
# L mean length T/B, H heads (softmax: columns), D head dim / feature width, K x M the bmm
# operands' widths, Tq dense queries; dtype a string ('bfloat16'), causal 0/1.
FAMILIES: dict[str, tuple[str, ...]] = {
    "flash_fwd": ("B", "N", "L", "H", "D", "dtype", "causal"),
    "flash_bwd": ("B", "N", "L", "H", "D", "dtype", "causal"),
    "dense_fwd": ("B", "N", "L", "H", "D", "Tq", "dtype"),
    "dense_bwd": ("B", "N", "L", "H", "D", "Tq", "dtype"),
    "softmax_fwd": ("B", "N", "L", "H", "dtype"),
    "softmax_bwd": ("B", "N", "L", "H", "dtype"),
    "jagged_dense_bmm": ("B", "N", "L", "K", "M", "dtype"),
    "jagged_jagged_bmm": ("B", "N", "L", "K", "M", "dtype"),
    "padded_to_jagged": ("B", "N", "L", "D", "dtype"),
    # S2 attention (kernels/_s2_attention_triton.py): forward; dQ and dK/dV. The layout's block
    # bounds the tiles (key chunks divide it; causal query tiles too): a config that does not fit
    # the block in use is ignored there and the hand rule runs
    "s2_fwd": ("B", "N", "L", "H", "D", "dtype", "causal"),
    "s2_bwd": ("B", "N", "L", "H", "D", "dtype", "causal"),
}

_UNSET = object()
_table: object = _UNSET  # LaunchTable | None once resolved
_entries: dict = {}  # (family, features) -> entry config or None
_forced: dict[str, dict] = {}
_caches: list[dict] = []
_lock = threading.Lock()


def p2(x: int) -> int:
    """x rounded to the nearest power of two in log space (1 for x <= 1): the feature bucket."""
    return 1 << max(0, ((x * 181) >> 7).bit_length() - 1)  # 181/128 ~ sqrt(2)


def bucket(B: int, N: int, T: int, *rest) -> tuple:
    """The shape features every family starts with, bucketed: (B sequences, N max_seq_len, L mean
    length T/B) as powers of two (:func:`p2`), then `rest` (the family's other features) as given."""
    return (p2(B), p2(N), p2(T // max(B, 1)), *rest)


def register_cache(cache: dict) -> dict:
    """A launcher's launch-dict cache, cleared whenever the table or a forced config changes."""
    _caches.append(cache)
    return cache


def clear_caches() -> None:
    _entries.clear()
    for c in _caches:
        c.clear()


def _current_gpu() -> str | None:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else None


def _resolve() -> LaunchTable | None:
    global _table
    with _lock:
        if _table is _UNSET:
            path = table_path(_current_gpu())
            if path is not None and not Path(path).is_file():
                raise ValueError(f"launch table {path} (from $JFA_LAUNCH_TABLE) does not exist")
            _table = LaunchTable.load(path) if path is not None else None
    return _table  # type: ignore[return-value]


def active() -> bool:
    """True when launches may differ from the hand rules (a table is loaded or a config forced)."""
    return bool(_forced) or (_resolve() if _table is _UNSET else _table) is not None


def use_table(table: LaunchTable | str | Path | None) -> None:
    """Use `table` (a LaunchTable, a path, or None for none) from now on; 'env' re-reads
    $JFA_LAUNCH_TABLE / the GPU's file at the next launch."""
    global _table
    if table == "env":
        _table = _UNSET
    elif isinstance(table, (str, Path)):
        _table = LaunchTable.load(table)
    else:
        _table = table
    clear_caches()


def current_table() -> LaunchTable | None:
    return _resolve() if _table is _UNSET else _table  # type: ignore[return-value]


@contextlib.contextmanager
def forced(family: str, config: dict):
    """Within the block, every launch of `family` uses `config` over its hand-rule dict."""
    if family not in FAMILIES:
        raise ValueError(f"unknown kernel family {family!r}; known: {', '.join(FAMILIES)}")
    _forced[family] = dict(config)
    clear_caches()
    try:
        yield
    finally:
        _forced.pop(family, None)
        clear_caches()


def _merge(default: dict, cfg: dict) -> dict:
    out = dict(default)
    out.update((k, v) for k, v in cfg.items() if k in default)
    return out


def tuned(family: str, features: tuple, default: dict) -> dict:
    """`default` (the hand rules' launch dict) with the table's config for (family, features)
    laid over it; `default` itself when there is neither a table entry nor a forced config.
    `features`: values in the order of FAMILIES[family] (dtype may be a torch.dtype)."""
    if _forced:
        cfg = _forced.get(family)
        if cfg is not None:
            return _merge(default, cfg)
    table = _resolve() if _table is _UNSET else _table
    if table is None:
        return default
    key = (family, features)
    cfg = _entries.get(key, _UNSET)
    if cfg is _UNSET:
        shape = {k: (str(v).removeprefix("torch.") if k == "dtype" else int(v))
                 for k, v in zip(FAMILIES[family], features)}
        entry = table.lookup(family, shape)  # type: ignore[union-attr]
        # an entry of source 'hand' says "the hand rule": this shape's own, not the config the rule
        # gave the entry's shape (a nearest entry's Tq 16 query tile on a Tq 32 shape ran slower: docs/tuning.md)
        keep_rule = entry is None or entry.get("source") == "hand"
        cfg = _entries[key] = None if keep_rule else entry["config"]
    return default if cfg is None else _merge(default, cfg)
