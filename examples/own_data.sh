#!/usr/bin/env bash
# Your own click log -> a widedp data set -> a private model (one user protected with all of
# their clicks) -> the releasable export, and what the data set has spent.
#
#   examples/own_data.sh [OUT_DIR]        (STEPS=N for a shorter run; default 200)
set -euo pipefail
WIDEDP=${WIDEDP:-.venv/bin/widedp}
PYTHON=${PYTHON:-.venv/bin/python}
OUT=${1:-runs/example-own-data}
STEPS=${STEPS:-200}
mkdir -p "$OUT"

# 1. A click log of your own: one row per impression. Here a small CSV is written for the
#    example (2,000 users, 30 days); point the schema at your files instead.
"$PYTHON" - "$OUT/clicks.csv" <<'PY'
import csv, random, sys
rng = random.Random(0)
with open(sys.argv[1], "w", newline="") as f:
    w = csv.writer(f)
    w.writerow(["user", "time", "item", "category", "price", "clicked"])
    for user in range(2000):
        taste = rng.randrange(20)
        for _ in range(rng.randint(1, 30)):
            item = rng.randrange(5000)
            category = item % 20
            p = 0.3 if category == taste else 0.05
            day = rng.randrange(30)  # November 2026
            w.writerow([f"u{user}", f"2026-11-{day + 1:02d}T12:00:00Z", f"i{item}", f"c{category}",
                        round(rng.uniform(1, 100), 2), int(rng.random() < p)])
PY

# 2. The schema says what each column is: the label, the privacy unit (the user), dense and
#    categorical features (hashed: a data-independent map, no privacy cost).
cat > "$OUT/schema.toml" <<'TOML'
format = "csv"
label = "clicked"
unit = "user"
timestamp = "time"

[dense.price]
transform = ["log1p", "standardize"]
mean = 3.5                # public statistics (else estimated with DP and charged)
std = 1.0

[categorical.item]
hash_size = 8192
[categorical.category]
hash_size = 64
TOML

# 3. Convert: the last days are the held-out test period.
"$WIDEDP" convert table "$OUT/clicks.csv" "$OUT/data" --schema "$OUT/schema.toml" --test-after 2026-11-26 > /dev/null

# 4. Train privately at user level (ε = 3 for one user with all of their clicks), in this process.
"$WIDEDP" train --config configs/logs.toml --run-dir "$OUT/run" --no-progress \
    --set data.path="$OUT/data" --set train.steps="$STEPS" --set cluster.backend=local \
    --set privacy.target_epsilon=3 > "$OUT/summary.json"

# 5. The releasable model (weights, a plain-PyTorch loader, PRIVACY.md) and the data set's budget.
"$WIDEDP" verify "$OUT/run" > /dev/null
"$WIDEDP" export "$OUT/run" "$OUT/model" > /dev/null
"$WIDEDP" budget "$OUT/data" > "$OUT/budget.json"
"$PYTHON" - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
s = json.load(open(f"{out}/summary.json"))
b = json.load(open(f"{out}/budget.json"))
print(f"ε = {s['epsilon']:.3f} (δ = {s['delta']:.2g}, unit: {s['privacy_unit']}), test AUC {s['test_metrics']['auc']:.3f}")
print(f"data set budget: {b['num_runs']} model(s), per-user total ε = {b['user_total_epsilon']:.3f}")
PY
