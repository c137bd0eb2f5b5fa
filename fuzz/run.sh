#!/usr/bin/env bash
# Fuzzes the targets of fuzz/fuzz_targets/ with cargo-fuzz (libFuzzer, nightly Rust).
#
#   fuzz/run.sh SECONDS [TARGET...]   each named target (default: every one) for SECONDS
#   fuzz/run.sh 60                    a minute per target
#   fuzz/run.sh 300 key               five minutes of the key parser
#
# Each run starts from the committed seeds in fuzz/corpus/<target>/ and writes the inputs it
# finds to fuzz/scratch/<target>/, never to the committed corpus: copy one there on purpose
# (`cargo +nightly fuzz tmin` first). A crash leaves its input in fuzz/artifacts/<target>/;
# the script goes on with the other targets, then exits 1 with one line per crash, naming its
# input, or per target that did not run. cargo-fuzz is installed with `cargo install
# cargo-fuzz --locked` when missing; FUZZ_TOOLCHAIN picks another toolchain than `nightly`.
set -euo pipefail

usage() {
    echo "usage: fuzz/run.sh SECONDS [TARGET...]" >&2
    exit 2
}
[[ $# -ge 1 && $1 =~ ^[1-9][0-9]*$ ]] || usage
seconds=$1
shift

fuzz_dir=$(cd "$(dirname "$0")" && pwd)
# cargo-fuzz finds the fuzz/ directory from the crate's root.
cd "$fuzz_dir/.."
toolchain=${FUZZ_TOOLCHAIN:-nightly}

all=()
for source in "$fuzz_dir"/fuzz_targets/*.rs; do
    all+=("$(basename "$source" .rs)")
done
targets=("$@")
[[ ${#targets[@]} -gt 0 ]] || targets=("${all[@]}")
for target in "${targets[@]}"; do
    if [[ ! -f $fuzz_dir/fuzz_targets/$target.rs ]]; then
        echo "fuzz/run.sh: no target '$target' (there are: ${all[*]})" >&2
        exit 2
    fi
done

# The first or the last match of a pattern in a file, or nothing (never a failure under
# `set -e`).
first() {
    grep -m 1 -o -- "$1" "$2" || true
}
last() {
    grep -o -- "$1" "$2" | tail -n 1 || true
}

if ! command -v cargo-fuzz >/dev/null 2>&1; then
    echo "fuzz/run.sh: installing cargo-fuzz" >&2
    cargo install cargo-fuzz --locked
fi

# One build for every target, so that a build error is reported once and not as a crash.
mkdir -p "$fuzz_dir/scratch"
if ! cargo "+$toolchain" fuzz build >"$fuzz_dir/scratch/build.log" 2>&1; then
    reason=$(first 'error.*' "$fuzz_dir/scratch/build.log")
    echo "fuzz/run.sh: the fuzz targets do not build: ${reason:-see the log}; log fuzz/scratch/build.log" >&2
    exit 1
fi

failures=()
for target in "${targets[@]}"; do
    scratch=$fuzz_dir/scratch/$target
    artifacts=$fuzz_dir/artifacts/$target
    log=$fuzz_dir/scratch/$target.log
    mkdir -p "$scratch" "$artifacts"
    # The first corpus directory takes the new inputs; the committed one is only read.
    if cargo "+$toolchain" fuzz run "$target" "$scratch" "$fuzz_dir/corpus/$target" -- \
        -max_total_time="$seconds" -artifact_prefix="$artifacts/" >"$log" 2>&1; then
        runs=$(last 'Done [0-9]* runs in' "$log" | cut -d' ' -f2)
        stats=$(last 'cov: [0-9]* ft: [0-9]* corp: [0-9]*' "$log")
        echo "fuzz/run.sh: $target: no crash in ${runs:-?} runs (${seconds} s; ${stats:-no stats}); log fuzz/scratch/$target.log"
        continue
    fi
    input=$(last 'Test unit written to .*' "$log" | cut -d' ' -f5)
    if [[ -n $input ]]; then
        failures+=("fuzz/run.sh: $target crashed on $input; reproduce: cargo +$toolchain fuzz run $target $input; log fuzz/scratch/$target.log")
    else
        # Not a crash: the target did not build or libFuzzer did not start.
        reason=$(first 'error.*' "$log")
        failures+=("fuzz/run.sh: $target did not run: ${reason:-see the log}; log fuzz/scratch/$target.log")
    fi
done

if [[ ${#failures[@]} -gt 0 ]]; then
    printf '%s\n' "${failures[@]}" >&2
    exit 1
fi
