"""The run skeleton every driver uses (:mod:`~truncsens.engine.run.skeleton`: lock, shards, resume,
merge, write, progress), the shard files and their checks (:mod:`~truncsens.engine.run.shards`), the
output lock (:mod:`~truncsens.engine.run.lock`), multi-process launches
(:mod:`~truncsens.engine.run.distributed`), the results Dataset of one ``measure`` shard
(:mod:`~truncsens.engine.run.shard_results`) and the progress of long steps besides the shards
(:mod:`~truncsens.engine.run.progress`: loading, tokenizing, fitting).

May import: results, models, corpora, targets and the math modules; the drivers hand it their work.
"""
