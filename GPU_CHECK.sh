#!/usr/bin/env bash
# Branch s3-w4a8 (issue 10): W4A8 fragment-order layout, int8 wgmma with the weight in registers.
# 1) the W4A8 kernel tests on the GPU (exact int32 accumulator, every path, NaN/Inf rows);
# 2) timings (CUDA graph, L2-cold copies) vs W4A16, cuBLAS fp16 and int8 cuBLAS. <= 3 minutes.
set -u
export PYTHONPATH=src
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout 100 python -m pytest -q -x -p no:cacheprovider tests/test_w4a8.py \
  -k "accumulator or nonfinite or paths_epilogue or layer_matches or identity or split_k or state_dict or fragment" 2>&1 | tail -15
timeout 150 python -m sailfish.bench --shapes 8192x57344,4096x28672,4096x4096 --m 1,16,64,1024 \
  --kernels cublas-fp16/fp16,sailfish-w4a16/fp16/g128,sailfish-w4a8/fp16/g128,sailfish-w4a8/fp16/chan,sailfish-w4a8-gemm/fp16/g128,cublas-int8/int8 \
  --out-dir /tmp/s3w4a8_bench --no-plots 2>&1 | tail -80
