"""Stage 2's data wing: what the trainer reads. Shards (:mod:`.shards`), padded batches and the
resumable data position (:mod:`.batching`), online training's window (:mod:`.online`), colocated
training's target (:mod:`.colocated`), the target's cached top-k (:mod:`.target_topk`) and the draft
vocabulary (:mod:`.draft_vocab`). It imports nothing of dspark/ but the lower wings
(:mod:`dspark.core`, :mod:`dspark.config`, :mod:`dspark.formats`) and itself."""
