"""What the Hopper Gluon kernels of both families share (kernels/w4a16_gluon.py,
kernels/w4a8_gluon.py): the chunk and K-step sizes, the SM's budget, and the warp-specialized
pipe kernels' parts that do not depend on the operand type (the program's tile and K steps,
the producer warp that copies x's chunks by TMA, the x rings and their mbarriers)."""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

from ..formats.int4 import K_CHUNK

# names that differ between Triton 3.6 and 3.9
tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared

CHUNK = K_CHUNK  # channels per wgmma (one chunk of the fragment order)
STEP = 2 * CHUNK  # channels per K step
CHUNK_C = gl.constexpr(CHUNK)
STEP_C = gl.constexpr(STEP)
WG_ROWS = gl.constexpr(64)  # rows per consumer warpgroup of the pipe kernels
# the pipe kernels' registers per thread: two consumer warpgroups at 232 (no spill with zero
# points, bf16; the chunk pipeline with a CTA barrier took 228-245), the producer warp's
# warpgroup at 40; launched at their mean over the 12 warps, setmaxnreg moves them
PIPE_CONSUMER_REGS = gl.constexpr(232)
PIPE_PRODUCER_REGS = gl.constexpr(40)
PIPE_MAXNREG = (2 * PIPE_CONSUMER_REGS.value + PIPE_PRODUCER_REGS.value) // 3  # 168

# Hopper SM: 228 KiB of shared memory (1 KiB of it reserved per resident CTA), 64 Ki registers
SM_SHARED_BYTES = 228 * 1024
CTA_RESERVED_SHARED = 1024
SM_REGISTERS = 65536


def pipe_shared_bytes(BLOCK_M: int, STAGES: int, elem_bytes: int = 2) -> int:
    """The pipe kernels' shared memory (_pipe_rings): x chunk rings of STAGES and STAGES + 1 slots
    of (BLOCK_M, 128) elements of elem_bytes (2: W4A16's fp16 / bf16 x, 1: W4A8's int8 x_q) and
    their ready / empty mbarriers (8 bytes each)."""
    return (2 * STAGES + 1) * (BLOCK_M * CHUNK * elem_bytes + 16)


@gluon.jit
def program(M, K, SPLIT_K: gl.constexpr, BLOCK_M: gl.constexpr):
    """Program (tile, split)'s N tile, M tile, split, first K step and step count (>= 1: the
    launcher checks). The M tiles of one N tile are adjacent programs: they read the same weight
    tile at about the same time, so HBM delivers it once (L2) when M spans several BLOCK_M."""
    pid = gl.program_id(0)
    pid_k = gl.program_id(1)
    tiles_m = gl.cdiv(M, BLOCK_M)
    steps = K // STEP_C
    per = gl.cdiv(steps, SPLIT_K)
    first = pid_k * per
    return pid // tiles_m, pid % tiles_m, pid_k, first, gl.minimum(per, steps - first)


@gluon.jit
def rows(ptr, pid_n, N, stride, BLOCK_N: gl.constexpr, LAYOUT: gl.constexpr):
    """One pointer per row of the N tile (rows past N: row n % N), in LAYOUT's rows."""
    rn = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, LAYOUT))
    return ptr + (rn % N).to(gl.int64) * stride


@gluon.jit
def pipe_loader(x_desc, M, K, x0_buf, x1_buf, ready0, ready1, empty0, empty1, SPLIT_K: gl.constexpr,
                BLOCK_M: gl.constexpr, S0: gl.constexpr, S1: gl.constexpr):
    """The dense pipe kernels' producer warp: the program's x rows and K steps (program) by pipe_copy."""
    pid_n, pid_m, pid_k, first, n = program(M, K, SPLIT_K, BLOCK_M)
    pipe_copy(x_desc, pid_m * BLOCK_M, first, n, x0_buf, x1_buf, ready0, ready1, empty0, empty1, S0, S1)


@gluon.jit
def pipe_copy(x_desc, row0, first, n, x0_buf, x1_buf, ready0, ready1, empty0, empty1, S0: gl.constexpr,
              S1: gl.constexpr):
    """A pipe kernel's producer warp: the two x chunks of each of the n K steps from step `first`
    on, rows row0 .. + BLOCK_M (the descriptor's block; rows and channels past the tensor
    zero-filled), into their rings by TMA, a slot refilled once both consumer warpgroups released it."""
    nbytes: gl.constexpr = x_desc.block_type.nbytes  # (fp16 / bf16 x, or W4A8's int8 x_q)
    for j in range(n):
        k0 = (first + j) * STEP_C
        a = j % S0
        mbarrier.wait(empty0.index(a), ((j // S0) & 1) ^ 1)
        mbarrier.expect(ready0.index(a), nbytes)
        tma_load(x_desc, [row0, k0], ready0.index(a), x0_buf.index(a))
        b = j % S1
        mbarrier.wait(empty1.index(b), ((j // S1) & 1) ^ 1)
        mbarrier.expect(ready1.index(b), nbytes)
        tma_load(x_desc, [row0, k0 + CHUNK_C], ready1.index(b), x1_buf.index(b))


@gluon.jit
def pipe_rings(DT: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr, X_SMEM: gl.constexpr):
    """The pipe kernels' x rings (STAGES slots of (BLOCK_M, 128) for chunk 0 of a K step, STAGES
    + 1 for chunk 1) and their per-slot ready / empty mbarriers, initialized."""
    S1: gl.constexpr = STAGES + 1
    x0_buf = gl.allocate_shared_memory(DT, [STAGES, BLOCK_M, CHUNK_C], X_SMEM)
    x1_buf = gl.allocate_shared_memory(DT, [S1, BLOCK_M, CHUNK_C], X_SMEM)
    ready0 = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty0 = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    ready1 = gl.allocate_shared_memory(gl.int64, [S1, 1], mbarrier.MBarrierLayout())
    empty1 = gl.allocate_shared_memory(gl.int64, [S1, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready0.index(s), count=1)  # the producer's expect; the TMA bytes complete it
        mbarrier.init(empty0.index(s), count=2)  # both consumer warpgroups
    for s in gl.static_range(S1):
        mbarrier.init(ready1.index(s), count=1)
        mbarrier.init(empty1.index(s), count=2)
    return x0_buf, x1_buf, ready0, ready1, empty0, empty1
