"""The on-disk data set (`meta`: dataset.json and its validation; `store`: the Parquet cache;
`writer`: writing a data set once; `dataset`: splits, batches as TorchRec KeyedJaggedTensors;
`jagged`: id lists).

May import: widedp.trainer.data.errors and widedp.trainer.data._util (errors, hashing helpers),
pyarrow, numpy, torch, torchrec. Not: the converters, the generators, or anything of the trainer outside data/.
"""
