"""`widedp audit`: the one-run audit's and the exposure audit's arguments (the audits: trainer/run/audit.py)."""

from __future__ import annotations

from pathlib import Path
from widedp.auditing.canaries import CANARY_KINDS, PHRASE_PLACEMENTS
from widedp.trainer.run.audit import (AUDIT_KINDS, BROKEN_VARIANTS, CHANNELS, OBSERVATIONS, exposure_audit, many_run_audit,
                                      one_run_audit, write_audit)


def add_commands(sub) -> dict:
    a = sub.add_parser("audit", help="train once with canaries and bound ε from below (one-run audit)")
    a.add_argument("--config", required=True, help="TOML config of the run to audit")
    a.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    a.add_argument("--kind", choices=AUDIT_KINDS, default="one-run")
    a.add_argument("--canaries", type=int, default=1000,
                   help="one-run: m canary examples (each a member with probability ½); exposure: canary phrases")
    a.add_argument("--insertions", type=int, default=9, help="exposure: times each canary phrase is inserted (n_c)")
    a.add_argument("--placement", choices=PHRASE_PLACEMENTS, default="text",
                   help="exposure: insert each phrase into the running text (seed §6.5) or as a line of its own")
    a.add_argument("--references", type=int, default=10_000, help="exposure: random phrases the canaries are ranked among")
    a.add_argument("--feature", help="one-run: the feature whose table gets the canaries' own rows (default: the first); "
                                     "a comma list, or 'all' (CTR: a row of its own in every table)")
    a.add_argument("--member-guesses", type=float, default=0.1, metavar="FRACTION",
                   help="share of the canaries guessed 'member' (the highest scores)")
    a.add_argument("--non-member-guesses", type=float, default=0.1, metavar="FRACTION",
                   help="share of the canaries guessed 'non-member' (the lowest scores); 0: abstain")
    a.add_argument("--confidence", type=float, default=0.95)
    a.add_argument("--seed", type=int, help="the audit's coins (default: secret, from OS entropy)")
    a.add_argument("--canary-kind", choices=CANARY_KINDS, default="example",
                   help="one-run: 'example' canaries are data points with rows of their own; 'gradient' canaries "
                        "are the same points with their pooled-output gradient set to 1000·S1 in a secret direction "
                        "(the strongest adversary clipping allows)")
    a.add_argument("--canary-examples", type=int,
                   help="one-run: examples per canary, all carrying it (default: privacy.max_examples_per_user at "
                        "privacy.unit = user, a canary user; else 1)")
    a.add_argument("--observe", choices=OBSERVATIONS, default="final",
                   help="one-run: what the auditor sees — 'final': the released model only; 'steps': the model "
                        "after every step (intermediate releases; needs --canary-kind gradient), scored by the "
                        "claimed mechanism's likelihood ratio. Every one-run audit reports the one-run (ε, δ) and Gaussian-DP "
                        "bounds, the threshold audit over the canaries as independent trials (threshold_audit) and those "
                        "rates against the run's own ε at several δ (claim_curve)")
    a.add_argument("--channel", choices=CHANNELS, default="as-run",
                   help="one-run, sparse mode: 'as-run' audits the run as it executes (a canary row moves only when "
                        "the step's selection picks it: selection and value together); 'value' adds the canaries' "
                        "rows to every step's selection (data-independent post-processing: the claim still covers "
                        "the run) so the audit sees the noisy values alone")
    a.add_argument("--broken", choices=sorted(BROKEN_VARIANTS),
                   help="train deliberately broken (noise off / σ divided by 10 or by 2 / each example clipped "
                        "to 2·S1 / every touched row selected / "
                        "untouched rows never selected / each example clipped at user level / a user's examples "
                        "accounted as one example / σ calibrated and ε computed at δ = 1/n while the auto δ is "
                        "stated / batches cut from a shuffle accounted as Poisson / thresholding with σ_sel/2, the "
                        "ledger told otherwise; the last two are caught by the record's `conformance` tests, not "
                        "by an ε bound) to see the audit catch it on this "
                        "configuration; NOT a private run")
    a.add_argument("--test-step-sizes", action="store_true",
                   help="one-run: the conformance test also tests each step's sample size against Binomial(n, q) "
                        "(catches fixed-size batches); the record then holds an un-noised statistic of the secret "
                        "sampling coins and says so (on anyway with --broken or privacy.reproducible = true)")
    a.add_argument("--runs", type=int, default=1,
                   help="one-run kind with R >= 4: the many-run audit instead (Nasr et al. 2023) — R independent "
                        "training runs, one canary of each the trial, nothing assumed about canaries sharing a run; "
                        "each run is charged to the data set's budget")
    a.add_argument("--out", help="directory for audit.json and audit.png (default RUN_DIR/audit)")
    return {"audit": cmd_audit}


def cmd_audit(args) -> dict:
    from widedp.trainer.config import load_config
    from widedp.trainer.run.budget import record_audit

    cfg = load_config(args.config, args.set)
    if args.kind == "exposure" and args.runs != 1:
        raise ValueError("--runs applies to --kind one-run (the many-run audit), not to --kind exposure")
    if args.kind == "exposure":
        record = exposure_audit(cfg, canaries=args.canaries, insertions=args.insertions, references=args.references,
                                seed=args.seed, placement=args.placement)
        out = Path(args.out) if args.out else Path(cfg.run_dir or "runs/latest") / "audit"
        record_audit(cfg, record, out)  # the audit's run trained on the data set: its spending counts
        return {"out": str(out), **write_audit(record, out)}
    if args.runs != 1:
        out = Path(args.out) if args.out else Path(cfg.run_dir or "runs/latest") / "audit"
        record = many_run_audit(cfg, args.runs, confidence=args.confidence, seed=args.seed, broken=args.broken,
                                canary_kind=args.canary_kind, observe=args.observe,
                                on_run=lambda run: record_audit(cfg, run, out))  # every run spent on the data set
        return {"out": str(out), **write_audit(record, out)}
    record = one_run_audit(cfg, canaries=args.canaries, feature=args.feature, member_fraction=args.member_guesses,
                           non_member_fraction=args.non_member_guesses, confidence=args.confidence, seed=args.seed,
                           broken=args.broken, canary_kind=args.canary_kind, canary_examples=args.canary_examples,
                           observe=args.observe, channel=args.channel, test_step_sizes=args.test_step_sizes)
    out = Path(args.out) if args.out else Path(cfg.run_dir or "runs/latest") / "audit"
    record_audit(cfg, record, out)  # the audit's run trained on the data set: its spending counts
    return {"out": str(out), **write_audit(record, out)}
