"""``python -m eval.serve_bench``: the serving benchmark's command (:func:`eval.serve_bench.stage.main`)."""

from eval.serve_bench.stage import main

if __name__ == "__main__":
    main()
