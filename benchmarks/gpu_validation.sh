#!/usr/bin/env bash
# Runs on a CUDA machine from the repository root: the side-by-side benchmark on W1 and W2
# (22 minutes in run 17), first so that a session short of device time keeps it; the CUDA
# tests; the main example; and what is alive at the measured peak of the W1 configurations
# whose predicted peak is furthest off, and of W2's `auto` (in forward's last block since
# the order stage, run 17).
# Logs and results go to $OUT (or ./out).
set -o pipefail
out=${OUT:-out}
mkdir -p "$out"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())" | tee "$out/env.log"
python -m benchmarks.compare --out "$out" 2>&1 | tee "$out/compare.log"
python -m pytest -q -p no:logging -m cuda -rs tests 2>&1 | tee "$out/pytest.log"
status=$?
python examples/train_gpt.py --steps 8 2>&1 | tee "$out/train_gpt_auto.log"
python -m benchmarks.peak_breakdown --workload W2 --configs "offload_pass auto" 2>&1 \
    | tee "$out/peak_breakdown.log"
python -m benchmarks.peak_breakdown --workload W1 --configs "offload_pass fraction 1" \
    "memory_budget 0.7" "offload_pass auto, recompute 0.7" 2>&1 | tee -a "$out/peak_breakdown.log"
exit $status
