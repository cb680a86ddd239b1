"""The core every wing and stage uses: leaves that import nothing of the project outside
``dspark.core``. User errors and the one-line exit (:mod:`.errors`), files (:mod:`.files`: atomic
writes, JSONL, hashes, ports, locks), bounded waits (:mod:`.waits`), the directory variables
(:mod:`.path_env`), files derived and reused across runs (:mod:`.derived`), fp8 storage
(:mod:`.fp8`), the layer-id convention (:mod:`.layer_ids`), a target directory's config.json
(:mod:`.target_dir`) and the AA-LCR prompt format (:mod:`.prompt_format`).

It imports neither DeepSpeed nor vLLM. The floors above it, each importing only those below
(``tests/test_layering.py``)::

    dspark.core  ->  dspark.serving  ->  dspark.families  ->  dspark.config  ->  dspark.formats | dspark.target
                 ->  data_tools (stage 1)  |  dspark (stage 2)  ->  eval (stage 3)  ->  train.py
"""
