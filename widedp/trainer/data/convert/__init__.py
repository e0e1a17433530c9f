"""Converters to a data set: Criteo TSV (`criteo`), any Parquet/CSV table by a schema (`table`,
with DP standardization statistics: `dp_statistics`), plain text with a private vocabulary
(`text`).

May import: widedp.trainer.data.format, widedp.trainer.data.errors, widedp.trainer.data._util,
widedp.accounting (the events of what a conversion releases), widedp.selection (the private
vocabulary's partition selection, keyed randomness). Not: the generators, or the trainer outside data/.
"""
