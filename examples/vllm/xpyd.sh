#!/usr/bin/env bash
# xPyD across hosts: run this script once per instance, with its role, then the proxy once.
#
#   # on each prefill host (one instance per GPU group):
#   HOST_IP=10.0.0.11 ./xpyd.sh prefill
#   # on each decode host:
#   HOST_IP=10.0.0.21 ./xpyd.sh decode
#   # anywhere:
#   ./xpyd.sh proxy --prefill http://10.0.0.11:8100 http://10.0.0.12:8100 \
#                   --decode  http://10.0.0.21:8200 http://10.0.0.22:8200
#
# HOST_IP is the address other hosts reach this one at: prefill's side channel and every
# worker's transfer engine listen there (each TP rank picks a free port; decode learns them
# from the side channel). With POOL_MASTER set (e.g. etcd://10.0.0.5:2379 for a store with
# master HA), every instance also shares prefix blocks through the kvconnect store.
set -euo pipefail
cd "$(dirname "$0")"
MODEL="${MODEL:-Qwen/Qwen3-32B}"
TP="${TP:-4}"
role="${1:?usage: xpyd.sh prefill|decode|proxy [proxy args]}"
shift

extra() {
    if [ -n "${POOL_MASTER:-}" ]; then
        echo "{\"host\": \"$HOST_IP\", \"pool\": true, \"master\": \"$POOL_MASTER\"}"
    else
        echo "{\"host\": \"$HOST_IP\"}"
    fi
}

serve() {  # serve PORT KV_ROLE
    local kv_role=$2
    [ -z "${POOL_MASTER:-}" ] || kv_role=kv_both
    VLLM_LOGGING_CONFIG_PATH="$PWD/logging.json" \
        exec vllm serve "$MODEL" --host 0.0.0.0 --port "$1" --tensor-parallel-size "$TP" \
        --kv-transfer-config \
        "{\"kv_connector\": \"KVConnectConnector\",
          \"kv_connector_module_path\": \"kvconnect.vllm.connector\",
          \"kv_role\": \"$kv_role\", \"kv_load_failure_policy\": \"recompute\",
          \"kv_connector_extra_config\": $(extra)}"
}

case "$role" in
    prefill) : "${HOST_IP:?set HOST_IP}"; serve 8100 kv_producer ;;
    decode) : "${HOST_IP:?set HOST_IP}"; serve 8200 kv_consumer ;;
    proxy) exec python proxy.py --host 0.0.0.0 --port 8000 "$@" ;;
    *) echo "unknown role $role" >&2; exit 2 ;;
esac
