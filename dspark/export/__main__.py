"""``python -m dspark.export``: the export's command line (:func:`dspark.export.main`)."""

import sys

from dspark.export import main

if __name__ == "__main__":
    sys.exit(main())
