#!/usr/bin/env bash
# Train Gemma 3 270M's Clover-2 and EAGLE-3 heads on a CPU, one job after another, and measure them.
#
#     bash train/gemma3_heads.sh            # from the repository root; rerun it to pick up where it stopped
#
# Gemma 3 270M is a base model: its data is ShareGPT's first user turns as plain text (no chat template),
# continued greedily by the model itself (self-distillation), then ShareGPT's own replies to the records
# after them. What it does (models/gemma3/heads/MODEL_CARD.md):
#   1. answers: the model's own greedy continuations of the first SELF_LIMIT listed records, kept as
#      compressed shards in models/gemma3/distill (small enough to commit; a killed run resumes at the
#      first missing chunk), made into a data set with bfloat16 hidden states and EAGLE-3's layers
#      (Gemma's residual stream passes float16's range);
#   2. ShareGPT's own replies to the FIXED_LIMIT records after them, cut to FIXED_LEN tokens, the same way;
#   3. merged; Clover-2 (loss over the LOSS_VOCAB most frequent answer tokens of its 262,144) and EAGLE-3
#      (a DRAFT_VOCAB-token draft vocabulary), STEPS steps each, one after the other (2 cores), every
#      training resumable (--resume); the held-out figures are 5% of the examples, by hash of their index;
#   4. tau of every trained method on models/gemma3/prompts.jsonl (Spec-Bench-style tasks, text the heads
#      never saw), greedy and T=1, batch 1, as one JSON: each method on its paper tree, EAGLE-3 also on the
#      authors' dynamic tree, every step drafted (--step-cost none: a CPU times no speedup worth quoting).
# Everything is tunable from the environment; a CPU dry run:
#   ROOT=/tmp/g3 ANSWERS=/tmp/g3/distill SELF_LIMIT=4 FIXED_LIMIT=2 MAX_NEW=8 STEPS=2 EVAL_EVERY=1 \
#   EVAL_BATCHES=1 BATCH=2 SEQ_LEN=64 LOSS_VOCAB=64 DRAFT_VOCAB=64 BENCH_ARGS="--per-task 1 --max-new-tokens 4"
set -u
T0=$(date +%s)
ROOT=${ROOT:-runs/gemma3-heads}
ANSWERS=${ANSWERS:-models/gemma3/distill}
SELF_LIMIT=${SELF_LIMIT:-640}      # listed ShareGPT records the model continues (10 chunks of 64)
MAX_NEW=${MAX_NEW:-128}            # tokens of each continuation
FIXED_LIMIT=${FIXED_LIMIT:-320}    # records after them whose ShareGPT reply is taken as it is
FIXED_LEN=${FIXED_LEN:-512}        # tokens a fixed example is cut to
STEPS=${STEPS:-600}
BATCH=${BATCH:-8}
SEQ_LEN=${SEQ_LEN:-128}
EVAL_EVERY=${EVAL_EVERY:-150}
EVAL_BATCHES=${EVAL_BATCHES:-8}
LOSS_VOCAB=${LOSS_VOCAB:-8192}     # Clover-2: the full 262,144-token softmax of 8 x 128 positions does not fit 24 GB
DRAFT_VOCAB=${DRAFT_VOCAB:-8192}   # EAGLE-3's own lm_head
MD_BATCH=${MD_BATCH:-8}
METHODS=${METHODS:-"clover2 eagle3"}
BENCH_ARGS=${BENCH_ARGS:-}
PY=${PY:-python3}
export PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=2
D=$ROOT/data; L=$ROOT/logs; H=$ROOT/heads; W=$ROOT/work
mkdir -p $D $L $H $W
el() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
step() {  # step NAME LOG COMMAND...: run it unless NAME's marker is there; stop the recipe if it fails
  local name=$1 log=$2; shift 2
  [ -f $ROOT/done-$name ] && return 0
  el "$name: $*"
  "$@" > $log 2>&1 || { el "$name failed:"; tail -n 3 $log; exit 1; }
  touch $ROOT/done-$name; el "$name done: $(tail -n 1 $log)"
}
MD="$PY -m train.make_data --base gemma3 --data sharegpt --store-hidden bfloat16 --store-features
    --batch-size $MD_BATCH"
step self $L/data-self.log $MD --max-new-tokens $MAX_NEW --max-len 1024 --answers $ANSWERS --limit $SELF_LIMIT \
  --out $D/self
step fixed $L/data-fixed.log $MD --mode fixed --first $SELF_LIMIT --limit $FIXED_LIMIT --max-len $FIXED_LEN \
  --out $D/fixed
step merge $L/merge.log $PY -m train.merge_data $D/self $D/fixed --out $D/joined
for m in $METHODS; do
  if [ $m = eagle3 ]; then own="--draft-vocab $DRAFT_VOCAB"; else own="--loss-vocab $LOSS_VOCAB"; fi
  step train-$m $L/train-$m.log $PY -m train.train --method $m --base gemma3 --data $D/joined --counts-from $D/self \
    --steps $STEPS --batch-size $BATCH --seq-len $SEQ_LEN --warmup 30 --dtype float32 --export-dtype bfloat16 \
    --eval-every $EVAL_EVERY --eval-batches $EVAL_BATCHES --ckpt-every 50 --resume $own \
    --out $H/$m --work-dir $W/$m
done
$PY -m train.curves $(for m in $METHODS; do echo $W/$m; done) --plot $ROOT/curves.png --out $ROOT/curves.md \
  > /dev/null 2>&1 || el "no curves (train.curves failed)"
step bench $L/bench.log $PY -m infer.benchmark --model gemma3 --heads-root $H --methods $(echo $METHODS | tr ' ' ',') \
  --tree default --tree eagle3=eagle2 --step-cost none --temperatures 0,1 --batch-sizes 1 --repeats 0 \
  --json $ROOT/tau.json $BENCH_ARGS
el "heads in $H, tau in $ROOT/tau.json ($L/bench.log)"
