#!/usr/bin/env bash
# One GPU node: SGLang with HiCache (GPU → host memory → kvconnect L3) and an all-in-one
# kvconnect store (a master and a 32 GiB store server) on the same machine.
#
#   pip install "kvconnect[sglang]"     # SGLang 0.5.23 and kvconnect's plugin
#   MODEL=Qwen/Qwen3-8B ./single_node.sh
#
# Same host: SGLang's host KV pool and the store server's memory are both on this machine, so
# every page moves with one memcpy through shared memory.
set -euo pipefail
MODEL="${MODEL:-Qwen/Qwen3-8B}"
STORE_SIZE="${STORE_SIZE:-32G}"

kvconnect serve --master-listen tcp://127.0.0.1:50051 --store-size "$STORE_SIZE" &
STORE=$!
trap 'kill $STORE' EXIT

# SGLang's prefetch budget (prefetch_timeout_base + prefetch_timeout_per_ki_token per 1024
# tokens) is kvconnect's read deadline too: reads answer before SGLang gives up on them.
python -m sglang.launch_server \
    --model-path "$MODEL" \
    --enable-hierarchical-cache \
    --hicache-ratio 2 \
    --hicache-mem-layout page_first \
    --hicache-write-policy write_through \
    --hicache-storage-backend kvconnect \
    --hicache-storage-prefetch-policy timeout \
    --hicache-storage-backend-extra-config \
    '{"master": "tcp://127.0.0.1:50051", "prefetch_timeout_base": 1.0}'
