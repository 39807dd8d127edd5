"""4-bit weight formats: the one place for their math (pure PyTorch, exact).

A linear layer's weight W has shape (N, K): N output channels, K input channels.
It is stored as 4-bit codes q in [0, 15] with one scale (and, asymmetric, one zero
point) per group of input channels and output channel:

    symmetric (Marlin):      W[n, k] = s[g, n] * (q[n, k] - 8)
    asymmetric (GPTQ / AWQ): W[n, k] = s[g, n] * (q[n, k] - z[g, n])
    g = g_idx[k]             (act-order), else g = k // group_size

Groups hold `group_size` consecutive input channels; if K is not a multiple of the
group size the last group is shorter (G = ceil(K / group_size)). group_size = -1
means one group per output channel.

The *effective* weight -- the number every Sailfish kernel multiplies x by -- is the
product s * (q - z) rounded once to the scale dtype (fp16 or bf16), because the
kernels dequantize into that dtype before the tensor-core product (as Marlin does).
`QuantizedWeight.dequantize()` returns exactly that value as float32.

The kernel layout (`PackedW4`) is produced by `pack` and inverted exactly by `unpack`.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Optional, Tuple

import torch

GROUP_SIZES = (32, 64, 128, 256, -1)
HALF_DTYPES = (torch.float16, torch.bfloat16)
# K is padded to a multiple of this in the kernel layouts so the K tiles the kernels use
# (W4A16: 128, 256; W4A8: 32..256) divide it: no masked weight loads in the hot loop.
K_PAD = 256


def check_int_choice(name: str, value, allowed: tuple, what: str = "") -> None:
    """ValueError unless value is a Python int in `allowed` (128.0 == 128, but a float group
    size would reach torch as a float and fail far from here; True == 1)."""
    if type(value) is not int or value not in allowed:
        kind = "" if type(value) is int else f" (a {type(value).__name__}; an int is needed)"
        raise ValueError(f"{name}={value!r}{kind} is not supported{what}; allowed: {allowed}")


def _check_group_size(group_size: int) -> None:
    check_int_choice("group_size", group_size, GROUP_SIZES)


def _check_bits(bits: int) -> None:
    check_int_choice("bits", bits, (4,), " (Sailfish stores 4-bit weights)")


def check_flag(name: str, value) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name}={value!r} must be a bool (True or False)")


def check_half_dtype(dtype, name: str = "dtype") -> None:
    if dtype not in HALF_DTYPES:
        raise TypeError(f"{name}={dtype!r} is not supported; allowed: torch.float16, torch.bfloat16")


def check_weight_values(weight: torch.Tensor) -> None:
    """ValueError if the weight to quantize holds NaN or +-Inf: its group would get a NaN
    (or infinite) scale and every output reading it would be NaN."""
    bad = ~torch.isfinite(weight)
    if bool(bad.any()):
        n, k = (int(i) for i in bad.nonzero()[0])
        raise ValueError(f"the weight holds {int(bad.sum())} non-finite value(s), first weight[{n}, {k}] = "
                         f"{float(weight[n, k])}; allowed: finite weights only")


# A scale rounded to its storage dtype may be off by at most 1/16 of itself: then the error
# it adds to a weight (at most 8 codes times it) stays within the 4-bit rounding's own
# (half a step). Only subnormal scales come near this (float16: below ~5e-7).
SCALE_ROUNDING = 1 / 16


def check_scales(exact: torch.Tensor, stored: torch.Tensor, effective: torch.Tensor) -> None:
    """Quantization must not over- or underflow: `exact` the scales before rounding (0 for an
    all-zero group, which is stored as 1), `stored` the same rounded to their dtype,
    `effective` the dequantized weight (float32, rounded as the kernels round it).
    ValueError naming the problem."""
    exact = exact.double()
    lost = ((stored.double() - exact).abs() > exact * SCALE_ROUNDING) & (exact > 0)
    dtype = stored.dtype
    or_bf16 = ", or use dtype=torch.bfloat16" if dtype == torch.float16 else ""
    if bool(lost.any()):
        i = int(torch.nonzero(lost.flatten())[0])
        raise ValueError(f"the weight's scales underflow {dtype}: a group needs a scale of "
                         f"{float(exact.flatten()[i]):.3g}, which {dtype} stores as "
                         f"{float(stored.flatten()[i]):.3g}; allowed: scales that {dtype} represents to within "
                         f"1/16 (scale the weight up{or_bf16})")
    bad = ~torch.isfinite(effective)
    if bool(bad.any()):
        n, k = (int(i) for i in bad.nonzero()[0])
        raise ValueError(f"the quantized weight overflows {dtype}: weight[{n}, {k}] dequantizes to "
                         f"{float(effective[n, k])} (a 4-bit code times its group's scale exceeds the largest "
                         f"{dtype} value); allowed: |weight| up to about 15/16 of that value (scale the weight "
                         f"down{or_bf16})")


def num_groups(in_features: int, group_size: int) -> int:
    return 1 if group_size == -1 else -(-in_features // group_size)


def default_g_idx(in_features: int, group_size: int, device=None) -> torch.Tensor:
    k = torch.arange(in_features, dtype=torch.int32, device=device)
    return torch.zeros_like(k) if group_size == -1 else k // group_size


@dataclass
class QuantizedWeight:
    """A 4-bit weight in its canonical, unpacked form.

    qweight: uint8 (N, K), codes in [0, 15].
    scales:  float16 or bfloat16 (G, N); G = ceil(K / group_size), or more with a g_idx.
    zeros:   uint8 (G, N) in [0, 16], or None for symmetric (zero point 8). Checkpoint
             formats hold 0..15; 16 is what Sailfish before the whole-word reading of GPTQ
             v1 zero points (formats/gptq.py) made of a stored 15, kept loadable.
    g_idx:   int32 (K,), group of each input channel, or None for k // group_size.
    group_size: 32, 64, 128, 256 or -1 (per output channel).
    """

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: Optional[torch.Tensor]
    g_idx: Optional[torch.Tensor]
    group_size: int
    bits: int = 4

    def __post_init__(self) -> None:
        _check_bits(self.bits)
        _check_group_size(self.group_size)
        if self.qweight.dim() != 2 or self.qweight.dtype != torch.uint8:
            raise TypeError(f"qweight must be a uint8 (N, K) tensor, got {self.qweight.dtype} {tuple(self.qweight.shape)}")
        n, k = self.qweight.shape
        if self.scales.dtype not in HALF_DTYPES:
            raise TypeError(f"scales dtype {self.scales.dtype} is not supported; allowed: float16, bfloat16")
        g = self.scales.shape[0]
        if self.scales.dim() != 2 or self.scales.shape[1] != n:
            raise ValueError(f"scales must have shape (G, N={n}), got {tuple(self.scales.shape)}")
        if self.g_idx is None and g != num_groups(k, self.group_size):
            raise ValueError(
                f"scales has {g} groups but K={k} with group_size={self.group_size} needs "
                f"ceil(K / group_size) = {num_groups(k, self.group_size)}")
        # with a g_idx, g_idx alone says which row scales a channel: more rows than
        # ceil(K / group_size) are allowed (a tensor-parallel slice of a GPTQ desc_act
        # weight touches nearly every group of the full weight), fewer are not
        if self.g_idx is not None and g < num_groups(k, self.group_size):
            raise ValueError(
                f"scales has {g} groups but a g_idx weight with K={k} and group_size="
                f"{self.group_size} needs at least ceil(K / group_size) = {num_groups(k, self.group_size)}")
        if self.g_idx is not None:
            if self.g_idx.shape != (k,):
                raise ValueError(f"g_idx must have shape (K={k},), got {tuple(self.g_idx.shape)}")
            if k and (int(self.g_idx.min()) < 0 or int(self.g_idx.max()) >= g):
                raise ValueError(f"g_idx values must lie in [0, {g}) (one per row of scales)")
        if self.zeros is not None:
            if self.zeros.shape != self.scales.shape or self.zeros.dtype != torch.uint8:
                raise ValueError(
                    f"zeros must be uint8 with the shape of scales {tuple(self.scales.shape)}, "
                    f"got {self.zeros.dtype} {tuple(self.zeros.shape)}")
            if self.zeros.numel() and int(self.zeros.max()) > 16:
                raise ValueError("zero points must lie in [0, 16]")
        if self.qweight.numel() and int(self.qweight.max()) > 15:
            raise ValueError("4-bit codes must lie in [0, 15]")

    @property
    def out_features(self) -> int:
        return self.qweight.shape[0]

    @property
    def in_features(self) -> int:
        return self.qweight.shape[1]

    @property
    def sym(self) -> bool:
        return self.zeros is None

    @property
    def dtype(self) -> torch.dtype:
        return self.scales.dtype

    def group_index(self) -> torch.Tensor:
        """int64 (K,): the group of every input channel."""
        if self.g_idx is not None:
            return self.g_idx.long()
        return default_g_idx(self.in_features, self.group_size, self.qweight.device).long()

    def dequantize(self, rounded: bool = True) -> torch.Tensor:
        """float32 (N, K): the effective weight, s * (q - z) rounded to the scale dtype (what
        the kernels multiply). rounded=False: s * (q - z) exactly (an fp16/bf16 scale times
        an integer below 16 fits in float32), the weight of a kernel that applies the scale
        to its fp32 product instead (kernels/w4a16.py SCALE_ACC)."""
        g = self.group_index()
        s = self.scales.float()[g].T  # (N, K)
        z = 8.0 if self.zeros is None else self.zeros.float()[g].T
        w = s * (self.qweight.float() - z)
        return w.to(self.dtype).float() if rounded else w


def grid(w: torch.Tensor, sym: bool, dtype: torch.dtype
         ) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """The quantization grid of groups of weights, one group per row of the last dimension:
    w float (..., n) -> (exact scale (...) float, stored scale (...) in `dtype`, zero point
    (...) float or None for sym). The one rule of `quantize` (RTN) and calibrate.gptq.
    Zeros added to a group change nothing (the range covers 0 anyway), so a ragged group
    may be padded with them or not."""
    if sym:
        exact, lo = w.abs().amax(dim=-1) / 7.5, None
    else:
        lo = w.amin(dim=-1).clamp(max=0)
        exact = (w.amax(dim=-1).clamp(min=0) - lo) / 15
    s = torch.where(exact == 0, torch.ones_like(exact), exact).to(dtype)
    z = None if sym else torch.round(-lo / s.float()).clamp(0, 15)
    return exact, s, z


def codes(w: torch.Tensor, s: torch.Tensor, z: Optional[torch.Tensor]) -> torch.Tensor:
    """The codes (float, integers 0..15) of weights w on the grid (s, z) of `grid`, which
    broadcast against w: clamp(round(w / s) + z, 0, 15), z = 8 when symmetric."""
    return (torch.round(w / s.float()) + (8 if z is None else z)).clamp(0, 15)


def quantize(weight: torch.Tensor, bits: int = 4, group_size: int = 128, sym: bool = True,
             dtype: Optional[torch.dtype] = None) -> QuantizedWeight:
    """Round-to-nearest 4-bit quantization of a (N, K) weight.

    sym=True:  s = max|w| / 7.5 per group, q = clamp(round(w / s) + 8, 0, 15) (Marlin).
    sym=False: s = (max(w, 0) - min(w, 0)) / 15, z = round(-min / s),
               q = clamp(round(w / s) + z, 0, 15) (GPTQ / AWQ).
    Scales are rounded to `dtype` (default: the weight's dtype if fp16/bf16, else fp16)
    before the codes are chosen, so the codes are the best ones for the stored scale.
    """
    _check_bits(bits)
    _check_group_size(group_size)
    check_weight_arg(weight)
    check_flag("sym", sym)
    if dtype is None:
        dtype = weight.dtype if weight.dtype in HALF_DTYPES else torch.float16
    check_half_dtype(dtype)
    n, k = weight.shape
    w = weight.detach().float()
    check_weight_values(w)
    gs = k if group_size == -1 else group_size
    g = -(-k // gs)
    pad = g * gs - k
    # Pad the ragged last group with zeros: they change neither max|w| nor the
    # [min(w, 0), max(w, 0)] range the quantizer uses.
    wg = torch.nn.functional.pad(w, (0, pad)).reshape(n, g, gs)
    exact, s, z = grid(wg, sym, dtype)
    q = codes(wg, s[..., None], None if z is None else z[..., None])
    q = q.to(torch.uint8).reshape(n, g * gs)[:, :k].contiguous()
    zeros = None if z is None else z.to(torch.uint8).T.contiguous()
    qw = QuantizedWeight(q, s.T.contiguous(), zeros, None, group_size)
    check_scales(exact, s, qw.dequantize())
    return qw


def check_weight_arg(weight) -> None:
    """The weight argument of quantize / quantize_qqq: a 2-D floating-point tensor."""
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        got = tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__
        raise ValueError(f"weight must be a 2-D (out_features, in_features) tensor, got {got}")
    if not weight.is_floating_point():
        raise TypeError(f"weight must be floating point, got {weight.dtype}")


# ----------------------------------------------------------------------------------
# Scale dtype casts: exact, or lossy only when asked (allow_lossy_scales=True) and then said
# ----------------------------------------------------------------------------------
# The scales define the weight: rounding them to the other half dtype changes it, so every
# path that changes a layer's dtype (load_quantized, QuantLinear.from_gptq / from_awq /
# to_dtype / load_state_dict) takes an exact cast silently, refuses a lossy one unless
# allow_lossy_scales=True, and then warns with the largest change.
def inexact(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Mask of the values of t that `dtype` cannot hold exactly (a NaN stays NaN: exact)."""
    c = t.to(dtype)
    return (c.to(t.dtype) != t) & ~(t.isnan() & c.isnan())


def checked_cast(t: torch.Tensor, dtype: torch.dtype, field: str, *, allow_lossy_scales: bool,
                 how: str) -> Tuple[torch.Tensor, bool]:
    """(t in dtype, whether that rounded any value). A lossy cast raises ValueError naming
    `field`, how many values, the first one and what is allowed (`how`: the opt-in), unless
    allow_lossy_scales=True."""
    bad = inexact(t, dtype)
    if bool(bad.any()) and not allow_lossy_scales:
        raise ValueError(f"{field}: {int(bad.sum())} of {t.numel()} {t.dtype} values are not exactly "
                         f"representable in {dtype} (first: {t[bad][0].item()!r}); allowed: an exact cast, "
                         f"or {how}, which rounds them and warns with the largest change")
    return t.to(dtype), bool(bad.any())


def relative_change(before: torch.Tensor, after: torch.Tensor) -> float:
    """max |after - before| / |before| over the nonzero entries of before (compared in float32)."""
    before, after = before.float(), after.float()
    nz = before != 0
    return float(((after[nz] - before[nz]).abs() / before[nz].abs()).max()) if bool(nz.any()) else 0.0


def cast_scales(qw: QuantizedWeight, dtype: torch.dtype, *, allow_lossy_scales: bool = False,
                field: str = "scales", how: str = "allow_lossy_scales=True") -> Tuple[QuantizedWeight, float]:
    """qw with its scales in `dtype`, and the largest relative change of any dequantized
    weight against s * (q - z) with the original scales, rounded to `dtype` (what the
    checkpoint's own dequantization gives in a `dtype` model): 0.0 when the scales are exact
    in `dtype`. A lossy cast raises ValueError unless allow_lossy_scales=True (checked_cast);
    one that overflows a scale or flushes it to 0 always does."""
    if dtype == qw.dtype:
        return qw, 0.0
    scales, lossy = checked_cast(qw.scales, dtype, field, allow_lossy_scales=allow_lossy_scales, how=how)
    out = QuantizedWeight(qw.qweight, scales, qw.zeros, qw.g_idx, qw.group_size)
    if not lossy:
        return out, 0.0
    broken = (scales.isinf() & qw.scales.isfinite()) | ((scales == 0) & (qw.scales != 0))
    if bool(broken.any()):
        raise ValueError(f"{field}: {int(broken.sum())} values fall outside the range of {dtype} "
                         f"(first: {qw.scales[broken][0].item()!r}); no cast to {dtype} keeps this weight")
    return out, relative_change(qw.dequantize(rounded=False).to(dtype), out.dequantize())


def warn_lossy_cast(where: str, src: torch.dtype, dst: torch.dtype, weight_change: float,
                    bias_change: float = 0.0, detail: str = "") -> None:
    bias = f", of a bias value {bias_change:.3g}" if bias_change else ""
    warnings.warn(f"sailfish: {where} with allow_lossy_scales=True rounded {src} scales to {dst}{detail}: "
                  f"the largest relative change of a dequantized weight is {weight_change:.3g}{bias}",
                  stacklevel=3)


# ----------------------------------------------------------------------------------
# Kernel layout
# ----------------------------------------------------------------------------------
# Channels per chunk of the fragment-ordered layout: the kernels' K tiles are 1, 2 or 4 chunks.
K_CHUNK = 128
# Layout version of PackedW4.qweight (QuantLinear's state_dict carries it; see nn.py):
# 1 = natural order (channel 8i + j in nibble j of word i), 2 = fragment order (below).
LAYOUT_VERSION = 2


@dataclass
class PackedW4:
    """The layout the W4A16 kernels read.

    qweight: int32 (N, Kp // 8), Kp = K rounded up to K_PAD, in *fragment order*: within
             each chunk c of K_CHUNK = 128 channels of one output row, channel
                 k = 128 c + 32 a + 16 r0 + 8 h + 2 t + e    (a, t in 0..3; r0, h, e in 0..1)
             is nibble j = 4 e + 2 h + r0 of word 16 c + 4 t + a.
             Why: in Hopper's wgmma m64nNk16 A fragment (fp16/bf16), lane t = lane % 4 holds
             channels 2t + e + 8h of every 16-channel step; so the 4 words a thread needs
             for a 128-channel chunk are adjacent (one 16-byte load), each word holds 8 of
             its own values, and nibbles j, j + 4 (e = 0, 1) are the half2 pair that the
             lop3 magic-number dequantization produces. The kernel unpacks with register-
             local shifts, joins and a reshape/permute that Triton lowers to nothing: the
             dequantized tile goes to the tensor cores from registers, never through
             shared memory (docs/perf_log.md v9).
             (`pack_words` / `unpack_words` are the exact map; layout version 2.)
    scales:  (N, Gp) float16/bfloat16, Gp = Kp // group_size (1 per channel); the
             groups that only cover K padding have scale 0, padded channels code 0.
             Every word lies in one group (its 8 channels sit in one aligned run of 32).
    zeros:   (N, Gp) in the scale dtype (integers 0..16), or None (symmetric: 8).
    perm:    int32 (K,) or None. Act-order: the kernel reads x[:, perm], and the
             channels are sorted by group so that groups are contiguous again.
    sorted_g_idx: int32 (Kp,) or None: the group of each (permuted) channel when the
             groups are not `group_size` consecutive channels after sorting (a general
             g_idx); None when they are, which is the case for GPTQ's desc_act.
    """

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: Optional[torch.Tensor]
    perm: Optional[torch.Tensor]
    sorted_g_idx: Optional[torch.Tensor]
    in_features: int
    group_size: int


def _words_from_nibbles(q: torch.Tensor) -> torch.Tensor:
    """int (..., 8) codes in [0, 15] -> int32 (...): nibble j in bits 4j .. 4j+3."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=q.device)
    words = (q.to(torch.int64) << shifts).sum(dim=-1)  # sum of disjoint bit fields
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _nibbles_from_words(words: torch.Tensor) -> torch.Tensor:
    """int32 (...) -> int64 (..., 8) codes, nibble j of each word at index j."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=words.device)
    return (words.to(torch.int64).unsqueeze(-1) >> shifts) & 0xF


def pack_words(codes: torch.Tensor) -> torch.Tensor:
    """int (N, Kp) codes, Kp % 128 == 0 -> int32 (N, Kp // 8) words in fragment order."""
    n, kp = codes.shape
    q = codes.reshape(n, kp // K_CHUNK, 4, 2, 2, 4, 2)  # (n, c, a, r0, h, t, e)
    q = q.permute(0, 1, 5, 2, 6, 4, 3)                  # (n, c, t, a, e, h, r0)
    return _words_from_nibbles(q.reshape(n, kp // 8, 8)).contiguous()


def unpack_words(words: torch.Tensor) -> torch.Tensor:
    """Exact inverse of `pack_words`: int32 (N, Kp // 8) -> int64 (N, Kp) codes."""
    n, kw = words.shape
    q = _nibbles_from_words(words).reshape(n, kw // 16, 4, 4, 2, 2, 2)  # (n, c, t, a, e, h, r0)
    return q.permute(0, 1, 3, 6, 5, 2, 4).reshape(n, kw * 8)           # (n, c, a, r0, h, t, e)


def natural_to_fragment_order(words: torch.Tensor) -> torch.Tensor:
    """Layout version 1 words (channel 8i + j in nibble j of word i) -> version 2."""
    return pack_words(_nibbles_from_words(words).reshape(words.shape[0], -1))


def padded_k(in_features: int) -> int:
    return -(-in_features // K_PAD) * K_PAD


def pack(qw: QuantizedWeight, k_multiple: int = K_PAD) -> PackedW4:
    """Arrange a QuantizedWeight in the kernel layout (exactly invertible by `unpack`), K
    padded to a multiple of `k_multiple` (K_PAD for the dense kernels; the stacked experts of
    formats/experts.py pad only to whole K_CHUNKs)."""
    n, k = qw.qweight.shape
    kp = -(-k // k_multiple) * k_multiple
    dev = qw.qweight.device
    q = qw.qweight
    perm = sorted_g = None
    g_of_k = qw.group_index()
    if qw.g_idx is not None and not torch.equal(
            g_of_k, default_g_idx(k, qw.group_size, dev).long()):
        perm = torch.argsort(g_of_k, stable=True)
        g_of_k = g_of_k[perm]
        q = q[:, perm]
        uniform = qw.group_size != -1 and torch.equal(
            g_of_k, default_g_idx(k, qw.group_size, dev).long())
        if not uniform:
            sorted_g = torch.zeros(kp, dtype=torch.int32, device=dev)
            sorted_g[:k] = g_of_k.to(torch.int32)
        perm = perm.to(torch.int32)
    # codes: pad K with code 0 (its scale is 0 too, and x is masked there anyway)
    qp = torch.zeros((n, kp), dtype=torch.int32, device=dev)
    qp[:, :k] = q.to(torch.int32)
    words = pack_words(qp)
    # scales / zeros: (N, Gp). Rows past ceil(K / group_size) (a g_idx weight may have them)
    # are kept only under act-order; with the plain k // group_size order nothing reads them
    g = qw.scales.shape[0] if perm is not None else num_groups(k, qw.group_size)
    gp = 1 if qw.group_size == -1 else max(kp // qw.group_size, g)
    scales = torch.zeros((n, gp), dtype=qw.scales.dtype, device=dev)
    scales[:, :g] = qw.scales[:g].T
    zeros = None
    if qw.zeros is not None:
        zeros = torch.zeros((n, gp), dtype=qw.scales.dtype, device=dev)
        zeros[:, :g] = qw.zeros[:g].T.to(qw.scales.dtype)
    return PackedW4(words, scales.contiguous(), zeros, perm, sorted_g, k, qw.group_size)


def unpack_codes(words: torch.Tensor, in_features: int) -> torch.Tensor:
    """int32 (N, Kp // 8) words in *natural* order (channel 8i + j in nibble j of word i,
    layout version 1; formats.qqq's layout) -> uint8 (N, in_features) codes."""
    q = _nibbles_from_words(words)
    return q.reshape(words.shape[0], -1)[:, :in_features].to(torch.uint8)


def unpack(p: PackedW4) -> QuantizedWeight:
    """Exact inverse of `pack`."""
    k = p.in_features
    q = unpack_words(p.qweight)[:, :k].to(torch.uint8)
    g = num_groups(k, p.group_size)
    if p.sorted_g_idx is not None and k:  # a general g_idx may use more rows (QuantizedWeight)
        g = max(g, int(p.sorted_g_idx[:k].max()) + 1)
    scales = p.scales[:, :g].T.contiguous()
    zeros = None if p.zeros is None else p.zeros[:, :g].T.to(torch.uint8).contiguous()
    g_idx = None
    if p.perm is not None:
        perm = p.perm.long()
        if p.sorted_g_idx is not None:
            g_sorted = p.sorted_g_idx[:k]
        else:
            g_sorted = default_g_idx(k, p.group_size, q.device)
        g_idx = torch.empty(k, dtype=torch.int32, device=q.device)
        g_idx[perm] = g_sorted.to(torch.int32)
        inv = torch.empty_like(perm)
        inv[perm] = torch.arange(k, device=q.device)
        q = q[:, inv].contiguous()
    return QuantizedWeight(q, scales, zeros, g_idx, p.group_size)


def check_shape(in_features: int, out_features: int) -> Optional[str]:
    """None if the kernels support this (K, N), else the rule it breaks."""
    for name, v, multiple in (("in_features", in_features, 16), ("out_features", out_features, 8)):
        if type(v) is not int or v <= 0 or v % multiple:
            kind = "" if type(v) is int else f" (a {type(v).__name__}; an int is needed)"
            return f"{name}={v!r}{kind} must be a positive multiple of {multiple}"
    return None
