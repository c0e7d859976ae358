#!/usr/bin/env bash
# Every GPU figure of benchmarks/RESULTS.md, at full size, into one folder:
#     bash benchmarks/run_all.sh OUT [stage ...]
# Stages (default: all, in this order): tests kernels throughput spec_bench serving.
# Each stage writes OUT/<stage>/ (results.json and plots) and OUT/<stage>.log.
set -u
out=${1:?usage: bash benchmarks/run_all.sh OUT [tests|kernels|throughput|spec_bench|serving ...]}
shift
stages=${*:-tests kernels throughput spec_bench serving}
cd "$(dirname "$0")/.."
mkdir -p "$out"
run() {  # run STAGE COMMAND...: log it, keep going when one stage fails
    local stage=$1; shift
    echo "== $stage: $*"
    "$@" > "$out/$stage.log" 2>&1 && echo "   ok" || echo "   FAILED (exit $?): see $out/$stage.log"
}
for stage in $stages; do
    case $stage in
        tests) run tests python3 -m pytest -q -m gpu tests --ignore tests/test_notebooks.py ;;
        kernels) run kernels bash -c "python3 benchmarks/kernel_bench.py --shape llama-3.1-8b --out $out/kernels/llama-3.1-8b \
                 && python3 benchmarks/kernel_bench.py --shape llama-3.2-1b --skip-attention --kernel-profile --out $out/kernels/llama-3.2-1b \
                 && python3 benchmarks/kernel_bench.py --shape smollm2-135m --skip-attention --kernel-profile --out $out/kernels/smollm2-135m" ;;
        throughput) run throughput python3 benchmarks/throughput.py --max-tokens 128 --profile-steps --out "$out/throughput" ;;
        spec_bench) run spec_bench python3 benchmarks/spec_bench.py --hf-per-category 1 --out "$out/spec_bench" ;;
        serving) run serving python3 benchmarks/serving.py --out "$out/serving" ;;
        *) echo "unknown stage '$stage' (tests kernels throughput spec_bench serving)"; exit 2 ;;
    esac
done
