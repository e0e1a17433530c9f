"""Synthetic data sets with planted ground truth: CTR and text (`synth`), realistic CTR logs
(`realistic`), raw click logs with users (`synth_logs`), and the registry `widedp train`
generates from (`generators`).

May import: widedp.trainer.data.format, widedp.trainer.data.convert (the text converter a text
set goes through), widedp.trainer.data.errors, widedp.trainer.data._util. Not: the trainer outside data/.
"""
