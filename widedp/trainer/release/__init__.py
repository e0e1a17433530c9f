"""What leaves a run: `widedp export` (the releasable model, its plain-PyTorch loader in
`export_template/`, the privacy report) and `widedp report` (plots and tables of run
directories).

May import: widedp.trainer.run (a run's checkpoint and its verified privacy records),
widedp.trainer.config, widedp.trainer.data, widedp.trainer.engine, widedp.trainer.models,
widedp.trainer.strict_json, the pure libraries. Not: cli/. `export_template/load_model.py` imports
nothing of widedp (it ships beside the weights).
"""
