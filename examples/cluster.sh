#!/usr/bin/env bash
# A two-node Ray cluster on this machine (a head with no CPUs for work and a worker with 2) and
# a private run submitted to it as a Ray job; the cluster is stopped at the end.
#
#   examples/cluster.sh [OUT_DIR]        (STEPS=N for a shorter run; default 100)
#
# At the end `ray stop --force` stops every Ray process on this machine (Ray has no per-cluster stop).
set -euo pipefail
OUT=$(realpath -m "${1:-runs/example-cluster}")
STEPS=${STEPS:-100}
VENV=${VENV:-.venv}
mkdir -p "$OUT"
RAY="$VENV/bin/ray"
PORT=${PORT:-6389}
export RAY_AUTH_MODE=token                         # Ray 2.60's token authentication (docs/guide/cluster.md §2)
"$RAY" get-auth-token --generate > /dev/null       # creates ~/.ray/auth_token unless it exists

# Two nodes on one machine need separate temp dirs (absolute paths) and free ports.
"$RAY" start --head --port "$PORT" --num-cpus 0 --temp-dir "$OUT/ray-head" --dashboard-port 8271 \
    --include-dashboard true --disable-usage-stats > "$OUT/head.log"
trap '"$RAY" stop --force > /dev/null 2>&1 || true' EXIT
"$RAY" start --address "127.0.0.1:$PORT" --num-cpus 2 --temp-dir "$OUT/ray-worker" --disable-usage-stats \
    > "$OUT/worker.log"

# The job: the quickstart config, shards as Ray actors placed on the worker (the head has no CPUs).
"$RAY" job submit --address http://127.0.0.1:8271 --runtime-env deploy/runtime_env.yaml -- \
    "$(realpath "$VENV/bin/widedp")" train --config configs/quickstart.toml --run-dir "$OUT/run" --no-progress \
    --set train.steps="$STEPS" --set cluster.num_shards=2 --set cluster.cpus_per_shard=0.5 > "$OUT/job.log"
"$VENV/bin/python" -c "import json, sys; s = json.load(open(sys.argv[1])); print(f\"ε = {s['epsilon']:.3f} on {s['num_shards']} shard actors ({s['backend']})\")" "$OUT/run/summary.json"
