#!/usr/bin/env bash
# s3-ovh (issue 11, eager host overhead): run from the repo root; ~3-4 minutes.
export PYTHONPATH=src
python -c "import torch, triton; print(torch.cuda.get_device_name(), 'torch', torch.__version__, 'triton', triton.__version__)"
# 1) the per-call cost, layer by layer (target: W4A16 layer <= 20 us at M = 1)
timeout 90 python -m sailfish.bench.overhead --calls 2000
timeout 40 python -m sailfish.bench.overhead --calls 1000 --m 16
# 2) plans vs the JIT launch, direct calls, graphs, compile, autograd, device guard
timeout 80 python -m pytest -q -x -p no:cacheprovider tests/test_launch.py tests/test_ops.py -k "not past_2g"
timeout 150 python -m pytest -q -x -p no:cacheprovider tests/test_nn.py tests/test_usability.py tests/test_w4a8.py \
    -k "compile or graph or gradient or lora or fallback or errors"
# 3) the kernels with None for their unread pointers (bias, g_idx, workspace, s_g): correctness
timeout 120 python -m pytest -q -x -p no:cacheprovider tests/test_w4a16.py tests/test_w4a8.py -k "not past_2g"
