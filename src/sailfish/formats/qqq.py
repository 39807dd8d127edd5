"""W4A8 (QQQ) formats: the one place for their math (pure PyTorch, exact).

int8 activations x 4-bit weights on int8 tensor cores. A linear layer's weight W has
shape (N, K); it is stored as 4-bit codes q in [0, 15] (signed value q - 8 in [-8, 7])
and becomes an int8 weight w8 inside the kernel:

    per-channel (group_size=-1):  w8[n, k] = q[n, k] - 8
    per-group   (group_size=128): w8[n, k] = clamp(rne(s_g[g, n] * (q[n, k] - 8)), -127, 127)
                                  g = k // 128 (the last group is shorter if 128 does not divide K)

    effective weight W[n, k] = s_ch[n] * w8[n, k]     s_ch: float32 (N,), s_g: float16 (G, N)

rne = round half to even. The product s_g * (q - 8) is exact in float32 (an fp16
significand times a 4-bit integer), so the rounding happens once and the kernels
(kernels/w4a8.py) and this module agree bit for bit.

Activations are quantized per token (row), dynamically (`quantize_activations`):

    amax = max_k |x[m, k]|  (float32),   s_tok[m] = amax / 127
    x_q[m, k] = clamp(rne(x[m, k] * (127 / amax)), -127, 127)   (int8; an all-zero row: s = 0, x_q = 0)

and the layer computes y[m, n] = s_tok[m] * s_ch[n] * sum_k x_q[m, k] * w8[n, k] (+ bias).
Note x_q uses the reciprocal 127 / amax (one IEEE division per row, then a float32
multiply per element), not x / s_tok: cheaper in the kernel, and matched here exactly.
A row holding NaN or +-Inf gets s_tok = NaN and x_q = 0: its outputs are NaN.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from .int4 import K_PAD, check_int_choice, check_scales, check_weight_arg, check_weight_values, padded_k
from .marlin import (INTERLEAVE, INTERLEAVE_QQQ_CHANNEL, QQQ_ROWS, check_tile_shapes, pack_tiles, permute_scales,
                     tile_codes, unpermute_scales, weight_perm)
from .nibbles import pack_nibbles, unpack_nibbles

GROUP_SIZES_W4A8 = (-1, 128)
# Per-group RTN: the per-channel int8 step keeps |w_i8| <= 119 so that with the 4-bit
# group scale s_g = max|w_i8| / 7.5 every code q - 8 in [-8, 7] maps into int8:
# 8 * fp16(119 / 7.5) = 126.94 <= 127 (the progressive scheme of QServe / QQQ).
INT8_LEVEL = 119
# Rows with max|x| below 2**-60 are scaled by 2**64 before 127 / amax (exact, as a power
# of two) so the reciprocal cannot overflow float32 (bf16 rows can be as small as 2**-133).
_TINY = 2.0 ** -60
_TINY_SCALE = 2.0 ** 64


def group_scales_fit_int8(s_g: torch.Tensor) -> bool:
    """True when every |s_g| < 127.5 / 8 (NaN: False): then |rne(s_g * (q - 8))| <= 127 for every
    code (|q - 8| <= 8), so the clamp of the per-group int8 weight cannot change a value (127.5
    itself rounds to 128). quantize_qqq's scales stop at INT8_LEVEL / 7.5. Reads the scales
    back (a sync on a GPU)."""
    return bool((s_g.float().abs() < 127.5 / 8).all()) if s_g.numel() else True


def check_group_size_w4a8(group_size: int) -> None:
    check_int_choice("group_size", group_size, GROUP_SIZES_W4A8, " for W4A8")


def num_groups_w4a8(in_features: int, group_size: int) -> int:
    return 1 if group_size == -1 else -(-in_features // group_size)


# ----------------------------------------------------------------------------------
# Activations
# ----------------------------------------------------------------------------------
ACT_DTYPES_W4A8 = ("int8", "fp8")
# Largest code of each activation type: int8 uses [-127, 127] (symmetric), e4m3 its largest
# finite value 448.
_QMAX = {"int8": 127.0, "fp8": 448.0}


def check_act_dtype(act_dtype: str) -> None:
    if act_dtype not in ACT_DTYPES_W4A8:
        raise ValueError(f"act_dtype={act_dtype!r} is not supported; allowed: {ACT_DTYPES_W4A8}")


def quantize_activations(x: torch.Tensor, act_dtype: str = "int8") -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-token symmetric quantization (the exact reference of the Triton kernel).

    x: (M, K) float16 / bfloat16 (any float dtype). act_dtype "int8": x_q int8 (M, K) in
    [-127, 127], rounded half to even; "fp8": x_q float8_e4m3fn, x * (448 / amax) clamped to
    +-448 and rounded to nearest even by the conversion. Returns x_q and scales float32 (M,)
    (amax / 127 or amax / 448), with x ~= scales[:, None] * x_q. All-zero rows give scale 0 and
    x_q 0. A row holding NaN or +-Inf gives scale NaN and x_q 0, so that row's layer outputs
    are all NaN (never silently finite).
    """
    check_act_dtype(act_dtype)
    qmax = _QMAX[act_dtype]
    xf = x.float()
    bad = ~torch.isfinite(xf).all(dim=1)
    xf = torch.where(bad[:, None], torch.zeros_like(xf), xf)
    amax = xf.abs().amax(dim=1) if xf.shape[1] else xf.new_zeros(xf.shape[0])
    c = torch.where(amax < _TINY, torch.full_like(amax, _TINY_SCALE), torch.ones_like(amax))
    den = torch.where(amax > 0, amax * c, torch.ones_like(amax))
    # IEEE divisions, tensor by tensor: PyTorch computes `127.0 / t` as reciprocal(t) * 127
    # and, on CUDA, `t / 127.0` as t * (1 / 127), each rounding twice.
    cq = torch.full_like(amax, qmax)
    inv = torch.where(amax > 0, cq / den, torch.zeros_like(amax))
    v = ((xf * c[:, None]) * inv[:, None]).clamp(-qmax, qmax)
    x_q = v.round().to(torch.int8) if act_dtype == "int8" else v.to(torch.float8_e4m3fn)
    return x_q, torch.where(bad, torch.full_like(amax, float("nan")), amax / cq)


# ----------------------------------------------------------------------------------
# Weights
# ----------------------------------------------------------------------------------
def codes_to_int8(q: torch.Tensor, s_g: Optional[torch.Tensor], group_size: int) -> torch.Tensor:
    """uint8 (N, K) codes (+ float16 (G, N) group scales) -> the kernel's int8 (N, K) weight."""
    if group_size == -1:
        return (q.to(torch.int16) - 8).to(torch.int8)
    return rounded_products(q, s_g, group_size).clamp(-127.0, 127.0).to(torch.int8)


def rounded_products(q: torch.Tensor, s_g: torch.Tensor, group_size: int) -> torch.Tensor:
    """float32 (N, K): rne(s_g * (q - 8)) before the int8 clamp (the product is exact in float32)."""
    g = torch.arange(q.shape[1], device=q.device) // group_size
    return ((q.float() - 8.0) * s_g.float()[g].T).round()


def fp8_weight(qw: "QQQWeight") -> torch.Tensor:
    """float32 (N, K): the weight operand of the fp8-activation variant, s_ch excluded.

    per-channel: q - 8, the same integers as the int8 path's w8 (every integer in [-8, 8]
                 is exact in e4m3, so the kernel's e4m3 weight tile is exact).
    per-group:   s_g * (q - 8) in float32 (exact: an fp16 times a 4-bit integer), NOT the
                 int8 path's rne(s_g * (q - 8)): those integers reach 127 and e4m3 holds only
                 16 significant levels per binade (17, 19, ... 127's odd neighbours are not
                 representable), so the kernel multiplies the e4m3 tile q - 8 and applies
                 s_g to each 128-channel group's fp32 partial sum instead. The effective
                 weight is QQQ's two-level value without the int8 rounding."""
    w = qw.qweight.float() - 8.0
    if qw.group_size == -1:
        return w
    g = torch.arange(qw.in_features, device=w.device) // qw.group_size
    return w * qw.s_g.float()[g].T


@dataclass
class QQQWeight:
    """A W4A8 weight in its canonical, unpacked form.

    qweight:    uint8 (N, K), codes in [0, 15] (signed value code - 8).
    s_ch:       float32 (N,), per output channel.
    s_g:        float16 (G, N) with G = ceil(K / 128), or None (per-channel).
    group_size: -1 (per-channel) or 128 (per-group, two-level).
    """

    qweight: torch.Tensor
    s_ch: torch.Tensor
    s_g: Optional[torch.Tensor]
    group_size: int

    def __post_init__(self) -> None:
        check_group_size_w4a8(self.group_size)
        if self.qweight.dim() != 2 or self.qweight.dtype != torch.uint8:
            raise TypeError("qweight must be a uint8 (N, K) tensor, got "
                            f"{self.qweight.dtype} {tuple(self.qweight.shape)}")
        n, k = self.qweight.shape
        if self.s_ch.dtype != torch.float32 or self.s_ch.shape != (n,):
            raise ValueError(f"s_ch must be float32 of shape (N={n},), got {self.s_ch.dtype} {tuple(self.s_ch.shape)}")
        if self.group_size == -1:
            if self.s_g is not None:
                raise ValueError("s_g must be None for per-channel weights (group_size=-1)")
        else:
            g = num_groups_w4a8(k, self.group_size)
            if self.s_g is None or self.s_g.dtype != torch.float16 or self.s_g.shape != (g, n):
                got = None if self.s_g is None else f"{self.s_g.dtype} {tuple(self.s_g.shape)}"
                raise ValueError(f"s_g must be float16 of shape (ceil(K / {self.group_size})={g}, N={n}), got {got}")
            if self.s_g.numel() and not bool(torch.isfinite(self.s_g).all()):
                raise ValueError("s_g must be finite")
        if self.qweight.numel() and int(self.qweight.max()) > 15:
            raise ValueError("4-bit codes must lie in [0, 15]")

    @property
    def out_features(self) -> int:
        return self.qweight.shape[0]

    @property
    def in_features(self) -> int:
        return self.qweight.shape[1]

    def int8_weight(self) -> torch.Tensor:
        """int8 (N, K): w8, the integer operand of the int8 tensor-core product."""
        return codes_to_int8(self.qweight, self.s_g, self.group_size)

    def dequantize(self) -> torch.Tensor:
        """float32 (N, K): the effective weight s_ch[n] * w8[n, k]."""
        return self.s_ch[:, None] * self.int8_weight().float()


def channel_scales(w: torch.Tensor, group_size: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """The per-output-channel scales of a float32 (N, K) weight: (exact, s_ch) float32 (N,),
    max|W[n]| / 7.5 per channel, max|W[n]| / INT8_LEVEL with groups (the first level); an
    all-zero row gets s_ch = 1. The one rule of quantize_qqq and calibrate.gptq."""
    exact = w.abs().amax(dim=1) / (7.5 if group_size == -1 else INT8_LEVEL)
    return exact, torch.where(exact == 0, torch.ones_like(exact), exact)


def int8_levels(w: torch.Tensor, s_ch: torch.Tensor) -> torch.Tensor:
    """The first level of the two-level rule: w (N, ...) on the per-channel int8 grid,
    clamp(rne(w / s_ch), -INT8_LEVEL, INT8_LEVEL) (float integers)."""
    s = s_ch.reshape(-1, *([1] * (w.dim() - 1)))
    return torch.round(w / s).clamp(-INT8_LEVEL, INT8_LEVEL)


def group_scales(w_i8: torch.Tensor) -> torch.Tensor:
    """float16 group scales of int8 levels, one group per row of the last dimension:
    fp16(max|w_i8| / 7.5), 1 for an all-zero group (padding zeros change nothing)."""
    a = w_i8.abs().amax(dim=-1)
    s_g = (a / 7.5).to(torch.float16)
    return torch.where(a == 0, torch.ones_like(s_g), s_g)


def codes_qqq(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """Codes (float, integers 0..15) of x on the symmetric grid s: clamp(rne(x / s) + 8, 0, 15)."""
    return (torch.round(x / s.float()) + 8).clamp(0, 15)


def quantize_qqq(weight: torch.Tensor, group_size: int = -1) -> QQQWeight:
    """Round-to-nearest (half to even) W4A8 quantization of a (N, K) weight.

    per-channel: s_ch = max|W[n]| / 7.5, q = clamp(rne(W / s_ch) + 8, 0, 15).
    per-group (two-level, as QQQ): first int8 per channel, s_ch = max|W[n]| / 119,
        w_i8 = clamp(rne(W / s_ch), -119, 119); then 4 bits per group of 128 input
        channels, s_g = fp16(max|w_i8 in group| / 7.5), q = clamp(rne(w_i8 / s_g) + 8, 0, 15).
        The 119 (instead of 127) guarantees |s_g * (q - 8)| <= 127 for every code.
    All-zero rows / groups get scale 1 (and codes 8).
    """
    check_group_size_w4a8(group_size)
    check_weight_arg(weight)
    n, k = weight.shape
    w = weight.detach().float()
    check_weight_values(w)
    exact, s_ch = channel_scales(w, group_size)
    if group_size == -1:
        q = codes_qqq(w, s_ch[:, None]).to(torch.uint8)
        qw = QQQWeight(q.contiguous(), s_ch.contiguous(), None, group_size)
        check_scales(exact.double(), s_ch, qw.dequantize())
        return qw
    w_i8 = int8_levels(w, s_ch)
    g = num_groups_w4a8(k, group_size)
    wg = torch.nn.functional.pad(w_i8, (0, g * group_size - k)).reshape(n, g, group_size)
    s_g = group_scales(wg)  # (N, G)
    q = codes_qqq(wg, s_g[..., None])
    q = q.reshape(n, g * group_size)[:, :k].to(torch.uint8).contiguous()
    qw = QQQWeight(q, s_ch.contiguous(), s_g.T.contiguous(), group_size)
    check_scales(exact.double(), s_ch, qw.dequantize())
    return qw


# ----------------------------------------------------------------------------------
# Kernel layout
# ----------------------------------------------------------------------------------
# Layout version of PackedQQQ.qweight (QuantLinearW4A8's state_dict carries it, nn.py):
# 1 = natural order (channel 8i + j in nibble j of word i; Sailfish <= 0.2), 2 = fragment
# order (below).
LAYOUT_VERSION_W4A8 = 2
# Channels per chunk of the fragment order: K tiles of the kernels are whole chunks or
# whole k32 steps of one.
K_CHUNK_W4A8 = 128


@dataclass
class PackedQQQ:
    """The layout the W4A8 kernels read.

    qweight: int32 (N, Kp // 8), Kp = K rounded up to K_PAD (256), in *fragment order*,
             best read as bytes (N, Kp // 2) (little-endian): within each chunk c of 128
             channels of one output row, channel
                 k = 128 c + 32 s + 16 h + 4 t + e      (s, t, e in 0..3; h in 0..1)
             is nibble h (0: low) of byte 64 c + 16 t + 4 s + e.
             Why: in Hopper's int8 wgmma (m64nNk32) A fragment, lane t = lane % 4 holds
             channels 4t + e (register 0) and 16 + 4t + e (register 1) of every k32 step,
             four int8 per 32-bit register. So a thread's 16 bytes of a chunk are adjacent
             (one 16-byte load), the 4 bytes of one 32-bit word are the 4 bytes of two of its
             A registers (low nibbles: h = 0, high nibbles: h = 1), and the unpack is a few
             register-local instructions per word, with no shared-memory relayout
             (kernels/w4a8.py). Padding channels hold code 8 (w8 = 0).
             (`pack_codes` / `unpack_codes` are the exact map; layout version 2.)
    s_ch:    float32 (N,).
    s_g:     float16 (N, Kp // 128) or None; groups covering only padding have scale 0.
             A group (128 channels) is one chunk: 64 whole bytes.
    """

    qweight: torch.Tensor
    s_ch: torch.Tensor
    s_g: Optional[torch.Tensor]
    in_features: int
    group_size: int


def pack_codes(q: torch.Tensor, kp: int, pad_code: int = 8) -> torch.Tensor:
    """uint8 (N, K) codes -> int32 (N, kp // 8) words in fragment order (PackedQQQ),
    padding channels set to pad_code."""
    n, k = q.shape
    if kp % K_CHUNK_W4A8 or kp < k:
        raise ValueError(f"kp={kp} must be a multiple of {K_CHUNK_W4A8} and >= K={k}")
    qp = torch.full((n, kp), pad_code, dtype=torch.int32, device=q.device)
    qp[:, :k] = q.to(torch.int32)
    qp = qp.reshape(n, kp // K_CHUNK_W4A8, 4, 2, 4, 4)   # (n, c, s, h, t, e)
    qp = qp.permute(0, 1, 4, 2, 5, 3)                    # (n, c, t, s, e, h): byte (c, t, s, e), nibble h
    return pack_nibbles(qp.reshape(n, kp // 8, 8)).contiguous()


def unpack_codes(words: torch.Tensor, in_features: int) -> torch.Tensor:
    """int32 (N, Kp // 8) fragment-order words -> uint8 (N, in_features) codes (inverse of
    pack_codes)."""
    n, kw = words.shape
    q = unpack_nibbles(words).reshape(n, kw // 16, 4, 4, 4, 2)  # (n, c, t, s, e, h)
    q = q.permute(0, 1, 3, 5, 2, 4)                               # (n, c, s, h, t, e)
    return q.reshape(n, kw * 8)[:, :in_features].contiguous()


def natural_to_fragment_order_w4a8(words: torch.Tensor) -> torch.Tensor:
    """Layout version 1 words (channel 8i + j in nibble j of word i) -> version 2."""
    n, kw = words.shape
    return pack_codes(unpack_nibbles(words).reshape(n, kw * 8), kw * 8)


def pack_qqq(qw: QQQWeight) -> PackedQQQ:
    """Arrange a QQQWeight in the kernel layout (exactly invertible by `unpack_qqq`)."""
    n, k = qw.qweight.shape
    kp = padded_k(k)
    s_g = None
    if qw.s_g is not None:
        g = qw.s_g.shape[0]
        s_g = torch.zeros((n, kp // qw.group_size), dtype=torch.float16, device=qw.s_g.device)
        s_g[:, :g] = qw.s_g.T
    return PackedQQQ(pack_codes(qw.qweight, kp), qw.s_ch.contiguous(), s_g, k, qw.group_size)


def unpack_qqq(p: PackedQQQ) -> QQQWeight:
    """Exact inverse of `pack_qqq`."""
    k = p.in_features
    q = unpack_codes(p.qweight, k)
    s_g = None
    if p.s_g is not None:
        s_g = p.s_g[:, :num_groups_w4a8(k, p.group_size)].T.contiguous()
    return QQQWeight(q, p.s_ch, s_g, p.group_size)


# ----------------------------------------------------------------------------------
# QQQ checkpoints (the QQQ repository, vLLM's quant_method "qqq")
# ----------------------------------------------------------------------------------
def from_qqq(B: torch.Tensor, s_channel: torch.Tensor, s_group: Optional[torch.Tensor], *,
             group_size: int = 128, per_channel: Optional[bool] = None) -> QQQWeight:
    """Read a QQQ layer's tensors into a QQQWeight, exactly.

    B int32 (K / 16, 2 N) in Marlin's tile order with QQQ's permutation (formats/marlin.py);
    s_channel float32 (1, N) and s_group float16 (K / 128, N) in Marlin's scale orders.
      group_size=128: nibbles are codes q (w8 = rne(s_group * (q - 8)), the int8 weight QQQ's
        kernel forms with one fp16 fma onto 1152, single rounding as here), s_ch = s_channel.
      group_size=-1: nibbles are two's-complement int4 w in [-8, 7], which QQQ's kernel
        reads as the int8 16 w (the high nibble of a byte), so the stored s_channel is the
        scale / 16: here q = w + 8 (= nibble ^ 8) and s_ch = 16 * s_channel (exact). s_group
        must be None or empty (QQQ writes a (0,) tensor). QQQ stores a layer whose K equals
        group_size=128 this way too (its layer treats group_size == in_features as per
        channel): it loads as a per-channel QQQWeight.
    A group weight whose int8 value rne(s_group * (q - 8)) leaves [-127, 127] is refused:
    QQQ's kernel keeps -128 and wraps values beyond [-128, 127] modulo 256 (it takes the low
    byte of 1152 + value in fp16), Sailfish clamps to [-127, 127], so they would differ.
    per_channel: default group_size == -1 or K == group_size; a tensor-parallel K slice
    passes the whole layer's (a 128-channel slice of a grouped layer is still grouped)."""
    check_group_size_w4a8(group_size)
    if s_channel.dtype != torch.float32:
        raise TypeError(f"s_channel must be float32 (QQQ's per-channel scales), got {s_channel.dtype}")
    check_tile_shapes(B, s_channel, -1, "s_channel")
    k, n = B.shape[0] * 16, s_channel.shape[1]
    if not bool(torch.isfinite(s_channel).all()):
        raise ValueError("s_channel must be finite")
    if per_channel is None:
        per_channel = group_size == -1 or k == group_size
    if per_channel:
        if s_group is not None and s_group.numel():
            raise ValueError(f"s_group must be empty for a per-channel layer (group_size={group_size}, K={k}), "
                             f"got shape {tuple(s_group.shape)}")
        q = tile_codes(B, weight_perm(QQQ_ROWS, 4, INTERLEAVE_QQQ_CHANNEL)) ^ 8
        s_ch = unpermute_scales(s_channel, n, grouped=False).reshape(n) * 16  # a power of two: exact
        if not bool(torch.isfinite(s_ch).all()):
            raise ValueError("16 * s_channel overflows float32")
        return QQQWeight(q, s_ch, None, -1)
    if s_group is None or s_group.dtype != torch.float16:
        raise TypeError(f"s_group must be a float16 tensor for group_size=128, got "
                        f"{None if s_group is None else s_group.dtype}")
    check_tile_shapes(B, s_group, group_size, "s_group")
    q = tile_codes(B, weight_perm(QQQ_ROWS, 4, INTERLEAVE))
    s_g = unpermute_scales(s_group, n, grouped=True)
    s_ch = unpermute_scales(s_channel, n, grouped=False).reshape(n)
    qw = QQQWeight(q, s_ch, s_g, group_size)
    w8 = rounded_products(q, s_g, group_size)
    bad = w8.abs() > 127
    if bool(bad.any()):
        i, j = (int(v) for v in bad.nonzero()[0])
        raise ValueError(f"s_group * (q - 8) rounds to {int(w8[i, j])} at (n={i}, k={j}) ({int(bad.sum())} weights "
                         f"outside [-127, 127]); allowed: int8 weights in [-127, 127] (QQQ's kernel keeps -128 "
                         f"and wraps larger values modulo 256, Sailfish clamps: they would differ)")
    return qw


def to_qqq(qw: QQQWeight) -> dict:
    """A QQQWeight as a QQQ checkpoint layer's tensors {"B", "s_channel", "s_group"}, exactly
    (the inverse of from_qqq: from_qqq(**to_qqq(qw), group_size=qw.group_size) == qw):
    per channel, nibbles q - 8 (two's complement) with s_channel = s_ch / 16 and an empty
    s_group, as QQQ writes them; per group, codes q with s_channel = s_ch and s_group = s_g.
    ValueError for shapes the format cannot hold: N not a multiple of 64 or K of 128 (whole
    tile runs), and a group-128 layer with K = 128 (QQQ reads those per channel: its int8
    weights rne(s_g (q - 8)) are no 4-bit values)."""
    n, k = qw.qweight.shape
    if n % 64 or k % 128:
        raise ValueError(f"a QQQ checkpoint stores whole 1024-element tile runs: out_features must be a multiple "
                         f"of 64 and in_features of 128, got {n} x {k}")
    if qw.group_size != -1 and k == qw.group_size:
        raise ValueError(f"in_features={k} equals group_size={qw.group_size}: QQQ reads such a layer per channel, "
                         f"which cannot hold its two-level weights; allowed: group_size=-1 for it")
    if qw.group_size == -1:
        s_channel = qw.s_ch / 16  # a power of two: exact (from_qqq multiplies back)
        if bool((s_channel * 16 != qw.s_ch).any()):
            raise ValueError("s_ch / 16 underflows float32; allowed: per-channel scales >= 2**-122")
        return {"B": pack_tiles(qw.qweight ^ 8, weight_perm(QQQ_ROWS, 4, INTERLEAVE_QQQ_CHANNEL)),
                "s_channel": permute_scales(s_channel.reshape(1, n), grouped=False),
                "s_group": torch.zeros(0, dtype=torch.float16, device=qw.s_ch.device)}
    return {"B": pack_tiles(qw.qweight, weight_perm(QQQ_ROWS, 4, INTERLEAVE)),
            "s_channel": permute_scales(qw.s_ch.reshape(1, n), grouped=False),
            "s_group": permute_scales(qw.s_g, grouped=True)}


__all__ = ["GROUP_SIZES_W4A8", "from_qqq", "INT8_LEVEL", "K_CHUNK_W4A8", "K_PAD", "LAYOUT_VERSION_W4A8", "PackedQQQ",
           "QQQWeight", "codes_to_int8", "fp8_weight", "ACT_DTYPES_W4A8", "check_act_dtype", "natural_to_fragment_order_w4a8", "pack_codes", "pack_qqq",
           "quantize_activations", "quantize_qqq", "to_qqq", "unpack_codes", "unpack_qqq"]
