#!/usr/bin/env bash
# One short lease on an NVIDIA GPU: what the CPU machine cannot check.
#
#   bash benchmarks/gpu_checks.sh [OUT_DIR]
#
# Uses the machine's own Python and packages (jax[cuda], flax, optax, orbax, torch,
# transformers); the project runs from this checkout through PYTHONPATH, nothing is installed.
# Each part has its own time limit and log under OUT_DIR; a failing part does not stop the
# others. Timed parts run one at a time; the two correctness parts at the end run side by side.
#
# 1. versions and the device;
# 2. attention: cuDNN fused attention ("auto" on an NVIDIA GPU) and the XLA path against a
#    float64 reference and PyTorch SDPA (benchmarks/bench_attention.py --gpu);
# 3. decode: the sampler vs transformers generate on the same GPU, bf16 (bench_decode.py);
# 4. train step: the jitted GRPO update vs PyTorch eager + autocast, bf16 (bench_train_step.py);
# 5. bf16 compute moves the f32 master weights (precision_moves.py);
# 6. the model / attention / sampler tests on the GPU (f32 matmuls at "highest" precision:
#    XLA's default f32 GPU matmul is TF32, which the tests' 1e-5 tolerances do not allow);
# 7. the default job (`jaxrl-llm train`), compute dtype auto = bf16 on the GPU.
set -u
cd "$(dirname "$0")/.."
OUT_DIR=${1:-${OUT:-/tmp/gpu_checks}}
mkdir -p "$OUT_DIR"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.45 TOKENIZERS_PARALLELISM=false

part() {  # part NAME LIMIT_S COMMAND...: run, log to OUT_DIR/NAME.log, print its status and tail
  local name=$1 limit=$2 start=$SECONDS
  shift 2
  timeout "$limit" "$@" >"$OUT_DIR/$name.log" 2>&1
  local rc=$?
  echo "=== $name: rc=$rc in $((SECONDS - start)) s (limit $limit)"
  tail -n "${TAIL:-25}" "$OUT_DIR/$name.log"
}

part versions 30 bash -c 'nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv;
  python3 -c "import sys, jax, flax, optax, orbax.checkpoint, chex, torch, transformers;
print(sys.version.split()[0], \"jax\", jax.__version__, \"flax\", flax.__version__, \"optax\", optax.__version__,
  \"orbax\", orbax.checkpoint.__version__, \"chex\", chex.__version__, \"torch\", torch.__version__,
  \"transformers\", transformers.__version__); print(jax.devices())"'
part attention 90 python3 benchmarks/bench_attention.py --gpu --rounds 20
part decode 100 python3 benchmarks/bench_decode.py --dtype bfloat16 --repeats 3
part train_step 130 python3 benchmarks/bench_train_step.py --no-mesh --dtype bfloat16 --repeats 5
part precision 60 python3 benchmarks/precision_moves.py --steps 3

# Correctness, side by side (each with its share of the GPU's memory).
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.3
(JAX_DEFAULT_MATMUL_PRECISION=highest timeout 150 python3 -m pytest -v -p no:cacheprovider \
  -o addopts="" tests/models tests/sampling/test_generate.py tests/sampling/test_generate_hf.py \
  tests/sampling/test_strategies.py -k "not sharded and not two_process" >"$OUT_DIR/tests.log" 2>&1;
  echo "=== tests: rc=$?") &
TESTS=$!
part train 150 python3 -c "import sys; from jaxrl_llm.cli import main; sys.exit(main(sys.argv[1:]))" \
  train run_dir=/tmp/gpu_run logging.progress=false
wait $TESTS
grep -E "FAILED|ERROR|passed|failed" "$OUT_DIR/tests.log" | tail -n 25
echo "tests: $(grep -c PASSED "$OUT_DIR/tests.log") passed, $(grep -c -E 'FAILED|ERROR' "$OUT_DIR/tests.log") failed lines"
find /tmp/gpu_run -name summary.json -exec cat {} \; 2>/dev/null | head -c 3000
