"""A run: `widedp train` from a config to a run directory (`train`: build, start or resume,
records, summary), the training loop every driver uses (`loop`), what a run writes and prints
(`outputs`, docs/THREAT_MODEL.md), its privacy records (`journal`, `records`, `ledger_key`,
`verify`), the data set's budget across runs (`budget`), the one-run audit (`audit`) and seed
A's wide linear model (`wide_linear`).

May import: widedp.trainer.config, widedp.trainer.data, widedp.trainer.engine,
widedp.trainer.cluster, widedp.trainer.private (the engine's builder), widedp.trainer.models, widedp.trainer.names, widedp.trainer.strict_json,
the pure libraries.
Not: release/ or cli/ (the CLI is a client of runs; the export reads runs).
"""
