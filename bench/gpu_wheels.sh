#!/usr/bin/env bash
# bench/gpu_wheels.sh [PYTHON_VERSION]: downloads bench/gpu_requirements.txt's wheels for the GPU machine
# (default CPython 3.12, Linux x86_64) into bench/gpu_wheels/, which the device run carries along
# (`carry: ["bench/gpu_wheels"]`) and bench/gpu_check.sh installs from, with no index.
set -euo pipefail
cd "$(dirname "$0")/.."
PYV=${1:-3.12}
rm -rf bench/gpu_wheels && mkdir -p bench/gpu_wheels
python3 -m pip download -q -r bench/gpu_requirements.txt -d bench/gpu_wheels --only-binary=:all: \
  --python-version "$PYV" --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform linux_x86_64 --platform any
du -sh bench/gpu_wheels
