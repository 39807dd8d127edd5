"""sailfish::add_rms_norm_quant (a residual add, the norm and W4A8's per-token quantization in one
launch) and the inductor pass that folds a compiled graph's residual adds into it
(sailfish/inductor.py). On the CPU the kernel runs in Triton's interpreter and inductor compiles
the graphs with its C++ backend."""
import pytest
import torch

from sailfish import inductor
from sailfish.ops.rowwise import (add_rms_norm_quant, add_rms_norm_quant_reference, rms_norm_quant,
                                  rms_norm_quant_fp8)

F16, BF16 = torch.float16, torch.bfloat16


def _operands(shape, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    x, r = ((torch.randn(*shape, generator=g) * s).to(dtype).to(device) for s in (3.0, 1.0))
    w = torch.randn(shape[-1], generator=g).to(dtype).to(device)
    return x, r, w


@pytest.mark.parametrize("dtype", [F16, BF16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("shape", [(16, 4096), (2, 3, 256), (1, 1, 96), (5, 200)], ids=str)
def test_op_is_the_add_then_rms_norm_quant(shape, dtype, device):
    """The sum is torch's half-precision add, and the codes and scales are rms_norm_quant's of it
    bit for bit (the same kernel tile), a row with an Inf included (scale NaN, codes 0)."""
    x, r, w = _operands(shape, dtype, device)
    x.view(-1)[3] = float("inf")
    h, q, s = add_rms_norm_quant(x, r, w, 1e-5)
    expect_h = x + r
    expect_q, expect_s = rms_norm_quant(expect_h, w, 1e-5)
    assert h.shape == x.shape and h.dtype == dtype and torch.equal(h, expect_h)
    assert torch.equal(q, expect_q)
    assert torch.equal(s.nan_to_num(-1.0), expect_s.nan_to_num(-1.0)) and s[0].isnan()


def test_reference_is_the_contract(monkeypatch):
    """Without the interpreter (CPU) the op is add_rms_norm_quant_reference: the add, then the
    norm's and the quantizer's references."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    x, r, w = _operands((4, 64), F16, "cpu", seed=1)
    for got, want in zip(add_rms_norm_quant(x, r, w, 1e-6), add_rms_norm_quant_reference(x, r, w, 1e-6)):
        assert torch.equal(got, want)


def test_bad_input_names_the_argument():
    x, r, w = _operands((4, 64), F16, "cpu")
    with pytest.raises(ValueError, match=r"residual must be a tensor of x's dtype and shape \(torch.float16 \(4, 64\)\), "
                                         r"got torch.float16 \(4, 32\)"):
        add_rms_norm_quant(x, r[:, :32], w, 1e-6)
    with pytest.raises(ValueError, match=r"residual must .* got torch.bfloat16 \(4, 64\)"):
        add_rms_norm_quant(x, r.to(BF16), w, 1e-6)
    with pytest.raises(TypeError, match=r"weight must be a tensor of x's dtype"):
        add_rms_norm_quant(x, r, w.float(), 1e-6)
    with pytest.raises(ValueError, match=r"eps must be a finite float >= 0, got -1.0"):
        add_rms_norm_quant(x, r, w, -1.0)


class _TwoNorms(torch.nn.Module):
    """A residual stream with two W4A8 input norms, as a fused decoder layer's graph has them,
    and two adds the pass must leave alone (a broadcast one, and one that feeds no norm)."""

    def __init__(self, k):
        super().__init__()
        self.k = k
        self.w = torch.nn.Parameter(torch.randn(k).to(F16), requires_grad=False)
        self.bias = torch.nn.Parameter(torch.randn(k).to(F16), requires_grad=False)

    def forward(self, a, b, c):
        h = a + b
        q1, s1 = rms_norm_quant(h.reshape(-1, self.k), self.w, 1e-5)
        h2 = h + c
        q2, s2 = rms_norm_quant(h2.reshape(-1, self.k), self.w, 1e-5)
        q3, s3 = rms_norm_quant((h2 + self.bias).reshape(-1, self.k), self.w, 1e-5)  # (broadcast: kept)
        return (h2 + a) * 2, q1, s1, q2, s2, q3, s3


def test_pass_folds_the_residual_adds_of_a_compiled_graph():
    """Compiled with the pass, the two residual adds run inside add_rms_norm_quant (counted) and
    every output is the eager module's, bit for bit; the broadcast add stays inductor's."""
    torch._dynamo.reset()
    module = _TwoNorms(256)
    a, b, c = (torch.randn(2, 3, 256).to(F16) for _ in range(3))
    folding = inductor.install()
    assert inductor.install() is folding  # (once)
    before = folding.folded
    try:  # (no FX graph cache: a cached graph does not run the pass, so nothing would be counted)
        with torch.no_grad(), torch._inductor.config.patch(fx_graph_cache=False):
            want = module(a, b, c)
            got = torch.compile(module, fullgraph=True)(a, b, c)
    finally:
        torch._dynamo.reset()
    assert folding.folded - before == 2
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and torch.equal(g, w)


def test_pass_leaves_other_graphs_alone():
    """No W4A8 norm after the add (or an fp8 one whose add broadcasts): nothing is rewritten."""
    g = torch.fx.Graph()
    a, b, w = g.placeholder("a"), g.placeholder("b"), g.placeholder("w")
    for n, v in ((a, torch.empty(4, 64, dtype=F16)), (b, torch.empty(64, dtype=F16)), (w, torch.empty(64, dtype=F16))):
        n.meta["val"] = v
    h = g.call_function(torch.ops.aten.add.Tensor, (a, b))
    h.meta["val"] = torch.empty(4, 64, dtype=F16)
    out = g.call_function(rms_norm_quant_fp8, (h, w, 1e-6))
    g.output((h, out))
    assert inductor.fold_residual_adds(g) == 0
    assert [n.target for n in g.nodes if n.op == "call_function"] == [torch.ops.aten.add.Tensor, rms_norm_quant_fp8]


def test_install_keeps_a_pass_that_was_there(monkeypatch):
    """A post-grad pass installed before runs after this one."""
    from torch._inductor import config

    seen = []
    monkeypatch.setattr(inductor, "_PASS", None)
    with config.patch(post_grad_custom_post_pass=lambda graph: seen.append(graph)):
        folding = inductor.install()
        assert config.post_grad_custom_post_pass is folding
        folding(torch.fx.Graph())
    assert len(seen) == 1


def test_compiled_w4a8_llama_folds_every_residual_add():
    """A fused W4A8 Llama (2 layers) compiled by inductor: three adds fold (each layer's
    mid-layer add, and the first layer's output into the second's input norm; the first input norm
    reads the embedding), and the logits are the eager model's up to inductor's own roundings (the
    ops' references on the CPU; compiled without the pass they differ from eager by ~4e-3 at most
    here, with it ~2e-3: the folded sums keep eager torch's half-precision roundings, where inductor
    adds the residual stream's fp32 values; the exact equality of the pass is the test above)."""
    transformers = pytest.importorskip("transformers")
    import sailfish
    from torch._inductor import config

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=300, pad_token_id=0, eos_token_id=None,
                                   bos_token_id=None)
    model = sailfish.quantize_model(transformers.AutoModelForCausalLM.from_config(cfg, dtype=F16).eval(),
                                    act_bits=8, group_size=128)
    folding = config.post_grad_custom_post_pass
    assert isinstance(folding, type(inductor.install()))  # (fuse_row_ops installed it)
    ids = torch.randint(1, 300, (1, 7))
    before = folding.folded
    torch._dynamo.reset()
    try:  # (no FX graph cache: a cached graph does not run the pass, so nothing would be counted)
        with torch.no_grad(), config.patch(fx_graph_cache=False):
            got = torch.compile(model, fullgraph=True)(ids).logits
            want = model(ids).logits
    finally:
        torch._dynamo.reset()
    assert folding.folded - before == 3
    torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=0)
