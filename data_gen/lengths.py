"""History-length distributions as exact probability tables over [0, max_len].

A table (rather than a sampler with a formula) gives the exact mean and quantiles that
meta.json records and the tests compare against, and sampling it is one `searchsorted` per row.
Power law and lognormal have one free parameter each, solved by bisection so that the mean is
`mean_len`; the uniform family has none and ignores `mean_len`."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from .config import ConfigError, DataConfig

_SQRT2 = math.sqrt(2.0)
_erfc = np.frompyfunc(math.erfc, 1, 1)


@dataclass(frozen=True)
class LengthModel:
    """pmf[n] = P(length == n) for n in [0, max_len] (zero below min_len); cdf ends at 1.0."""

    dist: str
    params: dict[str, float]
    pmf: np.ndarray  # [max_len + 1] float64
    cdf: np.ndarray  # [max_len + 1] float64

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """n lengths, int64 [n], by inverse CDF."""
        return np.searchsorted(self.cdf, rng.random(n), side="right").astype(np.int64)

    def quantile(self, q: float) -> int:
        """The smallest length whose CDF reaches q (numpy's 'inverted_cdf' quantile)."""
        return int(np.searchsorted(self.cdf, q - 1e-12, side="left"))

    def expected(self) -> dict[str, Any]:
        n = np.arange(self.pmf.size)
        over = {str(k): float(self.pmf[k + 1:].sum()) for k in (64, 256, 1024, 4096)}
        return {
            "mean": float((n * self.pmf).sum()),
            "p50": self.quantile(0.5), "p90": self.quantile(0.9), "p99": self.quantile(0.99),
            "frac_zero": float(self.pmf[0]),
            "frac_over": over,
        }


def _normalise(weights: np.ndarray, lo: int) -> np.ndarray | None:
    w = np.where(np.arange(weights.size) >= lo, weights, 0.0)
    total = w.sum()
    if not np.isfinite(total) or total <= 0:
        return None
    return w / total


def _power_pmf(lo: int, hi: int, exponent: float, shift: float) -> np.ndarray | None:
    # P(n) ~ (n + shift)^-exponent; a large shift flattens it toward uniform.
    n = np.arange(hi + 1, dtype=np.float64)
    return _normalise(np.exp(-exponent * np.log(n + shift)), lo)


def _std_normal_cdf_diff(z1: np.ndarray, z2: np.ndarray) -> np.ndarray:
    """Phi(z2) - Phi(z1) for z1 <= z2, computed in whichever tail avoids cancellation."""
    upper = z1 >= 0
    lower_tail = 0.5 * (_erfc(-z2 / _SQRT2) - _erfc(-z1 / _SQRT2)).astype(np.float64)
    upper_tail = 0.5 * (_erfc(z1 / _SQRT2) - _erfc(z2 / _SQRT2)).astype(np.float64)
    return np.where(upper, upper_tail, lower_tail)


def _lognormal_pmf(lo: int, hi: int, sigma: float, mu: float) -> np.ndarray | None:
    # length = floor(X), X ~ LogNormal(mu, sigma), truncated to [lo, hi] and renormalised.
    n = np.arange(hi + 1, dtype=np.float64)
    with np.errstate(divide="ignore"):
        z1 = (np.log(n) - mu) / sigma  # [hi + 1], -inf at n = 0
    z2 = (np.log(n + 1.0) - mu) / sigma
    return _normalise(np.maximum(_std_normal_cdf_diff(z1, z2), 0.0), lo)


def _mean(pmf: np.ndarray) -> float:
    return float((np.arange(pmf.size) * pmf).sum())


def _solve(make, lo_param: float, hi_param: float, target: float, log_space: bool, what: str):
    """Bisection for the parameter whose pmf has mean `target` (the mean rises with it)."""
    def at(x: float) -> np.ndarray | None:
        return make(math.exp(x) if log_space else x)

    a, b = (math.log(lo_param), math.log(hi_param)) if log_space else (lo_param, hi_param)
    pa, pb = at(a), at(b)
    m_lo = _mean(pa) if pa is not None else float("nan")
    m_hi = _mean(pb) if pb is not None else float("nan")
    if not (m_lo <= target <= m_hi):
        raise ConfigError(f"mean_len={target} is out of reach for {what}: "
                          f"it can give means between {m_lo:.1f} and {m_hi:.1f}")
    for _ in range(80):
        mid = 0.5 * (a + b)
        pm = at(mid)
        if pm is not None and _mean(pm) < target:
            a = mid
        else:
            b = mid
    x = 0.5 * (a + b)
    return (math.exp(x) if log_space else x), at(x)


def build_length_model(cfg: DataConfig) -> LengthModel:
    """The exact length table for cfg's family, with its free parameter solved for mean_len."""
    lo, hi = cfg.min_len, cfg.max_len
    if cfg.length_dist == "uniform" or lo == hi:
        pmf = _normalise(np.ones(hi + 1), lo)
        params: dict[str, float] = {}
    elif cfg.length_dist == "power":
        beta = cfg.length_exponent
        shift, pmf = _solve(lambda s: _power_pmf(lo, hi, beta, s), 1e-3, 1e12, cfg.mean_len,
                            True, f"a power law of exponent {beta} on [{lo}, {hi}]")
        params = {"exponent": beta, "shift": shift}
    else:
        sigma = cfg.length_sigma
        span = 8.0 * sigma
        mu, pmf = _solve(lambda m: _lognormal_pmf(lo, hi, sigma, m), math.log(lo + 1) - span,
                         math.log(hi + 1) + span, cfg.mean_len, False,
                         f"a lognormal of sigma {sigma} on [{lo}, {hi}]")
        params = {"mu": mu, "sigma": sigma}
    assert pmf is not None
    cdf = np.cumsum(pmf)
    cdf[-1] = 1.0  # so that searchsorted(cdf, u < 1) never runs off the end
    return LengthModel(cfg.length_dist, params, pmf, cdf)
