#!/usr/bin/env bash
# Download, here, the wheels the lent GPU image lacks (it has torch, transformers and peft, no network) into
# .whl/ for scripts/gpu_check.sh; carry .whl with the device run (about 45 MB). See ../shared/ENVIRONMENT.md.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
pip download -q --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 -d .whl \
  trl==1.16.0 wandb==0.31.0 datasets==5.2.0 math-verify latex2sympy2_extended antlr4-python3-runtime==4.13.2 \
  hjson ninja py-cpuinfo msgpack dill multiprocess xxhash pyarrow
DS_BUILD_OPS=0 pip wheel -q --no-deps deepspeed==0.19.8 -w .whl
(cd .whl && apt-get download bubblewrap 2>/dev/null) || echo "bubblewrap .deb not downloaded (the sandbox falls back to unshare)"
du -sh .whl
