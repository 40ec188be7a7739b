"""The SGLang hook functions on stand-in objects (no SGLang needed): pass-through for other backends, the MpFA
cell size (the means' share per page included) in SGLang's capacity formula, and launcher-side validation of the
server arguments."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from mpfa.backends.sglang_plugin import hooks, runner_checks
from mpfa.backends.sglang_plugin.pool_sizing import PoolGeometry, cell_size
from mpfa.backends.sglang_plugin.setup_checks import MpfaSetupError


class _Config:
    head_dim = v_head_dim = 128
    dtype = "torch.bfloat16"

    def __init__(self, heads=32, kv_heads=8):
        self.heads, self.kv_heads = heads, kv_heads

    def get_num_attention_heads(self, tp):
        return self.heads // tp

    def get_num_kv_heads(self, tp):
        return max(1, self.kv_heads // tp)


def _runner(backend, page_size=128):
    return SimpleNamespace(server_args=SimpleNamespace(attention_backend=backend, page_size=page_size),
                           model_config=_Config(), dp_size=1)


@pytest.fixture(autouse=True)
def _tp1(monkeypatch):
    monkeypatch.setattr(runner_checks, "attention_tp_size", lambda: 1)


def test_cell_size_hook_passes_other_backends_through():
    assert hooks.around_compute_cell_size(lambda c, r, n: 12345, SimpleNamespace(), _runner("fa4"), 32) == 12345


@pytest.mark.parametrize("backend,means", [("mpfa", 40 * 128 * 2 * 32 // 128), ("mpfa-direct", 0)])
def test_cell_size_for_mpfa_carries_each_page_s_share_of_the_means(backend, means):
    size = hooks.around_compute_cell_size(lambda *a: pytest.fail("BF16 cell size used"), SimpleNamespace(),
                                          _runner(backend), 32)
    g = PoolGeometry(32, 8, 128, 32)
    assert size == cell_size(g, 128, backend == "mpfa") == 1664 * 32 + means


def _server_args(backend="mpfa"):
    graphs = SimpleNamespace(prefill=SimpleNamespace(backend="breakable"))
    return SimpleNamespace(attention_backend=backend, kv_cache_dtype="auto", page_size=128, tp_size=1,
                           disable_radix_cache=False, cuda_graph_config=graphs, get_model_config=lambda: _Config())


def test_server_args_hook(monkeypatch):
    monkeypatch.setattr(hooks, "check_device", lambda capability: None)
    monkeypatch.setattr(hooks, "check_kernel_packages", lambda: None)
    other = _server_args("flashinfer")
    hooks.after_attention_backend_compat(None, other)
    assert other.disable_radix_cache is False
    args = _server_args()
    hooks.after_attention_backend_compat(None, args)
    assert args.disable_radix_cache is False, "a cached prefix carries its means: the radix cache stays on"
    assert args.cuda_graph_config.prefill.backend == "disabled"
    args.get_model_config = lambda: _Config(heads=64, kv_heads=4)
    with pytest.raises(MpfaSetupError, match="at most 8 query heads"):
        hooks.after_attention_backend_compat(None, args)


def test_layer_checks():
    def layer(**kw):
        base = dict(tp_q_head_num=8, layer_id=3, qk_head_dim=128, v_head_dim=128, logit_cap=0.0,
                    sliding_window_size=-1, is_cross_attention=False, attn_type=SimpleNamespace(value="decoder"))
        return SimpleNamespace(**{**base, **kw})

    model = SimpleNamespace(modules=lambda: [SimpleNamespace(), layer()])
    runner_checks.check_layers(model)
    for kw, pattern in [(dict(logit_cap=30.0), "logit cap"), (dict(sliding_window_size=4096), "sliding window"),
                        (dict(qk_head_dim=64, v_head_dim=64), "head_dim 64/64")]:
        with pytest.raises(MpfaSetupError, match=f"layer 3 is unsupported: {pattern}"):
            runner_checks.check_layers(SimpleNamespace(modules=lambda kw=kw: [layer(**kw)]))


def test_hook_targets_name_sglang_0_5_15_methods():
    table = hooks.hook_table()
    assert {kind for _, kind in table.values()} == {"AFTER", "AROUND"}
    assert all(target.startswith("sglang.srt.") for target in table)
