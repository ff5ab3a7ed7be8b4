#!/usr/bin/env bash
# The README demo: examples/reproduce-small.sh with small budgets (about 5 minutes on 2 CPU cores, install
# excluded): prepare the embedded real hg38 pieces (train chr1:1-1,000,000 + chr2:1-2,333,275, hold out
# chr22:32.0-32.3 Mb), train a base at short context (1k-token crops), post-train it on whole 16k windows, then
# eval --by-position of base vs post-trained with the order-8 Markov chain and the repeat reference in the same
# table and plot.
# The untrained model is in demo/init. Rerunning is safe: prepare skips finished shards, train resumes.
set -euo pipefail
export OUT=${OUT:-demo} BASE_STEPS=${BASE_STEPS:-100} POST_STEPS=${POST_STEPS:-8} COPY_PROBE=${COPY_PROBE:-0}
exec bash "$(dirname "$0")/reproduce-small.sh"
