"""Run every benchmark, then regenerate docs/RESULTS.md and docs/plots (what `make bench` does).

Each benchmark runs as its own command (a failure is reported and the others still run);
selection_scaling.py's printed table is saved to benchmarks/results[/quick]/selection_scaling.txt.
Full run: several hours on a 2-core machine, dominated by the privacy-utility grid and the
Opacus steps at V = 10^7; `--quick` takes about 20 minutes there.

    python benchmarks/run_all.py [--quick] [--only table_scaling,opacus_compare] [--skip privacy_utility]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ORDER = ("selection_scaling", "table_scaling", "communication", "privacy_overhead", "phase_breakdown", "opacus_compare",
         "dlrm_compare", "trainer_scaling", "cluster_model", "data_plane_probe", "paper_fig1", "paper_fig1_seed", "privacy_utility", "calibration_study", "privacy_audit", "audit_power", "audit_conformance",
         "canary_exposure", "canary_exposure_kjv", "canary_exposure_line", "canary_exposure_kjv_line", "sparse_mean_estimation",
         "wide_linear", "dp_ambssgd", "modelmix_accountant", "engine_modelmix_adaptive", "modelmix_image", "noise_generators",
         "cli_startup", "user_level", "user_level_examples", "convert_throughput")
#: Benchmarks that are another script run with extra arguments.
VARIANTS = {"dlrm_compare": ("dlrm_compare.py", ["--batch", "1024", "--examples", "50000", "--steps", "10",
                                              "--max-seconds", "40"]),  # §2b's goals are set at b = 1,024
            "canary_exposure_kjv": ("canary_exposure.py", ["--kjv"]),
            "canary_exposure_line": ("canary_exposure.py", ["--placement", "line"]),
            "canary_exposure_kjv_line": ("canary_exposure.py", ["--kjv", "--placement", "line"]),
            "user_level_examples": ("user_level.py", ["--units", "user-examples", "--no-nonprivate"])}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--only", default="", help="comma list of benchmarks to run")
    parser.add_argument("--skip", default="", help="comma list of benchmarks to skip")
    parser.add_argument("--no-results", action="store_true", help="do not regenerate docs/RESULTS.md at the end")
    args = parser.parse_args(argv)
    only = {n for n in args.only.split(",") if n}
    skip = {n for n in args.skip.split(",") if n}
    status = {}
    for name in ORDER:
        if (only and name not in only) or name in skip:
            continue
        t0 = time.time()
        print(f"\n=== {name} {'--quick' if args.quick else ''}", flush=True)
        if name == "selection_scaling":
            cmd = [sys.executable, str(HERE / "selection_scaling.py")] + (["--max-exp", "7", "--repeats", "3"] if args.quick else [])
            out_dir = HERE / "results" / ("quick" if args.quick else "")
            out_dir.mkdir(parents=True, exist_ok=True)
            proc = subprocess.run(cmd, capture_output=True, text=True)
            print(proc.stdout, end="")
            if proc.returncode == 0:
                (out_dir / "selection_scaling.txt").write_text(proc.stdout)
            else:
                print(proc.stderr[-2000:], file=sys.stderr)
            code = proc.returncode
        else:
            script, extra = VARIANTS.get(name, (f"{name}.py", []))
            code = subprocess.call([sys.executable, str(HERE / script), *extra] + (["--quick"] if args.quick else []))
        status[name] = (code, time.time() - t0)
    if not args.no_results:
        subprocess.call([sys.executable, str(HERE / "make_results.py")])
    print("\n=== summary")
    for name, (code, sec) in status.items():
        print(f"{name:>20}: {'ok' if code == 0 else f'FAILED (exit {code})'} in {sec / 60:.1f} min")
    return 0 if all(code == 0 for code, _ in status.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
