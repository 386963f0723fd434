#!/usr/bin/env bash
# The GPU evidence run: every GPU check and every headline figure of the lessons, in sections that each fit one
# 10-minute call on the H200. Run every section at one commit, then copy $OUT/gpu/ over results/gpu/: each lesson's
# table is a generated slice of those files (scripts/results_table.py), so a fact has one value.
#   bash scripts/gpu_suite.sh                     # every section (about an hour on the H200)
#   bash scripts/gpu_suite.sh decode_small stall  # only the named sections
# Runs from the repository root with PYTHONPATH=. and no install; writes under $OUT/gpu/ (default runs/gpu/).
# The random:* models need only the embedded model's tokenizer files: carry them in .gpucache/
# (made by scripts/prepare_gpu_cache.sh) and point LLM_STEPS_CACHE there.
# step08 needs fastapi, uvicorn and openai, which the GPU machine lacks: carry their wheels in .whl/ and
# install them with --target into a folder on PYTHONPATH before calling this script.
# The tree arrives without .git: pass LLM_STEPS_GIT_COMMIT=<sha> LLM_STEPS_GIT_DIRTY=0|1 so evidence names it.
set -euo pipefail
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 NO_PROXY=127.0.0.1,localhost LLM_STEPS_CACHE="${LLM_STEPS_CACHE:-.gpucache}"
OUT="${OUT:-runs}"
G="$OUT/gpu"
mkdir -p "$G"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$G/gpu.txt"
# The workload of every decode table: Qwen2.5-7B's shapes with random weights, bf16, 32-token prompts, 128 new tokens.
SEVEN_B=(--device cuda --model random:qwen2.5-7b)

# The steps of the chain, in order, as common/steps.py lists them.
STEPS=($(python -m common.steps))

parity() {
  echo "== greedy parity with HF generate() on CUDA: every step's dry run (tiny models of each architecture, fp32),"
  echo "   with the switches it offers: Triton's attention, a budget of 5 tokens (prompts in chunks), batch invariance"
  {
    local step flags help
    offers() { grep -qE "^ +$1[ ,]" <<<"$help"; }  # the flag is one of the step's options in its --help
    for step in "${STEPS[@]}"; do
      help="$(python "$step/run.py" --help)"
      flags=()
      offers --attn && flags+=(--attn triton)
      offers --max-num-batched-tokens && flags+=(--max-num-batched-tokens 5)
      python "$step/run.py" --dry-run --device cuda "${flags[@]}"
      if offers --batch-invariant; then
        python "$step/run.py" --dry-run --device cuda "${flags[@]}" --batch-invariant
      fi
    done
    python step06_paged_attention/run.py --dry-run --device cuda --attn torch  # step 06's other backend
    python step08_serve/run.py --dry-run --device cuda
    # Step 04 on one GPU: its ranks share it over gloo, so with an engine that captures no graphs.
    python step04_multi_gpu/run.py --dry-run --device cuda --distributed-backend gloo --step step11_speculative_decoding
  } 2>&1 | tee "$G/dry-runs.txt"
}

decode_small() {
  echo "== every step and HF generate() (default, and static cache + torch.compile) at batch 1 and 8"
  python compare.py "${SEVEN_B[@]}" --batch-sizes 1,8 --max-tokens 128 --hf-static-max-batch 8 --repeats 2 \
    --output "$G/decode-batch1-8.json"
}

decode_large() {
  echo "== the batched steps and HF generate() at batch 32 and 64 (step 01 is serial, step 02 loops in Python: skipped)"
  python compare.py "${SEVEN_B[@]}" --batch-sizes 32,64 --max-tokens 128 --repeats 2 \
    --steps "$(printf '%s\n' "${STEPS[@]}" | grep -v -e step01_serial -e step02_paged_kv | paste -sd,)" \
    --output "$G/decode-batch32-64.json"
}

decode_profile() {
  echo "== where a replayed decode step's GPU time goes (step 12's plain graphs, step 13's fused kernels), batch 1, 8, 64"
  python step13_fused_decode/bench/profile_step.py --model random:qwen2.5-7b --batches 1,8,64 --output "$G/decode-profile.json"
}

profile_steps() {
  echo "== step 05: every step's decode step at batch 8, phase by phase, and where its time goes (with the traces of"
  echo "   one eager step and one replayed graph for the lesson's picture); the dry run's traces checked on CUDA"
  python step05_profiling/run.py --dry-run --device cuda 2>&1 | tee "$G/profile-dry-run-cuda.txt"
  python step05_profiling/run.py "${SEVEN_B[@]}" --batch 8 --output "$G/profile-steps.json"
  for step in step11_speculative_decoding step12_cuda_graph; do
    gzip -c "runs/profile/traces/$step-cuda.json" > "$OUT/trace-$step-cuda.json.gz"
  done
  echo "== step 05: Nsight Compute on step 06's paged decode kernel, batch 8 x 2048 tokens of Qwen2.5-7B's heads"
  ncu --clock-control none --kernel-name regex:paged_decode_split --launch-count 1 \
    --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__throughput.avg.pct_of_peak_sustained_elapsed \
    python step06_paged_attention/run.py --kernel-bench --batches 8 --contexts 2048 --repeats 1 \
    --output "$OUT/kernel-bench-under-ncu.json" 2>&1 | tee "$G/ncu-paged-decode.txt"
}

overlap() {
  echo "== step 14: a decode step's GPU and host parts, without and with overlap, batch 1, 8, 64"
  python step14_overlap_scheduling/bench/bench_overlap.py "${SEVEN_B[@]}" --batches 1,8,64 --output "$G/overlap.json"
}

kernels() {
  echo "== step 06's kernels alone, each checked then timed: paged decode, paged prefill"
  python step06_paged_attention/run.py --kernel-bench --batches 1,8,32,64 --contexts 128,512,2048,8192 \
    --output "$G/kernel-paged-decode.json"
  python step06_paged_attention/bench/prefill_kernel_bench.py --points 256x16384,1024x16384,2048x2048 \
    --output "$G/kernel-paged-prefill.json"
}

matmul() {
  echo "== step 13's skinny matrix multiply against cuBLAS at Qwen2.5-7B's projection shapes, 1 to 16 rows"
  python step13_fused_decode/bench/matmul_bench.py --config qwen2.5-7b --rows 1,2,4,8,16 --output "$G/kernel-skinny-matmul.json"
}

step06_parts() {
  echo "== step 06's two changes apart (paged attention, batched prefill), and a .item() in every layer"
  python step06_paged_attention/bench/bench_prefill.py "${SEVEN_B[@]}" --attn triton --batch-sizes 1,8,64 --prompt-lens 32,1024 \
    --max-tokens 128 --output "$G/step06-prefill-vs-paged.json"
  for sync in "" --sync-per-layer; do
    python step06_paged_attention/run.py --bench "${SEVEN_B[@]}" --batch-sizes 1,8,32 --max-tokens 128 --repeats 2 --no-hf \
      $sync --bench-output "$G/step06-sync${sync:+-per-layer}.json"
  done
}

preempt() {
  echo "== step 07: throughput with a generous and a tight KV budget in both modes, and the swap bandwidth"
  python step07_preemption/bench/bench_preempt.py "${SEVEN_B[@]}" --output "$G/preempt.json"
}

serve() {
  echo "== step 08: concurrency through the openai SDK against the bare engine, serving step 07's engine and the final one"
  for step in step07_preemption step14_overlap_scheduling; do
    python step08_serve/bench/bench_serve.py "${SEVEN_B[@]}" --step "$step" --concurrency 1,8,32 --max-tokens 128 \
      --output "$G/serve-${step%%_*}.json"
  done
}

stall() {
  echo "== 32 decoders and one 16,000-token prompt: step 07 (no budget), step 09 (eager mixed steps) and step 12 (mixed"
  echo "   steps as graphs) per budget, the final engine at its default"
  local stall=(--scenarios stall --decoders 32 --long-prompt-len 16000)
  python step09_chunked_prefill/bench/bench_long_prompt.py "${SEVEN_B[@]}" "${stall[@]}" --step step07_preemption \
    --output "$G/stall-step07.json"
  for step in step09_chunked_prefill step12_cuda_graph; do
    python step09_chunked_prefill/bench/bench_long_prompt.py "${SEVEN_B[@]}" "${stall[@]}" --step "$step" \
      --budgets none,256,512,1024,2048 --output "$G/stall-${step%%_*}.json"
  done
  python step09_chunked_prefill/bench/bench_long_prompt.py "${SEVEN_B[@]}" "${stall[@]}" --step step14_overlap_scheduling \
    --budgets none,default --output "$G/stall-step14.json"
}

bursts() {
  echo "== 64 prompts of 2,080 tokens at once to the bare engine (step 07, the final engine); bursts through the server"
  local burst=(--scenarios burst --burst-requests 64 --burst-prompt-len 2080)
  python step09_chunked_prefill/bench/bench_long_prompt.py "${SEVEN_B[@]}" "${burst[@]}" --step step07_preemption \
    --output "$G/burst-step07.json"
  python step09_chunked_prefill/bench/bench_long_prompt.py "${SEVEN_B[@]}" "${burst[@]}" --step step14_overlap_scheduling \
    --budgets default --output "$G/burst-step14.json"
  python step09_chunked_prefill/bench/bench_burst_serve.py "${SEVEN_B[@]}" --bursts 64x2000,256x4000 --max-tokens 16 \
    --output "$G/burst-serve.json"
}

prefix() {
  echo "== 64 requests sharing a 2,048-token prefix, and 32 conversations x 4 turns, caching on and off"
  for step in step10_prefix_caching step14_overlap_scheduling; do
    python step10_prefix_caching/bench/bench_prefix.py "${SEVEN_B[@]}" --step "$step" --requests 64 --prefix-len 2048 \
      --suffix-len 32 --conversations 32 --turns 4 --user-len 256 --output "$G/prefix-${step%%_*}.json"
  done
}

nanovllm() {
  echo "== the 256-sequence workload (lengths uniform in [100, 1024]) on random:qwen3-0.6b: step 10 (eager) and the final engine"
  for step in step10_prefix_caching step14_overlap_scheduling; do
    python "$step/run.py" --bench --workload nanovllm --model random:qwen3-0.6b --device cuda --no-hf \
      --bench-output "$G/nanovllm-${step%%_*}.json"
  done
}

speculative() {
  echo "== step 11 on the GPU: verification graphs give step 01's tokens (float32); what a verification step costs; the rule"
  python -m pytest -q -rs -p no:warnings tests/test_step12_verify_graphs.py 2>&1 | tee "$G/pytest-speculative.txt" \
    || echo "== FAILED: the verification tests on the GPU (pytest-speculative.txt); the benchmarks run anyway"
  # Every step verifies (both costs 0): a verification step's cost against a decode step's, per batch and k, with
  # every proposal right. In bf16 a verification row breaks random weights' near-ties unlike a decode step, so the
  # oracle replays the tokens of its own last run until they hold (bench_oracle.py --rounds).
  python step11_speculative_decoding/bench/bench_oracle.py "${SEVEN_B[@]}" --step "${STEPS[-1]}" --batch-sizes 1,8,32,64 \
    --ks 1,4,8 --acceptances 1 --token-cost 0 --step-cost 0 --max-tokens 64 --output "$G/speculative-verify-step.json"
  # The sweep under the rule with the engine's GPU costs: what speculation gains at acceptance a; an always-wrong
  # oracle must cost nothing, a good one must not lose at batch 64.
  python step11_speculative_decoding/bench/bench_oracle.py "${SEVEN_B[@]}" --step "${STEPS[-1]}" --batch-sizes 1,8,32,64 \
    --ks 2,4,8 --acceptances 0,0.5,0.7,0.9 --max-tokens 64 --output "$G/speculative-sweep.json"
}

batch_invariant() {
  echo "== step 15: which ops change a row with its batch; 32 requests together and one at a time (engine, then server);"
  echo "   speculation (the target as its own draft) on and off; a budget of 256 tokens, so that prompts sent together are cut into chunks"
  python step15_batch_invariant/bench/probe.py --device cuda --output "$G/batch-invariance-probe.json"
  python step15_batch_invariant/bench/bench_invariance.py "${SEVEN_B[@]}" --parts together,speculation,server \
    --draft-model random:qwen2.5-7b --requests 32 --max-tokens 64 --max-num-batched-tokens 256 --output "$G/batch-invariance.json"
}

batch_invariant_cost() {
  echo "== step 15's cost, mode on against off: decode at batch 1/8/64 and one 4,000-token prompt (7B), the 256-sequence workload (0.6B);"
  echo "   its kernels against cuBLAS and step 06's decode kernel, with the multiply's tile sweep"
  python step15_batch_invariant/bench/bench_kernels.py --output "$G/batch-invariance-kernels.json"
  python step15_batch_invariant/bench/bench_invariance.py "${SEVEN_B[@]}" --parts decode --batches 1,8,64 --long-prompt 4000 \
    --output "$G/batch-invariance-cost.json"
  python step15_batch_invariant/bench/bench_invariance.py --device cuda --model random:qwen3-0.6b --parts nanovllm \
    --output "$G/batch-invariance-nanovllm.json"
}

multi_gpu() {
  echo "== step 04 on two GPUs (nvidia-h200-x2): the dry run over NCCL, tensor parallel 2 against 1, replicas 2 against 1, a burst through the server over 2 ranks"
  echo "   (step 12's engine: step 13's fused kernels are not split yet)"
  python step04_multi_gpu/run.py --dry-run --device cuda --step step12_cuda_graph 2>&1 | tee "$G/step04-dry-run-nccl.txt"
  python step04_multi_gpu/bench/bench_tensor_parallel.py "${SEVEN_B[@]}" --sizes 1,2 --batch-sizes 1,8,64 \
    --step step12_cuda_graph --output "$G/tensor-parallel.json"
  python step04_multi_gpu/bench/bench_replicas.py --device cuda --model random:qwen3-0.6b --sizes 1,2 --output "$G/replicas.json"
  python step09_chunked_prefill/bench/bench_burst_serve.py "${SEVEN_B[@]}" --step step12_cuda_graph --tensor-parallel-size 2 \
    --bursts 64x2000 --output "$G/burst-serve-tp2.json"
}

# The final engine with speculation off against an older tree's, in the same call, as ratios: OLD_TREE=runs/tree-old
# (made with `git archive <commit> | tar -x -C runs/tree-old`, and carried) and OLD_COMMIT=<commit> name it.
in_both_trees() {
  # Runs "$@" (with {out} replaced by the absolute output folder and {name} by head or old) in this tree, then
  # in OLD_TREE, each named as its own commit: the two measured in the same call, as ratios.
  local out name tree commit
  out="$(cd "$G" && pwd)"
  for name in head old; do
    tree=. commit="${LLM_STEPS_GIT_COMMIT:-}"
    [ "$name" = old ] && tree="${OLD_TREE:?set OLD_TREE}" && commit="${OLD_COMMIT:?set OLD_COMMIT to the commit of OLD_TREE}"
    local args=("${@//\{out\}/$out}")
    # PYTHONPATH starts with ".": inside the old tree, its own packages.
    (cd "$tree" && LLM_STEPS_GIT_COMMIT="$commit" "${args[@]//\{name\}/$name}")
  done
}

kernel_bits() {
  echo "== the attention kernels' outputs on fixed inputs, in this tree and OLD_TREE, compared bit for bit"
  in_both_trees python "$PWD/scripts/kernel_bits.py" save "/tmp/kernel-bits-{name}.pt"
  python scripts/kernel_bits.py compare /tmp/kernel-bits-old.pt /tmp/kernel-bits-head.pt --output "$G/kernel-bits-old-new.json"
}

unchanged() {
  echo "== the final engine, speculation off, against OLD_TREE: decode at batch 1, 8, 64"
  in_both_trees python "${STEPS[-1]}/run.py" --bench "${SEVEN_B[@]}" --no-hf --batch-sizes 1,8,64 \
    --repeats 3 --bench-output "{out}/unchanged-decode-{name}.json"
}

unchanged_workloads() {
  echo "== the final engine, speculation off, against OLD_TREE: the stall at its default budget, the 256-sequence workload"
  in_both_trees python step09_chunked_prefill/bench/bench_long_prompt.py "${SEVEN_B[@]}" --scenarios stall --decoders 32 \
    --long-prompt-len 16000 --step "${STEPS[-1]}" --budgets default --output "{out}/unchanged-stall-{name}.json"
  in_both_trees python "${STEPS[-1]}/run.py" --bench --workload nanovllm --model random:qwen3-0.6b \
    --device cuda --no-hf --bench-output "{out}/unchanged-nanovllm-{name}.json"
}

checkpoint_memory() {
  echo "== a 7B checkpoint loads onto the GPU without a second copy"
  python scripts/check_checkpoint_memory.py --folder /tmp/ckpt-qwen2.5-7b --output "$G/checkpoint-load-memory.json"
}

all_tests() {
  # The whole suite outlasts one 10-minute call on the H200: TESTS="..." and PART=name run one part per call. The
  # part stops itself (SIGINT) before the call's limit, so pytest still reports what ran, the slowest tests and a
  # JUnit file naming every test's outcome.
  local log="$G/pytest-cuda${PART:+-$PART}"
  echo "== the test suite on CUDA, as a user with a GPU runs it (the embedded model's weights are not carried): ${TESTS:-tests/}"
  timeout -s INT "${TEST_SECONDS:-540}" python -m pytest -q -rs --durations=15 --junitxml="$log.xml" \
    -m "not embedded" ${TESTS:-tests/} 2>&1 | grep --line-buffered -v "Loading weights" | tee "$log.txt"
}

sections=("$@")
[ ${#sections[@]} -gt 0 ] || sections=(parity decode_small decode_large decode_profile profile_steps overlap kernels matmul step06_parts preempt serve stall bursts prefix nanovllm speculative batch_invariant batch_invariant_cost checkpoint_memory all_tests)
for section in "${sections[@]}"; do "$section"; done
