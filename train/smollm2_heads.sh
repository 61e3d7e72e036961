#!/usr/bin/env bash
# Rebuild SmolLM2's head training data and train all five draft methods side by side on one accelerator.
#
#     bash train/smollm2_heads.sh            # from the repository root; rerun it to pick up where it stopped
#
# What it does (models/smollm2/heads/MODEL_CARD.md, round 6):
#   1. data: the self-distilled answers committed in models/smollm2/distill (SELF_LIMIT listed ShareGPT
#      records), round 5's held-out yardstick (EVAL_LIMIT), and three sets of ShareGPT's own replies to the
#      records after them (FIXED_LIMIT each), with float16 hidden states (and EAGLE-3's inner layers
#      with FEATURES=1); merged into one training set. The held-out set goes first: the programs it
#      compiles (one per --buckets length) are kept by the compile cache, and the four others, run side
#      by side, load them.
#   2. training: Medusa, Clover, Clover-2, EAGLE-1 and EAGLE-3, each its own process, the same data,
#      steps and batch; heads exported to $ROOT/heads/METHOD.
# Re-entrant: finished data sets and heads are kept, a training still running is not started twice, and
# train.train --resume continues a stopped one. On a GPU, compiling SmolLM2's 30-layer forward costs
# far more than running it: hence few buckets. Everything is tunable from the environment (a CPU dry
# run: SELF_LIMIT=20 EVAL_LIMIT=12 FIXED_LIMIT=3 STEPS=4 BATCH=2 EVAL_EVERY=2 EVAL_BATCHES=1 MD_BATCH=4).
#   RETURN_AFTER=S   return after S seconds while the trainings run on (detached); rerun to wait again
#   PACK_TO=DIR      also write each exported method as DIR/METHOD.tgz.part-NN (15 MB parts) and the logs
#                    and metrics as DIR/logs.tgz
set -u
T0=$(date +%s)
ROOT=${ROOT:-runs/smollm2-heads}
SELF_LIMIT=${SELF_LIMIT:-1570}     # round 6: the first 25 committed chunks; models/smollm2/README.md: N for more
EVAL_LIMIT=${EVAL_LIMIT:-640}      # round 5's yardstick: 624 conversations, 35 of them held out
FIXED_LIMIT=${FIXED_LIMIT:-800}
STEPS=${STEPS:-4800}
BATCH=${BATCH:-8}
EVAL_EVERY=${EVAL_EVERY:-400}
EVAL_BATCHES=${EVAL_BATCHES:-4}    # 4 x 8 windows: the 32 that round 5 evaluated as 8 x 4
MD_BATCH=${MD_BATCH:-32}
BUCKETS=${BUCKETS:-512,1024}
DTYPE=${DTYPE:-bfloat16}           # the heads' compute dtype (float32 master weights and optimizer state)
FEATURES=${FEATURES:-0}            # 1: store EAGLE-3's inner layers too (3x the hidden states' bytes, copied
                                   # again by the merge); 0: EAGLE-3 runs the base model at every step
METHODS=${METHODS:-"clover2 clover medusa eagle eagle3"}
RETURN_AFTER=${RETURN_AFTER:-0}
PACK_TO=${PACK_TO:-}
PY=${PY:-python3}
POLL=${POLL:-15}                    # seconds between looks at the trainings
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false TF_CPP_MIN_LOG_LEVEL=2
D=$ROOT/data; L=$ROOT/logs; H=$ROOT/heads; W=$ROOT/work
mkdir -p $D $L $H $W
el() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
pack() {
  local m=$1
  [ -n "$PACK_TO" ] && [ -f $H/$m/heads.json ] && [ ! -f $ROOT/packed-$m ] || return 0
  tar czf $ROOT/$m.tgz -C $H $m && split -b 15m -d $ROOT/$m.tgz $PACK_TO/$m.tgz.part- && touch $ROOT/packed-$m \
    && el "packed $m"
}
$PY -c "from clover_jax import sources; sources.fetch('sharegpt'); print(sources.model_path('smollm2'))" || exit 1
el "model ready"

MD="$PY -m train.make_data --base smollm2 --data sharegpt --chat --max-len 2048 --store-hidden float16
    --batch-size $MD_BATCH --buckets $BUCKETS"
[ "$FEATURES" = 1 ] && MD+=" --store-features"
SELF="--max-new-tokens 256 --answers models/smollm2/distill"
made() { [ -f $D/$1/meta.json ]; }
made eval || $MD $SELF --limit $EVAL_LIMIT --out $D/eval > $L/data-eval.log 2>&1 || { tail -n 3 $L/data-eval.log; exit 1; }
el "held-out set made"
pids=()
made self || { $MD $SELF --limit $SELF_LIMIT --out $D/self > $L/data-self.log 2>&1 & pids+=($!); }
for k in 0 1 2; do
  made fixed$k || { $MD --mode fixed --first $(( SELF_LIMIT + k * FIXED_LIMIT )) --limit $FIXED_LIMIT --out $D/fixed$k \
                    > $L/data-fixed$k.log 2>&1 & pids+=($!); }
done
for p in "${pids[@]}"; do wait $p || { el "a make_data failed"; tail -n 3 $L/data-*.log; exit 1; }; done
el "data made"; tail -qn 1 $L/data-*.log
made r6 || $PY -m train.merge_data $D/self $D/fixed0 $D/fixed1 $D/fixed2 --out $D/r6 > $L/merge.log 2>&1 \
  || { tail -n 3 $L/merge.log; exit 1; }
el "merged"; tail -n 1 $L/merge.log

TR="$PY -m train.train --base smollm2 --data $D/r6 --eval-data $D/eval --counts-from $D/self --steps $STEPS
    --batch-size $BATCH --seq-len 512 --warmup 50 --dtype $DTYPE --export-dtype bfloat16 --eval-every $EVAL_EVERY
    --eval-batches $EVAL_BATCHES --ckpt-every $EVAL_EVERY --resume"
for m in $METHODS; do
  [ -f $H/$m/heads.json ] || pgrep -f -- "--work-dir $W/$m( |$)" > /dev/null && continue
  if [ $m = eagle3 ]; then own="--draft-vocab 8192"; else own="--loss-vocab 8192"; fi
  setsid nohup $TR --method $m $own --out $H/$m --work-dir $W/$m >> $L/train-$m.log 2>&1 < /dev/null &
done
el "training: $METHODS"
while :; do
  for m in $METHODS; do pack $m; done
  [ -n "$PACK_TO" ] && tar czf $PACK_TO/logs.tgz -C $ROOT logs $(cd $ROOT && ls work/*/run.json work/*/metrics.jsonl 2>/dev/null)
  left=""; for m in $METHODS; do [ -f $H/$m/heads.json ] || left+=" $m"; done
  [ -z "$left" ] && { el "all exported to $H"; break; }
  pgrep -f -- "--work-dir $W/" > /dev/null || { el "not exported and not running:$left (see $L/train-*.log)"; exit 1; }
  [ $RETURN_AFTER -gt 0 ] && [ $(( $(date +%s) - T0 )) -ge $RETURN_AFTER ] && { el "returning; still training:$left"; break; }
  line=""; for m in $left; do line+=" $m:$(tail -n 1 $W/$m/metrics.jsonl 2>/dev/null | grep -o '"step": [0-9]*' | grep -o '[0-9]*$')"; done
  el "steps$line"
  sleep $POLL
done
for m in $METHODS; do grep -h "^saved" $L/train-$m.log; done
exit 0
