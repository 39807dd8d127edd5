"""QuantExperts against transformers 5's own experts modules (holding the dequantized weights,
float32), per element, and quantize_model on tiny MoE blocks of Mixtral, Qwen3-MoE, Qwen2-MoE
and DeepSeek-V2 (random weights, nothing downloaded)."""
import pytest
import torch
from torch import nn

from helpers import DTYPE_NAMES
from test_moe import assert_moe_close, moe_bound
from sailfish import QuantExperts, QuantLinear, quantize_model
from sailfish.fuse import FusedOutput

transformers = pytest.importorskip("transformers")
F16, BF16 = torch.float16, torch.bfloat16
H, I, E, TOPK = 64, 48, 6, 2


def tiny_block(arch: str):
    """(MoE block, experts class) of a tiny random config of `arch`, float32."""
    if arch == "mixtral":
        from transformers.models.mixtral.modeling_mixtral import MixtralConfig, MixtralSparseMoeBlock as B
        cfg = MixtralConfig(hidden_size=H, intermediate_size=I, num_local_experts=E, num_experts_per_tok=TOPK)
    elif arch == "qwen3_moe":
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeConfig, Qwen3MoeSparseMoeBlock as B
        cfg = Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=I, num_experts=E, num_experts_per_tok=TOPK)
    elif arch == "qwen2_moe":
        from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeConfig, Qwen2MoeSparseMoeBlock as B
        cfg = Qwen2MoeConfig(hidden_size=H, moe_intermediate_size=I, shared_expert_intermediate_size=2 * I,
                             num_experts=E, num_experts_per_tok=TOPK)
    else:
        from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Config, DeepseekV2Moe as B
        cfg = DeepseekV2Config(hidden_size=H, moe_intermediate_size=I, n_routed_experts=E, num_experts_per_tok=TOPK,
                               n_shared_experts=2)
    block = B(cfg)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.1)
    return block


ARCHS = ["mixtral", "qwen3_moe", "qwen2_moe", "deepseek_v2"]


class Recorder(nn.Module):
    """Stands in for the quantized experts inside a block: runs them and keeps their inputs."""

    def __init__(self, inner):
        super().__init__()
        self.inner, self.calls = inner, []

    def forward(self, hidden_states, top_k_index, top_k_weights):
        self.calls.append((hidden_states, top_k_index, top_k_weights))
        return self.inner(hidden_states, top_k_index, top_k_weights)


def check_against_transformers(experts_fp32, layer, x, ids, weights, sentinel=False):
    """layer(x, ids, weights) against transformers' experts module (float32, the layer's
    dequantized weights), per element: the bound of test_moe.moe_bound for the layer plus the
    float32 module's own. sentinel: ids hold E ("no local expert"), which transformers'
    experts accept only in newer releases (5.17's Mixtral one-hot raises): then, where it
    raises, the layer is checked against the float64 reference alone."""
    gate_up, down = (w.cpu() for w in layer.dequantize())  # (the reference runs on the CPU)
    ref, bound = moe_bound(x.cpu(), ids.cpu(), weights.cpu(), gate_up, down, x.dtype)
    _, bound32 = moe_bound(x.cpu(), ids.cpu(), weights.cpu(), gate_up, down, torch.float32)
    with torch.no_grad():
        experts_fp32.gate_up_proj.copy_(gate_up)
        experts_fp32.down_proj.copy_(down)
        ours = layer(x, ids, weights)
        try:
            theirs = experts_fp32(x.cpu().float(), ids.cpu(), weights.cpu().float()).double()
        except RuntimeError:
            if not sentinel:
                raise
            theirs = None
    assert ours.shape == x.shape and ours.dtype == x.dtype
    if theirs is None:
        assert_moe_close(ours.cpu(), ref, bound)
        return
    assert_moe_close(ours.cpu(), theirs, bound + bound32)
    assert_moe_close(theirs, ref, bound32)


@pytest.mark.parametrize("arch,dtype,gs,sym", [("mixtral", BF16, 32, False), ("qwen3_moe", F16, -1, True),
                                               ("qwen2_moe", BF16, 64, True), ("deepseek_v2", F16, 32, False)],
                         ids=lambda v: DTYPE_NAMES.get(v, str(v)))
def test_quant_experts_match_transformers(arch, dtype, gs, sym, device):
    experts = tiny_block(arch).experts
    layer = QuantExperts.from_experts(experts.to(dtype), group_size=gs, sym=sym).to(device)
    assert layer.dtype == dtype
    M = 5
    x = torch.randn(M, H, device=device).to(dtype)
    ids = torch.stack([torch.randperm(E)[:TOPK] for _ in range(M)]).to(device)
    weights = torch.softmax(torch.randn(M, TOPK), -1).to(device)  # float32, as Mixtral's router
    check_against_transformers(experts.float(), layer, x, ids, weights)
    # transformers' id E ("no local expert") contributes nothing, in both
    ids[2, 1] = E
    check_against_transformers(experts.float(), layer, x, ids, weights.to(dtype), sentinel=True)


@pytest.mark.parametrize("arch", ARCHS)
def test_quantize_model_converts_moe_blocks(arch, device):
    """quantize_model replaces the experts module (report "experts"), quantizes the shared
    experts' Linears, leaves the router alone; the block then calls QuantExperts with the
    router's own (ids, weights), and its output is checked per element against transformers'
    experts with the dequantized weights on exactly those."""
    block = tiny_block(arch).to(device, BF16)
    router = {n: p.detach().clone() for n, p in block.gate.named_parameters()}
    quantize_model(block, group_size=32)
    report = block.sailfish_report
    assert report["experts"] == ["experts"] and isinstance(block.experts, QuantExperts)
    prefix = {"qwen2_moe": "shared_expert.", "deepseek_v2": "shared_experts."}.get(arch)
    assert report["quantized"] == ([] if prefix is None else [prefix + n for n in ("gate_proj", "up_proj", "down_proj")])
    # (the shared experts, a Qwen2MoeMLP / DeepseekV2MLP: their gate and up run as one fused layer, fuse.py)
    assert sorted(report["fused"]) == ([] if prefix is None else [prefix + "gate_up_proj"])
    if arch == "deepseek_v2":  # (not run inside the experts: I = 48 would cut a group of 32 at an expert's end)
        assert "intermediate size 48 is not a multiple of group_size=32" in report["not_fused"]["shared_experts"]
    assert all(isinstance(block.get_submodule(n), (QuantLinear, FusedOutput)) for n in report["quantized"])
    assert all(torch.equal(p, router[n]) for n, p in block.gate.named_parameters())  # 16-bit router kept
    layer = block.experts
    block.experts = Recorder(layer)
    x = torch.randn(1, 3, H, device=device).to(BF16)
    with torch.no_grad():
        y = block(x)
    assert y.shape == x.shape and bool(torch.isfinite(y).all())
    (hs, ids, weights), = block.experts.calls
    check_against_transformers(tiny_block(arch).experts.float(), layer, hs, ids, weights)


def test_quant_experts_refuses():
    experts = tiny_block("mixtral").experts
    experts.act_fn = nn.GELU()
    with pytest.raises(ValueError, match="activation GELU is not supported; allowed: silu"):
        QuantExperts.from_experts(experts)
    with pytest.raises(TypeError, match="transformers experts module"):
        QuantExperts.from_experts(nn.Linear(4, 4))
    layer = QuantExperts(4, 64, 32, dtype=F16)
    with pytest.raises(TypeError, match="do not change it"):
        layer.bfloat16()
    assert layer.dtype == F16
    with pytest.raises(ValueError, match="top_k_index must have shape"):
        layer(torch.randn(3, 64).half(), torch.zeros(2, 2, dtype=torch.long), torch.ones(3, 2))


def test_quant_experts_state_dict_round_trip(device):
    layer = QuantExperts.from_experts(tiny_block("qwen3_moe").experts.to(F16), group_size=32, sym=False).to(device)
    fresh = QuantExperts(E, H, I, group_size=32, sym=False, dtype=F16, device=device)
    fresh.load_state_dict(layer.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(fresh.dequantize(), layer.dequantize()))
    with pytest.raises(RuntimeError, match="size mismatch"):
        QuantExperts(E, H, I, group_size=64, sym=False, dtype=F16, device=device).load_state_dict(layer.state_dict())


def test_quant_experts_act_order_state_dict(device):
    """act_order=True: w13_perm (E, H) / w2_perm (E, I) buffers, in the state dict; loaded only
    if each row is a permutation (the kernel reads x at them unchecked); from_packed checks too."""
    from dataclasses import replace

    from test_moe import random_experts
    from sailfish.formats.experts import stack

    w13, w2 = (stack(random_experts(E, n, k, 32, False, F16, act_order=True)) for n, k in ((2 * I, H), (H, I)))
    layer = QuantExperts.from_packed(w13, w2).to(device)
    assert layer.act_order and torch.equal(layer.w13_perm.cpu(), w13.perm)
    fresh = QuantExperts(E, H, I, group_size=32, sym=False, act_order=True, dtype=F16, device=device)
    fresh.load_state_dict(layer.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(fresh.dequantize(), layer.dequantize()))
    x, ids = torch.randn(4, H, device=device).half(), torch.randint(0, E, (4, TOPK), device=device)
    weights = torch.softmax(torch.randn(4, TOPK, device=device), -1)
    check_against_transformers(tiny_block("qwen3_moe").experts.float(), layer, x, ids, weights)
    state = layer.state_dict()
    state["w2_perm"] = state["w2_perm"].clone()
    state["w2_perm"][3, 0] = state["w2_perm"][3, 1]
    with pytest.raises(RuntimeError, match=r"w2_perm\[3\] is not a permutation of 0 .. 47"):
        fresh.load_state_dict(state)
    with pytest.raises(ValueError, match=r"w13.perm\[0\] is not a permutation of 0 .. 63"):
        QuantExperts.from_packed(replace(w13, perm=torch.zeros_like(w13.perm)), w2)


def test_quantize_model_tiny_qwen3_moe_model(device):
    """A whole (tiny, random) Qwen3MoeForCausalLM: every layer's experts become QuantExperts, and
    the quantized model's logits stay close to those of the same model with each layer's
    dequantized weights (QuantExperts.dequantize / QuantLinear.dequantize) in 16 bits."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                         num_experts=4, num_experts_per_tok=2)
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(cfg).to(device, BF16).eval()
    ref = Qwen3MoeForCausalLM(cfg).to(device, BF16).eval()
    with torch.no_grad():  # experts large enough to dominate the residual stream (transformers' init: 0.02)
        for n, p in model.named_parameters():
            if "experts" in n:
                p.normal_(0, 0.3)
    quantize_model(model, group_size=32, fuse=False)  # (unfused: the layers keep transformers' names)
    assert model.sailfish_report["experts"] == [f"model.layers.{i}.mlp.experts" for i in range(2)]
    with torch.no_grad():  # the reference: the same effective weights, transformers' own modules
        for name, mod in model.named_modules():
            if isinstance(mod, QuantExperts):
                gate_up, down = mod.dequantize()
                target = ref.get_submodule(name)
                target.gate_up_proj.copy_(gate_up)
                target.down_proj.copy_(down)
            elif isinstance(mod, QuantLinear):
                ref.get_submodule(name).weight.copy_(mod.dequantize())
        for n, p in model.named_parameters():  # embedding, norms, routers, lm_head: 16 bits in both
            ref.get_parameter(n).copy_(p)
        ids = torch.randint(0, 128, (1, 6), device=device)
        got, want = model(ids).logits.float(), ref(ids).logits.float()
    assert got.shape == (1, 6, 128) and bool(torch.isfinite(got).all())
    # bf16 model: the two differ by where each path rounds to bf16 (measured 1e-2 relative on the
    # logits); gate and up swapped in the kernel gave 1.1
    assert float((got - want).norm() / want.norm()) < 5e-2
