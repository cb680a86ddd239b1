"""What stage 1 hands stage 2, on disk and online: the shard format (:mod:`.shard_format`: schema,
manifest, encoding; :mod:`.shard_rows`: a shard's rows) and the stream of the same rows for online
training (:mod:`.stream`: the hand-off and its producer loop; :mod:`.stream_link`: the gloo link;
:mod:`.stream_remote`: its two ends across nodes; :mod:`.frames`: the wire format). It imports
:mod:`dspark.config` and :mod:`dspark.core`."""
