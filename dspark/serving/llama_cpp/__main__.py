"""``python -m dspark.serving.llama_cpp build|where``: :func:`dspark.serving.llama_cpp.build.main`."""

import sys

from dspark.serving.llama_cpp.build import main

if __name__ == "__main__":
    sys.exit(main())
