"""Llama-3-, Qwen3-MoE- and DeepSeek-V2-shaped `transformers` models for the end-to-end benchmark
(bench/e2e.py).

The models are transformers' own LlamaForCausalLM / Qwen3MoeForCausalLM / DeepseekV2ForCausalLM
(their experts run by transformers' default experts implementation, grouped_mm in transformers 5)
with random weights
(nothing is downloaded)
and its own StaticCache, so a decode step here is the step a transformers user runs. That needs
transformers >= 5, whose StaticCache layers keep their write position in a device tensor
(`cumulative_length`) and whose Llama derives the token positions from it: a step then has no
host-side state, so one captured CUDA graph replays step after step. transformers is an
optional dependency (the `hf` extra) and is imported only when a function here needs it.
"""
from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Tuple

import torch
from torch import nn

from ..convert import quantize_model
from ..fuse import fuse_row_ops
from ..moe import SHARED_MLP, QuantExperts, is_experts_module
from ..nn import QuantLinear, QuantLinearW4A8


@dataclass(frozen=True)
class ModelShape:
    name: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    # mixture of experts (Qwen3-MoE architecture) when experts > 0: every decoder layer's MLP is
    # `experts` experts of width moe_intermediate, top-k routed (intermediate is then unused)
    experts: int = 0
    topk: int = 0
    moe_intermediate: int = 0
    head_dim: int = 0  # 0: hidden // heads
    # DeepSeek-V2 architecture when mla is set: multi-head latent attention (kv_lora_rank,
    # qk_nope_head_dim, qk_rope_head_dim, v_head_dim), `shared` shared experts of width
    # moe_intermediate beside the routed ones, the first `dense_layers` layers a dense MLP of
    # width intermediate
    mla: Tuple[int, int, int, int] = ()
    shared: int = 0
    dense_layers: int = 0

    @property
    def moe(self) -> bool:
        return self.experts > 0


MODELS: Dict[str, ModelShape] = {
    "8b": ModelShape("Llama-3-8B", 4096, 14336, 32, 32, 8, 128256),
    "70b": ModelShape("Llama-3-70B", 8192, 28672, 80, 64, 8, 128256),
    # The CPU check: every code path at a size the Triton interpreter gets through in seconds
    # (K = 128 and 256 keep group size 128 legal).
    "tiny": ModelShape("tiny Llama (CPU check)", 128, 256, 2, 4, 2, 512),
    "qwen3-moe": ModelShape("Qwen3-30B-A3B", 2048, 6144, 48, 32, 4, 151936, experts=128, topk=8,
                            moe_intermediate=768, head_dim=128),
    "tiny-moe": ModelShape("tiny Qwen3-MoE (CPU check)", 128, 256, 2, 4, 2, 512, experts=4, topk=2,
                           moe_intermediate=128, head_dim=32),
    "deepseek-v2-lite": ModelShape("DeepSeek-V2-Lite", 2048, 10944, 27, 16, 16, 102400, experts=64, topk=6,
                                   moe_intermediate=1408, mla=(512, 128, 64, 128), shared=2, dense_layers=1),
    "tiny-deepseek": ModelShape("tiny DeepSeek-V2 (CPU check)", 128, 256, 3, 4, 4, 512, experts=4, topk=2,
                                moe_intermediate=128, mla=(128, 32, 16, 32), shared=1, dense_layers=1),
}


@dataclass(frozen=True)
class Variant:
    name: str
    label: str
    dtype: torch.dtype
    quant: Optional[dict]  # sailfish.quantize_model keyword arguments; None = not quantized
    rows: bool = False  # not quantized, but with Sailfish's row-wise ops (sailfish.fuse.fuse_row_ops)


# Run order: the fp16 models first, then the bf16 ones (the base model is converted to bf16
# in place once, between the two groups), and within a group the baseline first. Quantized
# variants fuse q/k/v and gate/up (quantize_model's default); the "-unfused" twins run the
# seven projections separately, to measure what fusion gives.
VARIANTS: Dict[str, Variant] = {v.name: v for v in (
    Variant("fp16", "fp16", torch.float16, None),
    # fp16 with the RMSNorms (one launch each) and the decode attention Sailfish's quantized
    # variants run: what those give a 16-bit model, so that the quantized variants' gain over
    # it is the 4-bit layers'
    Variant("fp16-rowops", "fp16, Sailfish's one-launch RMSNorm and decode attention", torch.float16, None,
            rows=True),
    Variant("w4a16", "W4A16 sym g128 fp16", torch.float16, dict(group_size=128, sym=True)),
    Variant("w4a16-unfused", "W4A16 sym g128 fp16, unfused", torch.float16,
            dict(group_size=128, sym=True, fuse=False)),
    Variant("w4a8", "W4A8 g128 fp16", torch.float16, dict(group_size=128, act_bits=8)),
    Variant("w4a8-unfused", "W4A8 g128 fp16, unfused", torch.float16, dict(group_size=128, act_bits=8, fuse=False)),
    # lm_head quantized too (quantize_model leaves it in 16 bits by default, for accuracy)
    Variant("w4a16-lmhead", "W4A16 sym g128 fp16, lm_head quantized", torch.float16,
            dict(group_size=128, sym=True, lm_head=True)),
    Variant("bf16", "bf16", torch.bfloat16, None),
    Variant("bf16-rowops", "bf16, Sailfish's one-launch RMSNorm and decode attention", torch.bfloat16, None,
            rows=True),
    Variant("w4a16-bf16", "W4A16 sym g128 bf16", torch.bfloat16, dict(group_size=128, sym=True)),
    Variant("w4a16-asym-bf16", "W4A16 asym g128 bf16 (GPTQ-style)", torch.bfloat16,
            dict(group_size=128, sym=False)),
)}
# What runs without --variants: all but the unfused twins, the quantized lm_head and the sym
# bf16 W4A16 (the MoE models' variant: transformers' grouped_mm experts are bf16 kernels).
DEFAULT_VARIANTS = tuple(n for n, v in VARIANTS.items()
                         if (v.quant or {}).get("fuse", True) and not (v.quant or {}).get("lm_head")
                         and n != "w4a16-bf16" and not v.rows)
MOE_DEFAULT_VARIANTS = ("bf16", "w4a16-bf16")


def require_transformers() -> str:
    """transformers' version; ImportError/RuntimeError saying what to install when it is
    missing or lacks the StaticCache this benchmark relies on."""
    try:
        import transformers
        from transformers import StaticCache
        from transformers.cache_utils import StaticLayer
    except ImportError as e:
        raise ImportError("the end-to-end benchmark needs transformers >= 5: "
                          "pip install 'sailfish[hf]' (or transformers>=5)") from e
    if not (hasattr(StaticLayer(max_cache_len=1), "cumulative_length")
            and hasattr(StaticCache, "early_initialization")):
        raise RuntimeError(f"transformers {transformers.__version__} is too old for the end-to-end "
                           "benchmark: it needs transformers >= 5 (StaticCache layers with a "
                           "device-side cumulative_length, early_initialization)")
    return transformers.__version__


def llama_config(shape: ModelShape, layers: int):
    if shape.mla:
        from transformers import DeepseekV2Config

        kv_lora, nope, rope, v = shape.mla
        return DeepseekV2Config(
            vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
            moe_intermediate_size=shape.moe_intermediate, n_routed_experts=shape.experts,
            n_shared_experts=shape.shared, num_experts_per_tok=shape.topk, first_k_dense_replace=shape.dense_layers,
            topk_method="greedy", norm_topk_prob=False, routed_scaling_factor=1.0, q_lora_rank=None,
            kv_lora_rank=kv_lora, qk_nope_head_dim=nope, qk_rope_head_dim=rope, v_head_dim=v,
            num_hidden_layers=layers, num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
            hidden_act="silu", max_position_embeddings=8192, rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=False,
            attention_bias=False, bos_token_id=None, eos_token_id=None, pad_token_id=None,
            attn_implementation="sdpa")
    if shape.moe:
        from transformers import Qwen3MoeConfig

        return Qwen3MoeConfig(
            vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
            moe_intermediate_size=shape.moe_intermediate, num_experts=shape.experts,
            num_experts_per_tok=shape.topk, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
            num_hidden_layers=layers, num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
            head_dim=shape.head_dim or shape.hidden // shape.heads, hidden_act="silu",
            max_position_embeddings=8192, rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, tie_word_embeddings=False,
            attention_bias=False, bos_token_id=None, eos_token_id=None, pad_token_id=None,
            attn_implementation="sdpa")
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
        num_hidden_layers=layers, num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
        head_dim=shape.hidden // shape.heads, hidden_act="silu", max_position_embeddings=8192,
        rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
        tie_word_embeddings=False, attention_bias=False, mlp_bias=False,
        bos_token_id=None, eos_token_id=None, pad_token_id=None, attn_implementation="sdpa")


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def build_model(shape: ModelShape, layers: int, device: torch.device, seed: int = 0) -> nn.Module:
    """A float16 LlamaForCausalLM (Qwen3MoeForCausalLM for a MoE shape, DeepseekV2ForCausalLM for
    one with mla) with `layers` decoder layers and transformers' random init (normal, std 0.02),
    created directly on `device` in float16 (no float32 copy)."""
    from transformers import DeepseekV2ForCausalLM, LlamaForCausalLM, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    cls = DeepseekV2ForCausalLM if shape.mla else Qwen3MoeForCausalLM if shape.moe else LlamaForCausalLM
    with _default_dtype(torch.float16), torch.device(device):
        model = cls(llama_config(shape, layers))
    return model.eval().requires_grad_(False)


def shared_copy(model: nn.Module) -> nn.Module:
    """A copy of the module tree that shares every parameter and buffer with `model`:
    replacing a submodule of the copy (quantize_model does) leaves `model` intact, at the cost
    of the replaced modules only."""
    memo = {id(t): t for t in list(model.parameters()) + list(model.buffers())}
    return copy.deepcopy(model, memo)


def make_variant(base: nn.Module, variant: Variant) -> nn.Module:
    """The model of `variant` from the base model (which must already be in variant.dtype):
    the base itself when not quantized, else a shared copy with its linear layers quantized
    by sailfish.quantize_model (lm_head stays in the model dtype: it is skipped by default)."""
    if base_dtype(base) != variant.dtype:
        raise ValueError(f"base model is {base_dtype(base)}, variant {variant.name} needs {variant.dtype}")
    if variant.quant is None:
        if not variant.rows:
            return base
        model = shared_copy(base)
        model.sailfish_report = {"quantized": [], "skipped": [], "row_ops": fuse_row_ops(model)}
        return model
    return quantize_model(shared_copy(base), **variant.quant)


def base_dtype(model: nn.Module) -> torch.dtype:
    return model.get_input_embeddings().weight.dtype


def dequantized_reference(model: nn.Module, base: Optional[nn.Module] = None) -> nn.Module:
    """A copy of `model` with every Sailfish layer replaced by an nn.Linear (model dtype)
    holding layer.dequantize(): the weights the kernels multiply by, so the two models differ
    only in how the products are computed (and, W4A8, in the int8 activations). A QuantExperts
    becomes a copy of the experts module of the same name in `base` (the model it was quantized
    from: transformers' own experts code) holding the dequantized experts; one holding a
    DeepSeek block's shared MLP (fuse.fold_shared_experts) gives the routed experts, and the block
    its transformers class and shared MLP back, of nn.Linears holding the shared MLP's weights."""
    ref = shared_copy(model)
    dtype = base_dtype(model)
    for name, mod in list(ref.named_modules()):
        if isinstance(mod, QuantExperts):
            if base is None:
                raise ValueError(f"{name} is a QuantExperts: pass the base model it was quantized from")
            orig = base.get_submodule(name)
            twin = copy.copy(orig)  # transformers' module, its own parameter dict (base keeps its own)
            twin._parameters = dict(orig._parameters)
            w13, w2 = mod.dequantize()
            twin.gate_up_proj = nn.Parameter(w13[:mod.num_experts].to(dtype), requires_grad=False)
            twin.down_proj = nn.Parameter(w2[:mod.num_experts].to(dtype), requires_grad=False)
            parent, _, child = name.rpartition(".")
            block = ref.get_submodule(parent) if parent else ref
            setattr(block, child, twin)
            if mod.num_shared:  # unfolded: transformers' block class (SharedExpertsMoE's subclass of it)
                block.__class__ = type(block).__bases__[1]
                orig = base.get_submodule(f"{parent}.{SHARED_MLP}" if parent else SHARED_MLP)
                mlp = copy.copy(orig)
                mlp._modules = {**orig._modules, **{n: _linear(m, dtype) for n, m in mod.shared_layers()}}
                block.add_module(SHARED_MLP, mlp)
            continue
        if isinstance(mod, (QuantLinear, QuantLinearW4A8)):
            parent, _, child = name.rpartition(".")
            setattr(ref.get_submodule(parent) if parent else ref, child, _linear(mod, dtype))
    return ref


def _linear(layer: nn.Module, dtype: torch.dtype) -> nn.Linear:
    """An nn.Linear holding a Sailfish layer's dequantized weight (and bias), in `dtype`."""
    lin = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None,
                    dtype=dtype, device=next(layer.buffers()).device)
    lin.weight.data.copy_(layer.dequantize())
    if layer.bias is not None:
        lin.bias.data.copy_(layer.bias)
    return lin.requires_grad_(False)


def tensor_bytes(module: nn.Module) -> int:
    """Bytes of the module's parameters and buffers, each storage counted once."""
    seen, total = set(), 0
    for t in list(module.parameters()) + list(module.buffers()):
        key = (t.device, t.untyped_storage().data_ptr())
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def decoder_experts(model: nn.Module) -> List[nn.Module]:
    """The MoE experts modules (transformers' or QuantExperts) of the decoder layers."""
    return [m for _, m in model.model.layers.named_modules() if isinstance(m, QuantExperts) or is_experts_module(m)]


def decoder_linears(model: nn.Module) -> List[Tuple[str, nn.Module]]:
    """The linear layers (nn.Linear, QuantLinear, QuantLinearW4A8) of the decoder layers (a
    fused q/k/v or gate/up layer once)."""
    kinds = (nn.Linear, QuantLinear, QuantLinearW4A8)
    return [(n, m) for n, m in model.model.layers.named_modules() if isinstance(m, kinds)]


class Decoder:
    """Greedy decoding of `batch` sequences against a StaticCache of `context` tokens.

    step() runs the model on the (batch, 1) token buffer `ids`, takes the argmax and writes it
    back into `ids`: a whole decode step on the device with no host synchronisation, so it can
    be captured in a CUDA graph, and each replay decodes the next token at the next position
    (the cache layers advance their device-side position). seek(p) sets that position.
    """

    def __init__(self, model: nn.Module, batch: int, context: int, seed: int = 0):
        from transformers import StaticCache

        cfg = model.config
        self.model, self.batch, self.context = model, batch, context
        device = model.get_input_embeddings().weight.device
        self.cache = StaticCache(config=cfg, max_cache_len=context)
        gen = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(cfg.vocab_size, (batch, 1), generator=gen).to(device)
        # Allocate the cache now rather than on the first step, so that it exists before
        # seek() and outside any graph capture. Multi-head latent attention (DeepSeek) caches
        # keys and values of the version's own shapes, unlike early_initialization's one head_dim:
        # one forward allocates them, and seek(0) rewinds (what it wrote is overwritten or masked).
        if getattr(cfg, "kv_lora_rank", None):
            with torch.no_grad():
                self.forward(self.ids)
            self.seek(0)
        else:
            self.cache.early_initialization(batch_size=batch, num_heads=cfg.num_key_value_heads,
                                            head_dim=cfg.head_dim, dtype=base_dtype(model), device=device)

    def seek(self, position: int) -> None:
        if not 0 <= position < self.context:
            raise ValueError(f"position={position} is outside the cache (0 .. {self.context - 1})")
        for layer in self.cache.layers:
            layer.cumulative_length.fill_(position)

    def position(self) -> int:
        return int(self.cache.layers[0].cumulative_length)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Logits (batch, vocab) of the last position of `ids` (batch, T); advances by T."""
        out = self.model(input_ids=ids, past_key_values=self.cache, use_cache=True, logits_to_keep=1)
        return out.logits[:, -1]

    def step(self) -> torch.Tensor:
        logits = self.forward(self.ids)
        self.ids.copy_(logits.argmax(-1, keepdim=True))
        return logits


def greedy_agreement(model: nn.Module, ref: Optional[nn.Module], *, batch: int, prompt: int, steps: int,
                     seed: int = 0) -> dict:
    """Next-token agreement of `model` with `ref` on the same inputs.

    Both prefill the same random prompt (batch, prompt) and then decode `steps` tokens fed the
    reference's greedy choices (teacher forcing, so one early disagreement does not change
    every later input). Compared: the argmax after the prompt and after each step, batch x
    (steps + 1) next tokens. ref=None checks `model` alone (finite logits).
    """
    vocab = model.config.vocab_size
    device = model.get_input_embeddings().weight.device
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(vocab, (batch, prompt), generator=gen).to(device)

    def run(m: nn.Module, feed: Optional[List[torch.Tensor]]) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
        dec = Decoder(m, batch, prompt + steps, seed=seed)
        logits, nxt = [dec.forward(tokens)], []
        for s in range(steps):
            nxt.append(logits[-1].argmax(-1, keepdim=True) if feed is None else feed[s])
            logits.append(dec.forward(nxt[-1]))
        return logits, nxt

    out: dict = {"batch": batch, "prompt": prompt, "steps": steps, "tokens_compared": batch * (steps + 1)}
    if ref is None:
        logits, _ = run(model, None)
        out.update(logits_finite=all(bool(torch.isfinite(x).all()) for x in logits),
                   agreement=None, logits_rel_err=None)
        return out
    ref_logits, fed = run(ref, None)
    logits, _ = run(model, fed)
    agree = sum(int((a.argmax(-1) == b.argmax(-1)).sum()) for a, b in zip(logits, ref_logits))
    diff = torch.stack([(a.float() - b.float()).norm() for a, b in zip(logits, ref_logits)]).norm()
    norm = torch.stack([b.float().norm() for b in ref_logits]).norm()
    out.update(logits_finite=all(bool(torch.isfinite(x).all()) for x in logits),
               ref_logits_finite=all(bool(torch.isfinite(x).all()) for x in ref_logits),
               agreement=agree / out["tokens_compared"], logits_rel_err=float(diff / norm.clamp_min(1e-30)))
    return out
