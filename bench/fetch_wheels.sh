#!/usr/bin/env bash
# Fills .wheels/ (ignored by git) with the pure-Python wheels a lent GPU box lacks, for its Python 3.12 on
# x86-64 Linux: that box reaches no package index, so bench/device_check.sh installs them from the checkout.
#
#     bench/fetch_wheels.sh NAME==VERSION...     e.g. bench/fetch_wheels.sh transformers==5.19.0
#
# Today the box's image has every package the quick smoke imports (torch, transformers, accelerate,
# safetensors, numpy, click, psutil), so nothing needs fetching; name a package only to check another
# version of it there. --no-deps: name each missing dependency too. Refuses a wheel with compiled code (it
# would need the box's exact platform; carry those by hand, docs/gpu.md) and more than 64 MiB in all (what
# the device tool carries).
set -eu
ROOT=$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")/.." && pwd)
PY=${PYTHON:-python3}
DEST=$ROOT/.wheels
if [ "$#" -eq 0 ]; then
    echo "fetch_wheels: nothing to fetch: the GPU image has every package the quick smoke imports (name NAME==VERSION to carry another version)"
    exit 0
fi
for spec in "$@"; do
    case $spec in
    *==*) ;;
    *)
        echo "fetch_wheels: $spec: name an exact version (NAME==VERSION): two versions of one package stop the install" >&2
        exit 2
        ;;
    esac
done
mkdir -p -- "$DEST"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform any -d "$DEST" "$@"
shopt -s nullglob
for whl in "$DEST"/*.whl; do
    case ${whl##*/} in
    *-py3-none-any.whl | *-py2.py3-none-any.whl) ;;
    *)
        echo "fetch_wheels: ${whl##*/} holds compiled code, not a pure-Python wheel: removed" >&2
        rm -f -- "$whl"
        exit 1
        ;;
    esac
done
size=$(du -sm -- "$DEST" | cut -f1)
if [ "$size" -gt 64 ]; then
    echo "fetch_wheels: .wheels/ holds ${size} MiB, more than the 64 MiB a device run carries" >&2
    exit 1
fi
echo "fetch_wheels: .wheels/ holds $(ls -- "$DEST" | wc -l) wheels (${size} MiB); carry it: run(..., carry=[\".wheels\"])"
