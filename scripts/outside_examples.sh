#!/usr/bin/env bash
# Builds the library examples (examples/*.rs) as a program outside this workspace would: a
# project of its own with path dependencies on candle-parallel, no `[patch]`, so it gets
# crates.io's candle-core 0.11.1 (the workspace patches candle-core's backward pass,
# third_party/README.md). Runs each example there and compares the losses it prints with the
# same example of the workspace build (patched), to 1e-6 relative: the patch changes no value.
#
# Usage: scripts/outside_examples.sh [PATCHED_EXAMPLES_DIR]
#   PATCHED_EXAMPLES_DIR  where the workspace's example binaries are (default
#                         target/debug/examples; `cargo build -p cpl-examples --examples`)
# Environment: CPL_OUTSIDE_DIR, the project folder, outside the workspace (default
# ~/.cache/cpl-outside; its target folder is kept, so only the first build is cold).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$(pwd)
PATCHED=${1:-target/debug/examples}
PROJ=${CPL_OUTSIDE_DIR:-$HOME/.cache/cpl-outside}
EXAMPLES=(tensor_parallel_mlp parallel_transformer)
case "$PROJ/" in
"$ROOT"/*) echo "CPL_OUTSIDE_DIR must be outside the workspace ($ROOT)" >&2; exit 2 ;;
esac
mkdir -p "$PROJ/src"
# The workspace's lock file pins every version but candle-core's source (crates.io, unpatched).
cp Cargo.lock "$PROJ/Cargo.lock"
{
    cat <<EOF
[package]
name = "cpl-outside-examples"
version = "0.0.0"
edition = "2021"
publish = false

[workspace]

[dependencies]
anyhow = "1"
candle-core = "=0.11.1"
candle-parallel = { path = "$ROOT/candle-parallel" }

[profile.dev]
opt-level = 1
# No debug info or incremental state: they only cost disk here (the examples' numbers are the
# same either way).
debug = false
incremental = false

[profile.dev.package."*"]
opt-level = 3
EOF
    for ex in "${EXAMPLES[@]}"; do
        printf '\n[[example]]\nname = "%s"\npath = "%s/examples/%s.rs"\n' "$ex" "$ROOT" "$ex"
    done
} >"$PROJ/Cargo.toml"
echo "// The examples are the package's content." >"$PROJ/src/lib.rs"
(cd "$PROJ" && cargo build --examples --quiet)
# The candle-core the outside build used must be crates.io's, not the vendored copy.
if (cd "$PROJ" && cargo tree -p candle-core --depth 0 --quiet) | grep -q "$ROOT"; then
    echo "the outside build resolved candle-core to the workspace's patched copy" >&2
    exit 1
fi
fail=0
for ex in "${EXAMPLES[@]}"; do
    [ -x "$PATCHED/$ex" ] || { echo "$PATCHED/$ex not built" >&2; exit 1; }
    "$PATCHED/$ex" >"$PROJ/$ex.patched.txt"
    "$PROJ/target/debug/examples/$ex" >"$PROJ/$ex.outside.txt"
    python3 - "$ex" "$PROJ/$ex.patched.txt" "$PROJ/$ex.outside.txt" <<'PY' || fail=1
import re, sys
def losses(path):
    # The loss table: "step  loss  loss" rows of numbers.
    rows = [l.split() for l in open(path).read().splitlines()]
    num = re.compile(r"-?[0-9.e+-]+")
    return [[float(x) for x in r[1:]] for r in rows if len(r) >= 3 and all(num.fullmatch(x) for x in r)]
a, b = losses(sys.argv[2]), losses(sys.argv[3])
assert a, "no loss rows in the patched output"
assert len(a) == len(b), f"{len(a)} rows patched, {len(b)} outside"
worst = 0.0
for ra, rb in zip(a, b):
    for x, y in zip(ra, rb):
        assert x == x and y == y, f"NaN: {ra} vs {rb}"
        worst = max(worst, abs(x - y) / max(abs(x), 1e-30))
assert worst <= 1e-6, f"largest relative difference {worst:.3e} > 1e-6"
print(f"-- {sys.argv[1]}: {len(a)} steps, outside (crates.io candle-core) vs patched: largest relative difference {worst:.1e}")
PY
done
exit "$fail"
