"""Probe (not part of the package; Hopper GPU): the rate of the W4A16 Gluon kernels' tensor-core step
alone, no memory traffic. Each program keeps a (BLOCK_N, 128) fp16 weight operand in registers (the
kernels' DotOperandLayout A) and a (BLOCK_M, 128) x tile in shared memory (their NVMMA layout) and
repeats the kernels' K step: two chunks' wgmmas (m64 n=BLOCK_M k16 x 8 each), then wait(0), either
accumulating in place (per channel) or as two products scaled into the accumulator (group size 128,
`use_acc=False` + FMAs). The grid is `per_sm` programs per SM, so the warpgroups per SM are set
directly. What it answers: the floor that wgmma's N = BLOCK_M puts under a K step at small M,
independent of loads and dequantization (docs/perf_log.md v30).

    PYTHONPATH=src python benchmarks/probes/wgmma_rate_probe.py
"""
import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

from sailfish.kernels.w4a16_gluon import layouts


@gluon.jit
def rate_kernel(out_ptr, iters, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, PRODUCTS: gl.constexpr,
                MMA: gl.constexpr, DOT_A: gl.constexpr, X_BLK: gl.constexpr, X_SMEM: gl.constexpr):
    pid = gl.program_id(0)
    x = gl.full([BLOCK_M, 128], 1.0, gl.float16, layout=X_BLK)
    x_buf = gl.allocate_shared_memory(gl.float16, [2, BLOCK_M, 128], X_SMEM)
    x_buf.index(0).store(x)
    x_buf.index(1).store(x)
    fence_async_shared()
    w = gl.full([BLOCK_N, 128], 1.0, gl.float16, layout=DOT_A)
    s = gl.full([BLOCK_N], 1.0, gl.float32, layout=gl.SliceLayout(1, MMA))
    acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=MMA)
    zero = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=MMA)
    x0 = x_buf.index(0).permute((1, 0))
    x1 = x_buf.index(1).permute((1, 0))
    for i in range(iters):
        if PRODUCTS:
            p0 = warpgroup_mma(w, x0, zero, use_acc=False, is_async=True)
            p1 = warpgroup_mma(w, x1, zero, use_acc=False, is_async=True)
            p0, p1 = warpgroup_mma_wait(num_outstanding=0, deps=(p0, p1))
            acc += p0 * s[:, None] + p1 * s[:, None]
        else:
            acc = warpgroup_mma(w, x0, acc, is_async=True)
            acc = warpgroup_mma(w, x1, acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    rows = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, MMA))
    cols = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, MMA))
    gl.store(out_ptr + pid * BLOCK_N * BLOCK_M + rows[:, None] * BLOCK_M + cols[None, :], acc)


def main():
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    print(torch.cuda.get_device_name(), sms, "SMs")
    iters = 4096
    for products in (False, True):
        for bm in (8, 16, 32, 64):
            for bn, warps in ((64, 4), (128, 8)):
                line = []
                for per_sm in (1, 2, 3, 4):
                    if per_sm * warps > 16:
                        continue
                    L = {k: v for k, v in layouts(bm, bn, warps).items() if k in ("MMA", "DOT_A", "X_BLK", "X_SMEM")}
                    grid = sms * per_sm
                    out = torch.empty(grid * bn * bm, dtype=torch.float32, device=dev)
                    def run(grid=grid, out=out, bm=bm, bn=bn, L=L, warps=warps, products=products):
                        rate_kernel[(grid,)](out, iters, BLOCK_M=bm, BLOCK_N=bn, PRODUCTS=products, **L,
                                             num_warps=warps)
                    run()
                    torch.cuda.synchronize()
                    assert out[0].item() == 256.0 * iters, out[0].item()  # all ones: 2 x 128 per step
                    best = 1e9
                    for _ in range(5):
                        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        a.record()
                        run()
                        b.record()
                        torch.cuda.synchronize()
                        best = min(best, a.elapsed_time(b) * 1e-3)
                    tflops = 2.0 * grid * iters * 2 * bn * bm * 128 / best / 1e12
                    # weights per SM and cycle at 1.755 GHz (what a W4A16 K loop at this M could stream at most)
                    wpc = grid * iters * 2 * bn * 128 / best / sms / 1.755e9
                    line.append(f"{per_sm}/SM {tflops:6.1f} TFLOP/s {wpc:5.1f} w/clk")
                print(f"{'products' if products else 'in place'} BLOCK_M {bm:3d} BN {bn:3d} {warps} warps: "
                      + " | ".join(line), flush=True)


if __name__ == "__main__":
    main()
