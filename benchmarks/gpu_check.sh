#!/usr/bin/env bash
# The CUDA path on a one-GPU machine, in about 5 minutes (budget: 8):
#   1. the GPU is visible to torch and the CUDA build of FBGEMM loads;
#   2. the shard on the GPU answers as the CPU shard does (tests/test_shard_storage.py -k gpu:
#      lookups, norms, row sums, write-back, SGD and row-wise Adagrad);
#   3. the engine on Ray shard actors (on the GPU) equals the in-process engine, bit for bit
#      (tests/test_engine.py -k ray_matches_in_process);
#   4. the DLRM step comparison with plain PyTorch and Opacus on the GPU (--device cuda) beside
#      widedp sparse and dpsgd (their shards on the GPU; widedp's dense part stays on the CPU),
#      written to benchmarks/results/gpu_dlrm_compare.json.
# Set-up first (needs PyPI): `make setup VARIANT=cuda`; on a machine without it, bring a .venv
# built that way. Run from anywhere: bash benchmarks/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
start=$(date +%s)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
$PY - <<'EOF'
import torch
assert torch.cuda.is_available(), "torch sees no CUDA device: is this the CUDA build (make setup VARIANT=cuda)?"
import fbgemm_gpu  # noqa: F401  (the CUDA build: fbgemm-gpu, not fbgemm-gpu-cpu)
print("torch", torch.__version__, "on", torch.cuda.get_device_name(0))
EOF
$PY -m pytest -p no:cacheprovider -q -rs tests/test_shard_storage.py -k gpu
$PY -m pytest -p no:cacheprovider -q tests/test_engine.py -k ray_matches_in_process
timeout 240 $PY benchmarks/dlrm_compare.py --device cuda --rows 20000,262144 \
    --systems pytorch-nonprivate,opacus-ghost,widedp-sparse-inprocess,widedp-dpsgd,widedp-nonprivate \
    --steps 10 --warmup 2 --max-seconds 20 --out benchmarks/results/gpu_dlrm_compare.json
echo "gpu_check: done in $(( $(date +%s) - start )) s"
