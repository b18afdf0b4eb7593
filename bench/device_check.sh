#!/usr/bin/env bash
# The GPU check in one command, for a lent one-GPU box (docs/gpu.md, "Checking a GPU box"):
#
#     bench/device_check.sh [gpu_smoke options...]
#
# First `python -m bench.flex_probe` (within DEVICE_CHECK_PROBE_S, default 60: flex attention compiled for a
# one-row batch of short queries, with torch's template choice and with BACKEND=TRITON; the device's
# capability and shared memory per block), then `python -m bench.gpu_smoke --quick --class-budget 60` from
# this checkout WITHOUT `pip install -e .` (the box's own torch and transformers are the ones checked; an
# install would fetch the pinned ones), after installing the wheels carried in .wheels/ (ignored by git;
# bench/fetch_wheels.sh fills it here, for the box's Python 3.12) into a folder of their own. With $OUT set,
# the figures go to $OUT/flex_probe.json and $OUT/gpu_smoke.json (rewritten after each part of the smoke:
# training, averaging, forced OOM, class check, so a failed or cut part keeps the others') and the log to
# $OUT/gpu_smoke.log; one line per part says ok or why not. The smoke ends within DEVICE_CHECK_LIMIT_S
# seconds (default 480: a cold cache's compiles took most of the 330 it had before), with gpu_smoke's exit
# code (0: every check passed, 1: one failed; 124: too slow). Between the two, within DEVICE_CHECK_GATE_S
# (default 240), the compile gate (`python -m bench.cross_compile --only flex`) for this device's capability at
# head dim 128: its rows (shared memory against the limit, registers, spills, as compiled without a GPU) are
# printed beside the device's own shared memory per block and the probe's result, so a lent GPU checks the
# gate too ($OUT/cross_compile.json).
# Without CUDA it says so in one line and exits 0 (with --cpu: the same path tiny on the CPU). PYTHON: the
# interpreter (default python3); DEVICE_CHECK_WHEELS: the wheels' folder (default .wheels).
set -u
ROOT=$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")/.." && pwd)
PY=${PYTHON:-python3}
LIMIT=${DEVICE_CHECK_LIMIT_S:-480}
GATE_LIMIT=${DEVICE_CHECK_GATE_S:-240}
PROBE_LIMIT=${DEVICE_CHECK_PROBE_S:-60}
cd -- "$ROOT" || exit 1

cpu=0
for a in "$@"; do [ "$a" = --cpu ] && cpu=1; done  # the same path tiny on the CPU (tests/dflash/test_gpu_smoke.py)
if [ "$cpu" = 0 ]; then
    # one interpreter says both (torch's import is seconds): 0 CUDA, 3 torch but no CUDA, 4 no torch
    "$PY" -c 'import sys
try:
    import torch
except Exception:
    sys.exit(4)
try:
    sys.exit(0 if torch.cuda.is_available() else 3)
except Exception:
    sys.exit(3)' 2>/dev/null
    case $? in
    0) ;;
    3)
        echo "device_check: no CUDA device: nothing to check"
        exit 0
        ;;
    *)
        echo "device_check: $PY cannot import torch: nothing to check" >&2
        exit 1
        ;;
    esac
fi

shopt -s nullglob
wheels=("${DEVICE_CHECK_WHEELS:-.wheels}"/*.whl)
if ((${#wheels[@]})); then
    site=$(mktemp -d "${TMPDIR:-/tmp}/dflash-wheels.XXXXXX")
    if ! "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
        "${wheels[@]}"; then
        echo "device_check: installing the ${#wheels[@]} carried wheels of .wheels/ failed" >&2
        exit 1
    fi
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
    echo "device_check: installed ${#wheels[@]} carried wheels: ${wheels[*]##*/}"
fi
# the checkout itself is the package (no install): dflash, ops and bench import from here
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
"$PY" -c 'import platform, torch, transformers
gpu = f"{torch.cuda.get_device_name(0)} x {torch.cuda.device_count()}" if torch.cuda.is_available() else "no GPU (--cpu)"
print(f"device_check: python {platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}, {gpu}")' ||
    exit 1

if [ -n "${OUT:-}" ]; then
    mkdir -p -- "$OUT"
    json=$OUT/gpu_smoke.json
    probe_json=$OUT/flex_probe.json
    gate_json=$OUT/cross_compile.json
    log=$OUT/gpu_smoke.log
else
    json=$(mktemp "${TMPDIR:-/tmp}/gpu_smoke.XXXXXX.json")
    probe_json=$(mktemp "${TMPDIR:-/tmp}/flex_probe.XXXXXX.json")
    gate_json=$(mktemp "${TMPDIR:-/tmp}/cross_compile.XXXXXX.json")
    log=/dev/null
fi
probe_args=()
[ "$cpu" = 1 ] && probe_args=(--cpu)
# the first minute: its lines go to stdout as they come; its exit code is a finding, not the end
timeout -k 10 "$PROBE_LIMIT" "$PY" -m bench.flex_probe --json "$probe_json" "${probe_args[@]}"
prc=$?
if [ "$prc" -eq 124 ] || [ "$prc" -eq 137 ]; then
    echo "device_check: part flex probe: FAILED: ran past ${PROBE_LIMIT}s"
else
    echo "device_check: part flex probe: $([ "$prc" -eq 0 ] && echo ok || echo "FAILED: exit $prc")"
fi
if [ "$cpu" = 0 ]; then
    # the gate's rows for this very device (compiled for a fake one of its capability) beside what it has
    cc=$("$PY" -c 'import torch; print("%d.%d" % torch.cuda.get_device_capability(0))')
    optin=$("$PY" -c 'import torch; print(torch.cuda.get_device_properties(0).shared_memory_per_block_optin)')
    echo "device_check: the compile gate for capability $cc (this device: $optin B shared memory per block):"
    timeout -k 10 "$GATE_LIMIT" "$PY" -m bench.cross_compile --capability "$cc" --head-dim 128 --only flex \
        --shapes 1 --json "$gate_json" 2>/dev/null | grep -v '^cross_compile: kernel options' | sed 's/^/device_check:   /'
    grc=${PIPESTATUS[0]}
    echo "device_check: part compile gate: $([ "$grc" -eq 0 ] && echo "ok (its limit against this device's $optin B; the probe: exit $prc)" || echo "FAILED: exit $grc")"
fi
set -o pipefail
# the report goes to stderr (and the log), the figures to $json after each part; -k: a smoke that ignores
# TERM is killed
{ timeout -k 15 "$LIMIT" "$PY" -m bench.gpu_smoke --quick --json --class-budget 60 --json-file "$json" "$@" \
    2>&1 >/dev/null; } | tee -- "$log" >&2
rc=${PIPESTATUS[0]}
if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    echo "device_check: FAIL: the quick smoke ran past ${LIMIT}s; the parts it finished:" >&2
fi
if [ -s "$json" ]; then
    # one line per part and per check, from the JSON (the figures are in the file)
    "$PY" - "$json" <<'PYEOF'
import json, sys
r = json.load(open(sys.argv[1]))
for p in r.get("parts", []):
    print(f"device_check: part {p['name']}: {'ok' if p['ok'] else 'FAILED: ' + str(p['why'])} ({p['s']}s)")
for c in r.get("checks", []):
    print(f"device_check: {'ok  ' if c['ok'] else 'FAIL'} {c['name']}")
keys = ("ktok_s", "drafter_step_s", "mfu", "compile_s", "compiled_entries", "recompiles_after_warmup",
        "flex_eager_warnings", "memory", "total_s")
print("device_check: " + ", ".join(f"{k} {json.dumps(r.get(k), default=str)}" for k in keys))
avg, oom = r.get("averaging") or {}, r.get("oom") or {}
print(f"device_check: averaging round {avg.get('round_s')} s against the copy bound {avg.get('copy_bound_s')} s; "
      f"forced OOM: {oom.get('state')} / {oom.get('cause')} / gpu {oom.get('gpu')}")
PYEOF
    echo "device_check: figures in $json (exit $rc)"
else
    echo "device_check: FAIL: the quick smoke exited $rc without figures" >&2
fi
exit "$rc"
