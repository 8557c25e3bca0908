#!/usr/bin/env bash
# A cluster: three kvconnect masters (one leads, elected in etcd), a store server per NUMA
# node of each storage host, and SGLang engines that hold no store memory of their own.
#
#   ./multi_node.sh etcd      on e1, e2, e3   a 3-member etcd cluster (Debian: etcd-server)
#   ./multi_node.sh master    on m1, m2, m3   one master each
#   ./multi_node.sh store     on each storage host: one store server per NUMA node
#   ./multi_node.sh engine    on each GPU host: SGLang with kvconnect as its L3
#
# Every host names the etcd cluster; nothing else is configured by address: engines and store
# servers find the leading master in etcd and follow it across failovers (docs/store.md).
# Every kvconnect process authenticates with one cluster token: give each host the same token
# file (KVCONNECT_TOKEN_FILE, or ~/.config/kvconnect/token, which the first master generates).
set -euo pipefail
ETCD="${ETCD:-etcd://e1:2379,e2:2379,e3:2379}"
HOST_IP="${HOST_IP:-$(hostname -I | awk '{print $1}')}"
MODEL="${MODEL:-deepseek-ai/DeepSeek-V3}"
PER_NODE="${PER_NODE:-256G}"   # store memory per NUMA node

case "${1:-}" in
etcd)
    etcd --name "$(hostname)" --data-dir /var/lib/etcd \
        --listen-client-urls "http://$HOST_IP:2379" --advertise-client-urls "http://$HOST_IP:2379" \
        --listen-peer-urls "http://$HOST_IP:2380" --initial-advertise-peer-urls "http://$HOST_IP:2380" \
        --initial-cluster "e1=http://e1:2380,e2=http://e2:2380,e3=http://e3:2380"
    ;;
master)
    kvconnect master --ha "$ETCD" --master-listen "tcp://$HOST_IP:50051" --master-metrics-port 9003
    ;;
store)
    # One server per NUMA node, bound to its node's CPUs and memory, so the memory it serves
    # sits next to the NIC that node uses. Each listens on the data network.
    for node in $(ls -d /sys/devices/system/node/node* | sed 's/.*node//'); do
        numactl --cpunodebind="$node" --membind="$node" \
            kvconnect store --store-master "$ETCD" --store-size "$PER_NODE" \
            --store-hugepages true --transfer-listen-host "$HOST_IP" &
    done
    wait
    ;;
engine)
    # Engines lend no memory to the store (local_store_size 0): GPU hosts keep their RAM for
    # SGLang's host KV pool (--hicache-ratio) and the model. Pages cross the network: a longer
    # prefetch budget, which kvconnect's reads follow (docs/sglang.md, "Deadlines").
    python -m sglang.launch_server --model-path "$MODEL" --tp 8 \
        --enable-hierarchical-cache --hicache-ratio 2 --hicache-mem-layout page_first \
        --hicache-storage-backend kvconnect \
        --hicache-storage-backend-extra-config \
        "{\"master\": \"$ETCD\", \"listen_host\": \"$HOST_IP\", \"prefetch_timeout_base\": 2.0}"
    ;;
*)
    echo "usage: $0 etcd|master|store|engine" >&2
    exit 2
    ;;
esac
