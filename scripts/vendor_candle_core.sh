#!/usr/bin/env bash
# Rebuilds third_party/candle-core: crates.io's candle-core $VERSION with
# third_party/candle-core-$VERSION-*.patch applied (see third_party/README.md). Needs the crate in
# cargo's registry cache (any `cargo fetch` of a project that depends on it puts it there; this
# script makes one). Run it after changing the patch or the version, then commit the result.
set -euo pipefail
cd "$(dirname "$0")/.."
version=${VERSION:-0.11.1}
cargo_home=${CARGO_HOME:-$HOME/.cargo}
src=$(ls -d "$cargo_home"/registry/src/*/candle-core-"$version" 2>/dev/null | head -n 1 || true)
if [ -z "$src" ]; then
    tmp=$(mktemp -d)
    mkdir -p "$tmp/src" && touch "$tmp/src/lib.rs"
    printf '[package]\nname = "fetch-candle"\nversion = "0.0.0"\nedition = "2021"\n[dependencies]\ncandle-core = "=%s"\n' \
        "$version" > "$tmp/Cargo.toml"
    cargo fetch --manifest-path "$tmp/Cargo.toml"
    src=$(ls -d "$cargo_home"/registry/src/*/candle-core-"$version" | head -n 1)
fi
out=third_party/candle-core
rm -rf "$out"
mkdir -p "$out"
cp -r "$src/src" "$src/LICENSE" "$src/README.md" "$src/Cargo.toml" "$out/"
# candle's own tests, benches and examples are not vendored: drop their targets.
python3 - "$out/Cargo.toml" <<'PY'
import re, sys
p = sys.argv[1]
s = open(p).read()
s = re.sub(r'\n\[\[(example|test|bench)\]\]\n(?:[^\[\n][^\n]*\n)*', '\n', s)
open(p, "w").write(s)
PY
for p in third_party/candle-core-"$version"-*.patch; do
    patch -d "$out" -p1 --quiet < "$p"
done
echo "third_party/candle-core: candle-core $version from $src, patched"
