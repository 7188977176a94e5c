# shellcheck shell=bash disable=SC2034
# (DEVICE and LIMIT are the caller's, read there.)
# Sourced by scripts/gpu_zoo.sh and scripts/gpu_commands.sh (each of which compares runs on the
# CPU and on a GPU with the bundle's cpl): their shared options and the cpl they run.
#
# gpu_compare_setup "$@": parses --out DIR (required), --cpl PATH, --device DEV, --limit S and
# -h/--help (prints the calling script's header comment) into the caller's OUT, CPL, DEVICE and
# LIMIT (the caller sets their defaults), then, unless --cpl was given, unpacks the bundle's cpl
# into the caller's temporary folder W and exports LD_LIBRARY_PATH from $OUT/env.txt (written by
# scripts/gpu_check.sh). Exits 2 on a bad option or a missing file.
gpu_compare_setup() {
    while [ $# -gt 0 ]; do
        case $1 in
        --out) OUT=$2; shift ;;
        --cpl) CPL=$2; shift ;;
        --device) DEVICE=$2; shift ;;
        --limit) LIMIT=$2; shift ;;
        -h | --help) sed -n '2,/^set -/{/^#/p}' "$0"; exit 0 ;;
        *) echo "unknown argument: $1" >&2; exit 2 ;;
        esac
        shift
    done
    [ -n "$OUT" ] || { echo "--out DIR is required" >&2; exit 2; }
    if [ -z "$CPL" ]; then
        [ -f "$OUT/env.txt" ] || { echo "$OUT/env.txt missing: run scripts/gpu_check.sh first" >&2; exit 2; }
        xz -dc gpu-bundle/bin/cpl.xz >"$W/cpl" || { echo "cannot unpack gpu-bundle/bin/cpl.xz" >&2; exit 2; }
        chmod +x "$W/cpl"
        CPL=$W/cpl
        LD_LIBRARY_PATH=$(sed -n 's/^LD_LIBRARY_PATH=//p' "$OUT/env.txt" | head -n 1)
        export LD_LIBRARY_PATH
    fi
    mkdir -p "$OUT"
}
