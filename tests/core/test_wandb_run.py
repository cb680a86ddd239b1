"""W&B as its users expect: the environment and wandb's own login decide the mode, runs are
named by target and variant, and one drafter's stages share a group. Offline only: nothing here
leaves the machine."""

import socket

import pytest

from dspark.config.wandb_run import init_wandb, run_group, wandb_mode

FAKE_KEY = "a" * 40  # the shape wandb checks (40+ word characters), never sent anywhere


@pytest.fixture
def wandb_home(monkeypatch, tmp_path):
    """A user with no W&B environment, no netrc and no settings; wandb's process state reset."""
    import wandb

    for name in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_DISABLED", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    home = tmp_path / "home"
    (home / "config").mkdir(parents=True)
    monkeypatch.setenv("NETRC", str(home / ".netrc"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(home / "config"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.chdir(tmp_path)  # no workspace wandb/settings
    real_connect = socket.socket.connect

    def guarded(self, address):
        if self.family in (socket.AF_INET, socket.AF_INET6) and address[0] not in ("127.0.0.1", "localhost", "::1"):
            raise AssertionError(f"network access to {address}")
        return real_connect(self, address)

    monkeypatch.setattr(socket.socket, "connect", guarded)
    wandb.teardown()
    yield home
    wandb.teardown()


def test_auto_is_offline_without_credentials(wandb_home):
    assert wandb_mode("auto") == "offline"


def test_auto_is_online_after_wandb_login(wandb_home):
    (wandb_home / ".netrc").write_text(f"machine api.wandb.ai\n  login user\n  password {FAKE_KEY}\n")
    (wandb_home / ".netrc").chmod(0o600)
    assert wandb_mode("auto") == "online"


def test_auto_is_online_with_an_api_key_in_wandb_settings(wandb_home):
    (wandb_home / "config" / "settings").write_text(f"[default]\napi_key = {FAKE_KEY}\n")
    assert wandb_mode("auto") == "online"


def test_auto_is_online_with_wandb_api_key(wandb_home, monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", FAKE_KEY)
    assert wandb_mode("auto") == "online"


def test_auto_keeps_wandb_offline_from_its_settings(wandb_home, monkeypatch):
    """``wandb offline`` writes mode = offline into wandb's settings: a logged-in user stays offline."""
    monkeypatch.setenv("WANDB_API_KEY", FAKE_KEY)
    (wandb_home / "config" / "settings").write_text("[default]\nmode = offline\n")
    assert wandb_mode("auto") == "offline"


@pytest.mark.parametrize(
    ("env", "config", "expected"),
    [
        ({"WANDB_MODE": "disabled"}, "online", "disabled"),
        ({"WANDB_MODE": "offline", "WANDB_API_KEY": FAKE_KEY}, "auto", "offline"),
        ({"WANDB_MODE": "dryrun"}, "online", "offline"),
        ({"WANDB_DISABLED": "true"}, "offline", "disabled"),
        ({}, "disabled", "disabled"),
        ({"WANDB_API_KEY": FAKE_KEY}, "offline", "offline"),
    ],
)
def test_the_environment_wins_over_the_config(wandb_home, monkeypatch, env, config, expected):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert wandb_mode(config) == expected


def test_wandb_mode_disabled_writes_no_run(wandb_home, monkeypatch, compose_config, tmp_path):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    cfg = compose_config("logging.mode=online")
    assert init_wandb(cfg, tmp_path / "out", job_type="train") is None
    assert not (tmp_path / "out").exists()


def test_runs_are_named_by_target_and_variant_and_grouped_by_drafter(wandb_home, monkeypatch, compose_config, tmp_path):
    import wandb

    monkeypatch.setenv("WANDB_MODE", "offline")
    cfg = compose_config("drafter.markov_rank=0", "tags=[demo]")
    seen = {}
    for job_type in ("extract", "train", "eval"):
        run = init_wandb(cfg, tmp_path / "out", job_type=job_type)
        seen[job_type] = (run.name, run.group, run.job_type, list(run.tags), run.offline)
        run.finish()
    assert seen["train"] == (
        "smollm2-135m-markov0-train",
        "smollm2-135m-markov0",
        "train",
        ["demo", "smollm2-135m", "markov0"],
        True,
    )
    assert {g for _, g, *_ in seen.values()} == {"smollm2-135m-markov0"}
    assert [seen[j][2] for j in ("extract", "train", "eval")] == ["extract", "train", "eval"]
    assert compose_config().train.run_name == "markov256"  # the variant tells the main run apart
    assert run_group(compose_config("logging.group=ablation")) == "ablation"
    wandb.teardown()  # flushes the offline files
    runs = sorted((tmp_path / "out" / "wandb").glob("offline-run-*"))
    assert len(runs) == 3
    for run_dir in runs:  # what a later `wandb sync` uploads carries the group
        assert b"smollm2-135m-markov0" in next(run_dir.glob("run-*.wandb")).read_bytes()
