"""``python -m dspark.core.llama_cpp build|where``: :func:`dspark.core.llama_cpp.build.main`."""

import sys

from dspark.core.llama_cpp.build import main

if __name__ == "__main__":
    sys.exit(main())
