"""Serving, for every engine: the registry of served methods (:mod:`.methods`) and export layouts
(:mod:`.layouts`), a local server's life (:mod:`.server_lifecycle`), starting a vLLM engine
(:mod:`.vllm_engine`, vLLM imported inside) and llama.cpp (:mod:`.llama_cpp`: its build and its
``llama-server``). It imports only :mod:`dspark.core`; the drafter families and the config read it."""
