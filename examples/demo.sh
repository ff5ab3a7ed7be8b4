#!/usr/bin/env bash
# The README demo: prepare -> train -> eval --by-position on the embedded real hg38 pieces, on a CPU.
# Train on chr1:1-1,000,000 and chr2:1-2,333,275 (16k windows); evaluate on chr22:32.0-32.3 Mb, held out.
# Rerunning is safe: prepare skips finished shards and train resumes from the latest checkpoint.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/genoctx ]; then
  python3 -m venv .venv && .venv/bin/pip install -q torch==2.13.0 -e '.[dev]'
fi
G=.venv/bin/genoctx
OUT=${OUT:-demo}
WINDOW=${WINDOW:-16k}

$G prepare --out "$OUT/data" --window "$WINDOW" --chroms chr1,chr2 --eval-chroms chr22 \
  --fasta data/hg38/hg38_chr1_1-1000000.fa.gz \
  --fasta data/hg38/hg38_chr2_1-2333275.fa.gz \
  --fasta data/hg38/hg38_chr22_32000001-32300000.fa >&2
# The untrained model (same seed) is the baseline.
$G train --data "$OUT/data" --recipe recipes/cpu-small.yaml --out "$OUT/init" --steps 0 --resume >&2
$G train --data "$OUT/data" --recipe recipes/cpu-small.yaml --out "$OUT/run" --resume >&2
$G eval --by-position --checkpoint "$OUT/run" --baseline "$OUT/init" --data "$OUT/data" \
  --plot "$OUT/by_position.png" --format table
