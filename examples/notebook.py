"""The Python API in a notebook: train a private model, evaluate, export, and the privacy
arithmetic of a DP-SGD run (ε for a σ, σ for a target ε).

    .venv/bin/python examples/notebook.py [RUN_DIR]      (STEPS=N for a shorter run; default 100)
"""

import os
import sys

import widedp

run_dir = sys.argv[1] if len(sys.argv) > 1 else "runs/example-notebook"
steps = int(os.environ.get("STEPS", "100"))

cfg = widedp.load_config("configs/quickstart.toml", [f"train.steps={steps}", "cluster.backend=local"])
run = widedp.train(cfg, run_dir)                      # refuses a directory that holds a run
print(f"ε = {run.epsilon:.3f}, test AUC = {run.test_metrics['auc']:.3f}")
print("evaluated again:", widedp.evaluate(run.run_dir)["test_metrics"])
print("exported:", widedp.export(run.run_dir, f"{run_dir}-release")["files"])

# The arithmetic, Opacus style: B, n and epochs (q = B/n, T = ⌈E·n/B⌉).
eps = widedp.epsilon(noise_multiplier=1.0, batch_size=512, dataset_size=40_000, epochs=3, delta=1e-6)
sigma = widedp.calibrate(target_epsilon=3.0, batch_size=512, dataset_size=40_000, epochs=3, delta=1e-6)
print(f"σ = 1.0 spends ε = {eps:.3f}; ε = 3 needs σ = {sigma:.3f}")
