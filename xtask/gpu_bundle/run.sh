#!/usr/bin/env bash
# burn-shard's GPU bundle (built by `cargo xtask gpu-bundle`): the GPU suite built as GPU users
# build Burn (`fusion` on) and with `fusion` off, and the GPU benchmark, as stripped, compressed
# binaries for a machine with an NVIDIA GPU and no Rust toolchain.
#
#   ./run.sh RESULTS_DIR
#
# Needs: the NVIDIA driver (libcuda.so.1); NCCL and NVRTC, from a system install or from Python's
# pip packages (nvidia-nccl-cu*, nvidia-cuda-nvrtc-cu*: every nvidia/*/lib folder on python3's
# sys.path is searched); CUDA's headers for NVRTC (CUDA_PATH, /usr/local/cuda, or a pip folder
# with include/cuda_fp16.h); xz or python3 to unpack; about 1 GB free under $TMPDIR (or /tmp),
# where the binaries are unpacked and removed again at the end.
# Writes 8 files into RESULTS_DIR: run.log (what was found, each part's result and time), one
# log per part (suite-fusion.log, suite-no-fusion.log, module-sweep.log, bench.log) and the
# benchmark's adam.csv, gpt.csv and results.md.
# Exit status: 2 at once, with the reason, when the driver, a GPU, NCCL, NVRTC or CUDA's headers
# are missing or the binaries cannot start here; 1 when a part failed or ran out of time; 0 when
# every part passed. The parts' time limits add up to 7.5 minutes.
set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
if [ $# -ne 1 ]; then
  echo "usage: $0 RESULTS_DIR" >&2
  exit 2
fi
mkdir -p "$1" || exit 2
out="$(cd "$1" && pwd)"
log="$out/run.log"
: > "$log"
say() { echo "$*" | tee -a "$log"; }
die() { say "run.sh: $*"; exit 2; }
start=$SECONDS
say "burn-shard GPU bundle: $(head -n 1 "$here/MANIFEST.txt")"

# 1. The driver and the GPUs.
libcuda=""
for f in $(ldconfig -p 2>/dev/null | awk '/libcuda\.so\.1 /{print $NF}') \
  /usr/lib/x86_64-linux-gnu/libcuda.so.1 /usr/lib64/libcuda.so.1 /usr/local/nvidia/lib64/libcuda.so.1 /usr/lib/wsl/lib/libcuda.so.1; do
  if [ -e "$f" ]; then libcuda="$f"; break; fi
done
[ -n "$libcuda" ] || die "no NVIDIA driver: libcuda.so.1 is not on this machine (searched ldconfig -p, /usr/lib*, /usr/local/nvidia/lib64). Run the bundle on a machine with an NVIDIA GPU and its driver."
say "driver: $libcuda"
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv 2>&1 | tee -a "$log"
  [ "$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')" != 0 ] \
    || die "nvidia-smi lists no GPU: the driver is installed but no GPU is visible (check the container's GPU access)"
else
  say "nvidia-smi not found: the binaries count the GPUs through libcuda"
fi
# The binaries count the GPUs themselves (CUDA's count honours CUDA_VISIBLE_DEVICES).

# Unpacked binaries, library links and the tests' files live in a scratch folder, removed at exit.
work="$(mktemp -d "${TMPDIR:-/tmp}/burn-shard-gpu.XXXXXX")" || die "cannot create a scratch folder under ${TMPDIR:-/tmp}"
trap 'rm -rf "$work"' EXIT

# 2. CUDA's libraries. cudarc loads them by their unversioned names (libnccl.so, libnvrtc.so),
# which pip packages do not ship: link each found library under that name in one folder.
libdir="$work/lib"
mkdir -p "$libdir"
search=()
if command -v python3 >/dev/null 2>&1; then
  while IFS= read -r d; do search+=("$d"); done < <(python3 -c '
import glob, os, sys
seen = []
for p in sys.path:
    for d in sorted(glob.glob(os.path.join(p or ".", "nvidia", "*", "lib"))):
        if d not in seen:
            seen.append(d)
print("\n".join(seen))')
fi
search+=(/usr/lib/x86_64-linux-gnu /usr/lib64 /usr/local/cuda/lib64 /usr/local/nvidia/lib64)
say "library folders searched: ${search[*]}"
find_lib() {
  for d in "${search[@]}"; do
    for f in "$d/lib$1.so" "$d"/lib"$1".so.[0-9]*; do
      if [ -e "$f" ]; then echo "$f"; return 0; fi
    done
  done
  return 1
}
for name in nccl nvrtc cudart nvJitLink; do
  if f=$(find_lib "$name"); then
    ln -sfn "$f" "$libdir/lib$name.so"
    say "found lib$name: $f"
  else
    case $name in
      nccl) die "libnccl not found (searched the folders above): install NCCL, or the pip package nvidia-nccl-cu13 for python3" ;;
      nvrtc) die "libnvrtc not found (searched the folders above): install CUDA's NVRTC, or the pip package nvidia-cuda-nvrtc for python3" ;;
      *) say "not found: lib$name (CUDA may not need it)" ;;
    esac
  fi
done
export LD_LIBRARY_PATH="$libdir:$(IFS=:; echo "${search[*]}")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

# NVRTC compiles CubeCL's kernels with CUDA's headers (cuda_fp16.h, cuda_bf16.h): CubeCL looks in
# CUDA_PATH, /usr/local/cuda, /opt/cuda or /usr (with /usr/bin/nvcc). Without those, a pip folder
# that has the headers stands in.
if [ -z "${CUDA_PATH:-}" ] && [ ! -e /usr/local/cuda ] && [ ! -e /opt/cuda ] && [ ! -e /usr/bin/nvcc ]; then
  for d in "${search[@]}"; do
    if [ -e "$d/../include/cuda_fp16.h" ]; then export CUDA_PATH="$(cd "$d/.." && pwd)"; break; fi
  done
  [ -n "${CUDA_PATH:-}" ] || die "CUDA's headers not found (no CUDA_PATH, /usr/local/cuda, /opt/cuda, /usr/bin/nvcc, nor a pip folder with include/cuda_fp16.h): install the CUDA toolkit's headers or the pip package nvidia-cuda-runtime, or set CUDA_PATH"
fi
cuda_home="${CUDA_PATH:-$( [ -e /usr/local/cuda ] && echo /usr/local/cuda || { [ -e /opt/cuda ] && echo /opt/cuda || echo /usr; } )}"
say "CUDA headers: $cuda_home/include (cuda_fp16.h $( [ -e "$cuda_home/include/cuda_fp16.h" ] && echo found || echo MISSING), cuda_bf16.h $( [ -e "$cuda_home/include/cuda_bf16.h" ] && echo found || echo MISSING), cccl $( [ -e "$cuda_home/include/cccl" ] && echo found || echo missing))"

# 3. The binaries: one solid xz archive (unpacking needs as much memory as its dictionary, about 512 MiB).
bin="$work/bin"
mkdir -p "$bin"
if command -v xz >/dev/null 2>&1; then
  xz -dc "$here/bin.tar.xz" | tar -xf - -C "$bin" || die "cannot unpack $here/bin.tar.xz"
else
  python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1], "r:xz").extractall(sys.argv[2])' "$here/bin.tar.xz" "$bin" \
    || die "cannot unpack $here/bin.tar.xz: needs xz or python3"
fi
say "unpacked: $(cd "$bin" && ls | tr '\n' ' ')"
preflight="$("$bin/suite-fusion" --list 2>&1 | tail -n 3)" \
  || die "the binaries cannot start on this machine (they need glibc 2.36 or newer, libstdc++, libz, libzstd): $preflight"

# 4. The parts, each with a time limit. The GPU tests must run, not skip (BURN_SHARD_REQUIRE_GPU);
# their files go under the scratch folder (BURN_SHARD_SCRATCH). The module sweep (every burn::nn
# module, stages 0-3, 2 and 4 ranks) runs on its own, once, in the fusion build.
export BURN_SHARD_REQUIRE_GPU=1
export BURN_SHARD_SCRATCH="$work/scratch"
status=0
part() {
  local name=$1 limit=$2
  shift 2
  local t0=$SECONDS
  say "== $name (time limit ${limit} s)"
  timeout --kill-after=10 "$limit" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  grep -E '^test .* \.\.\. |^test result' "$out/$name.log" | tee -a "$log" > /dev/null
  grep -E '^test result' "$out/$name.log" | tail -n 1
  case $rc in
    0) say "-- $name: passed in $((SECONDS - t0)) s" ;;
    124 | 137) say "-- $name: out of time after $((SECONDS - t0)) s (log: $name.log)"; status=1 ;;
    *) say "-- $name: failed (exit $rc) in $((SECONDS - t0)) s (log: $name.log)"; status=1 ;;
  esac
}
sweep=gpu_module_sweep
part suite-fusion 100 "$bin/suite-fusion" gpu:: --skip "$sweep" --test-threads=1
part suite-no-fusion 100 "$bin/suite-no-fusion" gpu:: --skip "$sweep" --test-threads=1
part module-sweep 80 "$bin/suite-fusion" "$sweep" --test-threads=1 --nocapture
part bench 170 "$bin/gpu-bench" --out "$out" --data "$here/data/tinyshakespeare.txt" --budget 160
say "total: $((SECONDS - start)) s; results in $out"
exit $status
