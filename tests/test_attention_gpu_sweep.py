"""A seeded randomized sweep of both attention ops on the GPU (compiled Triton kernels).

JAGGED_SWEEP_CASES (default 120) and JAGGED_SWEEP_SEED (default 0) set its size and seed; the
summary (cases, worst error and worst error / tolerance bound per dtype) is printed and, with
JAGGED_ERR_LOG set, appended there as JSON. Every case runs; failures are listed at the end.
"""

import os
import random

import pytest
import torch

import attention_checks as ac
from kernels._jagged_common import set_poison_outputs

# the head dims of the GPU grid tests (kernels already compiled) plus a few odd ones
DIMS = {torch.bfloat16: (16, 24, 48, 64, 96, 128, 200, 256), torch.float16: (64, 96, 256),
        torch.float32: (16, 48, 128)}


def _lengths(rng: random.Random, B: int, top: int) -> list[int]:
    kind = rng.choice(["uniform", "long_tail", "empties"])
    if kind == "uniform":
        return [rng.randint(0, top) for _ in range(B)]
    if kind == "long_tail":
        return [min(top, int(rng.paretovariate(1.2) * 8)) for _ in range(B)]
    return [rng.choice([0, 0, 1, rng.randint(0, top)]) for _ in range(B)]


def _case(rng: random.Random):
    dtype = rng.choice(list(DIMS))
    D, H = rng.choice(DIMS[dtype]), rng.choice([1, 2, 3, 4])
    N = rng.choice([1, 16, 63, 128, 200, 511, 1024])
    budget = 4e7  # padded B * H * N * Tq elements of the reference
    B = max(1, min(rng.choice([1, 3, 17, 64, 300]), int(budget / (H * N * N))))
    lengths = _lengths(rng, B, int(N * rng.choice([1.0, 1.0, 1.5])))  # some past max_seq_len
    if rng.random() < 0.5:
        return "flash", dict(lengths=lengths, H=H, D=D, max_seq_len=N, dtype=dtype,
                             causal=rng.random() < 0.5)
    Tq = rng.choice([1, 2, 16, 64, 100, 300])
    B = max(1, min(B, int(budget / (H * N * Tq))))
    return "dense", dict(lengths=lengths[:B], Tq=Tq, H=H, D=D, max_seq_len=N, dtype=dtype,
                         with_bias=rng.random() < 0.6)


@pytest.mark.gpu
def test_attention_gpu_sweep():
    n = int(os.environ.get("JAGGED_SWEEP_CASES", "120"))
    rng = random.Random(int(os.environ.get("JAGGED_SWEEP_SEED", "0")))
    set_poison_outputs(True)
    start = len(ac.RECORDS)
    failures = []
    try:
        for _ in range(n):
            op, kw = _case(rng)
            try:
                if op == "flash":
                    ac.check_flash(device="cuda", **kw)
                else:
                    ac.check_dense(device="cuda", **kw)
            except AssertionError as e:
                failures.append(f"{op} {kw['dtype']} D={kw['D']}: {str(e)[:300]}")
    finally:
        set_poison_outputs(False)
    records = ac.RECORDS[start:]
    ac.dump_summary(records, "sweep")
    print(f"\nsweep: {n} cases, {len(records)} comparisons, {len(failures)} failures")
    for dt, s in ac.summarize(records).items():
        print(f"  {dt}: worst err {s['worst_err']:.3e}, worst err/bound {s['worst_ratio']:.3f}"
              f" ({s['worst_case']})")
    assert not failures, "\n".join(failures[:20])


ALL_DIMS = list(range(16, 257, 8))


@pytest.mark.gpu
@pytest.mark.parametrize("D", ALL_DIMS, ids=[f"D{d}" for d in ALL_DIMS])
def test_every_head_dim_gpu(D):
    # every supported head dim, both ops, forward and backward (bf16; causal on every other);
    # JAGGED_DIM_SHARD="i/n" runs one shard of the dims (to spread compilation over processes)
    shard = os.environ.get("JAGGED_DIM_SHARD")
    if shard:
        i, n = map(int, shard.split("/"))
        if ALL_DIMS.index(D) % n != i:
            pytest.skip(f"shard {shard}")
    set_poison_outputs(True)
    start = len(ac.RECORDS)
    try:
        ac.check_flash([0, 37, 130, 1], 2, D, 100, D % 16 == 0, torch.bfloat16, "cuda")
        ac.check_dense([0, 37, 130, 1], 5, 2, D, 100, True, torch.bfloat16, "cuda")
    finally:
        set_poison_outputs(False)
        ac.dump_summary(ac.RECORDS[start:], f"D{D}")
