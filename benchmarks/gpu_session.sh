#!/usr/bin/env bash
# Everything a lent GPU should run, in one go: the CUDA tests, then the GPU benchmarks of issue 16.
#
#   OUT=/tmp/gpu bash benchmarks/gpu_session.sh            # from the repository root, on the GPU machine
#   PEERS=.peers OUT=... bash benchmarks/gpu_session.sh    # a folder of torchtitan / megatron-core for moe_layer.py
#   STEPS="tests moe train_step trainer" ...               # a subset, in that order (the default)
#   SIZES=mid,proxy ...                                    # train_step.py's sizes (default tiny,mid,proxy)
#   STEPS="profile compile" ...                            # the trainer's profile (Chrome trace); compiled
#   STEPS="syncs" ...                                      # where a proxy step makes the host wait for the GPU
#   STEPS="tests deepseek" ...                             # DeepSeek-V3 (MLA, sigmoid router): train_step.py
#       --model deepseek-v3 at tiny and mid, and 30 steps of its tiny recipe in bf16 through the trainer
#   STEPS="trainer trainer_eager" ...                      # A/B: Triton vs eager RMSNorm
#   OLD=.old STEPS=trainer_ab ...                          # A/B: this tree against a baseline checkout, e.g.
#       `git worktree add .old <commit>`, listed in .git/info/exclude and carried to the GPU machine
#
# Runs from the source tree (PYTHONPATH, no install) with the machine's own torch. Each part has its
# own time limit, so one that hangs leaves the others their time; every part's log is $OUT/<part>.txt
# and the last lines of each are printed at the end. The trainer part runs the Qwen3-MoE proxy of
# issue 16 (8 layers, H1024, 64 experts top-8: 1.30 B parameters, 240 M active; 4x2048 tokens, bf16).
set -u
OUT=${OUT:-/tmp/moetron-gpu}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PEERS:+:$PWD/$PEERS}${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PY:-python3}
STEPS=${STEPS:-"tests moe train_step trainer"}
PROXY="--set model.hidden_size=1024 --set model.num_layers=8 --set model.num_attention_heads=16
 --set model.num_kv_heads=4 --set model.head_dim=64 --set model.intermediate_size=3072
 --set model.moe_intermediate_size=768 --set model.num_experts=64 --set model.top_k=8
 --set model.vocab_size=32768 --set model.max_position_embeddings=4096 --set train.seq_len=2048
 --set train.micro_batch_size=4 --set train.device=cuda --set train.dtype=bf16 --set train.peak_tflops=989"

ab_runs() {  # the trainer on the proxy, $OLD and this tree alternating, twice each, on one machine
    local round side dir
    for round in 1 2; do for side in old new; do
        dir=$PWD; [ "$side" = old ] && dir=$OLD
        echo "$side run $round, steps 6-16, tokens/s sorted: $(cd "$dir" && PYTHONPATH=$dir timeout 60 $PY -m moetron \
            train $PROXY --set train.steps=16 --set train.log_every=1 2>&1 |
            sed -n 's/^step *\([0-9]*\)\/16 .*| \([0-9]*\) tok\/s.*/\1 \2/p' | awk '$1 > 5 {print $2}' | sort -n | tr '\n' ' ')"
    done; done
}

part() {  # part NAME SECONDS COMMAND...: run with a time limit, log to $OUT/NAME.txt
    local name=$1 limit=$2; shift 2
    local start=$SECONDS
    echo "=== $name: $*" | tee "$OUT/$name.txt"
    timeout "$limit" "$@" >> "$OUT/$name.txt" 2>&1
    echo "=== $name: rc $? after $((SECONDS - start)) s" | tee -a "$OUT/$name.txt"
}

{ nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
  $PY -c "import torch, triton, transformers, platform; print('torch', torch.__version__, 'cuda', torch.version.cuda,
'triton', triton.__version__, 'transformers', transformers.__version__, 'python', platform.python_version(),
torch.cuda.get_device_name(), torch.cuda.get_device_properties(0).multi_processor_count, 'SMs')"
  git log -1 --format='moetron %h %s' 2>/dev/null || true; } > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

for step in $STEPS; do
    case $step in
    tests) part tests 180 $PY -m pytest tests/test_cuda.py tests/test_cuda_deepseek.py -q -rs -p no:cacheprovider -s ;;
    moe) part moe_layer 100 $PY benchmarks/moe_layer.py --device cuda --dtype bf16 --tokens 16384 --hidden 2048 \
             --ffn 1024 --experts 64 --topk 8 --skip "hf eager" --repeats 20 --warmup 3 --profile \
             --trace "$OUT/moe_layer_trace.json.gz" ;;
    train_step) part train_step 150 $PY benchmarks/train_step.py --device cuda --dtype bf16 --sizes "${SIZES:-tiny,mid,proxy}" \
             --repeats 9 --warmup 3 --peak-tflops 989 ;;
    deepseek) part ds_train_step 120 $PY benchmarks/train_step.py --model deepseek-v3 --device cuda --dtype bf16 \
                  --sizes tiny,mid --repeats 9 --warmup 3 --peak-tflops 989
              part ds_trainer 60 $PY -m moetron train --recipe deepseek-v3-tiny --set train.device=cuda \
                  --set train.dtype=bf16 --set train.steps=30 --set train.log_every=5 ;;
    trainer) part trainer 100 $PY -m moetron train $PROXY --set train.steps=30 --set train.log_every=1 ;;
    # A/B on the same machine: the trainer with eager RMSNorm
    trainer_eager) part trainer_eager 100 $PY -m moetron train $PROXY --set train.fusion=none --set train.steps=30 \
                       --set train.log_every=1 ;;
    trainer_ab) if [ -z "${OLD:-}" ] || [ ! -d "$OLD/moetron" ]; then echo "trainer_ab: set OLD to a baseline checkout"
                else part trainer_ab 260 bash -c "$(declare -f ab_runs); PY=$PY PROXY='$PROXY' OLD=$(realpath "$OLD") ab_runs"; fi ;;
    profile) part profile_step 120 $PY benchmarks/profile_step.py $PROXY --warmup 4 --steps 2 --rows 45 \
                 --trace "$OUT/proxy_step_trace.json.gz" ;;
    syncs) part syncs 120 $PY benchmarks/profile_step.py $PROXY --warmup 4 --steps 3 --syncs ;;
    compile) part compile 180 $PY -m moetron train $PROXY --set train.fusion=compile --set train.steps=25 \
                 --set train.log_every=1 ;;
    *) echo "unknown step $step" ;;
    esac
done

echo; echo "##### summary"
for f in tests moe_layer train_step ds_train_step ds_trainer trainer trainer_eager trainer_ab profile_step syncs compile; do
    [ -f "$OUT/$f.txt" ] || continue
    echo "----- $f"
    case $f in
    tests) grep -E "passed|failed|error|SKIPPED|^(bf16|FP8|grouped|trainer)" "$OUT/$f.txt" | tail -12 ;;
    moe_layer) grep -E -A7 "^candidate" "$OUT/$f.txt"; grep -E "^moetron:" "$OUT/$f.txt" ;;
    train_step|ds_train_step) grep -E -A6 "^size" "$OUT/$f.txt" ;;
    trainer_ab) grep -E "^(old|new) run" "$OUT/$f.txt" ;;
    trainer*|ds_trainer|compile) grep -E "^(recipe|memory|step +(1|5|10|15|20|25|30)/|done)" "$OUT/$f.txt" ;;
    profile_step) grep "profiled steps" "$OUT/$f.txt" ;;
    syncs) grep -A12 "synchronisations a step" "$OUT/$f.txt" ;;
    esac
    tail -1 "$OUT/$f.txt"
done
