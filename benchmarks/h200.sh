#!/usr/bin/env bash
# GPU runs on the H200 (set-up: docs/gpu.md; figures: benchmarks/RESULTS.md).
#   bash benchmarks/h200.sh tests   # CUDA tests: more than one 10-minute call on a new machine (2026-12-03): split with TESTS, e.g. TESTS=features then TESTS="not features"
#   bash benchmarks/h200.sh bench   # offline benchmark: both loops, graphs on/off, HF, roofline
#   bash benchmarks/h200.sh breakdown      # offline, both loops, graphs on, with the run-level breakdown
#   bash benchmarks/h200.sh scale          # breakdowns at 256, 1,024 and 4,096 requests (SCALE), both loops: ~9 min warm
#   bash benchmarks/h200.sh decode-plan    # FlashInfer decode: tensor-core vs plain kernel, host and device per step
#   bash benchmarks/h200.sh deterministic  # offline, overlap loop, deterministic=True (its cost)
#   bash benchmarks/h200.sh gate           # issue 27: offline breakdown, overlap loop, prefill gate off/on (GATE_RUNS)
#   bash benchmarks/h200.sh prefill        # prefill batches alone, 256..8192 tokens: launch vs device vs floor, eager then piecewise graphs
#   bash benchmarks/h200.sh online         # Poisson arrivals, both loops; overlap with prefill_sync off
#   bash benchmarks/h200.sh checks         # batch-1 TPOT, eager overlap vs normal profile, host profile
#   bash benchmarks/h200.sh host           # host work per decode step at 256 requests, both loops
#   bash benchmarks/h200.sh lab            # the loop-comparison lab on the model shape (sweeps C only)
#   bash benchmarks/h200.sh invariance     # deterministic mode: which part makes overlap != normal
#   bash benchmarks/h200.sh eager-ab       # eager overlap vs normal, ABBA, then sync debug mode
#   bash benchmarks/h200.sh profile        # kernel time of a whole offline run by kind (PROFILE=attention|steps|batches|gemm: others)
#   bash benchmarks/h200.sh make8b         # the Qwen3-8B shape, random bf16 weights drawn on the GPU, in /tmp/qwen3-8b (16 GB)
#   bash benchmarks/h200.sh 8b             # offline breakdown on the 8B shape at 256 and 1,024 requests (SIZES_8B), both loops; HF generate at 256
#   bash benchmarks/h200.sh kernels        # kernels and device ms per decode step at 256 and 64 requests, each A/B variant (KERNEL_VARIANTS)
#   bash benchmarks/h200.sh ab             # offline breakdown, 256 requests (N), overlap loop, each A/B variant (AB_VARIANTS)
#   bash benchmarks/h200.sh spec           # speculation and mixed chunk: exactness, TPOT, verify cost; online ITL, mixed chunk off/on
#   bash benchmarks/h200.sh http           # the HTTP online bench, both loops, per HTTP_RUNS ("DIR:RATES ..."); needs .whl/srv
#   bash benchmarks/h200.sh profile8b      # kernels and device ms per decode step on the 8B shape at 256 and 64 requests
#   bash benchmarks/h200.sh hostprof       # the host's time by function in an offline run (cProfile), N requests (default 1,024)
# Several modes in one device call: `timeout 200 bash benchmarks/h200.sh A; timeout 300 bash ... B`.
# Environment: N (requests), TESTS (a pytest -k expression for `tests`), RATES (online), SCALE (scale's
# request counts, default "256 1024 4096": on a new machine give 4096 a call of its own), GATE_RUNS
# (gate: REQUESTS:MIN_PREFILL_TOKENS pairs, default "1024:0 1024:4096 4096:4096"; 0 is the gate off),
# SCALE_LOOPS (scale: "--compare-loops --delays 0" unless given, e.g. "--loop overlap"),
# KERNEL_VARIANTS (kernels: settings per engine, ';' between variants, '-' the defaults, default
# "-;fast_decode_plan=false"), AB_VARIANTS (ab: bench flags per run, default "-;--no-fast-decode-plan"),
# HTTP_RUNS (http: model directory and rates, default "/tmp/qwen3-0.6b:16,32").
# Wheels for FlashInfer travel in .whl/ (ignored by git, named in the tool's `carry`); the server's
# packages (starlette, uvicorn, pyzmq, xgrammar, the openai client and their needs) in .whl/srv/.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD
# Once per machine: later calls of this script in the same command (each under its own
# `timeout`) reuse the install and the compiled kernels.
if [ ! -d /tmp/site/flashinfer ]; then
  python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
  if [ -f .whl/flashinfer-cache.tgz ]; then
    # Even with this cache restored, a new machine spent about 4 minutes before its first run
    # printed anything (2026-12-01, RESULTS.md): plan for that warm-up whether or not it travels.
    mkdir -p ~/.cache && tar xzf .whl/flashinfer-cache.tgz -C ~/.cache
  fi
fi
# The server's packages too: the CLI (`minisgl bench` included) lists `serve` and its flags.
[ -d /tmp/site/uvicorn ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/srv/*.whl
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
# The device tool copies the working tree, not the history: this id may be an older commit's.
echo "git metadata on this machine: $(git rev-parse --short HEAD 2>/dev/null) (may lag the working tree)"
for what in "$@"; do
case "$what" in
  tests)
    python3 -m pytest -q -rA -s tests/test_cuda_features.py tests/test_cuda.py tests/test_qkv_epilogue.py -m cuda -p no:cacheprovider ${TESTS:+-k "$TESTS"} 2>&1 | tee "$OUT/tests.log" \
      | grep -E "identical|again|launch /|engine holds|passed|failed|Error|^E "
    cp "$OUT/tests.log" "$OUT/tests_${TESTS:-all}.log" 2>/dev/null ;;
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
  breakdown|deterministic)
    N=${N:-256}
    [ -d /tmp/qwen3-0.6b ] || python3 -m minisgl make-tiny /tmp/qwen3-0.6b --arch qwen3 --preset qwen3-0.6b
    if [ "$what" = breakdown ]; then flags="--compare-loops --delays 0"; else flags="--loop overlap --deterministic"; fi
    python3 -m minisgl bench --workload offline --num-requests "$N" --model /tmp/qwen3-0.6b $flags --breakdown \
      --json "$OUT/$what.json" 2>&1 | tee "$OUT/bench_$what.log" ;;
  gate)
    [ -d /tmp/qwen3-0.6b ] || python3 -m minisgl make-tiny /tmp/qwen3-0.6b --arch qwen3 --preset qwen3-0.6b
    for run in ${GATE_RUNS:-1024:0 1024:4096 4096:4096}; do
      n=${run%%:*}; tokens=${run##*:}
      python3 -m minisgl bench --workload offline --num-requests "$n" --model /tmp/qwen3-0.6b --loop overlap \
        --min-prefill-tokens "$tokens" --breakdown --json "$OUT/gate_${n}_${tokens}.json" 2>&1 | tee "$OUT/gate_${n}_${tokens}.log"
    done ;;
  prefill)
    [ -d /tmp/qwen3-0.6b ] || python3 -m minisgl make-tiny /tmp/qwen3-0.6b --arch qwen3 --preset qwen3-0.6b
    python3 benchmarks/gpu_checks.py /tmp/qwen3-0.6b prefill 2>&1 | tee "$OUT/prefill.log" ;;
  scale)
    # Issue 27: host work C per iteration as the queue grows, 256 running at most. Each table
    # gives C per iteration by phase, and its schedule / launch / commit parts, beside the device
    # time (observe/breakdown.py), so a per-step cost that grows can be told from a mix of
    # iterations that changes. Measured durations: 256 requests ~10 s per loop, 1,024 ~25-30 s,
    # 4,096 ~85 s (overlap) and ~115 s (normal), plus each engine's start.
    [ -d /tmp/qwen3-0.6b ] || python3 -m minisgl make-tiny /tmp/qwen3-0.6b --arch qwen3 --preset qwen3-0.6b
    for n in ${SCALE:-256 1024 4096}; do
      echo "=== figure: scale, $n requests, both loops ==="
      python3 -m minisgl bench --workload offline --num-requests "$n" --model /tmp/qwen3-0.6b ${SCALE_LOOPS:---compare-loops --delays 0} \
        --breakdown --json "$OUT/scale_$n.json" 2>&1 | tee "$OUT/bench_scale_$n.log"
    done ;;
  hostprof)
    # Where the host's time goes in an offline run (overlap loop, N requests, default 1,024), by
    # function: cProfile over the whole run (it slows Python calls, so read it for shares, not
    # durations), then the run-level breakdown without the profiler.
    [ -d /tmp/qwen3-0.6b ] || python3 -m minisgl make-tiny /tmp/qwen3-0.6b --arch qwen3 --preset qwen3-0.6b
    python3 -m cProfile -o "$OUT/host.prof" -m minisgl bench --workload offline --num-requests "${N:-1024}" \
      --model /tmp/qwen3-0.6b --loop overlap --breakdown 2>&1 | tee "$OUT/hostprof.log"
    python3 -c "import pstats, sys; s = pstats.Stats(sys.argv[1]); s.sort_stats('tottime').print_stats(40); s.sort_stats('cumulative').print_stats('minisgl', 60)" \
      "$OUT/host.prof" > "$OUT/hostprof_stats.txt" 2>&1; head -c 20000 "$OUT/hostprof_stats.txt" ;;
  make8b)
    [ -d /tmp/qwen3-8b ] || python3 -m minisgl make-tiny /tmp/qwen3-8b --arch qwen3 --preset qwen3-8b --device cuda ;;
  8b)
    [ -d /tmp/qwen3-8b ] || python3 -m minisgl make-tiny /tmp/qwen3-8b --arch qwen3 --preset qwen3-8b --device cuda
    for n in ${SIZES_8B:-256 1024}; do
      echo "=== figure: 8B shape, $n requests, both loops ==="
      hf=""; [ "$n" = 256 ] && hf="--hf --hf-requests 64"
      python3 -m minisgl bench --workload offline --num-requests "$n" --model /tmp/qwen3-8b --compare-loops --delays 0 \
        --breakdown $hf --json "$OUT/8b_$n.json" 2>&1 | tee "$OUT/bench_8b_$n.log"
    done ;;
  kernels)
    [ -d /tmp/qwen3-0.6b ] || python3 -m minisgl make-tiny /tmp/qwen3-0.6b --arch qwen3 --preset qwen3-0.6b
    python3 benchmarks/profile_decode.py /tmp/qwen3-0.6b batches 256,64 "${KERNEL_VARIANTS:--;fast_decode_plan=false}" 2>&1 | tee "$OUT/kernels.log" ;;
  ab)
    [ -d /tmp/qwen3-0.6b ] || python3 -m minisgl make-tiny /tmp/qwen3-0.6b --arch qwen3 --preset qwen3-0.6b
    IFS=';' read -ra variants <<< "${AB_VARIANTS:--;--no-fast-decode-plan}"
    for v in "${variants[@]}"; do
      echo "=== figure: A/B, ${N:-256} requests, overlap, flags: $v ==="
      flags=""; [ "$v" != "-" ] && flags="$v"
      name=$(echo "$v" | tr -c 'a-z0-9\n' '_')
      python3 -m minisgl bench --workload offline --num-requests "${N:-256}" --model /tmp/qwen3-0.6b --loop overlap \
        --breakdown $flags --json "$OUT/ab_$name.json" 2>&1 | tee "$OUT/ab_$name.log"
    done ;;
  spec)
    [ -d /tmp/qwen3-0.6b ] || python3 -m minisgl make-tiny /tmp/qwen3-0.6b --arch qwen3 --preset qwen3-0.6b
    python3 benchmarks/gpu_speculative.py /tmp/qwen3-0.6b 2>&1 | tee "$OUT/spec.log"
    for mixed in "" --enable-mixed-chunk; do
      echo "=== figure: online, overlap, ${mixed:-mixed chunk off} ==="
      python3 -m minisgl bench --workload online --num-requests "${N:-128}" --rate "${RATES:-16,32}" --loop overlap \
        $mixed --model /tmp/qwen3-0.6b --json "$OUT/online_mixed${mixed:+_on}.json" 2>&1 | tee "$OUT/online_mixed${mixed:+_on}.log"
    done ;;
  http)
    for run in ${HTTP_RUNS:-/tmp/qwen3-0.6b:16,32}; do
      model=${run%%:*}; rates=${run##*:}
      [ -d "$model" ] || python3 -m minisgl make-tiny "$model" --arch qwen3 --preset "$(basename "$model")" --device cuda
      echo "=== figure: HTTP online, $model, $rates req/s ==="
      python3 benchmarks/http_online.py --model "$model" --num-requests "${N:-128}" --rate "$rates" 2>&1 \
        | tee "$OUT/http_$(basename "$model").log"
    done ;;
  profile8b)
    [ -d /tmp/qwen3-8b ] || python3 -m minisgl make-tiny /tmp/qwen3-8b --arch qwen3 --preset qwen3-8b --device cuda
    python3 benchmarks/profile_decode.py /tmp/qwen3-8b batches 256,64 - 2>&1 | tee "$OUT/profile8b.log" ;;
  decode-plan)
    [ -d /tmp/qwen3-0.6b ] || python3 -m minisgl make-tiny /tmp/qwen3-0.6b --arch qwen3 --preset qwen3-0.6b
    python3 benchmarks/gpu_checks.py /tmp/qwen3-0.6b decode-plan 2>&1 | tee "$OUT/decode_plan.log" ;;
  online)
    N=${N:-128}
    [ -d /tmp/qwen3-0.6b ] || python3 -m minisgl make-tiny /tmp/qwen3-0.6b --arch qwen3 --preset qwen3-0.6b
    python3 -m minisgl bench --workload online --num-requests "$N" --rate "${RATES:-8,16,32}" --compare-loops \
      --model /tmp/qwen3-0.6b --json "$OUT/online.json" 2>&1 | tee "$OUT/online.log"
    python3 -m minisgl bench --workload online --num-requests "$N" --rate "${RATES:-8,16,32}" --loop overlap \
      --disable prefill_sync --model /tmp/qwen3-0.6b --json "$OUT/online_nosync.json" 2>&1 | tee "$OUT/online_nosync.log" ;;
  lab)
    [ -d /tmp/qwen3-0.6b ] || python3 -m minisgl make-tiny /tmp/qwen3-0.6b --arch qwen3 --preset qwen3-0.6b
    python3 -m minisgl lab --model /tmp/qwen3-0.6b --device cuda --json "$OUT/lab.json" 2>&1 | tee "$OUT/lab.log" ;;
  invariance)
    # the CUDA tests' model: preset small (head_dim 128), seed 3
    [ -d /tmp/small-qwen3 ] || python3 -m minisgl make-tiny /tmp/small-qwen3 --arch qwen3 --preset small --seed 3
    python3 benchmarks/gpu_checks.py /tmp/small-qwen3 invariance 2>&1 | tee "$OUT/invariance.log" ;;
  eager-ab)
    [ -d /tmp/qwen3-0.6b ] || python3 -m minisgl make-tiny /tmp/qwen3-0.6b --arch qwen3 --preset qwen3-0.6b
    python3 benchmarks/gpu_checks.py /tmp/qwen3-0.6b eager-ab 2>&1 | tee "$OUT/eager_ab${TAG:-}.log" ;;
  profile)
    [ -d /tmp/qwen3-0.6b ] || python3 -m minisgl make-tiny /tmp/qwen3-0.6b --arch qwen3 --preset qwen3-0.6b
    python3 benchmarks/profile_decode.py /tmp/qwen3-0.6b "${PROFILE:-run}" 2>&1 | tee "$OUT/profile_${PROFILE:-run}.log" ;;
  checks|host)
    [ -d /tmp/qwen3-0.6b ] || python3 -m minisgl make-tiny /tmp/qwen3-0.6b --arch qwen3 --preset qwen3-0.6b
    checks="batch1 eager host"; [ "$what" = host ] && checks=host
    for c in $checks; do
      python3 benchmarks/gpu_checks.py /tmp/qwen3-0.6b $c "$OUT" 2>&1 | tee "$OUT/checks_$c.log"
    done ;;
esac
done
(cd ~/.cache && tar czf "$OUT/flashinfer-cache.tgz" flashinfer 2>/dev/null) || true
ls -la "$OUT"
