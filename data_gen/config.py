"""The generator's configuration: one dataclass, its presets, `--key value` overrides.

Every knob of the data lives here so that `meta.json` can record the whole resolved config and a
run can be reproduced from it. Validation runs before any work: a bad argument must fail in
milliseconds with a message, not after minutes of generation.

Two modes: per-example (the default: every row has a fresh user) and timeline (`users` > 0:
each of `users` users has one event stream, impressions over `days` days, splits by day; see
data_gen/timeline.py). Each mode's meta.json records only the fields that apply to it."""

from __future__ import annotations

import dataclasses
import difflib
import math
from dataclasses import dataclass
from pathlib import PurePath
from typing import Any

LENGTH_DISTS = ("power", "uniform", "lognormal")


class ConfigError(ValueError):
    """A bad preset, override or config value (raised before any work is done)."""


@dataclass(frozen=True)
class DataConfig:
    """Everything that determines the data, except the seed.

    Rows are counted across the three splits; `val_fraction` and `test_fraction` of them go to
    val and test, the rest to train. History lengths follow `length_dist` on [min_len, max_len]
    with mean `mean_len` (power and lognormal solve their free parameter for it; uniform ignores
    it). The planted label model is described in `data_gen/planted.py`."""

    rows: int = 6_000  # examples across the three splits
    val_fraction: float = 0.1
    test_fraction: float = 0.1
    # items: Zipf popularity p(rank k) ~ k^-alpha over vocab_size ids, in n_clusters interests
    vocab_size: int = 1_000_000
    alpha: float = 1.0  # any alpha > 0, including <= 1
    n_clusters: int = 1_000
    # each cluster belongs to one of n_categories categories (the label's terms match on them);
    # the files show each item's category, wrong for a category_noise fraction of the items
    n_categories: int = 256
    category_noise: float = 0.1
    # users: a current and a past sparse mixture of interests_per_user clusters each
    interests_per_user: int = 3
    interest_concentration: float = 0.5  # Dirichlet concentration of the weights (small: sparse)
    noise: float = 0.15  # fraction of history items drawn from global popularity
    switch_mean: float = 64.0  # mean number of most recent items drawn from current interests
    history_days: float = 365.0  # time span of the longest histories (ages are in days)
    n_actions: int = 4  # action types; higher = more engaged, weighs more in the label
    # history lengths on [min_len, max_len]: power (P(n) ~ (n + s)^-length_exponent), uniform,
    # or lognormal (sigma length_sigma); power and lognormal are solved for mean mean_len
    length_dist: str = "power"
    min_len: int = 0
    max_len: int = 2_048
    mean_len: float = 128.0
    length_exponent: float = 2.0
    length_sigma: float = 1.0
    # candidate kinds (random popular items take the rest) and the planted label model
    cand_current: float = 0.15  # from the current interests
    cand_past: float = 0.15  # from the past interests
    cand_reconsume: float = 0.15  # an item seen at least far_start items ago
    cand_motif: float = 0.35  # of the category a motif planted in the history favours
    recent_halflife: float = 16.0  # items; recency weights of R's average over matches
    far_start: int = 256  # re-consumption X counts only items at least this far back
    freq_cap: float = 16.0  # cluster matches over the whole history saturate F here
    # motifs: n_motifs (a, b) category pairs; a candidate of category b is favoured (M) when an
    # item of category a is followed within motif_window items by one of category b; each history
    # position starts a planted pair with probability motif_rate, reversed (b then a) for a
    # motif_decoy share of them
    n_motifs: int = 8
    motif_window: int = 2
    motif_rate: float = 0.02
    motif_decoy: float = 0.5
    bias: float = -2.6
    w_recent: float = 2.0  # logit weight of R
    w_freq: float = 2.0  # logit weight of F
    w_item: float = 2.5  # logit weight of X
    w_motif: float = 4.0  # logit weight of M
    quality_sd: float = 0.3  # sd of the per-item logit offset
    n_dense: int = 8  # dense features; the first half carry signal
    dense_sd: float = 0.3  # sd of their logit weights
    oracle_ks: tuple[int, ...] = (0, 64, 256, 1024)  # windows of the oracle AUCs in meta.json
    # files
    rows_per_shard: int = 65_536
    row_group_size: int = 16_384
    # timeline mode (users > 0): `users` event streams over `days` days, each user shown
    # impressions at a rate drawn once per user from a Gamma of mean impressions_per_day and
    # shape activity_shape (small: many rare users, a few heavy ones); rows, val_fraction and
    # test_fraction do not apply (the splits are days: train 1..days-2, val days-1, test days)
    users: int = 0
    days: int = 0
    impressions_per_day: float = 1.0
    activity_shape: float = 0.5

    @property
    def is_timeline(self) -> bool:
        return self.users > 0

    def split_rows(self) -> dict[str, int]:
        """Rows per split; train takes what rounding leaves."""
        n_val = int(round(self.rows * self.val_fraction))
        n_test = int(round(self.rows * self.test_fraction))
        return {"train": self.rows - n_val - n_test, "val": n_val, "test": n_test}

    def to_dict(self) -> dict[str, Any]:
        """The fields that apply to this config's mode (what meta.json records)."""
        d = dataclasses.asdict(self)
        d["oracle_ks"] = list(self.oracle_ks)
        for key in PER_EXAMPLE_ONLY if self.is_timeline else TIMELINE_ONLY:
            del d[key]
        return d


TIMELINE_ONLY = ("users", "days", "impressions_per_day", "activity_shape")
PER_EXAMPLE_ONLY = ("rows", "val_fraction", "test_fraction")


# the order world (docs/data.md): frequent motifs decide most candidates, so self-attention pays, and R
# reads mostly the last match (half-life 2 items), so target attention's positions pay
ORDER_WORLD = dict(cand_current=0.1, cand_past=0.1, cand_reconsume=0.05, cand_motif=0.7, motif_rate=0.05,
                   n_motifs=4, recent_halflife=2.0, w_recent=4.0)

PRESETS: dict[str, dict[str, Any]] = {
    # seconds on a laptop: the test suite's data
    "tiny": dict(rows=6_000, vocab_size=20_000, n_clusters=100, n_categories=32,
                 mean_len=96.0, max_len=2_048, n_dense=4, rows_per_shard=1_024,
                 row_group_size=512),
    # the CPU demo: generated in seconds, trained on in a minute or two
    "small": dict(rows=100_000, vocab_size=100_000, n_clusters=500, n_categories=128,
                  mean_len=128.0, max_len=2_048, rows_per_shard=16_384,
                  row_group_size=8_192),
    # the GPU experiments: 1M train rows, mean length 256, lengths up to 4096; the order world
    "paper": dict(ORDER_WORLD, rows=1_250_000, vocab_size=1_000_000, n_clusters=2_000, mean_len=256.0,
                  max_len=4_096, rows_per_shard=65_536, row_group_size=16_384),
    # long histories (S2-attention's case) in the order world: lengths up to 16384, expected mean
    # 2150, and a long-range signal: re-consumption (15% of the candidates, weight 4) counts only
    # items at least 2048 back, so the oracle AUC keeps rising from the last 1024 to 4096 items
    "long": dict(ORDER_WORLD, rows=250_000, vocab_size=1_000_000, n_clusters=2_000, mean_len=2_150.0,
                 max_len=16_384, far_start=2_048, oracle_ks=(0, 256, 1_024, 4_096, 16_384),
                 rows_per_shard=16_384, row_group_size=4_096, cand_reconsume=0.15, cand_motif=0.6,
                 w_item=4.0),
    # timeline mode for tests: the tiny world, 300 users over 7 days (about 2k impressions)
    "timeline_tiny": dict(vocab_size=20_000, n_clusters=100, n_categories=32,
                          mean_len=96.0, max_len=2_048,
                          n_dense=4, rows_per_shard=1_024, row_group_size=512, users=300,
                          days=7, impressions_per_day=1.0),
    # timeline mode at the paper's scale, the order world: 40k users over 14 days, about 1.1M impressions
    "timeline": dict(ORDER_WORLD, vocab_size=1_000_000, n_clusters=2_000, mean_len=256.0, max_len=4_096,
                     rows_per_shard=65_536, row_group_size=16_384, users=40_000, days=14,
                     impressions_per_day=2.0),
}


def generate_hint(out: str) -> str:
    """The command that makes the data set a config names: the preset the folder is named after
    (`data/<preset>`, what `make data PRESET=<preset>` writes), else a choice of presets."""
    preset = PurePath(out).name
    if preset not in PRESETS:
        return f"`python -m data_gen generate --preset <{'|'.join(PRESETS)}> --out {out}`"
    data = "" if PurePath(out) == PurePath("data", preset) else f" DATA={out}"
    return f"`make data PRESET={preset}{data}` or `python -m data_gen generate --preset {preset} --out {out}`"


def _field_types() -> dict[str, Any]:
    return {f.name: f.type for f in dataclasses.fields(DataConfig)}


def _coerce(key: str, raw: Any, kind: Any) -> Any:
    """Turn a CLI string (or a Python value) into the field's type, or raise ConfigError."""
    kind = str(kind)
    try:
        if kind == "int":
            if isinstance(raw, str):
                value = float(raw) if any(c in raw for c in ".eE") else int(raw)
            else:
                value = raw
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            return int(value)
        if kind == "float":
            return float(raw)
        if kind.startswith("tuple"):
            items = raw.split(",") if isinstance(raw, str) else list(raw)
            return tuple(int(str(x).strip()) for x in items if str(x).strip() != "")
        return str(raw)
    except (TypeError, ValueError):
        raise ConfigError(f"--{key.replace('_', '-')}: cannot read {raw!r} as {kind}") from None


def option_pairs(tokens: list[str]) -> dict[str, str]:
    """['--alpha', '0.8', '--rows=5'] -> {'alpha': '0.8', 'rows': '5'} (values may be '-5'):
    the `--key value` options of data_gen's overrides and of the main job's arguments for fit."""
    out, rest = {}, list(tokens)
    while rest:
        tok = rest.pop(0)
        if not tok.startswith("--") or len(tok) == 2:
            raise ConfigError(f"unexpected argument {tok!r} (options are --key value)")
        key, eq, value = tok[2:].partition("=")
        if not eq:
            if not rest:
                raise ConfigError(f"{tok} needs a value")
            value = rest.pop(0)
        out[key] = value
    return out


def resolve_config(preset: str = "tiny", overrides: dict[str, Any] | None = None) -> DataConfig:
    """Preset values, then overrides (keys with '-' or '_'), then validation.

    Raises ConfigError for an unknown preset, an unknown key or an invalid value."""
    if preset not in PRESETS:
        raise ConfigError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    types = _field_types()
    values: dict[str, Any] = dict(PRESETS[preset])
    given = []
    for raw_key, raw in (overrides or {}).items():
        key = raw_key.lstrip("-").replace("-", "_")
        if key not in types:
            near = difflib.get_close_matches(key, list(types), n=1)
            hint = f" (did you mean --{near[0].replace('_', '-')}?)" if near else ""
            raise ConfigError(f"unknown option --{raw_key.lstrip('-')}{hint}")
        values[key] = _coerce(key, raw, types[key])
        given.append(key)
    cfg = DataConfig(**values)
    validate_config(cfg)
    other_mode = PER_EXAMPLE_ONLY if cfg.is_timeline else TIMELINE_ONLY
    ignored = [f"--{k.replace('_', '-')}" for k in given if k in other_mode and k != "users"]
    if ignored and cfg.is_timeline:  # it would be ignored: say so instead
        raise ConfigError(f"{ignored[0]} does not apply in timeline mode (--users > 0): the "
                          "rows are the users' impressions over --days days")
    if ignored:
        raise ConfigError(f"{ignored[0]} applies only in timeline mode: give --users too")
    return cfg


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _finite(x: float) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def validate_config(cfg: DataConfig) -> None:
    """Raise ConfigError naming the first bad value; cheap (no sampling)."""
    _check(cfg.rows > 0, f"rows must be positive, got {cfg.rows}")
    _check(_finite(cfg.alpha) and cfg.alpha > 0, f"alpha must be > 0, got {cfg.alpha}")
    for name in ("val_fraction", "test_fraction"):
        v = getattr(cfg, name)
        _check(_finite(v) and 0 <= v < 1, f"{name} must be in [0, 1), got {v}")
    split = cfg.split_rows()
    _check(all(n > 0 for n in split.values()),
           f"rows={cfg.rows} leaves an empty split with these fractions: {split}")
    _check(1 <= cfg.n_clusters <= cfg.vocab_size,
           f"n_clusters must be in [1, vocab_size={cfg.vocab_size}], got {cfg.n_clusters}")
    _check(cfg.vocab_size < 2**31, f"vocab_size must fit int32, got {cfg.vocab_size}")
    _check(cfg.interests_per_user >= 1, "interests_per_user must be >= 1")
    _check(_finite(cfg.interest_concentration) and cfg.interest_concentration > 0,
           "interest_concentration must be > 0")
    _check(_finite(cfg.noise) and 0 <= cfg.noise <= 1, f"noise must be in [0, 1], got {cfg.noise}")
    _check(_finite(cfg.switch_mean) and cfg.switch_mean > 0, "switch_mean must be > 0")
    _check(_finite(cfg.history_days) and cfg.history_days > 0, "history_days must be > 0")
    _check(1 <= cfg.n_actions <= 127, f"n_actions must be in [1, 127] (int8), got {cfg.n_actions}")
    _check(cfg.length_dist in LENGTH_DISTS,
           f"length_dist must be one of {', '.join(LENGTH_DISTS)}, got {cfg.length_dist!r}")
    _check(0 <= cfg.min_len <= cfg.max_len <= 1 << 17,
           f"need 0 <= min_len <= max_len <= 131072, got min_len={cfg.min_len}, "
           f"max_len={cfg.max_len}")
    _check(_finite(cfg.mean_len) and cfg.mean_len >= 0, "mean_len must be >= 0")
    _check(_finite(cfg.length_exponent) and cfg.length_exponent > 0, "length_exponent must be > 0")
    _check(_finite(cfg.length_sigma) and cfg.length_sigma > 0, "length_sigma must be > 0")
    _check(_finite(cfg.recent_halflife) and cfg.recent_halflife > 0, "recent_halflife must be > 0")
    _check(_finite(cfg.freq_cap) and cfg.freq_cap > 0, "freq_cap must be > 0")
    _check(0 <= cfg.n_dense <= 1024, f"n_dense must be in [0, 1024], got {cfg.n_dense}")
    _validate_terms(cfg)
    ks = cfg.oracle_ks
    _check(all(k >= 0 for k in ks) and list(ks) == sorted(set(ks)),
           f"oracle_ks must be distinct, sorted and >= 0, got {ks}")
    _check(cfg.rows_per_shard >= 1, "rows_per_shard must be >= 1")
    _check(cfg.row_group_size >= 1, "row_group_size must be >= 1")
    _validate_timeline(cfg)
    from .lengths import build_length_model  # local: lengths imports ConfigError from here

    build_length_model(cfg)  # raises ConfigError when mean_len is out of the family's reach



LOGIT_LIMIT = 20.0  # |logit| beyond this for every row: p_true within 2e-9 of 0 or 1


def _validate_terms(cfg: DataConfig) -> None:
    """Categories, motifs, candidate kinds and weights: each message names the key and limit."""
    _check(2 <= cfg.n_categories <= min(cfg.vocab_size, 32_767),
           f"n_categories={cfg.n_categories} must be in [2, min(vocab_size={cfg.vocab_size}, 32767)]")
    _check(cfg.n_categories <= cfg.n_clusters, f"n_categories={cfg.n_categories} must be <= "
           f"n_clusters={cfg.n_clusters} (each category is a union of clusters)")
    for name in ("category_noise", "motif_rate", "motif_decoy"):
        v = getattr(cfg, name)
        _check(_finite(v) and 0 <= v <= 1, f"{name} must be in [0, 1], got {v}")
    _check(0 <= cfg.n_motifs <= cfg.n_categories // 2, f"n_motifs={cfg.n_motifs} must be in "
           f"[0, n_categories // 2 = {cfg.n_categories // 2}] (two categories each)")
    _check(1 <= cfg.motif_window < cfg.max_len, f"motif_window={cfg.motif_window} must be in "
           f"[1, max_len={cfg.max_len}) (a planted pair must fit in a history)")
    mix = (cfg.cand_current, cfg.cand_past, cfg.cand_reconsume, cfg.cand_motif)
    _check(all(_finite(p) and p >= 0 for p in mix) and sum(mix) <= 1 + 1e-9,
           "cand_current + cand_past + cand_reconsume + cand_motif must be probabilities summing "
           f"<= 1, got {mix}")
    _check(0 <= cfg.far_start < cfg.max_len or cfg.cand_reconsume == 0,
           f"far_start={cfg.far_start} must be in [0, max_len={cfg.max_len}) while "
           "cand_reconsume > 0 (no history reaches that far back)")
    _check(cfg.cand_motif == 0 or (cfg.n_motifs > 0 and cfg.motif_rate > 0),
           "cand_motif > 0 needs n_motifs > 0 and motif_rate > 0 (motifs to pick from)")
    weights = ("w_recent", "w_freq", "w_item", "w_motif")
    for name in ("bias", *weights, "quality_sd", "dense_sd"):
        _check(_finite(getattr(cfg, name)), f"{name} must be finite")
    _check(cfg.quality_sd >= 0 and cfg.dense_sd >= 0, "quality_sd and dense_sd must be >= 0")
    # |R| < 1, F, X, M <= 1; the random offsets count to 5 sd
    reach = sum(abs(getattr(cfg, n)) for n in weights) \
        + 5 * cfg.quality_sd + 5 * cfg.dense_sd * math.sqrt(cfg.n_dense)
    _check(reach > 0, "w_recent, w_freq, w_item, w_motif, quality_sd and dense_sd are all 0: "
           "every row would have the same label probability")
    _check(abs(cfg.bias) - reach < LOGIT_LIMIT, f"bias={cfg.bias} is more than {LOGIT_LIMIT:g} "
           f"beyond the terms' reach ({reach:.1f}): every label would be "
           f"{int(cfg.bias > 0)}")


def _validate_timeline(cfg: DataConfig) -> None:
    _check(0 <= cfg.users <= 100_000_000, f"users must be in [0, 1e8], got {cfg.users}")
    if not cfg.is_timeline:
        _check(cfg.days == 0, f"days={cfg.days} needs --users > 0 (timeline mode)")
        return
    _check(3 <= cfg.days <= 3_650, "timeline mode needs days in [3, 3650] (train on days "
           f"1..days-2, validate on days-1, test on the last), got days={cfg.days}")
    _check(_finite(cfg.impressions_per_day) and cfg.impressions_per_day > 0,
           f"impressions_per_day must be > 0, got {cfg.impressions_per_day}")
    _check(_finite(cfg.activity_shape) and cfg.activity_shape > 0,
           f"activity_shape must be > 0, got {cfg.activity_shape}")


def config_from_dict(d: dict[str, Any]) -> DataConfig:
    """The DataConfig recorded in a meta.json `config` (derived keys such as length_model are
    ignored), validated."""
    names = {f.name for f in dataclasses.fields(DataConfig)}
    values = {k: v for k, v in d.items() if k in names}
    if "oracle_ks" in values:
        values["oracle_ks"] = tuple(values["oracle_ks"])
    cfg = DataConfig(**values)
    validate_config(cfg)
    return cfg
