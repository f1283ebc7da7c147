#!/usr/bin/env bash
# A first look on a 4-GPU host: the harness's GPU paths (leases, xdist benchmarks, NCCL collectives) before the
# long runs. Writes logs under $OUT.
set -u
export NCCL_NVLS_ENABLE=0 PYTHONPATH=. PYTHONUNBUFFERED=1
nvidia-smi -L; python -c "import torch, triton, pytest_benchmark, xdist; print(torch.__version__, triton.__version__, pytest_benchmark.__version__, xdist.__version__, torch.cuda.device_count())"
start=$(date +%s)
timeout 240 python -m pytest -q -p no:cacheprovider -x tests/test_workers.py tests/test_leases.py tests/test_collectives.py \
    tests/test_options.py 2>&1 | tee $OUT/smoke_tests.log | tail -25
echo "tests: $(( $(date +%s) - start )) s"
start=$(date +%s)
timeout 200 python -m pytest -n 4 -q -p no:cacheprovider benches/bench_model.py -k test_model --presets small,medium \
    --contexts 128,256 --precisions bf16 --rounds 5 --benchmark-autosave --benchmark-storage=file://$OUT/bstore 2>&1 \
    | tee $OUT/smoke_bench.log | tail -15
echo "bench -n 4: $(( $(date +%s) - start )) s"
python -m systems.report --storage $OUT/bstore --out $OUT/report && head -20 $OUT/report/model.md
