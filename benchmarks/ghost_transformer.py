"""Ghost norms on a transformer-sized dense part: widedp's step against the non-private floor, the
torch.func reference and Opacus, in one run.

The dense part is one pre-LN encoder block over a sequence, input [B, L, D] (the pooled
embeddings as L positions of width D), mean-pooled through a final LayerNorm to one logit with
a binary loss:

  linear-attention  attention written with nn.Linear q/k/v/out projections (widedp's ghost path
                    takes it: every layer has a registered ghost norm and ghost sum)
  multihead         the same block with nn.MultiheadAttention, which has no ghost norm: widedp's
                    "auto" falls back to the torch.func reference (the output says so)

Per batch size and model, median step time over `--steps` steps after `--warmup`, the
systems taken in turn within each round (so slow drift of the machine hits them alike):

  floor       plain PyTorch: forward, mean loss, one backward (parameters and ∂ℓ/∂pooled)
  ghost       widedp `dense_gradients(..., method="auto")` (the engine's call): pass 1, the
              per-example norms, c_j = min(1, S1/‖g_j‖), `clipped_sum(c)` (no noise)
  reference   the same with method="per_example" (torch.func vmap(grad), materialized)
  opacus-hooks / opacus-ghost
              Opacus GradSampleModule + DPOptimizer (per-sample gradients materialized by
              hooks), and GradSampleModuleFastGradientClipping + DPLossFastGradientClipping
              (ghost clipping), noise multiplier 0, the same clip norm, lr 0 (parameters'
              gradients only: the input needs none); an Opacus failure to wrap or run the
              model is caught and recorded, not fatal (nn.MultiheadAttention: Opacus wants it
              swapped for its DPMultiheadAttention by ModuleValidator.fix, another module,
              which is not done here)

Ratios (ghost/floor, reference/floor, reference/ghost, opacus/floor) are of medians from the same
run. The clip factors are the dense part's alone (the engine adds the embedding rows' squared
norms from the shards; they are not part of this module). The ghost norms are checked against
the reference's on the same batch: the largest relative difference of ‖g_j‖ is recorded and the
run exits non-zero, after writing its JSON, when it is above 1e-4. No timing asserts.

    python benchmarks/ghost_transformer.py [--quick] [--batches 64,256,1024] [--length 32] [--width 64]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Callable, Optional

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import announce_machine, format_table, write_results  # noqa: E402
from widedp.trainer.engine.dense_grads import GhostGradients, dense_gradients, supports_ghost  # noqa: E402
from widedp.trainer.models.base import DenseModel  # noqa: E402

NORM_TOLERANCE = 1e-4  # largest relative difference of the ghost norms from the reference's
CLIP = 1.0
MODELS = ("linear-attention", "multihead")
SYSTEMS = ("floor", "ghost", "reference", "opacus-hooks", "opacus-ghost")
LABELS = {
    "floor": "plain PyTorch (non-private floor)",
    "ghost": "widedp ghost norms (engine's auto)",
    "reference": "widedp torch.func reference",
    "opacus-hooks": "Opacus GradSampleModule (hooks)",
    "opacus-ghost": "Opacus ghost clipping",
}


# ---- the dense part ----------------------------------------------------------------------------------

class EncoderBlock(DenseModel):
    """Pre-LN encoder block over pooled [B, L, D]: attention (`attention` = "linear": q/k/v/out
    nn.Linear projections; "multihead": nn.MultiheadAttention), a 4×-wide GELU MLP, a final
    LayerNorm, mean over the positions, a Linear to one logit. `dense` is not used."""

    def __init__(self, width: int, heads: int, attention: str = "linear"):
        super().__init__()
        self.heads, self.attention = heads, attention
        self.ln1, self.ln2, self.ln_out = nn.LayerNorm(width), nn.LayerNorm(width), nn.LayerNorm(width)
        if attention == "linear":
            self.q, self.k, self.v = (nn.Linear(width, width) for _ in range(3))
            self.out = nn.Linear(width, width)
        elif attention == "multihead":
            self.mha = nn.MultiheadAttention(width, heads, batch_first=True)
        else:
            raise ValueError(f"attention must be 'linear' or 'multihead', got {attention!r}")
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)
        self.head = nn.Linear(width, 1)

    def forward(self, pooled: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        x = pooled
        h = self.ln1(x)
        if self.attention == "linear":
            def split(t):
                return t.unflatten(-1, (self.heads, -1)).transpose(1, 2)  # [B, heads, L, D/heads]

            q, k, v = split(self.q(h)), split(self.k(h)), split(self.v(h))
            att = torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, -1) @ v
            x = x + self.out(att.transpose(1, 2).flatten(2))
        else:
            x = x + self.mha(h, h, h, need_weights=False)[0]
        x = x + self.down(nn.functional.gelu(self.up(self.ln2(x))))
        return self.head(self.ln_out(x).mean(1)).squeeze(-1)

    def loss(self, outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return nn.functional.binary_cross_entropy_with_logits(outputs, labels, reduction="none")

    def metrics(self, outputs, labels):
        return {}


def make_model(name: str, width: int, heads: int, seed: int = 0) -> EncoderBlock:
    torch.manual_seed(seed)
    return EncoderBlock(width, heads, "linear" if name == "linear-attention" else "multihead")


def make_batch(batch: int, length: int, width: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    pooled = torch.randn(batch, length, width, generator=g)
    dense = torch.zeros(batch, 1)
    labels = torch.randint(0, 2, (batch,), generator=g).float()
    return pooled, dense, labels


# ---- the steps ---------------------------------------------------------------------------------------

def floor_step(model: EncoderBlock, pooled, dense, labels) -> Callable[[], None]:
    def step():
        model.zero_grad(set_to_none=True)
        leaf = pooled.detach().requires_grad_(True)
        model.loss(model(leaf, dense), labels).mean().backward()
    return step


def widedp_step(model: EncoderBlock, pooled, dense, labels, method: str) -> Callable[[], None]:
    """Pass 1 by `method`, the clip factors from the per-example norms, pass 2 (the clipped sum)."""
    def step():
        grads = dense_gradients(model, pooled, dense, labels, method)
        factors = (CLIP / grads.sq_norms.sqrt().clamp_min(1e-12)).clamp(max=1.0)
        grads.clipped_sum(factors)
    return step


def opacus_step(model: EncoderBlock, pooled, dense, labels, ghost: bool) -> Callable[[], None]:
    """Opacus DP-SGD without noise (noise multiplier 0), clip norm CLIP, lr 0 (the update is not
    what is measured): per-sample gradients by hooks, or ghost clipping's two backward passes."""
    import opacus
    from opacus.optimizers import DPOptimizer, DPOptimizerFastGradientClipping

    B = int(labels.shape[0])
    criterion = nn.BCEWithLogitsLoss(reduction="mean")
    if ghost:
        from opacus.grad_sample import GradSampleModuleFastGradientClipping
        from opacus.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping

        wrapped = GradSampleModuleFastGradientClipping(model, max_grad_norm=CLIP, use_ghost_clipping=True)
        optimizer = DPOptimizerFastGradientClipping(torch.optim.SGD(wrapped.parameters(), lr=0.0), noise_multiplier=0.0,
                                                    max_grad_norm=CLIP, expected_batch_size=B)
        loss_fn = DPLossFastGradientClipping(wrapped, optimizer, criterion, loss_reduction="mean")
    else:
        wrapped = opacus.GradSampleModule(model)
        optimizer = DPOptimizer(torch.optim.SGD(wrapped.parameters(), lr=0.0), noise_multiplier=0.0,
                                max_grad_norm=CLIP, expected_batch_size=B)
        loss_fn = criterion

    def step():
        optimizer.zero_grad(set_to_none=True)
        loss_fn(wrapped(pooled, dense), labels).backward()
        optimizer.step()
    return step


def build_step(system: str, model: EncoderBlock, pooled, dense, labels) -> Callable[[], None]:
    if system == "floor":
        return floor_step(model, pooled, dense, labels)
    if system == "ghost":
        return widedp_step(model, pooled, dense, labels, "auto")
    if system == "reference":
        return widedp_step(model, pooled, dense, labels, "per_example")
    return opacus_step(model, pooled, dense, labels, ghost=(system == "opacus-ghost"))


def norm_difference(model: EncoderBlock, pooled, dense, labels) -> float:
    """max_j |‖g_j‖_ghost − ‖g_j‖_ref| / ‖g_j‖_ref over the batch, the engine's call against the
    reference (0 where "auto" falls back to the reference: it is the reference)."""
    ghost = dense_gradients(model, pooled, dense, labels, "auto").sq_norms.sqrt()
    ref = dense_gradients(model, pooled, dense, labels, "per_example").sq_norms.sqrt()
    return float(((ghost - ref).abs() / ref.clamp_min(1e-30)).max())


def measure(model_name: str, batch: int, length: int, width: int, heads: int, warmup: int, steps: int) -> dict:
    """One (model, batch size): every system's step times (ms), taken in turn within each round."""
    pooled, dense, labels = make_batch(batch, length, width)
    row: dict = {"model": model_name, "batch": batch, "length": length, "width": width, "heads": heads}
    probe = make_model(model_name, width, heads)
    row["parameters"] = sum(p.numel() for p in probe.parameters())
    row["ghost_supported"] = supports_ghost(probe)
    row["auto_path"] = ("ghost" if isinstance(dense_gradients(probe, pooled, dense, labels, "auto"), GhostGradients)
                        else "reference")
    row["max_rel_norm_diff"] = norm_difference(probe, pooled, dense, labels)
    steps_by: dict = {}
    errors: dict = {}
    for system in SYSTEMS:
        try:
            steps_by[system] = build_step(system, make_model(model_name, width, heads), pooled, dense, labels)
            steps_by[system]()  # a first call: catches what fails only when run
        except Exception as exc:  # an Opacus failure is a result, not a crash
            if not system.startswith("opacus"):
                raise
            errors[system] = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
            steps_by.pop(system, None)
    times: dict = {s: [] for s in steps_by}
    for i in range(warmup + steps):
        for system, step in steps_by.items():
            t0 = time.perf_counter()
            step()
            if i >= warmup:
                times[system].append(1e3 * (time.perf_counter() - t0))
    row["step_ms"] = {s: statistics.median(t) for s, t in times.items()}
    row["step_ms_min"] = {s: min(t) for s, t in times.items()}
    row["errors"] = errors
    ms = row["step_ms"]
    floor = ms["floor"]
    row["ratios"] = {"ghost_over_floor": ms["ghost"] / floor, "reference_over_floor": ms["reference"] / floor,
                     "reference_over_ghost": ms["reference"] / ms["ghost"],
                     **{f"{s.replace('-', '_')}_over_floor": ms[s] / floor for s in ("opacus-hooks", "opacus-ghost")
                        if s in ms}}
    return row


# ---- RESULTS ---------------------------------------------------------------------------------------

def _x(v: Optional[float]) -> str:
    return "–" if v is None else f"{v:.2f}×"


def _ms(v: Optional[float]) -> str:
    return "–" if v is None else (f"{v:.1f}" if v < 100 else f"{v:,.0f}")


def speed_goal(doc: dict) -> Optional[tuple]:
    """The one goal row: widedp's ghost path faster than the torch.func reference on the
    linear-attention block at the largest batch size measured (reference / ghost > 1)."""
    rows = [r for r in doc["rows"] if r["model"] == "linear-attention"]
    if not rows:
        return None
    r = max(rows, key=lambda r: r["batch"])
    ratio = r["ratios"]["reference_over_ghost"]
    why = (f"{_ms(r['step_ms']['ghost'])} ms against {_ms(r['step_ms']['reference'])} ms a step, dense part only "
           f"(L = {r['length']}, D = {r['width']}); ghost norms within {doc['setting']['norm_tolerance']:g} of the "
           f"reference: largest relative difference {max(x['max_rel_norm_diff'] for x in doc['rows']):.2g}")
    return (f"Ghost-norm step faster than the torch.func reference on a transformer block at B = {r['batch']:,}",
            f"reference / ghost = {ratio:.2f}×", "**met**" if ratio > 1.0 else "**missed**", why)


def results_section(doc: dict) -> tuple[list[str], list]:
    """docs/RESULTS.md's section (benchmarks/make_results.py): medians and ratios per model and
    batch size, what fell back, and one goal row."""
    s = doc["setting"]
    lines = [f"One pre-LN encoder block as the dense part: input [B, L, D] = [B, {s['length']}, {s['width']}], "
             f"{s['heads']} heads, a 4×-wide GELU MLP, three LayerNorms, mean over positions to one logit. Median of "
             f"{s['steps']} steps after {s['warmup']} warm-up, the systems in turn within each round, one process, "
             f"clip norm {s['clip']:g}, no noise. *Floor*: forward and one backward of the mean loss. *Ghost*: "
             "`dense_gradients(method=\"auto\")` (what the engine calls), the clip factors from its per-example "
             "norms, then `clipped_sum`. *Reference*: the same with `method=\"per_example\"` (torch.func). Opacus: "
             f"GradSampleModule + DPOptimizer (hooks) and ghost clipping (GradSampleModuleFastGradientClipping), "
             "noise multiplier 0, parameter gradients only. The dense part's clip factors alone (the engine adds "
             "the embedding rows' norms from the shards).", "",
             "| model | B | path widedp takes | floor ms | ghost ms | reference ms | Opacus hooks ms | Opacus ghost ms | "
             "ghost / floor | reference / floor | reference / ghost | Opacus hooks / floor | Opacus ghost / floor | "
             "max rel. norm diff |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in doc["rows"]:
        ms, x = r["step_ms"], r["ratios"]
        lines.append(f"| {r['model']} | {r['batch']:,} | {r['auto_path']} | {_ms(ms['floor'])} | {_ms(ms['ghost'])} | "
                     f"{_ms(ms['reference'])} | {_ms(ms.get('opacus-hooks'))} | {_ms(ms.get('opacus-ghost'))} | "
                     f"{_x(x['ghost_over_floor'])} | {_x(x['reference_over_floor'])} | {_x(x['reference_over_ghost'])} | "
                     f"{_x(x.get('opacus_hooks_over_floor'))} | {_x(x.get('opacus_ghost_over_floor'))} | "
                     f"{r['max_rel_norm_diff']:.2g} |")
    fallback = sorted({r["model"] for r in doc["rows"] if r["auto_path"] != "ghost"})
    lines += ["", ("What falls back: " + ", ".join(fallback) + " — nn.MultiheadAttention has no ghost norm (it applies "
                   "its projections inside F.multi_head_attention_forward, where no hook sees them), so "
                   "`dense_gradients(method=\"auto\")` uses the torch.func reference and its *ghost* column is the "
                   "reference's path timed again (reference / ghost ≈ 1 by construction); attention written with "
                   "nn.Linear projections takes the ghost path.") if fallback else
              "Nothing fell back: every model took the ghost path."]
    errors = [(r["model"], r["batch"], system, e) for r in doc["rows"] for system, e in r.get("errors", {}).items()]
    if errors:
        lines += ["", "Opacus could not run these (the same model as widedp's; Opacus would need nn.MultiheadAttention "
                  "swapped for its own DPMultiheadAttention by `ModuleValidator.fix`, a different module, not done "
                  "here):"] + [f"- {m}, B = {b:,}, {system}: `{e}`" for m, b, system, e in errors]
    goal = speed_goal(doc)
    return lines, [goal] if goal else []


# ---- main --------------------------------------------------------------------------------------------

def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="B = 8, 16, L = 8, D = 32, 1 warm-up, 3 steps")
    parser.add_argument("--batches", default=None, help="comma-separated batch sizes (default 64,256,1024)")
    parser.add_argument("--length", type=int, default=None, help="sequence positions L (default 32)")
    parser.add_argument("--width", type=int, default=None, help="model width D (default 64)")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    batches = [int(b) for b in (args.batches or ("8,16" if args.quick else "64,256,1024")).split(",")]
    length = args.length or (8 if args.quick else 32)
    width = args.width or (32 if args.quick else 64)
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 3)
    steps = args.steps or (3 if args.quick else 15)
    models = args.models.split(",")
    unknown = set(models) - set(MODELS)
    if unknown:
        parser.error(f"--models: unknown {sorted(unknown)} (choose from {', '.join(MODELS)})")
    # Opacus's hooks on a model whose input needs no gradient: said once per call, not a problem here
    warnings.filterwarnings("ignore", message="Full backward hook is firing")
    started = time.time()
    machine = announce_machine()
    rows = []
    for model_name in models:
        for batch in batches:
            r = measure(model_name, batch, length, width, args.heads, warmup, steps)
            rows.append(r)
            print(f"{model_name:>16} B={batch:<5} path={r['auto_path']:<9} "
                  + "  ".join(f"{s} {r['step_ms'][s]:8.1f} ms" for s in SYSTEMS if s in r["step_ms"])
                  + f"  norm diff {r['max_rel_norm_diff']:.2g}", flush=True)
            if r["auto_path"] != "ghost":
                print(f"{'':>16} {model_name}: no ghost norm for nn.MultiheadAttention -> widedp falls back to the "
                      "torch.func reference (its 'ghost' time is the reference's)", flush=True)
            for system, e in r["errors"].items():
                print(f"{'':>16} {system} could not run: {e}", flush=True)
    print()
    print(format_table(["model", "B", "path", "ghost/floor", "ref/floor", "ref/ghost", "opacus-hooks/floor",
                        "opacus-ghost/floor", "norm diff"],
                       [[r["model"], r["batch"], r["auto_path"], _x(r["ratios"]["ghost_over_floor"]),
                         _x(r["ratios"]["reference_over_floor"]), _x(r["ratios"]["reference_over_ghost"]),
                         _x(r["ratios"].get("opacus_hooks_over_floor")), _x(r["ratios"].get("opacus_ghost_over_floor")),
                         f"{r['max_rel_norm_diff']:.2g}"] for r in rows]))
    worst = max(r["max_rel_norm_diff"] for r in rows)
    setting = {"batches": batches, "length": length, "width": width, "heads": args.heads, "warmup": warmup,
               "steps": steps, "clip": CLIP, "norm_tolerance": NORM_TOLERANCE, "models": models}
    write_results("ghost_transformer", {"setting": setting, "rows": rows, "max_rel_norm_diff": worst,
                                        "norms_agree": worst <= NORM_TOLERANCE},
                  quick=args.quick, machine=machine, out=args.out, started=started)
    print(f"largest relative difference of the ghost norms from the reference: {worst:.3g} "
          f"(tolerance {NORM_TOLERANCE:g})")
    if worst > NORM_TOLERANCE:
        print(f"FAILED: the ghost norms differ from the torch.func reference by {worst:.3g} > {NORM_TOLERANCE:g}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
