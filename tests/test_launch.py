"""Launch plans (ops/launch.py, Tuner.plans): the steady-state eager path that skips the
tuner and Triton's per-call binding.

CPU: the binding logic against a stand-in JIT function, the invalidation rules (clear_caches,
tune sessions, a config that changes), hooks and alignment. CUDA: a plan hit computes
exactly what the Triton JIT launch of the same config computes, for every path it covers
(gemv / mma, split-K, bias, W4A8 quantize); misaligned inputs, side streams, CUDA-graph
capture and Triton launch hooks."""
from types import SimpleNamespace

import pytest
import torch

import sailfish.runtime.device as device_mod
import sailfish.runtime.launch as launch_mod
import sailfish.tuning as tuning
from sailfish import QuantLinear, QuantLinearW4A8
from sailfish.runtime.launch import Launch, aligned, hooks_idle, pointers
from sailfish.tuning import Config, Tuner, clear_caches, tuning_session

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


# ----------------------------------------------------------------------------------
# Launch against a stand-in JIT function
# ----------------------------------------------------------------------------------
def _param(name, constexpr, default=None):
    return SimpleNamespace(name=name, is_constexpr=constexpr, has_default=default is not None, default=default)


class FakeCompiled:
    def __init__(self):
        self.function, self.packed_metadata, self.calls = 1234, b"meta", []

    @property
    def run(self):
        return lambda *a: self.calls.append(a)


class FakeJit:
    def __init__(self, params):
        self.params, self.jit_calls, self.compiled = params, [], FakeCompiled()

    def __getitem__(self, grid):
        def launch(*args, **meta):
            self.jit_calls.append((grid, args, meta))
            return self.compiled
        return launch


def test_launch_binds_the_compiled_kernel_after_the_first_call(monkeypatch):
    monkeypatch.setattr(launch_mod, "stream_getter", lambda: (lambda idx: 1000 + idx))
    fn = FakeJit([_param("a", False), _param("n", False), _param("BLOCK", True), _param("FLAG", True, 7)])
    launch = Launch(fn, dict(BLOCK=64, num_warps=4), device_index=3)
    launch((5, 2), "A", 10)
    assert fn.jit_calls == [((5, 2), ("A", 10), dict(BLOCK=64, num_warps=4))]
    assert fn.compiled.calls == []
    launch((6, 1), "B", 11)
    assert len(fn.jit_calls) == 1  # no second trip through the JIT
    # CompiledKernel.run's arguments: grid, stream, function, metadata, no launch hooks,
    # then every parameter in signature order, constexprs (and their defaults) included
    assert fn.compiled.calls == [(6, 1, 1, 1003, 1234, b"meta", None, None, None, "B", 11, 64, 7)]
    launch((4, 3, 2), "C", 12)  # a 3-D grid keeps its third side (the MoE GEMV's (slot, N tile, split))
    assert fn.compiled.calls[-1][:3] == (4, 3, 2)


@pytest.mark.parametrize("params,meta", [
    ([_param("a", False), _param("BLOCK", True), _param("n", False)], dict(BLOCK=16)),  # runtime after constexpr
    ([_param("a", False), _param("BLOCK", True)], {}),  # BLOCK neither passed nor defaulted
], ids=["order", "missing"])
def test_launch_stays_on_the_jit_when_it_cannot_bind(monkeypatch, params, meta):
    monkeypatch.setattr(launch_mod, "stream_getter", lambda: (lambda idx: 0))
    fn = FakeJit(params)
    launch = Launch(fn, meta, 0)
    for _ in range(3):
        launch((1, 1), "A")
    assert len(fn.jit_calls) == 3 and fn.compiled.calls == [] and launch.run is None


def test_hooks_idle_sees_triton_launch_hooks():
    from triton import knobs

    assert hooks_idle()
    hook = knobs.runtime.launch_enter_hook
    if not hasattr(hook, "add"):
        pytest.skip("this Triton has no HookChain")
    fn = lambda metadata: None  # noqa: E731
    hook.add(fn)
    try:
        assert not hooks_idle()
    finally:
        hook.remove(fn)
    assert hooks_idle()


def test_aligned():
    t = torch.zeros(64, dtype=torch.float16)
    assert aligned(t, None, t[8:])
    assert not aligned(t, t[1:])  # 2 bytes in
    assert not aligned(t[4:])     # 8 bytes in


def test_pdl_rule(monkeypatch):
    """Programmatic dependent launch (the split-K reduce): never for the CPU (device index -1),
    off with SAILFISH_PDL=0 and forced with =1 without asking the GPU; otherwise by compute
    capability (sm_90+), read through a cached query."""
    monkeypatch.setattr(device_mod, "capability", lambda i: (8, 0) if i == 0 else (9, 0))
    monkeypatch.delenv("SAILFISH_PDL", raising=False)
    assert not device_mod.pdl(-1)
    assert not device_mod.pdl(0) and device_mod.pdl(1)
    monkeypatch.setenv("SAILFISH_PDL", "0")
    assert not device_mod.pdl(1)
    monkeypatch.setenv("SAILFISH_PDL", "1")
    assert device_mod.pdl(0) and not device_mod.pdl(-1)


def test_pointers():
    t = torch.zeros(64, dtype=torch.float16)
    assert pointers(t, None, t[8:]) == (t.data_ptr(), None, t.data_ptr() + 16)
    assert pointers(t, t[1:]) is None  # 2 bytes in: the JIT path, which specializes again
    assert pointers(None) == (None,)


# ----------------------------------------------------------------------------------
# Invalidation
# ----------------------------------------------------------------------------------
@pytest.fixture
def fake(monkeypatch):
    """A Tuner of its own (kept out of the global list afterwards) whose heuristic picks
    `slow` and whose benchmark finds `fast` faster; `get(device)` asks it for its problem."""
    monkeypatch.setattr(tuning, "_TUNERS", list(tuning._TUNERS))
    monkeypatch.setenv("SAILFISH_HEURISTICS_ONLY", "1")  # no GPU table lookup on the CPU
    slow, fast = Config(16, 64, 64), Config(16, 128, 64)
    last = {}

    def run(cfg):  # the stand-in launch; the stand-in benchmark times the last one
        last["cfg"] = cfg

    monkeypatch.setattr(tuning, "_bench", lambda fn: (fn(), {slow: 2.0, fast: 1.0}[last["cfg"]])[1])
    t = Tuner("fake", lambda **_: slow, lambda **_: [slow, fast])
    return SimpleNamespace(t=t, slow=slow, fast=fast,
                           get=lambda device: t.get("fake|key", device, run, memo_key="memo"))


def test_clear_caches_drops_plans(fake):
    fake.t.plans["k"] = "plan"
    clear_caches()
    assert fake.t.plan("k") is None and fake.t.plans == {}


def test_tune_session_bypasses_and_drops_plans(fake):
    t, dev = fake.t, torch.device("cuda", 0)  # never touched: launch and benchmark are stand-ins
    assert fake.get(dev) == fake.slow  # the heuristic, outside a session
    t.plans_for_build()["k"] = "plan"
    assert t.plan("k") == "plan"
    with tuning_session():
        assert t.plan("k") is None and t.plans_for_build() is None
        assert fake.get(dev) == fake.fast  # benchmarked: the config changed ...
        assert t.plans == {}  # ... so the plans built from the old one are gone
        t.plans["k2"] = "stale"
    assert t.plans == {}  # and none survives the session
    assert fake.get(dev) == fake.fast and t.lookup(dev, "memo") == fake.fast


def test_plan_stored_after_a_config_change_is_dropped(fake):
    """A launcher takes plans_for_build() before reading the config: if the config changes
    in between, its plan lands in the discarded dict."""
    dev = torch.device("cuda", 0)
    fake.get(dev)
    plans = fake.t.plans_for_build()
    with tuning_session():
        fake.get(dev)
    plans["k"] = "built from the old config"
    assert fake.t.plan("k") is None


# ----------------------------------------------------------------------------------
# CUDA: plan hits against the JIT launch
# ----------------------------------------------------------------------------------
@pytest.fixture
def heuristics(monkeypatch):
    monkeypatch.setenv("SAILFISH_HEURISTICS_ONLY", "1")
    clear_caches()
    yield
    clear_caches()


def _w4a16_layer(k, n, gs, sym, bias):
    torch.manual_seed(k + n + gs)
    lin = torch.nn.Linear(k, n, bias=bias).half().cuda()
    return QuantLinear.from_linear(lin, group_size=gs, sym=sym)


def _jit_w4a16(layer, x):
    """The same problem through Triton's JIT (an explicit config never uses a plan)."""
    from sailfish.ops.w4a16 import W4A16_TUNER, w4a16_launch
    from sailfish.tuning import m_bucket

    memo = (layer.qweight.shape[1] * 8, layer.out_features, m_bucket(x.shape[0]), layer.group_size,
            layer.zeros is not None, False, x.dtype)
    cfg = W4A16_TUNER.lookup(x.device, memo)
    assert cfg is not None
    return w4a16_launch(x, layer.qweight, layer.scales, layer.zeros, None, None, layer.bias,
                        layer.in_features, layer.group_size, config=cfg), cfg


@requires_cuda
@pytest.mark.parametrize("k,n,m,gs,sym,bias", [
    (4096, 4096, 1, 128, True, False),   # gemv
    (4096, 256, 1, 128, False, True),    # gemv, split-K summed in the GEMV, zeros, bias
    (1024, 512, 16, 64, True, True),     # mma tiles
    (2048, 256, 7, -1, True, False),     # multi-row, per channel
])
def test_w4a16_plan_hit_matches_the_jit_launch(heuristics, k, n, m, gs, sym, bias):
    from sailfish.ops.w4a16 import W4A16_TUNER

    layer = _w4a16_layer(k, n, gs, sym, bias)
    x = torch.randn(m, k, device="cuda").half()
    with torch.no_grad():
        first = layer(x)  # builds the plan
        assert len(W4A16_TUNER.plans) == 1
        hits = [layer(torch.randn(m, k, device="cuda").half()) for _ in range(2)] + [layer(x)]
        assert len(W4A16_TUNER.plans) == 1
        ref, cfg = _jit_w4a16(layer, x)
    torch.cuda.synchronize()
    assert torch.equal(first, ref) and torch.equal(hits[-1], ref)
    if (k, n, m) == (4096, 256, 1):
        assert cfg.SPLIT_K > 1
        (plan,) = W4A16_TUNER.plans.values()
        assert plan.fixup and plan.reduce is None  # one launch per call (ops/w4a16.gemv_fixup)


@requires_cuda
@pytest.mark.parametrize("k,n,m,gs", [(4096, 4096, 1, 128), (4096, 256, 1, -1), (1024, 512, 16, 128)])
def test_w4a8_plan_hit_matches_the_jit_launch(heuristics, k, n, m, gs):
    from sailfish.formats.qqq import quantize_activations
    from sailfish.ops.w4a8 import W4A8_TUNER, w4a8_launch
    from sailfish.tuning import m_bucket

    torch.manual_seed(k + n)
    layer = QuantLinearW4A8.from_linear(torch.nn.Linear(k, n).cuda(), group_size=gs)
    x = torch.randn(m, k, device="cuda").half()
    with torch.no_grad():
        first = layer(x)
        n_plans = len(W4A8_TUNER.plans)
        assert n_plans == 2  # the quantize kernel's and the GEMM's
        for _ in range(2):
            layer(torch.randn(m, k, device="cuda").half())
        hit = layer(x)
        assert len(W4A8_TUNER.plans) == n_plans
        x_q, x_s = quantize_activations(x)
        cfg = W4A8_TUNER.lookup(x.device, (k, n, m_bucket(m), gs, x.dtype))
        ref = w4a8_launch(x_q, x_s, layer.qweight, layer.s_ch, layer.s_g, layer.bias, k, gs, x.dtype, config=cfg)
    torch.cuda.synchronize()
    assert torch.equal(first, ref) and torch.equal(hit, ref)


@requires_cuda
# decode (split-K gate_up: "moe_gemv"'s in-launch sum, or with act-order the gated reduce); BLOCK_M 32;
# act-order experts (perms in the plan key)
@pytest.mark.parametrize("M,act_order", [(1, False), (160, False), (1, True)])
def test_moe_plan_hit_matches_the_jit_launch(heuristics, M, act_order):
    from test_moe import make_problem

    from sailfish.ops.moe import MOE_TUNER, moe_config, moe_gemv_format, moe_w4a16_launch

    args, _, _ = make_problem(8, 2, M, 512, 256, 128, False, torch.float16, "cuda", act_order=act_order)
    first = moe_w4a16_launch(*args)  # builds the plan
    assert len(MOE_TUNER.plans) == 1
    for _ in range(2):
        moe_w4a16_launch(torch.randn_like(args[0]), *args[1:])
    hit = moe_w4a16_launch(*args)
    assert len(MOE_TUNER.plans) == 1
    # (cached: what the plan runs; M = 1 without act-order: "moe_gemv", its split gate_up a 3-D grid)
    cfgs = moe_config(args[0].device, M, 2, 8, 256, 512, 512, 256,
                      gemv_format=moe_gemv_format(128, 512, 256, (act_order, act_order)))
    assert (M > 1 or cfgs[0].SPLIT_K > 1) and list(MOE_TUNER.plans.values())[0].bound()
    ref = moe_w4a16_launch(*args, configs=cfgs)  # (explicit configs: the JIT, no plan)
    torch.cuda.synchronize()
    assert torch.equal(first, ref) and torch.equal(hit, ref)
    clear_caches()
    assert MOE_TUNER.plans == {} and MOE_TUNER.cache == {}


@requires_cuda
def test_misaligned_input_takes_the_jit_and_keeps_the_plan(heuristics):
    from sailfish.ops.w4a16 import W4A16_TUNER

    k, n = 1024, 512
    layer = _w4a16_layer(k, n, 128, True, True)
    x = torch.randn(1, k, device="cuda").half()
    buf = torch.empty(k + 1, device="cuda", dtype=torch.float16)
    shifted = buf[1:].view(1, k)  # 2 bytes past an aligned address
    shifted.copy_(x)
    assert not aligned(shifted)
    with torch.no_grad():
        y = layer(x)
        plans = dict(W4A16_TUNER.plans)
        y_shifted = layer(shifted)
        assert W4A16_TUNER.plans == plans  # the misaligned call stored nothing
        y_again = layer(x)
    torch.cuda.synchronize()
    assert torch.equal(y, y_shifted) and torch.equal(y, y_again)


@requires_cuda
def test_plans_follow_clear_caches_and_streams(heuristics):
    from sailfish.ops.w4a16 import W4A16_TUNER

    layer = _w4a16_layer(512, 256, 128, True, False)
    x = torch.randn(1, 512, device="cuda").half()
    with torch.no_grad():
        y = layer(x)
        clear_caches()
        assert W4A16_TUNER.plans == {}
        assert torch.equal(layer(x), y) and len(W4A16_TUNER.plans) == 1
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # a plan hit launches on the current stream
            y_side = layer(x)
        torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    assert torch.equal(y_side, y)


@requires_cuda
@pytest.mark.parametrize("family", ["w4a16", "w4a8"])
def test_graph_capture_replays_the_plan(heuristics, family):
    k, n = 2048, 1024
    if family == "w4a16":
        layer = _w4a16_layer(k, n, 128, True, True)
    else:
        layer = QuantLinearW4A8.from_linear(torch.nn.Linear(k, n).cuda(), group_size=128)
    x = torch.randn(1, k, device="cuda").half()
    with torch.no_grad():
        eager = layer(x)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            layer(x)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = layer(x)
        x.copy_(torch.randn_like(x))
        graph.replay()
        fresh = layer(x)
    torch.cuda.synchronize()
    assert torch.equal(out, fresh) and not torch.equal(out, eager)


@requires_cuda
def test_launch_hooks_see_every_launch(heuristics):
    from triton import knobs

    hook = knobs.runtime.launch_enter_hook
    if not hasattr(hook, "add"):
        pytest.skip("this Triton has no HookChain")
    layer = _w4a16_layer(512, 256, 128, True, False)
    x = torch.randn(1, 512, device="cuda").half()
    seen = []
    fn = lambda metadata: seen.append(metadata)  # noqa: E731
    with torch.no_grad():
        y = layer(x)  # plan built
        hook.add(fn)
        try:
            y_hooked = layer(x)
        finally:
            hook.remove(fn)
    torch.cuda.synchronize()
    assert seen and torch.equal(y, y_hooked)


# ----------------------------------------------------------------------------------
# Direct calls of an op's implementation (ops.direct_call_ok)
# ----------------------------------------------------------------------------------
def test_plain_context_sees_modes_transforms_traces_and_profilers():
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode

    from sailfish.ops import direct_call_ok, plain_context

    class Dispatch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    class Function(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    assert plain_context()
    assert not direct_call_ok(torch.zeros(2))  # a CPU tensor always takes the dispatcher
    with Dispatch():
        assert not plain_context()
    with Function():
        assert not plain_context()
    with torch.profiler.profile():
        assert not plain_context()
    seen = []
    torch.vmap(lambda t: (seen.append(plain_context()), t)[1])(torch.zeros(2, 3))
    torch.jit.trace(lambda t: (seen.append(plain_context()), t * 2)[1], torch.zeros(2), check_trace=False)
    assert seen == [False, False]
    assert plain_context()


@requires_cuda
def test_layers_take_the_dispatcher_where_it_matters(heuristics):
    """Under a dispatch mode (as FlopCounterMode, export and friends use) the layers call
    their ops, so the mode sees them; plain eager calls compute the same numbers directly."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Recorder(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    w16 = _w4a16_layer(512, 256, 128, True, True)
    w8 = QuantLinearW4A8.from_linear(torch.nn.Linear(512, 256).cuda(), group_size=128)
    x = torch.randn(1, 512, device="cuda").half()
    with torch.no_grad():
        direct = w16(x), w8(x)
        with Recorder() as rec:
            via_ops = w16(x), w8(x)
    torch.cuda.synchronize()
    assert any("w4a16_gemm_nograd" in o for o in rec.ops) and any("w4a8_linear_nograd" in o for o in rec.ops)
    assert all(torch.equal(a, b) for a, b in zip(direct, via_ops))
