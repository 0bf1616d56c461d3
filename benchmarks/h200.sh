#!/usr/bin/env bash
# GPU runs on the H200 (set-up: benchmarks/H200_SETUP.md; figures: benchmarks/RESULTS.md).
#   bash benchmarks/h200.sh tests   # CUDA tests
#   bash benchmarks/h200.sh bench   # offline benchmark: both loops, graphs on/off, HF, roofline
# Wheels for FlashInfer travel in .whl/ (ignored by git, named in the tool's `carry`).
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD
python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
if [ -f .whl/flashinfer-cache.tgz ]; then mkdir -p ~/.cache && tar xzf .whl/flashinfer-cache.tgz -C ~/.cache; fi
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
git rev-parse --short HEAD 2>/dev/null || true
for what in "$@"; do
case "$what" in
  tests)
    python3 -m pytest -q -rA -s tests/test_cuda.py -p no:cacheprovider 2>&1 | tee "$OUT/tests.log" | grep -E "identical|launch /|passed|failed|^E " ;;
  bench)
    N=${N:-256}
    python3 -m minisgl make-tiny /tmp/qwen3-0.6b --arch qwen3 --preset qwen3-0.6b
    python3 -m minisgl bench --workload offline --num-requests "$N" --model /tmp/qwen3-0.6b \
      --compare-loops --delays 0 --hf --hf-requests 64 --json "$OUT/graphs.json" 2>&1 | tee "$OUT/bench_graphs.log"
    python3 -m minisgl bench --workload offline --num-requests "$N" --model /tmp/qwen3-0.6b \
      --compare-loops --delays 0 --disable cuda_graph --json "$OUT/eager.json" 2>&1 | tee "$OUT/bench_eager.log" ;;
  graphs)
    N=${N:-256}
    [ -d /tmp/qwen3-0.6b ] || python3 -m minisgl make-tiny /tmp/qwen3-0.6b --arch qwen3 --preset qwen3-0.6b
    python3 -m minisgl bench --workload offline --num-requests "$N" --model /tmp/qwen3-0.6b \
      --compare-loops --delays 0 --json "$OUT/graphs.json" 2>&1 | tee "$OUT/bench_graphs.log" ;;
esac
done
(cd ~/.cache && tar czf "$OUT/flashinfer-cache.tgz" flashinfer 2>/dev/null) || true
ls -la "$OUT"
