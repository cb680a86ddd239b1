"""Compose and check a run's config the way ``python train.py OVERRIDES`` does, running nothing:
what ``slurm/pipeline.sh`` does before it submits a job, so that a misspelt experiment or key, or
a value out of range, is refused in seconds on the login node instead of after the queue wait.

    python -m dspark.config.compose +experiment=kimi_k3_gb300 train.lr=3e-4 --stages extract,train

Exit status 0 and one ``config ok`` line per stage; 2 and one ``error:`` line (Hydra's message
or the range check's) otherwise.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path
from typing import Optional

from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException

from dspark.config import DEFAULT_STAGES, RunConfig, load_config
from dspark.core.errors import USER_ERROR_EXIT, UserError

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"


def compose_run(overrides: list[str]) -> RunConfig:
    """The typed, validated config of ``python train.py *overrides``. Hydra's own settings
    (``hydra.*``) do not change the run's config and are left out."""
    from hydra import compose, initialize_config_dir

    run_overrides = [o for o in overrides if not o.lstrip("+~").startswith("hydra.")]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return load_config(compose(config_name="config", overrides=run_overrides))


def describe(err: Exception) -> str:
    """One line from Hydra's message: what could not be composed, why (its cause: the key and
    the schema) and, for a missing option, the ones there are."""
    lines = str(err).strip().splitlines()
    text = lines[0].rstrip(".")
    if err.__cause__ is not None and str(err.__cause__).strip():
        text += ": " + str(err.__cause__).strip().splitlines()[0]
    if "Available options" in str(err):
        start = next(i for i, line in enumerate(lines) if line.startswith("Available options"))
        options = [o.strip() for o in itertools.takewhile(lambda line: line.startswith("\t"), lines[start + 1 :])]
        text += ", expected one of: " + ", ".join(options)
    return text


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dspark.config.compose", description=__doc__.split("\n\n")[0])
    p.add_argument("overrides", nargs="*", help="Hydra overrides, as for train.py (+experiment=NAME key=value ...)")
    p.add_argument(
        "--stages", default=",".join(DEFAULT_STAGES), help="comma-separated stages, each composed with stages=[S]"
    )
    args = p.parse_args(argv)
    for stage in args.stages.split(","):
        try:
            cfg = compose_run([*args.overrides, f"stages=[{stage}]"])
        except (HydraException, OmegaConfBaseException, UserError) as err:
            print(f"error: {describe(err)}", file=sys.stderr)
            return USER_ERROR_EXIT
        print(f"config ok: {stage} ({cfg.target.name}, {cfg.train.run_name})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
