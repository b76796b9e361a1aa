#!/usr/bin/env bash
# Runs on a host with two CUDA devices from the repository root: every CUDA test (the
# distributed ones on NCCL among them), then the pipeline example with 1F1B and
# interleaved 1F1B, auto and fraction 1, each against the same pipeline without
# offloading (with a profiler trace per rank of 1F1B auto's last step). Logs go to $OUT
# (or ./out).
set -o pipefail
out=${OUT:-out}
mkdir -p "$out"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.device_count(), 'x', torch.cuda.get_device_name())" | tee "$out/env.log"
nvidia-smi topo -m 2>&1 | tee -a "$out/env.log"
python -m pytest -q -p no:logging -m cuda -rs tests 2>&1 | tee "$out/pytest.log"
status=$?
for schedule in 1f1b interleaved; do
    for fraction in "" "--fraction 1.0"; do
        trace=""
        [ "$schedule" = 1f1b ] && [ -z "$fraction" ] && trace="--trace-dir $out"
        timeout 170 torchrun --nproc-per-node 2 examples/pipeline_parallel.py --schedule "$schedule" \
            $fraction $trace 2>&1 | grep -E "^rank|Error|error" | tee -a "$out/pipeline.log"
    done
done
exit $status
