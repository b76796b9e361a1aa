#!/usr/bin/env bash
# Runs on a CUDA machine from the repository root. Steps, in this order:
#   compare     the side-by-side benchmark on W1 and W2 (22 minutes in run 17)
#   cuda-tests  every test marked cuda but the model zoo's (stalled copy streams, ...; 2 minutes)
#   zoo         the model zoo's CUDA tests (7 minutes)
#   zoo-bench   the model-zoo benchmark (benchmarks/zoo.py; $ZOO_ARGS are passed to it,
#               shell quoting kept: ZOO_ARGS='--models gpt2 --configs "offload_pass auto"')
#   example     the main example
#   overhead    the transfer ops' host time, alone and inside compiled steps (op_overhead.py)
#   kernels     the zoo's launches as counted against the kernels run and the host's time
#               (kernel_count.py; the generated code and the table as JSON in $OUT/kernel_count)
#   finetune    the fine-tuning example (examples/finetune_hf.py; $FINETUNE_ARGS are passed,
#               shell quoting kept: FINETUNE_ARGS='--configs none auto "budget 0.7"')
#   breakdown   what is alive at the measured peak of W2's auto and three W1 configurations
#   steps       each kind of kernel's device time on W1 and W2 beside its predicted time
#               (step_breakdown.py)
#   cuda-graphs mode="reduce-overhead" with offloading: gradients, 200 replays of GPT-2
#               (benchmarks/reduce_overhead.py)
#   plan-repeat W2's plan under a budget in fresh processes, with the device cache and
#               without (benchmarks/plan_repeat.py)
#   checkpointing  W1 and W2 each under a budget at full checkpointing's peak (7.35 and
#               12.45 GiB), beside checkpointing and the stock compile (benchmarks/compare.py)
#   peers       W1 and W2 fitted to checkpointing's peak and to save_on_cpu's (6.69 and 9.32
#               GiB), beside checkpointing, save_on_cpu and torchtune (its wheels installed
#               as benchmarks/README.md says; about 15 minutes)
# With no argument compare, cuda-tests, zoo, example and breakdown run; `--only STEP
# [STEP ...]` runs those alone. Logs and results go to $OUT (or ./out); the exit status is pytest's.
set -o pipefail
out=${OUT:-out}
mkdir -p "$out"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
steps=(compare cuda-tests zoo example breakdown)
if [[ ${1:-} == --only ]]; then
    shift
    steps=("$@")
fi
status=0
python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())" | tee "$out/env.log"
for step in "${steps[@]}"; do
    case $step in
    compare)
        python -m benchmarks.compare --out "$out" 2>&1 | tee "$out/compare.log"
        ;;
    cuda-tests)
        python -m pytest -q -p no:logging -p no:cacheprovider -m cuda -rs tests \
            --ignore=tests/test_zoo_cuda.py 2>&1 | tee "$out/pytest.log" || status=$?
        ;;
    zoo)
        python -m pytest -q -p no:logging -p no:cacheprovider -m cuda -rs tests/test_zoo_cuda.py \
            2>&1 | tee "$out/zoo.log" || status=$?
        ;;
    zoo-bench)
        eval "python -m benchmarks.zoo --out \"\$out\" ${ZOO_ARGS:-}" 2>&1 \
            | tee "$out/zoo_bench.log"
        ;;
    example)
        python examples/train_gpt.py --steps 8 2>&1 | tee "$out/train_gpt_auto.log"
        ;;
    overhead)
        python -m benchmarks.op_overhead --device cuda 2>&1 | tee "$out/op_overhead.log"
        ;;
    kernels)
        python -m benchmarks.kernel_count --out "$out/kernel_count" 2>&1 | tee "$out/kernel_count.log"
        ;;
    finetune)
        eval "python examples/finetune_hf.py ${FINETUNE_ARGS:-}" 2>&1 | tee "$out/finetune_hf.log"
        ;;
    breakdown)
        python -m benchmarks.peak_breakdown --workload W2 --configs "offload_pass auto" 2>&1 \
            | tee "$out/peak_breakdown.log"
        python -m benchmarks.peak_breakdown --workload W1 --configs "offload_pass fraction 1" \
            "memory_budget 0.7" "offload_pass auto, recompute 0.7" 2>&1 \
            | tee -a "$out/peak_breakdown.log"
        ;;
    steps)
        python -m benchmarks.step_breakdown --workload W1 W2 2>&1 | tee "$out/step_breakdown.log"
        ;;
    cuda-graphs)
        python -m benchmarks.reduce_overhead 2>&1 | tee "$out/reduce_overhead.log"
        ;;
    plan-repeat)
        python -m benchmarks.plan_repeat 2>&1 | tee "$out/plan_repeat.log"
        ;;
    checkpointing)
        python -m benchmarks.compare --out "$out" --workloads W1 --steps 6 --configs compiled \
            "checkpoint blocks" "offload_pass budget 7.35 GiB" 2>&1 | tee "$out/checkpointing.log"
        python -m benchmarks.compare --out "$out" --workloads W2 --steps 6 --configs compiled \
            "checkpoint blocks" "offload_pass budget 12.45 GiB" 2>&1 | tee -a "$out/checkpointing.log"
        ;;
    peers)
        python -m benchmarks.compare --out "$out" --workloads W1 --steps 6 --configs compiled \
            "checkpoint blocks" "offload_pass budget 7.35 GiB, fitted" \
            "offload_pass budget 6.69 GiB, fitted" save_on_cpu "torchtune streams" 2>&1 \
            | tee "$out/peers.log"
        python -m benchmarks.compare --out "$out" --workloads W2 --steps 6 --configs compiled \
            "checkpoint blocks" "offload_pass budget 12.45 GiB, fitted" \
            "offload_pass budget 9.32 GiB, fitted" save_on_cpu "torchtune streams" 2>&1 \
            | tee -a "$out/peers.log"
        ;;
    *)
        echo "unknown step $step (compare, cuda-tests, zoo, zoo-bench, example, overhead, kernels," \
            "finetune, breakdown, steps, cuda-graphs, plan-repeat, checkpointing, peers)" >&2
        exit 2
        ;;
    esac
done
exit $status
