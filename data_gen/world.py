"""The item universe: Zipf popularity, latent clusters, categories, motifs, an exact sampler.

Popularity by rank k is p(k) = k^-alpha / Z for any alpha > 0; ranks map to ids and to
clusters by random permutations. A draw picks a cluster, then an item by the cluster's own
popularity, both from alias tables (O(1) per draw whatever the skew); drawing clusters by mass
gives exactly the global Zipf law. docs/data.md says why (and what was tried first).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .config import DataConfig

def _vose(p: np.ndarray) -> tuple[list[float], list[int]]:
    """Walker's alias table for one distribution (Vose's O(n) construction), as lists."""
    n = p.size
    q = (p * (n / p.sum())).tolist()
    alias = list(range(n))
    small = [i for i, x in enumerate(q) if x < 1.0]
    large = [i for i, x in enumerate(q) if x >= 1.0]
    while small and large:
        s, big = small.pop(), large[-1]
        alias[s] = big
        q[big] -= 1.0 - q[s]  # the large entry gives away the small one's deficit
        if q[big] < 1.0:
            small.append(large.pop())
    for i in small + large:  # rounding leftovers: keep themselves
        q[i] = 1.0
    return q, alias


# One 16-byte record per position, so that a draw touches a single cache line.
ALIAS_RECORD = np.dtype([("keep", "<f4"), ("value", "<i4"), ("alias", "<i4"), ("pad", "<i4")])


@dataclass(frozen=True)
class AliasTable:
    """Exact O(1) sampling for several discrete distributions stored back to back.

    Distribution c owns positions [start[c], start[c] + size[c]). A draw picks a position
    uniformly in its distribution and returns its value with probability keep, else its alias's
    value (Walker, 1977). One uniform serves both choices: scaled by the distribution's size,
    its integer part picks the position and its fraction decides keep-or-alias. Unlike an
    inverse-CDF search, the cost does not depend on how skewed a distribution is (a cluster
    holding a head item puts ~99% of its mass on it). `keep` in float32 has relative precision
    6e-8, far below any sampling error the data could show."""

    table: np.ndarray  # [P] ALIAS_RECORD
    start: np.ndarray  # [C] int32 (int64 if P does not fit)
    size: np.ndarray  # [C] float64, positions per distribution

    @classmethod
    def build(cls, p: np.ndarray, start: np.ndarray, values: np.ndarray) -> "AliasTable":
        """p: float64 [P] weights laid out by distribution (start: int [C + 1]); values:
        int32 [P], what a draw of each position returns."""
        table = np.zeros(p.size, dtype=ALIAS_RECORD)
        table["value"] = values
        for c in range(start.size - 1):  # a Python loop over distributions: once per data set
            lo, hi = int(start[c]), int(start[c + 1])
            q, a = _vose(p[lo:hi])
            table["keep"][lo:hi] = q
            table["alias"][lo:hi] = values[lo:hi][a]
        dtype = np.int32 if p.size < 2**31 else np.int64
        return cls(table=table, start=start[:-1].astype(dtype),
                   size=np.diff(start).astype(np.float64))

    def sample(self, which: np.ndarray | None, u: np.ndarray,
               out: np.ndarray | None = None) -> np.ndarray:
        """Values drawn from distribution `which` (int [N]; None: the only one) with uniforms
        u in [0, 1) (float64 [N]). Returns int32 [N] (into out if given)."""
        x = u * (self.size[0] if which is None else self.size[which])  # [N]
        pos = x.astype(self.start.dtype)
        x -= pos  # the fraction: uniform in [0, 1) and independent of the position
        if which is not None:
            pos += self.start[which]
        rec = self.table[pos]  # [N] records
        if out is None:
            out = np.empty(u.shape, dtype=np.int32)
        np.copyto(out, rec["alias"])
        np.copyto(out, rec["value"], where=x < rec["keep"])
        return out


@dataclass(frozen=True)
class World:
    """Tables shared by every shard; built once from the world seed and never mutated.

    V = vocab_size, K = n_clusters. Cluster c's items are distribution c of `items`."""

    items: AliasTable  # within-cluster popularity, one distribution per cluster
    clusters: AliasTable  # cluster mass Z_c / Z, one distribution over the K clusters
    mass: np.ndarray  # [K] float64, Z_c / Z
    item_cluster: np.ndarray  # [V] int32, cluster of each item id
    item_rank: np.ndarray  # [V] int32, popularity rank of each item id (0 = most popular)
    quality: np.ndarray  # [V] float32, per-item logit offset in the planted label model
    dense_w: np.ndarray  # [n_dense] float64, weights of the dense features in the label model
    cluster_category: np.ndarray  # [K] int16, the category of each cluster
    item_category: np.ndarray  # [V] int16, the true category of each item (the label's)
    shown_category: np.ndarray  # [V] int16, the category the files show (category_noise wrong)
    category_clusters: AliasTable  # a category's clusters by mass, one distribution per category
    motifs: np.ndarray  # [n_motifs, 2] int16, categories (a, b): a then b favours b
    motif_of: np.ndarray  # [n_categories] int32, the motif ending in each category, or -1

    @property
    def n_clusters(self) -> int:
        return int(self.mass.size)

    def sample_clusters_by_mass(self, u: np.ndarray) -> np.ndarray:
        """Clusters with probability Z_c / Z for uniforms u (float64) in [0, 1): int32."""
        return self.clusters.sample(None, u.reshape(-1)).reshape(u.shape)

    def sample_items(self, cluster: np.ndarray, u: np.ndarray,
                     out: np.ndarray | None = None) -> np.ndarray:
        """Item ids drawn from each cluster's popularity p(k) / Z_c with uniforms u.

        cluster: int [N] in [0, K); u: float64 [N] in [0, 1); out: optional int32 [N] to fill.
        Returns int32 [N]. (The exact item law needs u's full float64 resolution.)"""
        return self.items.sample(cluster, u, out=out)

    def sample_category_items(self, category: np.ndarray, u: np.ndarray) -> np.ndarray:
        """Item ids of the given categories (int [N]): a cluster of the category by mass, then an
        item by popularity, from two uniforms per draw (u: float64 [2, N]). Returns int32 [N]."""
        return self.sample_items(self.category_clusters.sample(category, u[0]), u[1])


def zipf_probs(vocab_size: int, alpha: float) -> np.ndarray:
    """p(rank k) = k^-alpha / Z for k = 1..V, as float64 [V] (index 0 = rank 1)."""
    w = np.exp(-alpha * np.log(np.arange(1, vocab_size + 1, dtype=np.float64)))
    return w / w.sum()


def world_seed(seed: int) -> np.random.SeedSequence:
    """The world's seed stream: the first child of the data set's seed (the rest of the
    children seed the shards, in either mode)."""
    return np.random.SeedSequence(seed).spawn(1)[0]


def build_world(cfg: DataConfig, seed: np.random.SeedSequence) -> World:
    """All item-level tables for cfg, from the world's own seed stream (deterministic)."""
    rng = np.random.default_rng(seed)
    v, k = cfg.vocab_size, cfg.n_clusters
    p_rank = zipf_probs(v, cfg.alpha)  # [V]
    item_of_rank = rng.permutation(v).astype(np.int32)  # rank -> id
    cluster_of_rank = (rng.permutation(v) % k).astype(np.int32)  # equal sizes, random members
    order = np.lexsort((np.arange(v), cluster_of_rank))  # by cluster, then by rank
    start = np.searchsorted(cluster_of_rank[order], np.arange(k + 1)).astype(np.int64)
    p_pos = p_rank[order]  # [V] probability of each position
    mass = np.add.reduceat(p_pos, start[:-1])  # [K] Z_c / Z
    item_cluster = np.empty(v, dtype=np.int32)
    item_cluster[item_of_rank] = cluster_of_rank
    item_rank = np.empty(v, dtype=np.int32)
    item_rank[item_of_rank] = np.arange(v, dtype=np.int32)
    quality = (rng.standard_normal(v) * cfg.quality_sd).astype(np.float32)
    # Half of the dense features carry signal, half are noise a model should learn to ignore.
    dense_w = rng.standard_normal(cfg.n_dense) * cfg.dense_sd
    dense_w[cfg.n_dense // 2 + cfg.n_dense % 2:] = 0.0
    n_cat = cfg.n_categories
    cluster_category = (rng.permutation(k) % n_cat).astype(np.int16)  # [K] balanced
    item_category = cluster_category[item_cluster]
    shown = item_category.copy()
    wrong = np.flatnonzero(rng.random(v) < cfg.category_noise)
    shown[wrong] = (shown[wrong] + rng.integers(1, n_cat, wrong.size)) % n_cat  # never the true one
    by_cat = np.argsort(cluster_category, kind="stable")  # clusters grouped by category
    cat_start = np.searchsorted(cluster_category[by_cat], np.arange(n_cat + 1))
    motifs = rng.permutation(n_cat)[:2 * cfg.n_motifs].reshape(2, -1).T.astype(np.int16)
    motif_of = np.full(n_cat, -1, np.int32)
    motif_of[motifs[:, 1]] = np.arange(cfg.n_motifs)
    return World(
        items=AliasTable.build(p_pos, start, item_of_rank[order]),
        clusters=AliasTable.build(mass, np.array([0, k]), np.arange(k, dtype=np.int32)),
        mass=mass, item_cluster=item_cluster, item_rank=item_rank, quality=quality,
        dense_w=dense_w, cluster_category=cluster_category, item_category=item_category,
        shown_category=shown, category_clusters=AliasTable.build(
            mass[by_cat], cat_start, by_cat.astype(np.int32)),
        motifs=motifs, motif_of=motif_of)
