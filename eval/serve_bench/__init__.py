"""The serving A/B benchmark (issue #15): the stage and its command (:mod:`.stage`, ``python -m
eval.serve_bench``), vLLM's own client (:mod:`.client`), the report (:mod:`.report`) and the vLLM
OpenAI server it starts (:mod:`.server`)."""
