#!/usr/bin/env bash
# Runs on a CUDA machine from the repository root: the whole test suite (CUDA tests
# included) and the main example with and without offloading. Logs go to $OUT (or ./out).
set -o pipefail
out=${OUT:-out}
mkdir -p "$out"
export PYTHONPATH=. PYTHONUNBUFFERED=1
python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())" | tee "$out/env.log"
python -m pytest -q -p no:logging -rs tests 2>&1 | tee "$out/pytest.log"
status=$?
for fraction in 0 0.5 1; do
  python examples/train_gpt.py --fraction "$fraction" --steps 8 2>&1 | tee "$out/train_gpt_f$fraction.log"
done
exit $status
