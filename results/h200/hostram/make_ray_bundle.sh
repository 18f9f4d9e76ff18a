#!/usr/bin/env bash
# Build the stripped Ray bundle the host-copy device run carries (the GPU machine has no Ray and no network).
#
#   results/h200/hostram/make_ray_bundle.sh [PYVER] [OUTDIR]
#
# PYVER: 312 (default: the device's Python 3.12) or 311 (this machine's, to validate the stripping locally).
# OUTDIR: default /work/main/.stage/raybundle (git-ignored; carried to the device as .stage/raybundle).
# Output: OUTDIR/raysite-cp<PYVER>.tar.xz holding site/ (ray 2.60.0 + jsonschema and its dependencies, which the
# device lacks); unpack with python3's tarfile (no external tools): see run.sh. Needs network for `pip download`.
set -euo pipefail
PYVER=${1:-312}
OUT=${2:-/work/main/.stage/raybundle}
PIP=${PIP:-/work/main/.venv/bin/pip}
WORK=$(mktemp -d /tmp/raybundle.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
# the versions in /work/main/.venv (ray's own pins are loose; these are the ones tested together)
PKGS="ray==2.60.0 jsonschema==4.26.0 referencing==0.37.0 rpds-py==2026.9.1 jsonschema-specifications==2025.9.1"
"$PIP" download -q -d "$WORK/dl" --only-binary=:all: --python-version "${PYVER:0:1}.${PYVER:1}" \
    --platform manylinux2014_x86_64 --no-deps $PKGS
mkdir -p "$WORK/site"
# unzip keeping the wheels' file modes (the raylet and GCS programs must stay executable)
python3 - "$WORK/site" "$WORK"/dl/*.whl <<'PY'
import os, sys, zipfile
dest = sys.argv[1]
for whl in sys.argv[2:]:
    with zipfile.ZipFile(whl) as z:
        for info in z.infolist():
            path = z.extract(info, dest)
            mode = (info.external_attr >> 16) & 0o777
            if mode and not info.is_dir():
                os.chmod(path, mode)
PY
cd "$WORK/site"
# Ray libraries PatchRay does not use (ray core = ray.init, actors, tasks, placement groups, the object store)
rm -rf ray/rllib ray/data ray/serve ray/train ray/tune ray/llm ray/air ray/workflow ray/jars ray/cpp \
       ray/dashboard/client ray/widgets/templates
find . -type d \( -name tests -o -name __pycache__ \) -prune -exec rm -rf {} +
find . -name '*.map' -delete
# symbol tables of the three native programs (debug info only: the dynamic symbols stay)
strip --strip-unneeded ray/_raylet.so ray/core/src/ray/raylet/raylet ray/core/src/ray/gcs/gcs_server
find . -name '*.so' ! -path './ray/_raylet.so' -exec strip --strip-unneeded {} +
cd "$WORK"
mkdir -p "$OUT"
tar -cJf "$OUT/raysite-cp$PYVER.tar.xz" site
du -sh site "$OUT/raysite-cp$PYVER.tar.xz"
