"""DSpark drafter pipeline entry point.

    python train.py +experiment=smollm2_cpu_demo            # run the stages on the embedded target
    python train.py +experiment=kimi_k3_gb300 --cfg job     # print the resolved config
    python train.py --help                                  # groups and overrides

The work lives in dspark.pipeline.run(cfg), which tests call directly.
"""

import hydra
from omegaconf import DictConfig

import dspark.config  # noqa: F401  (registers the config schemas before composition)


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> None:
    from dspark.pipeline import run

    run(cfg)


if __name__ == "__main__":
    main()
