#!/usr/bin/env bash
# The same as single_node.sh without kvconnect's plugin: SGLang's `dynamic` backend loader.
# Use it with an SGLang release the plugin does not support, or with SGLANG_PLUGINS set to
# exclude kvconnect. `interface_v1: 1` selects SGLang's zero-copy page path.
set -euo pipefail
MODEL="${MODEL:-Qwen/Qwen3-8B}"

python -m sglang.launch_server \
    --model-path "$MODEL" \
    --enable-hierarchical-cache \
    --hicache-mem-layout page_first \
    --hicache-storage-backend dynamic \
    --hicache-storage-backend-extra-config \
    '{"backend_name": "kvconnect", "module_path": "kvconnect.sglang", "class_name": "KVConnectStore", "interface_v1": 1, "master": "tcp://127.0.0.1:50051"}'
