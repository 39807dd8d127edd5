"""Decode attention (ops/attention.py, kernels/attention.py; issue 39): the kernel against its fp32
reference and transformers' sdpa path per element, grouped heads, masks (none, boolean per
sequence or per head, additive), the split combine, bad input, registration (opcheck, compile),
and a transformers model decoding through it (sailfish.fuse.use_decode_attention)."""
import copy

import pytest
import torch
import transformers

import sailfish
from sailfish.fuse import ATTENTION, use_decode_attention
from sailfish.ops.attention import (check_decode_attention, decode_attention, decode_attention_launch,
                                    decode_attention_reference)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
UNIT = {torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}  # the dtype's unit roundoff


def _operands(B, hq, hkv, L, D, dtype, mask_kind, seed=0):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    q = (torch.randn(B, hq, 1, D, device=DEVICE, generator=g) * 2).to(dtype)
    k = torch.randn(B, hkv, L, D, device=DEVICE, generator=g).to(dtype)
    v = torch.randn(B, hkv, L, D, device=DEVICE, generator=g).to(dtype)
    mask = None
    if mask_kind == "bool":
        mask = torch.rand(B, 1, 1, L, device=DEVICE, generator=g) > 0.3
        mask[..., 0] = True
    elif mask_kind == "bool-heads":  # one mask per query head, broadcast over the batch
        mask = torch.rand(1, hq, 1, L, device=DEVICE, generator=g) > 0.5
        mask[..., 0] = True
    elif mask_kind == "float":
        mask = (torch.randn(B, 1, 1, L, device=DEVICE, generator=g) * 3).to(dtype)
        mask[..., L // 2:] = float("-inf")
    return q, k, v, mask


def assert_within_bound(out, q, k, v, mask, scale):
    """Per element: |out - ref| <= u * (sum_i p_i |v_i|) + u * |ref| + 2**-14 * max|v|: the
    probabilities rounded to the dtype before P @ V (u each), the output's rounding, and the fp32
    sums / exp2 (the last term)."""
    ref = decode_attention_reference(q, k, v, mask, scale).float()
    spread = decode_attention_reference(q.float(), k.float(), v.float().abs(), mask, scale)
    u = UNIT[q.dtype]
    bound = u * spread + u * ref.abs() + 2.0 ** -14 * v.float().abs().max()
    err = (out.float() - ref).abs()
    assert out.shape == ref.shape and out.dtype == q.dtype
    assert (err <= bound).all(), f"max err {err.max().item()} (bound there {bound.flatten()[err.argmax()].item()})"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(2, 8, 2, 200, 64), (1, 4, 4, 70, 32), (3, 6, 2, 130, 128), (2, 32, 8, 96, 128),
                                   (1, 16, 2, 65, 16)])
@pytest.mark.parametrize("mask_kind", [None, "bool", "bool-heads", "float"])
def test_matches_reference(dtype, shape, mask_kind):
    q, k, v, mask = _operands(*shape, dtype, mask_kind)
    scale = shape[-1] ** -0.5
    assert_within_bound(decode_attention(q, k, v, mask, scale), q, k, v, mask, scale)


@pytest.mark.parametrize("splits", [1, 2, 3, 5, 17])
def test_split_combine(splits):
    """The split-cache programs and their in-kernel combine (the last program of a (sequence, KV
    head) to finish sums them, in a fixed order) give the one-program result up to the fp32 sums'
    order; splits beyond the combine's MAX_SPLITS are refused."""
    q, k, v, mask = _operands(2, 8, 2, 300, 64, torch.float16, "bool", seed=splits)
    one = decode_attention_launch(q, k, v, mask, 0.125, splits=1)
    got = decode_attention_launch(q, k, v, mask, 0.125, splits=splits)
    assert_within_bound(got, q, k, v, mask, 0.125)
    assert (got.float() - one.float()).abs().max() <= 2 * UNIT[torch.float16] * v.float().abs().max()
    again = decode_attention_launch(q, k, v, mask, 0.125, splits=splits)  # the counters were reset
    assert torch.equal(got, again)
    with pytest.raises(ValueError, match="splits=33 is not supported"):
        decode_attention_launch(q, k, v, mask, 0.125, splits=33)


@pytest.mark.parametrize("block_n, num_warps, splits", [(16, 1, 7), (32, 2, 3), (128, 8, 2)])
def test_other_tiles(block_n, num_warps, splits):
    """The tiles benchmarks/probes/decode_attention_sweep.py tries compute the same thing."""
    q, k, v, mask = _operands(2, 8, 2, 300, 64, torch.float16, "bool", seed=block_n)
    got = decode_attention_launch(q, k, v, mask, 0.125, splits=splits, block_n=block_n, num_warps=num_warps)
    assert_within_bound(got, q, k, v, mask, 0.125)
    with pytest.raises(ValueError, match="block_n=48"):
        decode_attention_launch(q, k, v, mask, 0.125, block_n=48)


def test_combine_in_chunks():
    """32 splits of a group of 8 heads of 128: the combine loads the partial outputs in 8 chunks
    (ops/attention.py COMBINE_TILE), against the one-program result and the reference."""
    q, k, v, mask = _operands(1, 32, 4, 2100, 128, torch.bfloat16, "bool", seed=5)
    got = decode_attention_launch(q, k, v, mask, 0.09, splits=32)
    assert_within_bound(got, q, k, v, mask, 0.09)
    one = decode_attention_launch(q, k, v, mask, 0.09, splits=1)
    assert (got.float() - one.float()).abs().max() <= 2 * UNIT[torch.bfloat16] * v.float().abs().max()


def test_fully_masked_row_is_zero():
    q, k, v, _ = _operands(2, 4, 2, 80, 32, torch.float16, None)
    mask = torch.ones(2, 1, 1, 80, dtype=torch.bool, device=DEVICE)
    mask[1] = False
    for splits in (1, 3):
        out = decode_attention_launch(q, k, v, mask, 0.2, splits=splits)
        assert torch.equal(out[1], torch.zeros_like(out[1]))
        assert out[0].abs().sum() > 0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_against_transformers_sdpa(dtype):
    """What the model's attention would have computed: transformers' sdpa_attention_forward
    (repeat_kv, torch's sdpa with the boolean mask), in fp32 (the rounding the bound allows)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    class M(torch.nn.Module):
        num_key_value_groups = 4
        is_causal = True

    q, k, v, mask = _operands(2, 16, 4, 150, 64, dtype, "bool")
    sd = sdpa_attention_forward(M(), q.float(), k.float(), v.float(), mask, scaling=0.125)[0]
    ref = decode_attention_reference(q, k, v, mask, 0.125)
    assert (sd - ref.float()).abs().max() <= 2 * UNIT[dtype] * v.float().abs().max()
    assert_within_bound(decode_attention(q, k, v, mask, 0.125), q, k, v, mask, 0.125)


@pytest.mark.parametrize("case, exc, words", [
    ("two_tokens", ValueError, "q.shape[2] must be 1"),
    ("fp32", TypeError, "float32 is not supported"),
    ("mixed", TypeError, "share one dtype"),
    ("heads", ValueError, "multiple of k's"),
    ("head_dim", ValueError, "head_dim 96"),
    ("mask_shape", ValueError, "mask must have shape"),
    ("mask_dtype", TypeError, "mask dtype torch.int64"),
    ("scale", ValueError, "scale must be a finite float"),
    ("strided", ValueError, "contiguous last dimension"),
])
def test_bad_input_is_refused(case, exc, words):
    q, k, v, mask = _operands(2, 8, 2, 40, 64, torch.float16, "bool")
    scale = 0.125
    if case == "two_tokens":
        q = torch.cat([q, q], 2)
    elif case == "fp32":
        q, k, v = q.float(), k.float(), v.float()
    elif case == "mixed":
        k = k.bfloat16()
    elif case == "heads":
        q = q[:, :7]
    elif case == "head_dim":
        q, k, v = (torch.cat([t, t[..., :32]], -1) for t in (q, k, v))
    elif case == "mask_shape":
        mask = mask[..., :39]
    elif case == "mask_dtype":
        mask = mask.long()
    elif case == "scale":
        scale = float("nan")
    elif case == "strided":
        k = k.transpose(2, 3).contiguous().transpose(2, 3)
    with pytest.raises(exc, match=words.replace("[", r"\[").replace("]", r"\]")):
        decode_attention(q, k, v, mask, scale)
    with pytest.raises(exc):
        check_decode_attention(q, k, v, mask, scale, fake=True)


def test_opcheck_and_compile():
    q, k, v, mask = _operands(2, 8, 2, 64, 32, torch.float16, "bool")
    torch.library.opcheck(torch.ops.sailfish.decode_attention.default, (q, k, v, mask, 0.2))
    backend = "inductor" if DEVICE == "cuda" else "aot_eager"
    got = torch.compile(lambda *a: decode_attention(*a) * 2, fullgraph=True, backend=backend)(q, k, v, mask, 0.2)
    assert torch.equal(got, decode_attention(q, k, v, mask, 0.2) * 2)


# ----------------------------------------------------------------------------------
# In a transformers model
# ----------------------------------------------------------------------------------
def _tiny(arch: str):
    common = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=96, pad_token_id=0, eos_token_id=None, bos_token_id=None)
    config = {"llama": lambda: transformers.LlamaConfig(**common),
              "qwen3": lambda: transformers.Qwen3Config(**common),
              # a window shorter than the prompt: the mask (sdpa's) carries it into the kernel
              "mistral-window": lambda: transformers.MistralConfig(sliding_window=4, **common),
              "qwen3-moe": lambda: transformers.Qwen3MoeConfig(num_experts=4, num_experts_per_tok=2,
                                                               moe_intermediate_size=64, **common)}[arch]()
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float16,
                                                         attn_implementation="sdpa").to(DEVICE).eval()


def _decode_logits(model, ids, steps=3):
    out = model.generate(ids, max_new_tokens=steps, do_sample=False, cache_implementation="static",
                         disable_compile=True, return_dict_in_generate=True, output_logits=True)
    return out.sequences, torch.stack(out.logits)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "mistral-window", "qwen3-moe"])
def test_model_decodes_through_the_kernel(arch, monkeypatch):
    base = _tiny(arch)
    model = copy.deepcopy(base)
    names = use_decode_attention(model)
    assert names == [f"model.layers.{i}.self_attn" for i in range(2)]
    assert model.config._attn_implementation == ATTENTION and base.config._attn_implementation == "sdpa"
    assert use_decode_attention(model) == []  # once
    calls = []
    import sailfish.fuse as fuse_mod
    real = fuse_mod._decode_ok

    def counted(query, *args):
        ok = real(query, *args)
        calls.append((tuple(query.shape), ok))
        return ok
    monkeypatch.setattr(fuse_mod, "_decode_ok", counted)
    ids = torch.randint(1, 96, (2, 5), device=DEVICE)
    seq, logits = _decode_logits(model, ids)
    seq0, logits0 = _decode_logits(base, ids)
    # the prompt through sdpa, each of the 2 later steps through the kernel, in every layer
    assert [ok for _, ok in calls] == [False] * 2 + [True] * 4 and all(s[2] == 1 for s, ok in calls if ok)
    assert torch.equal(seq, seq0)
    assert (logits.float() - logits0.float()).abs().max() <= 0.02 * logits0.float().abs().max()
    # the saved config does not name the attention function (another process may not have it)
    assert "sailfish" not in model.config.to_json_string()


def test_user_choice_and_fuse_false_are_left_alone():
    eager = _tiny("llama")
    eager.config._attn_implementation = "eager"
    assert use_decode_attention(eager) == [] and eager.config._attn_implementation == "eager"
    quantized = sailfish.quantize_model(_tiny("llama"), fuse=False)
    assert quantized.config._attn_implementation == "sdpa"
    fused = sailfish.quantize_model(_tiny("llama"))
    assert fused.config._attn_implementation == ATTENTION
    assert fused.sailfish_report["row_ops"]["attention"] == [f"model.layers.{i}.self_attn" for i in range(2)]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_kept_plan_and_cuda_graph():
    q, k, v, mask = _operands(1, 32, 8, 1024, 128, torch.float16, "bool")
    first = decode_attention(q, k, v, mask, 0.088)
    assert torch.equal(decode_attention(q, k, v, mask, 0.088), first)  # the kept plan, same bits
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode_attention(q, k, v, mask, 0.088)
    q2, k2, v2, m2 = _operands(1, 32, 8, 1024, 128, torch.float16, "bool", seed=3)
    for a, b in ((q, q2), (k, k2), (v, v2), (mask, m2)):
        a.copy_(b)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, decode_attention(q, k, v, mask, 0.088))


_SM90_CHILD = r"""
import triton
from triton.backends.compiler import GPUTarget
from sailfish.kernels.attention import decode_attention_kernel
from sailfish.tools.ptx import ast_source

sig = {"q_ptr": "*fp16", "k_ptr": "*fp16", "v_ptr": "*fp16", "mask_ptr": "*u8", "out_ptr": "*fp16",
       "ws_ptr": "*fp32", "ml_ptr": "*fp32", "cnt_ptr": "*i32", "HKV": "i32", "L": "i32", "CHUNK": "i32",
       "scale": "fp32"}
sig.update({n: "i32" for n in "sqb sqh skb skh skl svb svh svl smb smh sml sob soh".split()})
names = list(sig)
aligned = [n for n in names if n.endswith("_ptr")] + "L CHUNK sqb sqh skb skh skl svb svh svl sob soh".split()
attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
for splits, mask, dt in [(16, 1, "*fp16"), (1, 0, "*bf16"), (2, 2, "*fp16")]:
    s = dict(sig, q_ptr=dt, k_ptr=dt, v_ptr=dt, out_ptr=dt, mask_ptr=dt if mask == 2 else "*u8")
    p2 = 1 << (splits - 1).bit_length()
    consts = dict(G=4, BLOCK_G=16, D=128, BLOCK_N=64, SPLITS=splits, MASK=mask, EMU_BF16=False, SPLITS_P2=p2,
                  G_P2=4, CS=min(p2, 8))
    k = triton.compile(ast_source(decode_attention_kernel, s, consts, attrs), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": 4, "num_stages": 3})
    # K and V stream through cp.async (the loop is software-pipelined), both products on tensor cores
    assert k.asm["ptx"].count("cp.async") >= 4 and "mma.sync" in k.asm["ptx"], (splits, mask, dt)
print("checked")
"""


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU runs the kernel itself")
def test_kernel_compiles_for_sm90(tmp_path):
    """The interpreter does not run Triton's compiler: compile the kernel's variants for sm_90."""
    from helpers import run_compile_child
    run_compile_child(_SM90_CHILD, tmp_path)
