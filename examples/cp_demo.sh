#!/usr/bin/env bash
# Context parallelism through Ray on a CPU: 2 workers share each training window (CP=2), gloo.
# Same data as demo.sh; the loss of every step equals the one-process run (genoctx train without --num-workers).
# On a cluster: add --address auto (or ray://HOST:PORT) and --gpus-per-worker 1 (NCCL).
# CP_LAYOUT=zigzag bash examples/cp_demo.sh: the load-balanced layout (equal DSA keys scored on both ranks).
set -euo pipefail
cd "$(dirname "$0")/.."
G=.venv/bin/genoctx
# --resume only where a run already is (train refuses --resume of a folder without one, exit 2)
resume() { if [ -e "$1/events.jsonl" ] || [ -d "$1/checkpoints" ]; then echo --resume; fi; }
OUT=${OUT:-demo}
[ -f "$OUT/data/manifest.json" ] || $G prepare --out "$OUT/data" --window 16k --chroms chr1,chr2 \
  --eval-chroms chr22 --fasta data/hg38/hg38_chr1_1-1000000.fa.gz \
  --fasta data/hg38/hg38_chr2_1-2333275.fa.gz --fasta data/hg38/hg38_chr22_32000001-32300000.fa >&2
LAYOUT=${CP_LAYOUT:-contiguous}
$G train --data "$OUT/data" --recipe recipes/cpu-small.yaml --out "$OUT/cp2-$LAYOUT" $(resume "$OUT/cp2-$LAYOUT") \
  --num-workers 2 --cp 2 --steps "${STEPS:-20}" --set train.cp_layout="$LAYOUT" >&2
# per-rank load of the last step: tokens, DSA indexer keys scored (contiguous: the last rank scores the most)
tail -n 1 "$OUT/cp2-$LAYOUT/metrics.jsonl" | python3 -c 'import json,sys; [print(r) for r in json.load(sys.stdin)["ranks"]]'
