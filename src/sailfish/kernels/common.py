"""Small @triton.jit helpers shared by the kernel families.

Why the *_emu helpers exist: Triton's interpreter (seen with triton 3.9) stores bf16 as
raw uint16 and runs add/mul/dot on those bits, and rounds fp32 -> bf16 by truncation.
Kernels therefore take an EMU_BF16 flag, set only under TRITON_INTERPRET=1 with bf16
data: they then compute in fp32 and round to bf16 with integer ops, exactly as the
GPU's round-to-nearest-even does, so the interpreter checks the same numbers.
"""
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def round_bf16_emu(x):
    """fp32 -> fp32 holding the nearest-even bf16 value (finite inputs)."""
    b = x.to(tl.int32, bitcast=True)
    b = (b + 0x7FFF + ((b >> 16) & 1)) & -65536
    return b.to(tl.float32, bitcast=True)


@triton.jit
def to_bf16_emu(x):
    """fp32 -> bf16, nearest-even, using only integer ops."""
    b = round_bf16_emu(x).to(tl.int32, bitcast=True)
    return (b >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def cast_out(x, DTYPE: tl.constexpr, EMU_BF16: tl.constexpr):
    """fp32 accumulator -> output dtype."""
    if EMU_BF16:
        return to_bf16_emu(x)
    else:
        return x.to(DTYPE)


@triton.jit
def grouped_tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Program id -> (pid_m, pid_n) in grouped order: GROUP_M row tiles in a row share each
    weight tile while it is in L2 (the swizzle of the GPTQ split-K seed / Triton's matmul)."""
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    width = GROUP_M * num_pid_n
    first_m = (pid // width) * GROUP_M
    rows = tl.minimum(num_pid_m - first_m, GROUP_M)
    return first_m + (pid % width) % rows, (pid % width) // rows


@triton.jit
def split_k_range(pid_k, K, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
    """The K tiles [kt0, kt1) of split pid_k: a fixed partition of the tiles that hold real
    channels (tiles wholly in the K padding are skipped), so the split-K sum is deterministic."""
    k_tiles = tl.cdiv(K, BLOCK_K)
    per_split = tl.cdiv(k_tiles, SPLIT_K)
    kt0 = pid_k * per_split
    return kt0, tl.minimum(kt0 + per_split, k_tiles)


# ----------------------------------------------------------------------------------
# Split-K inside one launch ("fixup": W4A8, docs/perf_log.md v23; W4A16's GEMVs, issue 39)
# ----------------------------------------------------------------------------------
# Instead of a second kernel summing the (SPLIT_K, M, N) workspace, the last slice of each output
# tile to finish sums it. sync_ptr holds int32 counters, one per output tile from SYNC_TILES on,
# zero between launches (each launch leaves them as it found them: no memset), one buffer per
# device and stream (ops/common.py sync_buffer). The sum runs over the slices in slice order
# whichever slice arrives last, so the result does not depend on the programs' timing.
SYNC_TILES = tl.constexpr(32)  # (the first 128 bytes are left free)


@triton.jit
def last_slice(cnt_ptr, count):
    """Count this program's slice in on its tile's counter, once all of its threads have stored
    their part of the partial tile (the barrier orders every thread's stores before the release);
    True for the tile's last of `count` slices (a constexpr for the dense kernels' SPLIT_K, a
    runtime value for the MoE top-k sum's programs), whose acquire makes the other slices'
    stores visible to it."""
    tl.debug_barrier()
    return tl.atomic_add(cnt_ptr, 1, sem="acq_rel") == count - 1


@triton.jit
def arrive_last(cnt_ptr, count):
    """last_slice, and the last of the `count` programs zeroes the counter for the next launch
    (the MoE kernels' fused sums, the router's top-k after its logits)."""
    last = last_slice(cnt_ptr, count)
    if last:
        tl.debug_barrier()
        tl.atomic_xchg(cnt_ptr, 0, sem="relaxed")
    return last


@triton.jit
def sum_slices(total, ws_ptr, offs, cnt_ptr, mn, mask, SPLIT_K: tl.constexpr):
    """The last slice (last_slice): total (zeros, the tile's shape and dtype) plus the SPLIT_K
    slices of the workspace at offs (the tile's offsets within a slice, 32-bit: the launchers take
    this path only while M * N < 2**31; mn: one slice's size, 64-bit) in slice order, read past L1
    (.cg: another SM wrote them); then the counter back to zero for the next launch. One slice per
    loop step: unrolled, every slice's load stays in flight and the registers (allocated for the
    whole kernel, K loop included) went from 80 to 255 at W4A8's BM 64 / BN 64 / split 8."""
    tl.debug_barrier()
    for s in tl.range(0, SPLIT_K, num_stages=1):
        total += tl.load((ws_ptr + s * mn) + offs, mask=mask, other=0, cache_modifier=".cg")
    tl.atomic_xchg(cnt_ptr, 0, sem="relaxed")
    return total


@triton.jit
def join8(n0, n1, n2, n3, n4, n5, n6, n7):
    """8 tensors (..., R) -> (..., R, 2, 2, 2) with element [..., r, i, l, m] = n_{4i + 2l + m}[..., r].
    tl.join appends a minor axis that Triton keeps in the same thread's registers, so the 8
    values unpacked from one packed word stay with the thread that loaded it."""
    return tl.join(tl.join(tl.join(n0, n4), tl.join(n2, n6)), tl.join(tl.join(n1, n5), tl.join(n3, n7)))


# ----------------------------------------------------------------------------------
# Programmatic dependent launch (PDL, sm_90+; runtime/device.py `pdl`)
# ----------------------------------------------------------------------------------
# W4A16's split-K chain (GEMM -> reduce) otherwise pays a full kernel boundary: the reduce
# is launched only after the GEMM has finished and flushed. With PDL the GEMM lets it launch
# at once (pdl_release) and the reduce waits (pdl_wait, griddepcontrol.wait: every write of
# the previous grid is visible after it) before reading the partial sums. Measured (H200, same
# run, off / on): M = 16 4096x4096 8.9 -> 8.0 us, 4096x6144 10.0 -> 9.7, 14336x4096 18.6 ->
# 18.1; elsewhere within noise (docs/perf_log.md v16). The row kernels after W4A8's GEMMs and
# the decode attention wait the same way (ops/common.as_dependent; v52: -0.06 ms a W4A8 decode
# step at batch 16). Off: no-ops, nothing is emitted (CPU interpreter, pre-Hopper GPUs).
@triton.jit
def pdl_release(PDL: tl.constexpr):
    """Let the next grid in the stream launch now (it waits itself for what it reads)."""
    if PDL:
        gdc_launch_dependents()


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """Wait until the previous grid in the stream has finished and its writes are visible."""
    if PDL:
        gdc_wait()

