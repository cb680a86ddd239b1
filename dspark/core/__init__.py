"""The core every stage uses: typed configs, the layer-id convention, the shard format, target
resolution and frozen heads, file and vLLM-engine helpers.

It imports neither DeepSpeed nor vLLM at module level (vLLM only inside the functions that start
an engine), so the extraction stage runs on a vLLM-only inference node. Layering, enforced by
``tests/test_layering.py``::

    dspark.core  ->  data_tools (stage 1: extract)  |  dspark (stage 2: train, export)
                 ->  eval (stage 3)  ->  train.py (the main job, the only importer of every stage)
"""
