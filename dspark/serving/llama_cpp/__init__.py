"""llama.cpp, the CPU serving engine: its build (:mod:`.build`, ``python -m dspark.serving.llama_cpp
build``) and its ``llama-server`` (:mod:`.server`: command line, counters, one completion)."""
