"""The cluster: Ray's runtime for widedp (connecting, tokens, placement), the shard actors' group
(`ray_shards`: ordinary calls or a compiled graph, actor recovery), the trainer actors
(`ray_trainers`) and the compiled data plane's channel wait (`compiled_wait`).

May import: widedp.trainer.engine (the step's parts it runs on actors: shards, trainer roles,
the shard-group protocol), widedp.trainer.config (the choices it validates), the pure
libraries, Ray. Not: run/, release/, cli/ (the run wires a cluster to an engine, not the other
way round). The engine never imports this package: a run hands it a shard group and a trainer
group built here (tests/test_package_boundaries.py).
"""
