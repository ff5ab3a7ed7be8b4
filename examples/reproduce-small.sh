#!/usr/bin/env bash
# The reference experiment in miniature, on a laptop CPU (about an hour on 2 cores, install excluded):
#   1. a BASE model, GLM-5.3-Flash's architecture at cpu-small size, trained at SHORT context: random
#      BASE_LEN-token crops of chr1 + chr2 (the stand-in for the published base's pretraining);
#   2. that base POST-TRAINED at LONG context: whole 16k-token windows of the same chromosomes (--init BASE);
#   3. held-out chr22 loss by position for base vs post-trained, with paired intervals, the order-8 Markov chain
#      in the same table and plot, and the copy probe (how far back each model copies from).
# The untrained model (same seed) is written too, for `genoctx eval --checkpoint OUT/init --checkpoint OUT/post`.
# Budgets are env-overridable (examples/demo.sh is this script with small ones); nothing was tuned on chr22.
# Rerunning is safe: prepare skips finished shards, train resumes from the latest checkpoint.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/genoctx ]; then
  python3 -m venv .venv && .venv/bin/pip install -q torch==2.13.0 -e '.[dev]'
fi
G=.venv/bin/genoctx
# --resume only where a run already is (train refuses --resume of a folder without one, exit 2)
resume() { if [ -e "$1/events.jsonl" ] || [ -d "$1/checkpoints" ]; then echo --resume; fi; }
OUT=${OUT:-reproduce-small}
SEED=${SEED:-0}
BASE_STEPS=${BASE_STEPS:-500}   # x BASE_BATCH crops x BASE_LEN tokens at short context
BASE_LEN=${BASE_LEN:-1024}
BASE_BATCH=${BASE_BATCH:-4}
BASE_LR=${BASE_LR:-3.0e-3}
POST_STEPS=${POST_STEPS:-64}    # x 1 window x 16384 tokens at long context
POST_LR=${POST_LR:-1.0e-3}
COPY_PROBE=${COPY_PROBE:-1}     # 0: skip the copy probe
log() { echo "reproduce-small: $*" >&2; }

$G prepare --out "$OUT/data" --window 16k --chroms chr1,chr2 --eval-chroms chr22 \
  --fasta data/hg38/hg38_chr1_1-1000000.fa.gz \
  --fasta data/hg38/hg38_chr2_1-2333275.fa.gz \
  --fasta data/hg38/hg38_chr22_32000001-32300000.fa >&2
log "the untrained model -> $OUT/init"
$G train --data "$OUT/data" --recipe recipes/cpu-small.yaml --out "$OUT/init" --steps 0 $(resume "$OUT/init") \
  --set train.seed="$SEED" >&2
log "1. base: $BASE_STEPS steps of $BASE_BATCH x $BASE_LEN-token crops -> $OUT/base"
$G train --data "$OUT/data" --recipe recipes/cpu-small.yaml --out "$OUT/base" $(resume "$OUT/base") \
  --steps "$BASE_STEPS" --set train.seq_len="$BASE_LEN" --set train.batch_size="$BASE_BATCH" \
  --set train.lr="$BASE_LR" --set train.warmup_steps=20 --set train.seed="$SEED" \
  --set train.checkpoint_every=200 --set train.log_every=50 >&2
log "2. post-training: $POST_STEPS steps of one whole 16k window, from the base -> $OUT/post"
$G train --data "$OUT/data" --recipe recipes/cpu-small.yaml --out "$OUT/post" $(resume "$OUT/post") --init "$OUT/base" \
  --steps "$POST_STEPS" --set model.preset=null --set train.seq_len=null --set train.batch_size=1 \
  --set train.lr="$POST_LR" --set train.warmup_steps=5 --set train.seed="$SEED" \
  --set train.checkpoint_every=20 --set train.log_every=5 >&2
log "3. eval: base vs post-trained on chr22, order-8 Markov and the repeat reference alongside -> $OUT/eval.json, $OUT/by_position.png"
PROBE=()
if [ "$COPY_PROBE" = 1 ]; then PROBE=(--copy-probe --copy-distances 6); fi
$G eval --by-position --data "$OUT/data" --checkpoint "$OUT/base" --checkpoint "$OUT/post" --markov 8 \
  --reference repeat "${PROBE[@]}" --seed "$SEED" --plot "$OUT/by_position.png" --format json > "$OUT/eval.json.tmp"
mv "$OUT/eval.json.tmp" "$OUT/eval.json"
.venv/bin/python -c 'import json, sys; from genoctx.eval.position import to_table; print(to_table(json.load(open(sys.argv[1]))))' \
  "$OUT/eval.json"
