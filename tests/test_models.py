"""The rankers: same parameters and same function for the dense, sdpa and jagged attention layouts."""

from __future__ import annotations

import copy

import pytest
import torch

from models import ATTENTIONS, Ranker, RankerConfig
from models.attention import Histories
from tolerance import assert_close_to_oracle, resolution_floor

VOCAB, N_ACTIONS, N_DENSE, N_CATEGORIES = 97, 3, 5, 7


def _batch(lengths: list[int], max_seq_len: int, dtype=torch.float32) -> dict:
    lengths_t = torch.tensor(lengths, dtype=torch.int64)
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    offsets[1:] = lengths_t.cumsum(0)
    total = int(offsets[-1])
    return {
        "hist_item": torch.randint(0, VOCAB, (total,), dtype=torch.int32),
        "hist_action": torch.randint(0, N_ACTIONS, (total,), dtype=torch.int8),
        "hist_age": torch.rand(total) * 400,
        "offsets": offsets,
        "max_seq_len": max_seq_len,
        "cand_item": torch.randint(0, VOCAB, (len(lengths),), dtype=torch.int32),
        "dense": torch.randn(len(lengths), N_DENSE, dtype=dtype),
    }


def _ranker(attention: str, **kw) -> Ranker:
    cfg = RankerConfig(**{"attention": attention, "embed_dim": 48, "num_heads": 2, "num_layers": 2, "pool_heads": 3,
                          "mlp_dims": [32], **kw})
    model = Ranker(cfg, vocab_size=VOCAB, n_actions=N_ACTIONS, n_dense=N_DENSE, n_categories=N_CATEGORIES)
    if model.embed.category is not None:  # a catalogue with unknown ids (category N_CATEGORIES) too
        model.embed.set_categories(torch.randint(0, N_CATEGORIES + 1, (VOCAB,)))
    for p in model.parameters():  # the residual branches start at zero: give them weights to check
        if p.abs().sum() == 0 and p.dim() == 2:
            torch.nn.init.normal_(p, std=0.05)
    return model


def _with_attention(model: Ranker, attention: str, dtype: torch.dtype) -> Ranker:
    other = _ranker(attention, target_attention=model.cfg.target_attention, interaction=model.cfg.interaction,
                    raw_history=model.cfg.raw_history, local_window=model.cfg.local_window)
    other.load_state_dict(model.state_dict(), strict=True)
    return other.to(dtype)


def _logits_and_grads(model: Ranker, batch: dict, weights: torch.Tensor):
    model.zero_grad(set_to_none=True)
    b = dict(batch, dense=batch["dense"].to(next(model.parameters()).dtype))
    logits = model(**b)
    (logits * weights.to(logits.dtype)).sum().backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return logits.detach(), grads


@pytest.mark.parametrize("lengths,max_seq_len", [([0, 1, 7, 12, 3], 12), ([5], 5), ([0, 0], 4), ([33, 2, 0, 17], 40)])
@pytest.mark.parametrize("blocks", [dict(), dict(target_attention=False, interaction=False), dict(raw_history=True),
                                    dict(local_window=2)])
def test_layouts_agree_with_fp64_oracle(lengths, max_seq_len, blocks):
    """Logits and every parameter gradient of each attention vs the fp64 dense oracle."""
    base = _ranker("dense", **blocks)
    batch = _batch(lengths, max_seq_len)
    weights = torch.randn(len(lengths))
    oracle = _with_attention(base, "dense", torch.float64)
    oracle_logits, oracle_grads = _logits_and_grads(oracle, batch, weights.double())
    lowp_logits, lowp_grads = _logits_and_grads(_with_attention(base, "dense", torch.float32), batch, weights)
    for attention in ATTENTIONS:
        logits, grads = _logits_and_grads(_with_attention(base, attention, torch.float32), batch, weights)
        assert_close_to_oracle(logits, oracle_logits.float(), lowp_logits, f"{attention} logits")
        assert grads.keys() == oracle_grads.keys()
        for name, g in grads.items():
            assert_close_to_oracle(g, oracle_grads[name].float(), lowp_grads[name], f"{attention} grad {name}")


def test_a_local_window_limits_what_each_item_reads():
    """With local_window w, changing the item w + 1 places before the newest one leaves the
    newest item's encoding (after one block) unchanged in every layout; within it, changed."""
    base = _ranker("dense", local_window=2)
    batch = _batch([9], 9)
    for attention in ATTENTIONS:
        model = _with_attention(base, attention, torch.float64)
        hist = Histories(batch["offsets"], 9, attention)

        def newest(items):
            x = hist.layout(model.embed(items, batch["hist_action"], batch["hist_age"]).double())
            x = model.blocks[0](x, hist)
            return x.reshape(-1, x.shape[-1])[8]

        far, near = batch["hist_item"].clone(), batch["hist_item"].clone()
        far[5], near[6] = (far[5] + 1) % VOCAB, (near[6] + 1) % VOCAB
        torch.testing.assert_close(newest(far), newest(batch["hist_item"]), msg=attention)
        assert not torch.allclose(newest(near), newest(batch["hist_item"])), attention


def test_state_dict_is_layout_independent():
    models = {b: _ranker(b) for b in ATTENTIONS}
    keys = {b: list(m.state_dict()) for b, m in models.items()}
    assert keys["dense"] == keys["sdpa"] == keys["jagged"]
    shapes = {b: [t.shape for t in m.state_dict().values()] for b, m in models.items()}
    assert shapes["dense"] == shapes["sdpa"] == shapes["jagged"]


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_empty_histories_are_finite(attention):
    model = _ranker(attention)
    batch = _batch([0, 0, 0], 8)
    logits = model(**batch)
    logits.sum().backward()
    assert torch.isfinite(logits).all()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_history_order_matters_through_age_only():
    """A candidate's logit depends on its own history, not on the other rows of the batch."""
    model = _ranker("jagged")
    batch = _batch([4, 6], 8)
    full = model(**batch)
    second = {k: (v[4:] if k.startswith("hist_") else v[1:] if k in ("cand_item", "dense") else v) for k, v in batch.items()}
    second["offsets"] = torch.tensor([0, 6])
    torch.testing.assert_close(model(**second), full[1:])


def test_the_category_embedding_reads_the_catalogue_and_can_be_switched_off():
    batch = _batch([5, 0, 9], 12)
    model = _ranker("jagged")
    before = model(**batch)
    model.embed.set_categories((model.embed.item_category + 1) % (N_CATEGORIES + 1))
    assert not torch.allclose(model(**batch), before)  # same ids, other categories
    assert model.embed.item_category.dtype == torch.int32 and "embed.item_category" in model.state_dict()
    off = _ranker("jagged", category_embedding=False)
    assert off.embed.category is None and not any("categor" in k for k in off.state_dict())
    assert Ranker(RankerConfig(), vocab_size=VOCAB, n_actions=N_ACTIONS, n_dense=N_DENSE).embed.category is None


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_rotary_positions_make_the_order_of_a_history_visible(attention):
    """With equal ages, a history and its reverse differ only in order: the ranker with rotary
    positions tells them apart, the one without gives both the same logit."""
    batch = _batch([6, 9], 10)
    batch["hist_age"] = torch.full_like(batch["hist_age"], 3.0)
    rev = dict(batch)
    for k in ("hist_item", "hist_action"):
        rev[k] = torch.cat([batch[k][:6].flip(0), batch[k][6:].flip(0)])
    for rotary in (True, False):
        model = _ranker(attention, rotary_positions=rotary)
        same = torch.allclose(model(**batch), model(**rev), atol=1e-5)
        assert same != rotary


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_raw_history_reads_the_items_before_the_blocks_and_adds_a_read_of_the_encoded_ones(attention):
    """With raw_history, target attention, the mean and the poolings equal those of the ranker
    without blocks (same weights); only the extra target attention sees what the blocks did."""
    batch = _batch([5, 0, 9, 1], 12)
    raw = _ranker(attention, raw_history=True)
    plain = _ranker(attention, num_layers=0)
    state = {k.replace("norm_raw.", "norm."): v for k, v in raw.state_dict().items()
             if not k.startswith(("blocks.", "norm.", "target_encoded.", "head."))}
    missing = plain.load_state_dict(state, strict=False).missing_keys
    assert missing == [k for k in plain.state_dict() if k.startswith("head.")]
    seen = {}
    for name, model in (("raw", raw), ("plain", plain)):
        for part in ("target", "interaction"):
            getattr(model, part).register_forward_hook(lambda m, i, o, key=(name, part): seen.__setitem__(key, o))
        model(**batch)
    for part in ("target", "interaction"):
        torch.testing.assert_close(seen["raw", part], seen["plain", part])
    assert raw.head[0].in_features == plain.head[0].in_features + raw.cfg.embed_dim
    before = raw(**batch)
    torch.nn.init.normal_(raw.blocks[0].qkv.weight)  # the blocks reach the logit through target_encoded
    assert not torch.allclose(raw(**batch), before)
    assert _ranker(attention, raw_history=True, num_layers=0).target_encoded is None


def test_bad_config_says_what_to_fix():
    with pytest.raises(ValueError, match="attention must be one of"):
        RankerConfig(attention="flash")
    with pytest.raises(ValueError, match="multiple of num_heads"):
        RankerConfig(embed_dim=10, num_heads=3)


def test_deepcopy_and_eval_mode_do_not_change_logits():
    model = _ranker("sdpa").eval()
    batch = _batch([3, 0, 5], 6)
    torch.testing.assert_close(copy.deepcopy(model)(**batch), model(**batch))


def _smooth_head(model: Ranker) -> Ranker:
    """The head's ReLUs as GELUs: a bf16 rounding that moves a pre-activation across ReLU's kink
    flips a whole gradient term, in any layout, so a check of the layouts' bf16 error keeps
    its inputs off the kink (what gradcheck asks of its inputs too)."""
    for i, layer in enumerate(model.head):
        if isinstance(layer, torch.nn.ReLU):
            model.head[i] = torch.nn.GELU()
    return model


@pytest.mark.gpu
@pytest.mark.parametrize("lengths,max_seq_len", [([0, 1, 70, 128, 33, 5], 128), ([300, 0, 257, 1], 300)])
@pytest.mark.parametrize("window", [None, 2])
def test_layouts_agree_on_cuda_in_bf16_autocast(lengths, max_seq_len, window):
    """On the GPU (Triton kernels in the jagged attention), in bf16 autocast as the paper preset
    trains: each attention within 2x the dense attention's own bf16 error against the fp64 oracle;
    with and without a local window."""
    base = _ranker("dense", local_window=window)
    batch = _batch(lengths, max_seq_len)
    weights = torch.randn(len(lengths))
    oracle_logits, oracle_grads = _logits_and_grads(_smooth_head(_with_attention(base, "dense", torch.float64)),
                                                    batch, weights.double())
    cuda_batch = {k: v.cuda() if torch.is_tensor(v) else v for k, v in batch.items()}

    def run(attention):
        model = _smooth_head(_with_attention(base, attention, torch.float32)).cuda()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits, grads = _logits_and_grads(model, cuda_batch, weights.cuda())
        return logits.cpu(), {n: g.cpu() for n, g in grads.items()}

    lowp_logits, lowp_grads = run("dense")
    misses = []  # every layout is checked, so that one layout's miss does not hide another's
    for attention in ATTENTIONS:
        logits, grads = run(attention)
        # the values have bf16 resolution (autocast's matmuls return bf16: the weight gradients and
        # the head's output are bf16 numbers held in fp32), so the floor is the rule's floor for bf16
        # values, as for every bf16 kernel output; the 1e-3 used before is an eighth of a bf16 ulp at
        # magnitude 1, below what two correct bf16 computations can be held to
        checks = [("logits", logits, oracle_logits, lowp_logits, resolution_floor(torch.bfloat16, oracle_logits))]
        checks += [(f"grad {n}", g, oracle_grads[n], lowp_grads[n], resolution_floor(torch.bfloat16, oracle_grads[n]))
                   for n, g in grads.items()]
        for what, out, oracle, lowp, floor in checks:
            try:
                assert_close_to_oracle(out, oracle.float(), lowp, f"{attention} {what}", floor=floor)
            except AssertionError as miss:
                misses.append(str(miss))
    assert not misses, "\n".join(misses)


def test_bad_local_windows_are_refused():
    from models.config import InvalidConfig, S2Config

    with pytest.raises(InvalidConfig, match="local_window must be >= 1"):
        RankerConfig(local_window=0)
    with pytest.raises(InvalidConfig, match="local_window and model.ranker.s2"):
        RankerConfig(local_window=4, s2=S2Config(block=16, local_blocks=1, stride=2))


def test_the_history_and_the_candidates_are_one_lookup_with_the_two_lookups_rows_and_gradient():
    """HistoryEmbedding.item_rows looks both up at once: one [vocab, D] gradient instead of two summed."""
    from models.layers import HistoryEmbedding

    emb = HistoryEmbedding(50, 3, 8, 6, n_categories=4).double()
    hist, cand = torch.randint(0, 50, (30,), dtype=torch.int32), torch.randint(0, 50, (5,))
    rows = emb.item_rows(hist, cand)
    assert [r.shape for r in rows] == [(30, 8), (5, 8)]
    assert torch.equal(rows[0], emb.item(hist)) and torch.equal(rows[1], emb.item(cand))
    (rows[0].sum() * 2 + rows[1].pow(2).sum()).backward()
    one = emb.item.weight.grad.clone()
    emb.zero_grad()
    (emb.item(hist).sum() * 2 + emb.item(cand).pow(2).sum()).backward()
    torch.testing.assert_close(one, emb.item.weight.grad, rtol=1e-12, atol=1e-12)
    assert torch.equal(emb.candidate(cand, rows[1]), emb.candidate(cand))
