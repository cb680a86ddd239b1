"""llama.cpp, the CPU serving engine: its build (:mod:`.build`, ``python -m dspark.core.llama_cpp
build``) and its ``llama-server`` (:mod:`.server`: command line, counters, one completion)."""
