#!/usr/bin/env bash
# The GPU checks: whether the accelerator kernels compile and compute what their references
# do on this card, and how fast they and the learner are against what a GPU user would run
# instead (XLA's full-logits GEMMs, cuDNN's attention, PyTorch). Each step appends its JSON
# line(s) to OUT_DIR (default ./gpu_out) and is bounded by its own timeout; a step that
# fails or times out leaves its stderr there and the next one runs.
#
#   bash scripts/bench/gpu_session.sh [OUT_DIR]
#   ONLY="kernels attention_cudnn" bash scripts/bench/gpu_session.sh OUT_DIR   # some steps
#
# Steps, in order (all together take up to ~20 minutes, the learner runs most of it; ONLY
# runs a subset):
#   kernels          segment attention (Pallas, and cuDNN's packed layout) compiled, values
#                    and gradients against the references (gpu_kernel_check.py);
#   logprob_tests    the GPU logprob kernels' tests, compiled, in full fp32;
#   logprob          token logprobs at the Qwen2.5-0.5B head: Pallas and chunked ("auto" on
#                    a GPU) against the full-logits reference, fp32 and bf16;
#   attention        segment attention against cuDNN at 4k/16k-token packed rows (bf16,
#                    Qwen2.5-0.5B heads), both dK/dV grids (over kv heads and query heads);
#   attention_cudnn  attention_impl="cudnn" (cuDNN's packed layout) against the same cuDNN
#                    padded batch;
#   learner          the learner at the Qwen2.5-0.5B shape against torch (MFU), fp32 (TF32);
#   learner_bf16     the same in bf16, with the Pallas attention and with cuDNN's.
# The last figures: docs/benchmarks.md, "On a GPU".
#
# Needs the project's dependencies (the learner imports ml-collections; a bare CUDA image
# may lack ml-collections, gymnax, gymnasium and tensorboardX) and torch with CUDA.
set -uo pipefail
OUT_DIR=${1:-gpu_out}
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/../.."

step() {  # step NAME SECONDS COMMAND...
  local name=$1 seconds=$2
  shift 2
  if [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $name "* ]]; then return; fi
  echo "== $name" >&2
  timeout "$seconds" "$@" >>"$OUT_DIR/$name.jsonl" 2>>"$OUT_DIR/$name.err" \
    || echo "== $name: exit $? (see $OUT_DIR/$name.err)" >&2
}

step kernels 90 python scripts/bench/gpu_kernel_check.py
JAX_PLATFORMS=cuda JAX_DEFAULT_MATMUL_PRECISION=highest step logprob_tests 90 \
  python -m pytest -q -n 0 tests/pallas_kernels/test_token_logprobs.py \
  -k "pallas_gpu or chunked"
for impl in pallas chunked; do
  step logprob 40 python scripts/bench/bench_logprob.py --impl "$impl" --n 4096
  step logprob 40 python scripts/bench/bench_logprob.py --impl "$impl" --n 4096 --dtype bfloat16
done
ATTN=(python scripts/bench/bench_attention.py --device gpu --dtype bfloat16 --min-len 256
      --max-len 2048 --repeats 10 --heads 14 --kv-heads 2 --head-dim 64)
step attention 75 "${ATTN[@]}" --row-len 4096 --rows 4 --dkdv-grid both
step attention 75 "${ATTN[@]}" --row-len 16384 --rows 1 --dkdv-grid both
step attention_cudnn 75 "${ATTN[@]}" --row-len 4096 --rows 4 --impl cudnn
step attention_cudnn 75 "${ATTN[@]}" --row-len 16384 --rows 1 --impl cudnn
LEARNER=(python scripts/bench/bench_learner.py --device gpu --sizes qwen0.5b --samples 64
         --row-len 4096 --torch-micro-tokens 4096 --repeats 3)
step learner 300 "${LEARNER[@]}"
step learner_bf16 300 "${LEARNER[@]}" --dtype bfloat16 --attention-impl pallas
step learner_bf16 300 "${LEARNER[@]}" --dtype bfloat16 --attention-impl cudnn
cat "$OUT_DIR"/*.jsonl
