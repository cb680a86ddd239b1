"""``python -m eval.serve``: one vLLM engine serving one method over the eval's prompts, and its
counters (the eval's vLLM rows start it as their child; the code and its usage: :mod:`eval.vllm_rows`)."""

import sys

from eval.vllm_rows import main

if __name__ == "__main__":
    sys.exit(main())
