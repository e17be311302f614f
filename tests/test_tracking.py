"""All four loggers write the same metric names and values; resume continues the same runs; credentials
never reach the run folder. wandb's offline file is read back with a reader written here (the LevelDB
log format it uses) and wandb's own protobuf records, so the test does not trust the writer's code."""

from __future__ import annotations

import glob
import json
import struct

import pytest

from megareason.trainer.tracking import Tracker

STEPS = {1: {"reward/mean": 0.25, "actor/grad_norm": 1.5, "time/step": 3.0, "val/by_source/gsm8k/accuracy": 0.1},
         2: {"reward/mean": 0.5, "actor/grad_norm": 1.25, "time/step": 2.5, "env/turns": 2.0},
         3: {"reward/mean": 0.75, "actor/grad_norm": 1.0, "time/step": 2.0, "critic/explained_variance": float("nan")}}
ALL = ["console", "tensorboard", "wandb", "mlflow"]


@pytest.fixture
def offline(monkeypatch, tmp_path_factory):
    for var in ("WANDB_API_KEY", "WANDB_MODE", "MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "WANDB_PROJECT",
                "WANDB_ENTITY", "WANDB_BASE_URL", "WANDB_IDENTITY_TOKEN_FILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    # no `wandb login` of the person running the tests counts: an empty netrc and wandb settings folder
    home = tmp_path_factory.mktemp("home")
    monkeypatch.setenv("NETRC", str(home / ".netrc"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(home / "wandb"))
    return home


def _wandb_records(path: str) -> list:
    """Records of a .wandb file: a 7-byte header (':W&B', magic 0xBEE1, version), then LevelDB log blocks of
    32 KiB holding chunks (crc32 4, length 2, type 1: full/first/middle/last) of protobuf ``Record``s."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = open(path, "rb").read()
    assert data[:4] == b":W&B" and struct.unpack("<H", data[4:6])[0] == 0xBEE1
    out, pos, pending = [], 7, b""
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:  # block trailer padding
            pos += left
            continue
        length, kind = struct.unpack("<HB", data[pos + 4:pos + 7])
        if length == 0 and kind == 0:
            pos += left
            continue
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(pending)
            out.append(rec)
    return out


def _wandb_history(root) -> tuple[dict[int, dict[str, float]], set[str]]:
    history, ids = {}, set()
    for path in sorted(glob.glob(str(root / "wandb" / "*run-*" / "run-*.wandb"))):
        for rec in _wandb_records(path):
            kind = rec.WhichOneof("record_type")
            if kind == "run":
                ids.add(rec.run.run_id)
            elif kind == "history":
                row = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in rec.history.item}
                history[int(row.pop("_step"))] = {k: v for k, v in row.items() if not k.startswith("_")}
    return history, ids


def _tensorboard(root) -> dict[int, dict[str, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(root / "tensorboard"))
    acc.Reload()
    out: dict[int, dict[str, float]] = {}
    for tag in acc.Tags()["scalars"]:
        for e in acc.Scalars(tag):
            out.setdefault(e.step, {})[tag] = e.value
    return out


def _mlflow(root) -> dict[int, dict[str, float]]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"file:{root / 'mlruns'}")
    run = client.get_run((root / "mlflow_run_id").read_text().strip())
    out: dict[int, dict[str, float]] = {}
    for key in run.data.metrics:
        for m in client.get_metric_history(run.info.run_id, key):
            out.setdefault(m.step, {})[key] = m.value
    return out


def _log(root, steps, start=0):
    tracker = Tracker(root, ALL, start, config={"optim": {"lr": 1e-5}, "trainer": {"steps": 3}})
    for step in steps:
        tracker.log(step, STEPS[step])
    tracker.close()


def test_all_four_loggers_write_the_same_metrics(tmp_path, offline):
    _log(tmp_path, [1, 2, 3])
    expected = {s: {k: v for k, v in m.items() if v == v} for s, m in STEPS.items()}  # NaN is not logged
    jsonl = {r["step"]: {k: v for k, v in r.items() if k != "step"}
             for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines())}
    wandb_history, _ = _wandb_history(tmp_path)
    for name, got in [("metrics.jsonl", jsonl), ("tensorboard", _tensorboard(tmp_path)), ("mlflow", _mlflow(tmp_path)),
                      ("wandb", wandb_history)]:
        assert set(got) == {1, 2, 3}, name
        for step in expected:
            assert got[step] == pytest.approx(expected[step]), (name, step)
    assert list(glob.glob(str(tmp_path / "wandb" / "offline-run-*")))  # offline without credentials
    from mlflow.tracking import MlflowClient

    run = MlflowClient(tracking_uri=f"file:{tmp_path / 'mlruns'}").get_run((tmp_path / "mlflow_run_id").read_text()
                                                                             .strip())
    assert run.info.run_name == tmp_path.name and run.data.params["optim.lr"] == "1e-05"


def test_resume_continues_the_same_wandb_and_mlflow_runs(tmp_path, offline):
    _log(tmp_path, [1, 2, 3])
    first = {f: (tmp_path / f).read_text() for f in ("wandb_run_id", "mlflow_run_id")}
    _log(tmp_path, [3], start=2)  # the interrupted run had logged step 3 after the step-2 checkpoint
    assert {f: (tmp_path / f).read_text() for f in first} == first
    _, ids = _wandb_history(tmp_path)
    assert ids == {first["wandb_run_id"].strip()}
    steps = [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]
    assert set(_mlflow(tmp_path)) == {1, 2, 3}


def test_credentials_never_reach_the_run_folder(tmp_path, offline, monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", "secret-xyz-0123456789012345678901234567890123")
    monkeypatch.setenv("WANDB_MODE", "offline")  # a key is configured, but this test must not go online
    _log(tmp_path, [1, 2])
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert len(files) > 5
    assert not [p for p in files if b"secret-xyz" in p.read_bytes()]


def test_mlflow_file_store_name_clash_is_named(tmp_path, offline):
    tracker = Tracker(tmp_path, ["mlflow"], 0)
    tracker.log(1, {"accuracy": 0.5})
    with pytest.raises(ValueError, match="metric 'accuracy/gsm8k' needs 'accuracy' to be a folder"):
        tracker.log(2, {"accuracy/gsm8k": 0.5})


def test_unknown_logger_and_missing_package(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="unknown \\['comet'\\]"):
        Tracker(tmp_path, ["console", "comet"], 0)
    import sys

    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed
    with pytest.raises(ImportError, match="pip install 'megareason\\[trackers\\]'"):
        Tracker(tmp_path, ["wandb"], 0)


class _FakeWandb:
    """wandb's ``init``/``Settings`` as the tracker calls them, recording the arguments (no network)."""

    def __init__(self):
        self.calls: list[dict] = []

    def Settings(self, **kwargs):  # noqa: N802 (wandb's name)
        return kwargs

    def init(self, **kwargs):
        import types

        self.calls.append(kwargs)
        return types.SimpleNamespace(log=lambda *a, **k: None, finish=lambda: None)


@pytest.fixture
def fake_wandb(monkeypatch):
    import sys

    fake = _FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    return fake


def test_wandb_login_credentials_go_online_with_the_configured_run(tmp_path, offline, fake_wandb, caplog):
    from megareason.config.schema import WandbConfig

    # what `wandb login` writes: a netrc entry for the wandb server
    (offline / ".netrc").write_text("machine api.wandb.ai\n  login user\n  password " + "k" * 40 + "\n")
    (offline / ".netrc").chmod(0o600)
    settings = WandbConfig(project="gsm8k-grpo", entity="my-team", name="lr1e-6", group="sweep", tags=["8b"])
    with caplog.at_level("INFO", logger="megareason.trainer.tracking"):
        Tracker(tmp_path, ["wandb"], 0, config={"a": 1}, wandb=settings).close()
    (call,) = fake_wandb.calls
    assert {k: call[k] for k in ("project", "entity", "name", "group", "tags", "mode", "config")} == {
        "project": "gsm8k-grpo", "entity": "my-team", "name": "lr1e-6", "group": "sweep", "tags": ["8b"],
        "mode": "online", "config": {"a": 1}}
    assert call["id"] == (tmp_path / "wandb_run_id").read_text().strip()
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("wandb:")]
    assert "logs online" in line and ".netrc (wandb login)" in line and "k" * 40 not in line


def test_wandb_without_credentials_logs_offline_and_says_so(tmp_path, offline, fake_wandb, caplog):
    with caplog.at_level("INFO", logger="megareason.trainer.tracking"):
        Tracker(tmp_path, ["wandb"], 0).close()
    (call,) = fake_wandb.calls
    assert (call["mode"], call["project"], call["name"], call["entity"]) == ("offline", "megareason", tmp_path.name,
                                                                             None)
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("wandb:")]
    assert "logs offline" in line and "wandb sync" in line and "wandb login" in line


@pytest.mark.parametrize("env, settings, mode", [
    ({"WANDB_API_KEY": "k" * 40}, {}, "online"),
    ({"WANDB_API_KEY": "k" * 40, "WANDB_MODE": "offline"}, {}, "offline"),  # wandb's own switch, in auto
    ({"WANDB_API_KEY": "k" * 40}, {"mode": "offline"}, "offline"),  # asked for in the config
    ({}, {"mode": "online"}, "online"),
    ({"WANDB_PROJECT": "from-env"}, {}, "offline"),
])
def test_wandb_mode_and_project_follow_the_config_then_wandbs_variables(tmp_path, offline, fake_wandb, monkeypatch,
                                                                        env, settings, mode):
    from megareason.config.schema import WandbConfig

    for k, v in env.items():
        monkeypatch.setenv(k, v)
    Tracker(tmp_path, ["wandb"], 0, wandb=WandbConfig(**settings)).close()
    (call,) = fake_wandb.calls
    assert call["mode"] == mode
    assert call["project"] == env.get("WANDB_PROJECT", "megareason")


def test_wandb_settings_file_api_key_counts_as_credentials(offline, monkeypatch):
    from megareason.trainer.tracking import wandb_mode

    (offline / "wandb").mkdir()
    (offline / "wandb" / "settings").write_text("[default]\napi_key = " + "k" * 40 + "\n")
    assert wandb_mode("auto")[0] == "online"
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(offline / "elsewhere"))
    assert wandb_mode("auto")[0] == "offline"


def test_wandb_keys_load_from_the_config():
    from megareason.config import load_config

    cfg = load_config("grpo_quickstart", ["trainer.wandb.project=p", "trainer.wandb.name=n",
                                          "trainer.wandb.tags=[a,b]", "trainer.wandb.mode=offline"])
    w = cfg.trainer.wandb
    assert (w.project, w.name, w.tags, w.mode, w.entity) == ("p", "n", ["a", "b"], "offline", "")
