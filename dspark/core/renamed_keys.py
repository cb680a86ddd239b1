"""Config keys that moved, the old key -> the new one: an old key on a command line or in a config
is refused with one line naming the new one (:func:`dspark.core.errors.renamed_key_message`), read
by both the composition check and :func:`dspark.config.load_config`."""

RENAMED_KEYS = {
    # issue #59: export became a stage of its own, with its own group
    "eval.export_dir": "export.out_dir",
    "eval.export_dtype": "export.dtype",
    "eval.checkpoint": "export.checkpoint",
}
