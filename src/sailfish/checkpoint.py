"""Whole quantized models in the Hugging Face directory layout (config.json + safetensors).

    model = sailfish.load_quantized("Llama-3-8B-GPTQ", device="cuda")   # GPTQ, AWQ or compressed-tensors
    sailfish.save_quantized(model, "out")                               # GPTQ checkpoint
    sailfish.save_quantized(model, "out-awq", format="awq")             # AWQ GEMM checkpoint

load_quantized builds the model from config.json with transformers, its parameters on the
meta device (buffers such as the rotary frequencies are computed for real), puts a
QuantLinear in place of every linear layer that has a `qweight` in the checkpoint (a
QuantExperts in place of every MoE experts module whose experts it stores quantized:
checkpoint_moe.py) and loads every other weight straight into place, so no weight is
allocated twice. Keys are matched after transformers' own renamings (its conversion mapping). The configuration
and every tensor's name, shape and dtype (from the safetensors headers) are checked before
any weight is read; values that only the data can contradict (g_idx out of range, a bias
that a bias-free layer would drop) raise while loading, naming the layer, and no model is
returned.

transformers and safetensors (the `hf` extra) are imported only when these functions run.
"""
from __future__ import annotations

import contextlib
import json
import os
import warnings
from dataclasses import dataclass
from typing import Dict, Optional

import torch
from torch import nn

from .checkpoint_io import (CT, TILED, _HALF, _check_tensor, _ct_ignores, _Entries, _field_error, _g_idx_key,
                            _group_size, _layer_tensors, _matches, _parse_quant_config, _read_headers, _read_layer,
                            _Reader, _Spec, _whole_matches)
from .checkpoint_moe import (KeyNames, experts_weights, float_experts_weights, plan_experts, read_experts,
                             read_float_experts)
from .formats.awq import to_awq
from .formats.compressed_tensors import to_compressed_tensors
from .formats.gptq import to_gptq
from .formats.int4 import HALF_DTYPES, cast_scales, checked_cast, relative_change, warn_lossy_cast
from .formats.qqq import to_qqq
from .formats.shard import _group_rows, shard_bounds, shard_range
from .fuse import check_fuse_flag, fuse_projections, unfused_layers
from .moe import QuantExperts
from .nn import QuantLinear, QuantLinearW4A8, check_shape

SAVE_FORMATS = ("gptq", "awq", "compressed-tensors", "qqq")


def _require_hf():
    try:
        import safetensors  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as e:
        raise ImportError("sailfish.load_quantized / save_quantized need transformers and safetensors: "
                          "pip install 'sailfish[hf]'") from e


# -- model skeleton --------------------------------------------------------------------
@contextlib.contextmanager
def _parameters_on_meta():
    """Create every nn.Parameter on the meta device while modules are constructed; buffers
    (rotary frequencies and the like, which no checkpoint holds) are computed for real."""
    register = nn.Module.register_parameter

    def on_meta(module, name, param):
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def _model_dtype(config, dtype: Optional[torch.dtype]) -> torch.dtype:
    if dtype is not None:
        if dtype not in HALF_DTYPES:
            raise TypeError(f"dtype={dtype} is not supported; allowed: torch.float16, torch.bfloat16")
        return dtype
    stored = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(stored, str):
        stored = getattr(torch, stored, None)
    return stored if stored in HALF_DTYPES else torch.float16


@dataclass
class _Plan:
    layers: Dict[str, nn.Linear]  # quantized linear layers, by module name
    params: Dict[str, list]  # checkpoint key -> every parameter name it fills (ties)
    buffers: list  # buffers the checkpoint stores (else they keep their computed values)
    zero_biases: list  # bias tensors of bias-free layers: must hold zeros (checked on load)
    experts: dict  # experts module name -> checkpoint_moe.ExpertsPlan (quantized MoE experts)


def _plan(model: nn.Module, entries: _Entries, spec: _Spec, naming) -> _Plan:
    """Match the checkpoint's tensors to the model; raise on anything that does not fit."""
    experts, zero_biases = plan_experts(model, entries, spec, naming)
    claimed = {key for p in experts.values() for key in p.keys}
    modules = dict(model.named_modules())
    field = "ignore" if spec.method == CT else "modules_to_not_convert"
    for entry in spec.not_convert if spec.method != CT else ():  # CT's patterns may name none
        if not any(_matches(name, entry) for name in modules if name):
            raise _field_error(field, list(spec.not_convert), f"names of modules of the model; {entry!r} names none")
    marker = {CT: ".weight_packed", "marlin": ".B", "qqq": ".B"}.get(spec.method, ".qweight")
    head = _output_layer_name(model)
    layers: Dict[str, nn.Linear] = {}
    for key in entries:
        if not key.endswith(marker) or key in claimed:
            continue
        name = key[: -len(marker)]
        module = modules.get(name)
        if not isinstance(module, nn.Linear):
            raise ValueError(f"{key}: the model has no nn.Linear named {name!r} "
                             f"(found {type(module).__name__ if module is not None else 'nothing'})")
        skipped = [e for e in spec.not_convert
                   if (_ct_ignores(name, module, e) if spec.method == CT else _matches(name, e))]
        if skipped:
            raise ValueError(f"{name} is quantized in the checkpoint (it has {key}) but "
                             f"quantization_config.{field} lists {skipped[0]!r}")
        err = check_shape(module.in_features, module.out_features)
        if err:
            raise ValueError(f"{name}: Sailfish cannot run this layer: {err}")
        if spec.method in TILED and (module.out_features % 64 or module.in_features % 128):
            raise ValueError(f"{name}: quant_method {spec.method!r} stores whole 1024-element tile runs: "
                             f"out_features must be a multiple of 64 and in_features of 128, got "
                             f"{module.out_features} x {module.in_features}")
        if name == head and spec.lm_head is False:
            raise ValueError(f"{name} is quantized in the checkpoint (it has {key}) but "
                             f"quantization_config.lm_head is false (or absent); allowed: lm_head true")
        layers[name] = module
    if not layers and not any(p.quantized for p in experts.values()):
        raise ValueError(f"the checkpoint has no quantized layer (no tensor named *{marker})")
    if spec.lm_head and head not in layers:
        raise ValueError(f"quantization_config.lm_head=True but the checkpoint has no {head}{marker}; "
                         f"allowed: lm_head false for a checkpoint whose {head} is not quantized")

    used = set(claimed)
    for name, linear in layers.items():
        for suffix, (shape, dtypes) in _layer_tensors(spec, linear).items():
            _check_tensor(entries, f"{name}.{suffix}", shape, dtypes)
            used.add(f"{name}.{suffix}")
        g_idx = _g_idx_key(spec, name, entries)
        if g_idx:
            _check_tensor(entries, g_idx, (linear.in_features,), ("I32", "I64"))
            used.add(g_idx)
        if spec.method == "qqq" and "s_group" not in _layer_tensors(spec, linear) and f"{name}.s_group" in entries:
            _check_tensor(entries, f"{name}.s_group", (0,), ("F16",))  # QQQ saves an empty one
            used.add(f"{name}.s_group")
        bias = f"{name}.bias"
        if linear.bias is not None:
            _check_tensor(entries, bias, (linear.out_features,), _HALF + ("F32",))
            used.add(bias)
        elif bias in entries:  # old AutoGPTQ wrote a zero bias for every layer
            _check_tensor(entries, bias, (linear.out_features,), _HALF + ("F32",))
            zero_biases.append(bias)
            used.add(bias)

    # Every other parameter: tied parameters (one object under several names) need one key.
    inside = tuple(f"{name}." for name in (*layers, *experts))
    groups: Dict[int, list] = {}
    for pname, p in model.named_parameters(remove_duplicate=False):
        if not pname.startswith(inside):
            groups.setdefault(id(p), []).append((pname, p))
    params: Dict[str, list] = {}
    for group in groups.values():
        present = [pname for pname, _ in group if pname in entries]
        if not present:
            raise ValueError(f"the checkpoint has no tensor {entries.stored(group[0][0])}")
        key, shape = present[0], tuple(group[0][1].shape)
        if entries[key].shape != shape:
            raise ValueError(f"{entries.stored(key)} has shape {entries[key].shape}, the model expects {shape}")
        params[key] = [pname for pname, _ in group]
        used.update(present)
    buffers = [b for b, _ in model.named_buffers() if b in entries and not b.startswith(inside)]
    used.update(buffers)
    unexpected = sorted(entries.stored(k) for k in set(entries) - used)
    if unexpected:
        raise ValueError(f"the checkpoint holds {len(unexpected)} tensor(s) the model has no place for: "
                         f"{unexpected[:5]}")
    return _Plan(layers, params, buffers, zero_biases, experts)


def _output_layer_name(model: nn.Module) -> Optional[str]:
    """The module name of the model's output projection (transformers' lm_head), if any."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return next((n for n, m in model.named_modules() if m is head), None) if head is not None else None


# -- tensor-parallel splits ---------------------------------------------------------------
# A shard must hold whole packed words (8 codes / zero points) and, in Marlin's tile order,
# whole 1024-element runs (64 output features) and 16-row tiles: (multiple of N, of K).
_SPLIT_MULTIPLE = {"gptq": (8, 8), "awq": (8, 1), CT: (8, 8), "marlin": (64, 16), "qqq": (64, 16)}


def _plain_g_idx(read: _Reader, key: str, gs: int, world: int, own: torch.Tensor, start: int) -> bool:
    """Whether the whole g_idx is k // group_size (no act-order: the formats' readers drop it)."""
    def plain(part, a):
        k = torch.arange(a, a + part.numel())
        return torch.equal(part.long(), torch.zeros_like(k) if gs == -1 else k // gs)
    return plain(own, start) and _whole_matches(read, key, 0, world, plain)


def _check_split(spec: _Spec, linear: nn.Linear, dim: int, world: int, plain: bool) -> None:
    """Raise ValueError if the layer's split over `world` ranks along `dim` cannot be read as
    whole words / tiles, breaks a shape rule or (plain groups) cuts a group."""
    n, k = linear.out_features, linear.in_features
    mult = _SPLIT_MULTIPLE[spec.method][dim]
    what, size = ("out_features", n) if dim == 0 else ("in_features", k)
    for r in range(world):
        start, stop = shard_bounds(n, k, r, world, dim)
        if (stop - start) % mult:
            raise ValueError(f"a {'column' if dim == 0 else 'row'}-parallel (dim={dim}) shard of {what}={size} "
                             f"over world_size={world} holds {stop - start}, but quant_method {spec.method!r} "
                             f"needs a multiple of {mult} (whole packed words / tiles along that dim)")
        if dim == 1 and plain:
            _group_rows(start, stop, k, _group_size(spec, linear))


def _tensor_parallel(model: nn.Module, plan: _Plan, spec: _Spec, read: _Reader, device_mesh, tp_plan):
    """({layer: (dim, style, own g_idx slice if act-order row shard)}, rank, world) of a tensor-parallel load, every split checked
    (headers and g_idx only, before any weight is read); ({}, 0, 1) without a mesh."""
    if device_mesh is None:
        if tp_plan is not None:
            raise ValueError("tp_plan needs device_mesh (the 1-D mesh of the tensor-parallel ranks)")
        return {}, 0, 1
    # here, not at the top: parallel imports torch.distributed, which `import sailfish` should not
    from .parallel import _mesh_rank_world, default_plan, resolve_plan
    rank, world = _mesh_rank_world(device_mesh)
    tp = resolve_plan(default_plan() if tp_plan is None else tp_plan, list(plan.layers))
    attn = [n for n, (d, _) in tp.items() if d == 0 and n.rpartition(".")[2] in ("q_proj", "k_proj", "v_proj")]
    for field in ("num_attention_heads", "num_key_value_heads") if attn else ():
        heads = getattr(model.config, field, None)
        if isinstance(heads, int) and heads % world:
            raise ValueError(f"config.{field}={heads} is not divisible by the device mesh size {world}: "
                             f"column-parallel q/k/v projections ({attn[0]}, ...) give every rank whole "
                             f"heads; allowed: mesh sizes that divide {heads}")
    for name, (dim, _) in tp.items():
        linear = plan.layers[name]
        g_key = _g_idx_key(spec, name, read.entries)
        plain, own = g_key is None, None
        if dim == 1 and g_key:  # act-order or not is a property of the whole g_idx
            start, stop = shard_range(linear.in_features, rank, world, 1)
            own = read(g_key, (slice(start, stop),))
            plain = _plain_g_idx(read, g_key, _group_size(spec, linear), world, own, start)
            own = None if plain else own
        tp[name] = (dim, tp[name][1], own)
        try:
            _check_split(spec, linear, dim, world, plain)
        except ValueError as e:
            fits = []
            for w in range(1, 9):
                try:
                    _check_split(spec, linear, dim, w, plain)
                    fits.append(w)
                except ValueError:
                    pass
            raise ValueError(f"{name}: {e} (mesh sizes up to 8 that split this layer: {fits})") from None
    return tp, rank, world


# -- public API ---------------------------------------------------------------------------
def load_quantized(path: str, *, dtype: Optional[torch.dtype] = None, device="cpu",
                   allow_lossy_scales: bool = False, fuse: bool = True, device_mesh=None,
                   tp_plan: Optional[dict] = None) -> nn.Module:
    """Load a GPTQ, AWQ, compressed-tensors or Marlin W4A16 checkpoint directory (Hugging Face
    layout) as a model whose quantized linear layers are Sailfish QuantLinear modules (QQQ W4A8
    checkpoints: QuantLinearW4A8).

    path: a local directory with config.json (holding quantization_config) and one or more
    *.safetensors files (with or without model.safetensors.index.json).
    dtype: activation / layer dtype, float16 or bfloat16; default the config's dtype when it
    is one of those, else float16. Quantized layers' scales and biases are cast to it when
    that is exact; a checkpoint whose scales it cannot hold exactly (GPTQModel writes fp16
    scales for bf16 models) raises ValueError naming the tensor, unless
    allow_lossy_scales=True, which rounds them and warns once with the largest relative
    change of any dequantized weight (pass dtype=torch.float16 to run them exactly).
    The other weights are cast to dtype, as transformers does.
    device: where the model lives ("cpu", "cuda", ...). Returns the model in eval mode, for
    inference (parameters with requires_grad=False).

    Supported: quant_method "gptq" (bits 4, group sizes 32/64/128/256/-1, desc_act true or
    false, sym true or false, checkpoint_format "gptq" (v1, zero points read as GPTQModel
    reads them) or "gptq_v2"), "awq" (bits 4, version "gemm", zero_point true or false) and
    "compressed-tensors" (format "pack-quantized": one config group targeting "Linear" with
    4-bit int weights, symmetric or not, strategy "group" (32/64/128/256) or "channel",
    actorder none / "weight" / "group", ignore; anything else, such as 8-bit or float weights,
    activation quantization or sparsity, is refused naming the field). Layers with a
    `qweight` (`weight_packed`) tensor become QuantLinear; every other weight loads into the
    transformers model unchanged. "marlin" (vLLM's config: group_size 128 or -1, lm_head;
    also quant_method "gptq" with checkpoint_format "marlin" / is_marlin_format true, sym,
    no desc_act): Marlin's B / s per layer, into QuantLinear (formats.marlin). "qqq" (the QQQ
    repository's config: wbits 4, group_size 128 or -1): B / s_channel / s_group per layer,
    into QuantLinearW4A8 (formats.qqq.from_qqq). Both need out_features a multiple of 64 and
    in_features of 128. "lm_head": true (GPTQ as GPTQModel writes it, Marlin) loads the
    quantized lm_head as a QuantLinear; the flag and the tensors must agree.
    MoE models (transformers 5 experts modules: Mixtral, Qwen2/3-MoE, DeepSeek-V2/V3, ...):
    per-expert GPTQ / AWQ / compressed-tensors tensors ({experts}.{e}.gate_proj / up_proj /
    down_proj, Mixtral's block_sparse_moe.experts.{e}.w1 / w3 / w2) load, expert by expert,
    into a QuantExperts (model.sailfish_report["experts"] lists them); act-order experts
    (GPTQ desc_act) load with a permutation per expert, a general g_idx is refused
    (checkpoint_moe.read_experts); 16-bit per-expert weights stack into the module's own parameters.
    fuse (default True): q/k/v and gate/up then run as one layer each, and DeepSeek's shared
    experts inside the MoE block, where exact (sailfish.fuse; model.sailfish_report says which).
    device_mesh (a 1-D torch DeviceMesh): tensor parallelism. Each rank reads only its shard
    of every layer the plan names, straight from the files (safetensors slices), and gets
    the model that loading it whole and sharding it with sailfish.parallel would give (the
    same tensors, bit for bit): column-parallel layers split along N, row-parallel ones along
    K (their outputs summed over the mesh, SailfishRowwiseParallel). tp_plan: a
    parallelize_module plan of SailfishColwiseParallel / SailfishRowwiseParallel by layer-name
    pattern (fused names such as qkv_proj stand for their projections); default
    sailfish.parallel.default_plan() (Llama-family: q/k/v, gate/up column, o, down row).
    Other weights load whole on every rank. Every split is checked before any weight is read
    (even shards, the kernels' shape rules, whole groups per row shard unless act-order,
    whole Marlin / QQQ tile runs of 64 output features, attention heads divisible by the
    mesh size); ValueError names the layer, the sizes and the mesh sizes that fit.
    """
    _require_hf()
    check_fuse_flag(fuse)
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    if not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"no config.json in {path!r}: load_quantized takes a local checkpoint directory")
    config = AutoConfig.from_pretrained(path)
    qc = getattr(config, "quantization_config", None)
    spec = _parse_quant_config(qc.to_dict() if hasattr(qc, "to_dict") else qc)
    dtype = _model_dtype(config, dtype)
    device = torch.device(device)
    entries = _read_headers(path)
    del config.quantization_config  # build a plain model: Sailfish does the quantized layers
    with _parameters_on_meta():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.tie_weights()  # ties (e.g. lm_head to the embedding) decide which keys are needed
    naming = KeyNames(model)
    entries = _Entries(entries, naming)  # the checkpoint's keys as transformers renames them
    plan = _plan(model, entries, spec, naming)
    converted = [name for name, experts in plan.experts.items() if experts.quantized]  # -> QuantExperts

    with contextlib.ExitStack() as stack:
        read = _Reader(entries, stack)
        tp, rank, world = _tensor_parallel(model, plan, spec, read, device_mesh, tp_plan)
        for key in plan.zero_biases:
            if bool(read(key).any()):
                raise ValueError(f"{entries.stored(key)} is not zero, but the model's layer has no bias")
        lossy = {}  # layer -> (largest relative change of a weight, of a bias value)
        for name, experts in plan.experts.items():  # MoE experts, read expert by expert
            if not experts.quantized:
                read_float_experts(read, name, experts, model.get_submodule(name), device)
                continue
            src = experts.scale_dtype
            how = f"load_quantized(..., allow_lossy_scales=True) (dtype={src} keeps them exact)"
            layer, change = read_experts(read, spec, name, experts, dtype, device,
                                         allow_lossy_scales=allow_lossy_scales, how=how)
            if change:
                lossy[name] = (change, 0.0)
            model.set_submodule(name, layer)
        for name, linear in plan.layers.items():
            try:
                split = (tp[name][0], rank, world, tp[name][2]) if name in tp else None
                qw, bias = _read_layer(read, spec, name, linear, device, split)
                if spec.method == "qqq":  # W4A8: scales are float32 / float16 by the format, bias float32
                    model.set_submodule(name, QuantLinearW4A8.from_quantized(qw, bias))
                    continue
                src = qw.dtype
                how = f"load_quantized(..., allow_lossy_scales=True) (dtype={src} keeps them exact)"
                qw, change = cast_scales(qw, dtype, allow_lossy_scales=allow_lossy_scales, how=how)
                bias_change = 0.0
                if bias is not None:
                    cast, _ = checked_cast(bias, dtype, "bias", allow_lossy_scales=allow_lossy_scales, how=how)
                    bias, bias_change = cast, relative_change(bias, cast)
                if change or bias_change:
                    lossy[name] = (change, bias_change)
                layer = QuantLinear.from_quantized(qw, bias)
            except (ValueError, TypeError) as e:
                raise type(e)(f"{name}: {e}") from e
            model.set_submodule(name, layer)
        for key, pnames in plan.params.items():
            like = model.get_parameter(pnames[0])
            value = read(key).to(device=device, dtype=like.dtype)
            tied = nn.Parameter(value, requires_grad=False)
            for pname in pnames:  # one Parameter under every tied name
                owner, _, attr = pname.rpartition(".")
                (model.get_submodule(owner) if owner else model)._parameters[attr] = tied
        for key in plan.buffers:
            owner, _, attr = key.rpartition(".")
            module = model.get_submodule(owner) if owner else model
            module._buffers[attr] = read(key).to(dtype=module._buffers[attr].dtype)
    if lossy:
        worst = max(lossy, key=lambda n: lossy[n][0])
        warn_lossy_cast("load_quantized", src, dtype, lossy[worst][0], max(b for _, b in lossy.values()),
                        f" in {len(lossy)} of {len(plan.layers) + len(converted)} quantized layers"
                        f"{' and experts modules' if converted else ''} (largest in {worst})")
    left = [n for n, p in model.named_parameters() if p.is_meta]
    if left:  # _plan accounts for every parameter; this guards against a model that re-creates some
        raise RuntimeError(f"parameters left unloaded: {left[:5]}")
    if _output_layer_name(model) in plan.layers and getattr(model.config, "tie_word_embeddings", False):
        # a quantized lm_head (GPTQModel) is no longer the embedding: keep transformers' tie_weights
        # (generate, resize_token_embeddings) from hanging the embedding on it
        model.config.tie_word_embeddings = False
    model = model.to(device).eval()
    if converted:
        model.sailfish_report = {"experts": converted}
    if fuse:  # a rank's q / k / v shards fuse into the shard of the fused layer (fuse.shard_fused)
        model = fuse_projections(model)
    for name, (dim, style, _) in tp.items():
        if dim == 1:  # row parallel: the partial outputs are summed over the mesh
            from .parallel import SailfishRowwiseParallel  # torch.distributed: only for tensor parallelism
            SailfishRowwiseParallel(reduce=style.reduce, shard=False)._apply(model.get_submodule(name), device_mesh)
    return model


def save_quantized(model: nn.Module, path: str, *, format: str = "gptq",
                   max_shard_size: int = 4 << 30) -> None:
    """Write `model` (a transformers model whose linear layers are Sailfish QuantLinear) as a
    checkpoint directory that load_quantized and the format's own loaders read: config.json
    with quantization_config, and safetensors holding every quantized layer's tensors (and
    bias) plus every other weight. Shards of at most max_shard_size bytes, with
    model.safetensors.index.json when there is more than one.

    format="gptq" (GPTQModel, vLLM, transformers): {quant_method "gptq", bits 4, group_size,
    desc_act, sym, checkpoint_format}, per layer qweight / qzeros / scales / g_idx
    (formats.gptq.to_gptq). checkpoint_format is "gptq" (v1, which every GPTQ loader reads)
    when every zero point is >= 1, else "gptq_v2" (v1 cannot hold a zero point of 0 for
    loaders that read it per nibble), with a warning naming the layers that need it.
    format="awq" (AutoAWQ GEMM: transformers, vLLM, GPTQModel): {quant_method "awq", bits 4,
    group_size, version "gemm", zero_point}, per layer qweight / qzeros / scales
    (formats.awq.to_awq); no act-order layers, K a multiple of the group size.
    format="compressed-tensors" (llm-compressor's W4A16: vLLM, transformers): {quant_method
    "compressed-tensors", format "pack-quantized", one config group targeting "Linear" with
    4-bit int weights, strategy "group" (or "channel" for group size -1), symmetric,
    actorder "group" if any layer has act-order, ignore: the other Linear layers}, per layer
    weight_packed / weight_scale / weight_shape (/ weight_zero_point / weight_g_idx)
    (formats.compressed_tensors.to_compressed_tensors).
    format="qqq" (QQQ W4A8: the QQQ repository, vLLM's quant_method "qqq"; the model's
    QuantLinearW4A8 layers): {quant_method "qqq", wbits 4, group_size}, per layer B /
    s_channel / s_group in Marlin's tile order (formats.qqq.to_qqq); out_features a multiple
    of 64 and in_features of 128 (not 128 itself with group size 128), lm_head not quantized.
    A model quantized with quantize_model(act_bits=8, method="gptq") holds its smoothing in
    its norm and projection weights, which are saved as they are.

    MoE models: every QuantExperts is written per expert, as a layer per projection under
    the names transformers' save_pretrained gives them (checkpoint_moe.py), experts left in
    16 bits as per-expert weights (listed in modules_to_not_convert / ignore).

    All QuantLinear layers and QuantExperts must share one group size and one dtype (the
    config has one of each); sym / zero_point false are written only if every layer is symmetric (a symmetric
    layer is stored with zero point 8, which reads back as symmetric), desc_act true if any
    layer has act-order. A zero point of 16 (no format stores it) and a layer of the other
    kind (QuantLinearW4A8 in a W4A16 format, QuantLinear in "qqq") are refused. `path` is
    created if needed and must not already hold *.safetensors files; nothing is written when
    a layer is refused.
    """
    _require_hf()
    from safetensors.torch import save_file

    config = getattr(model, "config", None)
    if not hasattr(config, "to_dict"):
        raise TypeError(f"model must be a transformers model (with .config), got {type(model).__name__}")
    if isinstance(max_shard_size, bool) or not isinstance(max_shard_size, int) or max_shard_size <= 0:
        raise ValueError(f"max_shard_size={max_shard_size!r} must be a positive number of bytes")
    if format not in SAVE_FORMATS:
        raise ValueError(f"format={format!r} is not supported; allowed: {SAVE_FORMATS}")
    experts = {n: m for n, m in model.named_modules() if isinstance(m, QuantExperts)}
    if experts and format == "qqq":
        raise TypeError(f"{next(iter(experts))} is a QuantExperts (W4A16 experts): format='qqq' holds "
                        f"QuantLinearW4A8 layers only; W4A16 experts save with 'gptq', 'awq' or 'compressed-tensors'")
    kind, other = (QuantLinearW4A8, QuantLinear) if format == "qqq" else (QuantLinear, QuantLinearW4A8)
    wrong = [n for n, m in unfused_layers(model).items() if isinstance(m, other)]
    if wrong:
        raise TypeError(f"{wrong[0]} is a {other.__name__}: format={format!r} holds {kind.__name__} layers only "
                        f"({len(wrong)} such layers; W4A8 layers save with format='qqq', W4A16 ones with 'gptq', "
                        f"'awq' or 'compressed-tensors')")
    layers = {n: m for n, m in unfused_layers(model).items() if isinstance(m, kind)}  # fused: per projection
    if not layers and not experts:
        raise ValueError(f"model has no {kind.__name__} layer to save (quantize it with sailfish.quantize_model)")
    if format == "qqq" and _output_layer_name(model) in layers:
        raise ValueError(f"{_output_layer_name(model)} is quantized, but a QQQ checkpoint keeps the output layer in "
                         f"fp16 (quantize_model's default skip=('lm_head',) leaves it so)")
    quantized = {**layers, **experts}
    dtypes = {} if format == "qqq" else {n: m.dtype for n, m in quantized.items()}
    for what, values in (("group sizes", {n: m.group_size for n, m in quantized.items()}), ("dtypes", dtypes)):
        distinct = sorted(set(values.values()), key=str)
        if len(distinct) > 1:
            example = {v: next(n for n in values if values[n] == v) for v in distinct}
            raise ValueError(f"the quantized layers have different {what} {distinct} (e.g. {example}); "
                             f"a {format} checkpoint has one for the whole model")
    first = next(iter(quantized.values()))
    if os.path.isdir(path) and any(f.endswith(".safetensors") for f in os.listdir(path)):
        raise FileExistsError(f"{path} already holds *.safetensors files; save into an empty directory")

    naming = KeyNames(model)
    weights = {name: layer.quantized_weight() for name, layer in layers.items()}
    weights.update(experts_weights(model, naming))  # every expert's gate, up and down as a layer
    zero_0 = [n for n, qw in weights.items() if getattr(qw, "zeros", None) is not None and bool((qw.zeros == 0).any())]
    checkpoint_format = "gptq_v2" if zero_0 else "gptq"
    sym = all(getattr(m, "sym", True) for m in layers.values()) and all(m.w13_zeros is None for m in experts.values())
    act_order = any(getattr(m, "act_order", False) for m in (*layers.values(), *experts.values()))
    write = {"gptq": lambda qw: to_gptq(qw, checkpoint_format), "awq": to_awq, "qqq": to_qqq,
             CT: lambda qw: to_compressed_tensors(qw, symmetric=sym, actorder=act_order)}[format]
    tensors, float_experts = float_experts_weights(model, naming)  # 16-bit experts, per expert too
    for name, qw in weights.items():
        try:
            packed = write(qw)
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from e
        if name in layers and layers[name].bias is not None:
            packed["bias"] = layers[name].bias
        tensors.update({f"{name}.{k}": v for k, v in packed.items()})
    inside = tuple(f"{name}." for name in (*quantized, *float_experts))
    seen = set()
    for key, t in model.state_dict().items():
        ident = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        if key.startswith(inside) or ident in seen:
            continue  # quantized layers are written above; tied weights once (the loader re-ties)
        seen.add(ident)
        tensors[key] = t
    # under the keys transformers' save_pretrained writes (Mixtral: block_sparse_moe, not mlp)
    tensors = {naming.to_checkpoint(k): v.detach().to("cpu").contiguous() for k, v in tensors.items()}

    shards, size = [{}], 0
    for key, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_size:
            shards.append({})
            size = 0
        shards[-1][key] = t
        size += nbytes
    os.makedirs(path, exist_ok=True)
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    for name, shard in zip(names, shards):
        save_file(shard, os.path.join(path, name), metadata={"format": "pt"})
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
                 "weight_map": {k: name for name, shard in zip(names, shards) for k in shard}}
        with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f, indent=2)

    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n not in layers]
    linears += float_experts
    cfg = config.to_dict()
    dtype = getattr(model, "dtype", torch.float16) if format == "qqq" else first.dtype  # W4A8 takes either
    cfg["dtype" if "dtype" in cfg else "torch_dtype"] = str(dtype).removeprefix("torch.")
    if format == "qqq":  # the QQQ repository's quant_config (vLLM's "qqq")
        qc = {"quant_method": "qqq", "wbits": 4, "group_size": first.group_size,
              "modules_to_not_convert": linears or None}
    elif format == "gptq":
        qc = {"quant_method": "gptq", "bits": 4, "group_size": first.group_size, "desc_act": act_order,
              "sym": sym, "checkpoint_format": checkpoint_format, "lm_head": "lm_head" in layers,
              "modules_to_not_convert": linears or None}
    elif format == "awq":
        qc = {"quant_method": "awq", "bits": 4, "group_size": first.group_size, "version": "gemm",
              "zero_point": not sym, "modules_to_not_convert": linears or None}
    else:  # llm-compressor's W4A16 config, one group for every Linear but the ignored ones
        channel = first.group_size == -1
        weights_scheme = {"num_bits": 4, "type": "int", "symmetric": sym, "strategy": "channel" if channel else "group",
                          "group_size": None if channel else first.group_size, "dynamic": False,
                          "actorder": "group" if act_order else None, "block_structure": None,
                          "observer": "minmax", "observer_kwargs": {}}
        qc = {"quant_method": CT, "format": "pack-quantized", "quantization_status": "compressed",
              "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights_scheme,
                                            "input_activations": None, "output_activations": None,
                                            "format": "pack-quantized"}},
              "ignore": linears, "kv_cache_scheme": None, "global_compression_ratio": None}
    cfg["quantization_config"] = qc
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
    if format == "gptq" and zero_0:
        warnings.warn(f"sailfish: save_quantized wrote checkpoint_format \"gptq_v2\" (zero points stored as "
                      f"they are), not v1: {len(zero_0)} layer(s) have a zero point of 0, which v1 loaders "
                      f"that read zero points per nibble misread (e.g. {zero_0[0]}); GPTQModel reads "
                      f"gptq_v2", stacklevel=2)
