#!/bin/bash
# The GPU runs that the open issues' targets are measured by, each under its own time limit, so one
# short lease of a GPU machine answers as many as fit and keeps what finished.
#
#   bash benchmarks/tools/gpu_runs.sh OUT_DIR [SECTION ...]
#
# Sections (default: all but sweep, engine_ab and the host ones, in this order):
#   kernel    decode kernel: the default launch checked against the reference at full shapes with a
#             bfloat16 cache, then timed with bfloat16 and float16 caches (the latter the ceiling)
#   sweep     the bf16-cache kernel's launch at batch x kv heads >= SMs (the default: two uncapped
#             warps; capped at 128, 120 and 96 registers, the last fitting 10 programs an SM but
#             spilling) in 2, 3 and 4 splits, checked, then timed (the kernel alone: engine_ab decides)
#   engine_ab the Llama-3-8B step at 32 x 8K in one process (tools/engine_step_ab.py): fp16, and
#             kvarn_k4v2_g128 as the engine runs it against nofold (its output unrotated before o_proj)
#   host      the SmolLM2-135M step at 32 x 2K in one process (tools/engine_step_ab.py): host time
#             inside the decode call against the device's, with the trace's longest host events;
#             variants nofold (KVarN's output unrotated before o_proj, not a rotated o_proj copy),
#             stablemeta (the metadata in buffers that keep their addresses), serial (steps that
#             never overlap); the
#             decode executables' thunk sequences summarized (tools/thunk_summary.py: what runs inside
#             XLA's command buffers)
#   host_quick base and nofold, 2 rounds (for a short lease)
#   host_skip_temp, host_cb_off  the same (base only) with XLA's command-buffer update mode SKIP_TEMP
#             (temporaries at a fixed address), or with command buffers off
#   host_vlog the same (base only, 2 rounds of 16 steps) with XLA's log of the allocations that move
#             between calls and the commands it updates
#   engine    generate.py, SmolLM2-135M shapes: batch 32 x 2K (fp16, int8, kvarn_k4v2_g128) and batch 1;
#             batch 32 again with XLA's command buffers off
#   fold      the SmolLM2-135M step at 32 x 2K in one process: fp16, kvarn_k4v2_g128 and its nofold
#             variant; then the engine section's first two generate.py runs
#   llama     generate.py, Llama-3-8B shapes (32 layers), batch 32 x 8K prompt, 128 new tokens
#   capacity  generate.py, Llama-3-8B shapes at a batch x context fp16 cannot hold (128 x 12K on a
#             GPU of more than 100 GiB, else 64 x 12K): fp16 must be refused at start, kvarn served
#             (its own command: up to 9 minutes)
#   bridge    bridge_overhead.py: the vLLM bridge's per-layer costs against JAX direct and torch SDPA
#   bridge_host  tools/bridge_host_profile.py: the bridge's fused decode layer's host time by part
#   accuracy  tools/decode_accuracy.py: every scheme's kernel against the reference at full context
# Each section writes its JSON and log into OUT_DIR and prints its summary lines; a section cut by its
# time limit says so (exit status 124 in the log line) and the next one runs.
set -u
out=${1:?usage: gpu_runs.sh OUT_DIR [SECTION ...]}
shift
mkdir -p "$out"
sections=${*:-kernel engine llama capacity bridge accuracy}
root=$(cd "$(dirname "$0")/../.." && pwd)
export PYTHONPATH=$root:$root/bridge:$root/ascend${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
cd "$root"
G=benchmarks/generate.py

run() {  # run NAME SECONDS COMMAND...: COMMAND under a time limit, output to OUT_DIR/NAME.log
    local name=$1 limit=$2
    shift 2
    timeout "$limit" "$@" > "$out/$name.log" 2>&1
    echo "== $name: exit $? ($limit s limit)"
}

nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/gpu.txt"
mem_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
for s in $sections; do
    case $s in
    kernel)
        run kernel_accuracy_bf16 110 python benchmarks/tools/decode_accuracy.py --dtype bfloat16 \
            --shapes 32x8192,8x16384 --schemes kvarn_k4v2_g128,int8 --old-fold '' \
            --json "$out/kernel_accuracy_bf16.json"
        run kernel_bf16 120 python benchmarks/decode.py --dtype bfloat16 --shapes 32x8192,8x16384 \
            --schemes kvarn_k4v2_g128,int8 --no-baselines --json "$out/kernel_bf16.json"
        run kernel_f16 120 python benchmarks/decode.py --dtype float16 --shapes 32x8192,8x16384 \
            --schemes kvarn_k4v2_g128,int8 --no-baselines --json "$out/kernel_f16.json"
        grep -hE "rel L2|of roofline|FAIL" "$out"/kernel_*.log ;;
    sweep)
        run sweep_bf16 300 python benchmarks/decode.py --dtype bfloat16 --shapes 32x8192,128x4096 \
            --schemes kvarn_k4v2_g128 --variants default,maxnreg=128,maxnreg=96,maxnreg=120 --splits 2,3,4 \
            --check --no-baselines --json "$out/sweep_bf16.json"
        grep -hE "check|of roofline|FAIL" "$out/sweep_bf16.log" ;;
    engine_ab)
        run engine_ab 280 python benchmarks/tools/engine_step_ab.py --config llama3-8b --batch 32 \
            --prompt-len 8192 --run fp16 --run kvarn_k4v2_g128:base,nofold --rounds 3 --profile \
            --json "$out/engine_ab.json"
        grep -hE "median" "$out/engine_ab.log" ;;
    host | host_quick)
        variants=base,nofold,stablemeta,serial rounds=3 limit=330
        [ $s = host_quick ] && variants=base,nofold rounds=2 limit=220
        # the decode executables' thunk sequences: what runs inside XLA's command buffers and what not
        XLA_FLAGS="${XLA_FLAGS:-} --xla_dump_to=$out/xla_dump --xla_dump_hlo_module_re=.*decode.*" \
            run host_default $limit python benchmarks/tools/engine_step_ab.py --config smollm2-135m --batch 32 \
            --prompt-len 2048 --run fp16:$variants --run kvarn_k4v2_g128:$variants --rounds $rounds \
            --profile --json "$out/host_default.json"
        find "$out/xla_dump" -type f ! -name "*thunk_sequence*" -delete 2>/dev/null
        find "$out/xla_dump" -type d -empty -delete 2>/dev/null
        python benchmarks/tools/thunk_summary.py "$out"/xla_dump/*thunk_sequence*.txt > "$out/thunks.txt"
        find "$out/xla_dump" -type f ! -name "*after_thunk_passes*" -delete 2>/dev/null  # few files come back
        grep -hE "median|    host " "$out"/host_default.log
        cat "$out/thunks.txt" ;;
    host_skip_temp | host_cb_off)
        # XLA's command buffers with the temporaries at a fixed virtual address (update mode
        # SKIP_TEMP: commands that touch only moved temporaries are not updated), or off
        flags=--xla_gpu_command_buffer_update_mode=SKIP_TEMP
        [ $s = host_cb_off ] && flags=--xla_gpu_enable_command_buffer=
        XLA_FLAGS="${XLA_FLAGS:-} $flags" run $s 200 python benchmarks/tools/engine_step_ab.py \
            --config smollm2-135m --batch 32 --prompt-len 2048 --run fp16 --run kvarn_k4v2_g128 --rounds 3 \
            --profile --json "$out/$s.json"
        grep -hE "median|    host " "$out/$s.log" ;;
    host_vlog)
        # which of the decode executable's allocations move between calls, and how many commands
        # XLA updates for it (XLA's own log lines)
        TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=gpu_executable=5,command_executor=1,command_buffer_thunk=2 \
            run host_vlog 150 python benchmarks/tools/engine_step_ab.py --config smollm2-135m --batch 32 \
            --prompt-len 2048 --run fp16 --run kvarn_k4v2_g128 --rounds 2 --steps 16
        # the decode executables' lines (their graphs have hundreds of commands; other executables' few)
        grep -E "jit__decode_fn executions|Updated [0-9]{3,} commands|median|engine and prefill" "$out/host_vlog.log" \
            | sed -E 's/^[IWE][0-9]+ [0-9:.]+ +[0-9]+ //' | cut -c1-300 > "$out/host_vlog_lines.txt"
        [ "$(stat -c %s "$out/host_vlog.log")" -gt 5000000 ] && gzip "$out/host_vlog.log"
        head -80 "$out/host_vlog_lines.txt" ;;
    engine)
        run smollm2_b32 150 python $G --config smollm2-135m --batch 32 --prompt-len 2048 --new-tokens 64 \
            --repeats 2 --kv-cache-dtype fp16,int8,kvarn_k4v2_g128 --json "$out/smollm2_b32.json"
        run smollm2_b1 90 python $G --config smollm2-135m --batch 1 --prompt-len 2048 --new-tokens 64 \
            --repeats 2 --kv-cache-dtype fp16,kvarn_k4v2_g128 --json "$out/smollm2_b1.json"
        XLA_FLAGS=--xla_gpu_enable_command_buffer= run smollm2_b32_no_command_buffers 100 python $G \
            --config smollm2-135m --batch 32 --prompt-len 2048 --new-tokens 64 \
            --kv-cache-dtype fp16,kvarn_k4v2_g128 --json "$out/smollm2_b32_no_command_buffers.json"
        grep -hE "^\| (1|32) \|" "$out"/smollm2_*.log ;;
    fold)
        # KVarN's output left rotated for a rotated o_proj copy (the engine) against unrotated (nofold),
        # fp16 in the same process; then the engine's rows through generate.py
        run fold_ab 230 python benchmarks/tools/engine_step_ab.py --config smollm2-135m --batch 32 \
            --prompt-len 2048 --run fp16 --run kvarn_k4v2_g128:base,nofold --rounds 3 --profile \
            --json "$out/fold_ab.json"
        grep -hE "median|kernels" "$out/fold_ab.log"
        run smollm2_b32 150 python $G --config smollm2-135m --batch 32 --prompt-len 2048 --new-tokens 64 \
            --repeats 2 --kv-cache-dtype fp16,int8,kvarn_k4v2_g128 --json "$out/smollm2_b32.json"
        run smollm2_b1 90 python $G --config smollm2-135m --batch 1 --prompt-len 2048 --new-tokens 64 \
            --repeats 2 --kv-cache-dtype fp16,kvarn_k4v2_g128 --json "$out/smollm2_b1.json"
        grep -hE "^\| (1|32) \|" "$out"/smollm2_*.log ;;
    llama)
        run llama3_8b_b32 200 python $G --config llama3-8b --batch 32 --prompt-len 8192 --new-tokens 128 \
            --kv-cache-dtype fp16,kvarn_k4v2_g128 --json "$out/llama3_8b_b32.json"
        grep -hE "^\| 32 \|" "$out/llama3_8b_b32.log" ;;
    capacity)
        # prompts enter 16 sequences at a time (the whole batch at once needs more working memory than
        # the pool leaves: refused at start); enough new tokens that the last group decodes beside all
        batch=64
        [ "${mem_mib:-0}" -gt 102400 ] && batch=128
        run capacity 540 python $G --config llama3-8b --batch $batch --prompt-len 12000 \
            --new-tokens $((batch / 16 * 12 + 64)) --prefill-chunk 1024 --prefill-batch 16 \
            --kv-cache-dtype fp16,kvarn_k4v2_g128 --json "$out/capacity.json"
        grep -hE "^\| $batch \||refused" "$out/capacity.log" ;;
    bridge)
        run bridge 200 python benchmarks/bridge_overhead.py --schemes kvarn_k4v2_g128,int8,fp16 \
            --json "$out/bridge.json"
        tail -20 "$out/bridge.log" ;;
    bridge_host)
        run bridge_host 200 python benchmarks/tools/bridge_host_profile.py
        grep -vE "^ *$" "$out/bridge_host.log" | head -80 ;;
    accuracy)
        run accuracy 300 python benchmarks/tools/decode_accuracy.py --shapes 1x131072,32x32768,8x16384,128x4096 \
            --json "$out/accuracy.json" --md "$out/accuracy.md"
        grep -h "rel L2" "$out/accuracy.log" ;;
    *)
        echo "unknown section $s (kernel sweep engine_ab host host_quick host_skip_temp host_cb_off host_vlog engine fold llama capacity bridge accuracy)" >&2
        exit 2 ;;
    esac
done
