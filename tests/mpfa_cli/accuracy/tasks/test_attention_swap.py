"""The attention swap really replaces the computation, on a tiny randomly initialised Llama (no download)."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from mpfa.kernels.smoothing import sequence_means  # noqa: E402
from mpfa.mpfa_cli.accuracy.tasks.attention_swap import AttentionSwapError, VariantAttention, install  # noqa: E402


def _tiny_model(seed: int):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=96, hidden_size=128, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=128,
    )
    model = transformers.LlamaForCausalLM(config).eval()
    model.set_attn_implementation("sdpa")
    return model


def _ids(seed: int, length: int) -> torch.Tensor:
    return torch.randint(0, 96, (1, length), generator=torch.Generator().manual_seed(seed))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@torch.inference_mode()
def test_bf16_matches_transformers_and_direct_nvfp4_differs():
    model, ids = _tiny_model(1), _ids(2, 40)
    reference = model(ids).logits
    errors = {}
    for variant in ("float64", "bf16", "qk4-pv8-direct"):
        install(model, variant)
        out = model(ids).logits
        assert torch.isfinite(out).all()
        errors[variant] = _rel(out, reference)
    assert errors["float64"] < 1e-5  # the swap itself is exact: same math as SDPA
    assert errors["bf16"] < 1e-2  # BF16 operand rounding only
    assert errors["qk4-pv8-direct"] > 3 * errors["bf16"]  # NVFP4 Q/K + FP8 P/V: measurably different


@torch.inference_mode()
def test_decode_with_cache_matches_transformers_and_means_stay_frozen():
    model, ids = _tiny_model(3), _ids(4, 33)
    prompt, step = ids[:, :32], ids[:, 32:]
    sdpa_out = model(input_ids=prompt, use_cache=True)
    sdpa_next = model(input_ids=step, cache=sdpa_out.cache, use_cache=True).logits

    bf16 = install(model, "bf16")
    bf16.reset()
    out = model(input_ids=prompt, use_cache=True)
    assert _rel(model(input_ids=step, cache=out.cache, use_cache=True).logits, sdpa_next) < 1e-2

    mpfa = install(model, "mpfa")
    mpfa.reset()
    captured = {}
    layer0 = model.model.layers[0].self_attn

    def keep_means(*_) -> None:
        captured["means"] = mpfa._means[0]

    hook = layer0.register_forward_hook(keep_means)
    out = model(input_ids=prompt, use_cache=True)
    hook.remove()
    prefill_means = captured["means"]
    model(input_ids=step, cache=out.cache, use_cache=True)
    assert mpfa._means[0] is prefill_means  # decode reused the prompt's means
    # ... which are the means of the prompt's BF16 keys (the first 32 of the cache's 33)
    keys = out.cache.layers[0].keys[0, :, :32].transpose(0, 1).to(torch.bfloat16)
    torch.testing.assert_close(prefill_means.k_mean, sequence_means(keys, torch.tensor([0, 32])), rtol=0, atol=1e-5)


def test_misuse_is_a_clear_error():
    model = _tiny_model(5)
    with pytest.raises(AttentionSwapError, match="unknown attention variant"):
        install(model, "fp4")
    mpfa = install(model, "mpfa")
    mpfa.reset()
    with torch.inference_mode():
        out = model(input_ids=_ids(6, 20), use_cache=True)
        mpfa.reset()
        with pytest.raises(AttentionSwapError, match="before any prefill"):
            model(input_ids=_ids(7, 1), cache=out.cache, use_cache=True)
        mpfa.reset()
        mpfa.set_key_mask(torch.ones(2, 9, dtype=torch.bool))  # a padded batch's mask of another call's shape
        with pytest.raises(AttentionSwapError, match="set_key_mask before each forward call"):
            model(input_ids=torch.cat([_ids(8, 10), _ids(9, 10)]))


def test_variant_attention_needs_a_known_variant():
    with pytest.raises(AttentionSwapError):
        VariantAttention("int8")


@torch.inference_mode()
@pytest.mark.parametrize("variant", ["fp8", "qk4-pv8-direct", "mpfa", "qk4-pv4"])
def test_kept_key_operands_give_the_same_logits_as_preparing_all(variant, monkeypatch):
    """Decode steps and choices scored on copies of one cache reuse the prepared keys; the logits are bit-identical
    to preparing every key at every call (qk4-pv4 blocks V along tokens, so it never keeps keys)."""
    import copy

    model, ids = _tiny_model(5), _ids(6, 40)
    prompt, steps = ids[:, :30], ids[:, 30:]

    def run(keep: bool) -> list[torch.Tensor]:
        fn = install(model, variant)
        fn.keep_keys = keep and fn.keep_keys
        fn.reset()
        out = model(input_ids=prompt, use_cache=True)
        logits = [out.logits]
        for choice in (steps[:, :4], steps[:, 4:6], steps[:, 6:]):  # like choice_logprobs: copies of the prompt's cache
            logits.append(model(input_ids=choice, cache=copy.deepcopy(out.cache), use_cache=True).logits)
        cache = out.cache
        for t in range(steps.shape[1]):  # like greedy_answer: one token at a time
            step = model(input_ids=steps[:, t:t + 1], cache=cache, use_cache=True)
            cache = step.cache
            logits.append(step.logits)
        return logits

    from mpfa.mpfa_cli.accuracy.tasks import attention_swap

    prepared_keys: list[int] = []
    prepare = attention_swap.prepare_batch
    monkeypatch.setattr(attention_swap, "prepare_batch",
                        lambda q, k, v, **kw: prepared_keys.append(k.shape[1]) or prepare(q, k, v, **kw))
    kept = run(True)
    reused = min(prepared_keys) == 1  # a decode step prepared only its own key
    fresh = run(False)
    assert reused == (variant != "qk4-pv4")
    assert all(torch.isfinite(x).all() for x in kept)
    assert all(torch.equal(a, b) for a, b in zip(kept, fresh))
    assert install(model, variant).keep_keys == (variant != "qk4-pv4")


def _padded_run(model, fn, rows: list[torch.Tensor], steps: torch.Tensor,
                active: list[list[bool]]) -> list[torch.Tensor]:
    """Right-padded prefill of `rows` then one decode step per column of `steps` [B, T] (inactive rows feed a masked
    pad token), as `generation.greedy_answers` runs them -> logits per call (padding positions zeroed)."""
    fn.reset()
    lengths = torch.tensor([r.numel() for r in rows])
    width = int(lengths.max())
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.arange(width) < lengths[:, None]
    for b, r in enumerate(rows):
        ids[b, : r.numel()] = r
    fn.set_key_mask(mask)
    out = model(input_ids=ids, attention_mask=mask, position_ids=torch.arange(width).expand_as(ids), use_cache=True)
    logits = [out.logits.masked_fill(~mask[..., None], 0)]
    for t in range(steps.shape[1]):
        on = torch.tensor([a[t] for a in active])
        mask = torch.cat([mask, on[:, None]], 1)
        fn.set_key_mask(mask)
        out = model(input_ids=torch.where(on, steps[:, t], 0)[:, None], attention_mask=mask,
                    position_ids=(lengths + t)[:, None], cache=out.cache, use_cache=True)
        logits.append(out.logits.masked_fill(~on[:, None, None], 0))
    return logits


@torch.inference_mode()
@pytest.mark.parametrize("variant", ["bf16", "fp8", "mpfa", "qk4-pv4", "mpfa-qk8tile-psum"])
def test_padded_batch_logits_equal_each_row_alone_and_kept_keys_stay_exact(variant, monkeypatch):
    """A padded batch (prefill + decode steps with a finished row) gives each row's logits as run alone without any
    mask, and the per-slot kept key operands give bit-identical logits to preparing every key at every call."""
    from mpfa.mpfa_cli.accuracy.tasks import attention_swap

    model = _tiny_model(11)
    rows = [_ids(12, 30)[0], _ids(13, 9)[0], _ids(14, 21)[0]]
    steps = _ids(15, 12).view(3, 4)
    active = [[True] * 4, [True, True, False, False], [True, False, False, False]]
    fn = install(model, variant)
    fn.block_n = 16  # rows span several KV tiles
    prepared: list[int] = []
    prepare = attention_swap.prepare_batch
    monkeypatch.setattr(attention_swap, "prepare_batch",
                        lambda q, k, v, **kw: prepared.append(k.shape[1]) or prepare(q, k, v, **kw))
    batched = _padded_run(model, fn, rows, steps, active)
    assert (min(prepared) == 1) == (variant != "qk4-pv4")  # decode steps prepared only their own slot
    fn.keep_keys = False
    assert all(torch.equal(a, b) for a, b in zip(batched, _padded_run(model, fn, rows, steps, active)))
    fn.keep_keys = attention_swap.piecewise_keys(variant)
    for b, row in enumerate(rows):
        fn.reset()
        out = model(input_ids=row[None], use_cache=True)
        alone = [out.logits[0]]
        for t in range(sum(active[b])):
            out = model(input_ids=steps[b : b + 1, t : t + 1], cache=out.cache, use_cache=True)
            alone.append(out.logits[0])
        torch.testing.assert_close(batched[0][b, : row.numel()], alone[0], rtol=0, atol=1e-5)
        for t in range(sum(active[b])):
            torch.testing.assert_close(batched[t + 1][b], alone[t + 1], rtol=0, atol=1e-5)


@torch.inference_mode()
@pytest.mark.parametrize("variant", ["bf16", "mpfa", "mpfa-qk8tile-psum", "qk4-pv4"])
def test_query_chunks_with_only_the_reached_tiles_give_bit_identical_logits(variant):
    """Attending in chunks of a few query rows, each over the KV tiles its last query reaches, is the one-call
    attention bit for bit: padded batch, prefill and decode steps (the chunks that let a 32K prompt fit a GPU)."""
    model = _tiny_model(21)
    rows = [_ids(22, 45)[0], _ids(23, 17)[0], _ids(24, 38)[0]]
    steps = _ids(25, 9).view(3, 3)
    active = [[True] * 3, [True, False, False], [True, True, False]]
    fn = install(model, variant)
    fn.block_n = 16
    whole = _padded_run(model, fn, rows, steps, active)
    calls: list[int] = []
    attend = fn._attend_in_chunks
    fn._attend_in_chunks = lambda q, *a: calls.append(q.shape[1]) or attend(q, *a)
    fn.score_elements = 3 * 4 * 45 * 5  # batch x query heads x keys x 5 rows
    chunked = _padded_run(model, fn, rows, steps, active)
    assert max(calls) == 45  # a prefill call of 45 query rows went in chunks of 5
    assert all(torch.equal(a, b) for a, b in zip(whole, chunked))


def test_select_rows_must_follow_the_cache():
    model = _tiny_model(16)
    fn = install(model, "mpfa")
    fn.reset()
    with torch.inference_mode():
        out = model(input_ids=torch.cat([_ids(17, 8), _ids(18, 8)]), use_cache=True)
        out.cache.batch_select_indices(torch.tensor([0, 0, 1]))
        with pytest.raises(AttentionSwapError, match="select_rows"):
            model(input_ids=_ids(19, 3).view(3, 1), cache=out.cache, use_cache=True)
        fn.select_rows(torch.tensor([0, 0, 1]))
        assert torch.isfinite(model(input_ids=_ids(19, 3).view(3, 1), cache=out.cache, use_cache=True).logits).all()


@torch.inference_mode()
def test_calibrated_fp8_scales_each_kv_head_by_its_calibration_amax():
    """`calibrate_kv_scales` records amax / 448 per layer and KV head from one BF16 pass; fp8-calibrated runs the
    fp8 reference with those scales (a saturating K, here 5000x, clips at scale 1 and not with them)."""
    from mpfa.mpfa_cli.accuracy.tasks.attention_swap import calibrate_kv_scales

    model, ids = _tiny_model(21), _ids(22, 48)
    for layer in model.model.layers:  # push K far past e4m3's 448
        layer.self_attn.k_proj.weight.mul_(5000.0)
    scales = calibrate_kv_scales(model, ids[0].tolist())
    assert sorted(scales) == list(range(len(model.model.layers)))
    heads = model.config.num_key_value_heads
    assert all(k.shape == (heads,) and v.shape == (heads,) for k, v in scales.values())
    assert all(bool((k > 1).all()) for k, _ in scales.values())  # amax well above 448
    logits = {}
    for variant, kv in (("bf16", None), ("fp8", None), ("fp8-calibrated", scales)):
        install(model, variant, kv_scales=kv).reset()
        logits[variant] = model(input_ids=ids).logits
    error = {v: float((logits[v] - logits["bf16"]).norm()) for v in ("fp8", "fp8-calibrated")}
    assert error["fp8-calibrated"] < error["fp8"] / 2
    with pytest.raises(AttentionSwapError, match="calibrated K/V scales"):
        VariantAttention("fp8-calibrated")
    with pytest.raises(AttentionSwapError, match="calibrated K/V scales"):
        VariantAttention("fp8", scales)
