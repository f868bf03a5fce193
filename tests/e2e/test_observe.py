"""Where labs look: one short real run feeds TensorBoard, W&B (offline) and MLflow at once; each
is read back with its own library's reader. The same run is exported (REST jsonl, `gtr export`
hf/parquet), trained on (`gtr sft --dataset`) and scraped through the API's Prometheus
`/metrics`."""

from __future__ import annotations

import base64
import io
import json
import struct
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import select

from services.api.app import create_app
from shared.db.models import Correction, Run, Step, Update
from shared.db.session import session_scope
from tests.conftest import RealRun, live_server
from tests.e2e.helpers import tiny_config

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tracked_run(real_run: RealRun) -> int:
    """The session's real run (tests/conftest.py): 2 updates of 4 envs x 4 steps in this process
    (in-process trainer and corrector), every tracker on, evaluated after each update."""
    return real_run.run_id


def _updates(run_id: int) -> list[dict]:
    with session_scope() as s:
        rows = s.scalars(select(Update).where(Update.run_id == run_id).order_by(Update.idx))
        return [dict(u.metrics) for u in rows]


def _folder(run_id: int) -> Path:
    from services.controller.tracking import run_folder

    return run_folder(run_id)


def test_trackers_receive_every_update_the_evaluation_config_and_summary(tracked_run) -> None:
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    updates = _updates(tracked_run)
    assert len(updates) == 2 and all("eval/success_rate" in m for m in updates)
    assert [m["tracking/failures"] for m in updates] == [0.0, 0.0]
    with session_scope() as s:
        run = s.get(Run, tracked_run)
        info, num_envs = dict(run.info), run.config["train"]["num_envs"]
    assert {k: v["ok"] for k, v in info["tracking"].items()} == {
        "tensorboard": True,
        "wandb": True,
        "mlflow": True,
    }
    keys = ("success_rate", "eval/success_rate", "losses/policy", "format_valid_rate")

    # TensorBoard: its own event reader over the run folder.
    acc = EventAccumulator(str(_folder(tracked_run) / "tensorboard"), size_guidance={"tensors": 0})
    acc.Reload()
    for k in keys:
        assert [(e.step, round(e.value, 5)) for e in acc.Scalars(k)] == [
            (i, round(m[k], 5)) for i, m in enumerate(updates)
        ]
    texts = {t: acc.Tensors(t) for t in acc.Tags()["tensors"]}
    assert any("config" in t for t in texts) and any("summary" in t for t in texts)

    # MLflow: the client on the local store (data_dir/mlruns).
    client = MlflowClient(info["tracking"]["mlflow"]["where"])
    exp = client.get_experiment_by_name("observe-test")
    (mrun,) = client.search_runs([exp.experiment_id], f"tags.`gtr.run_id` = '{tracked_run}'")
    assert mrun.info.status == "FINISHED"
    for k in keys:
        hist = client.get_metric_history(mrun.info.run_id, k)
        assert sorted((h.step, round(h.value, 5)) for h in hist) == [
            (i, round(m[k], 5)) for i, m in enumerate(updates)
        ]
    assert mrun.data.params["train.num_envs"] == str(num_envs) == "4"
    assert mrun.data.params["task"] == "numberline"
    summary = json.loads(
        Path(client.download_artifacts(mrun.info.run_id, "summary.json")).read_text()
    )
    assert summary["status"] == "completed" and summary["updates_done"] == 2

    # W&B offline: the run's .wandb file, decoded with W&B's own protobuf records.
    (wfile,) = (_folder(tracked_run) / "wandb").glob("offline-run-*/run-*.wandb")
    records = list(_wandb_records(wfile))
    history = [r.history for r in records if r.WhichOneof("record_type") == "history"]
    logged = {
        h.step.num: {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in h.item}
        for h in history
    }
    assert sorted(logged) == [0, 1]
    for i, m in enumerate(updates):
        for k in keys:
            assert logged[i][k] == pytest.approx(m[k])
    # The config travels in the run record (and in config records for later changes).
    config = {
        i.key: json.loads(i.value_json)
        for r in records
        for i in (
            r.run.config.update
            if r.WhichOneof("record_type") == "run"
            else r.config.update
            if r.WhichOneof("record_type") == "config"
            else []
        )
    }
    assert config["task"] == "numberline" and config["train"]["num_envs"] == num_envs
    summaries = {
        i.key: json.loads(i.value_json)
        for r in records
        if r.WhichOneof("record_type") == "summary"
        for i in r.summary.update
    }
    assert summaries.get("status") == "completed"


def _wandb_records(path: Path) -> Iterator:
    """W&B's transaction log: a 7-byte header, then LevelDB-style 32 KiB blocks of chunks
    (crc32c 4, length 2, type 1: full/first/middle/last) holding ``Record`` protobufs."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, block, buf = path.read_bytes(), 7, 32768, b""
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind == 0:  # zero padding to the block's end
            pos += block - pos % block if pos % block else 0
            continue
        buf = chunk if kind in (1, 2) else buf + chunk
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(buf)
            yield rec


def _corrected_steps(run_id: int) -> list[Step]:
    with session_scope() as s:
        q = (
            select(Step)
            .join(Correction, Correction.step_id == Step.id)
            .where(Step.run_id == run_id, Correction.verdict == "incorrect")
            .order_by(Step.id)
        )
        rows = s.scalars(q).unique().all()
        s.expunge_all()
        return list(rows)


@pytest.fixture(scope="module")
def api(real_run: RealRun) -> Iterator[tuple[str, dict]]:
    with live_server(create_app()) as url:
        yield url, {"Authorization": f"Bearer {real_run.read_token}"}  # the run's team


def test_rest_export_streams_corrected_steps_and_metrics_count_it(
    tracked_run, api, tmp_path
) -> None:
    url, headers = api
    want = _corrected_steps(tracked_run)
    assert want, "the run produced no corrected step to export"
    r = httpx.get(
        f"{url}/api/runs/{tracked_run}/export", params={"corrected": "true"}, headers=headers
    )
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/x-ndjson")
    rows = [json.loads(line) for line in r.text.splitlines()]
    assert [x["step_id"] for x in rows] == [s.id for s in want]
    first, step = rows[0], want[0]
    assert (first["prompt"], first["output"], first["reward"]) == (
        step.prompt,
        step.output,
        step.reward,
    )
    assert first["verdict"] == "incorrect" and first["corrected_thought"]
    assert json.loads(first["target"])["action"] == step.action_text  # the agent's own action
    frame = Image.open(io.BytesIO(base64.b64decode(first["image_png_b64"])))
    assert frame.format == "PNG" and frame.size == (64, 64)
    # Parquet: HF features in the schema, so `datasets` decodes the frames as images.
    from datasets import Image as ImageFeature
    from datasets import load_dataset

    pq = httpx.get(
        f"{url}/api/runs/{tracked_run}/export",
        params={"corrected": "true", "format": "parquet"},
        headers=headers,
    )
    assert pq.status_code == 200
    path = tmp_path / "steps.parquet"
    path.write_bytes(pq.content)
    pds = load_dataset("parquet", data_files=str(path), split="train", cache_dir=str(tmp_path))
    assert isinstance(pds.features["image"], ImageFeature)
    assert pds["step_id"] == [s.id for s in want] and pds[0]["image"].size == (64, 64)
    # Bad input: a clear 4xx; a run of another team or none: 404.
    bad = httpx.get(f"{url}/api/runs/{tracked_run}/export?format=csv", headers=headers)
    assert bad.status_code == 422
    assert httpx.get(f"{url}/api/runs/999999/export", headers=headers).status_code == 404

    run = httpx.get(f"{url}/api/runs/{tracked_run}", headers=headers).json()
    assert set(run["info"]["tracking"]) == {"tensorboard", "wandb", "mlflow"}
    assert run["latest_metrics"]["tracking/failures"] == 0.0
    metrics = _scrape(f"{url}/metrics")
    assert metrics[("gtr_runs", (("status", "completed"),))] >= 1
    oracle = [
        v
        for (n, lab), v in metrics.items()
        if n == "gtr_corrections"
        and dict(lab).get("corrector") == "oracle"
        and dict(lab).get("verdict") == "incorrect"
    ]
    assert sum(oracle) >= len(want)
    route = ("route", "/api/runs/{run_id}/export")
    served = [
        v
        for (n, lab), v in metrics.items()
        if n == "gtr_http_requests_total" and route in lab and ("status", "200") in lab
    ]
    assert served == [2.0]


def _scrape(url: str) -> dict[tuple[str, tuple], float]:
    text = httpx.get(url, timeout=10).text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_gtr_export_writes_an_hf_dataset_with_image_features(tracked_run, tmp_path) -> None:
    from click.testing import CliRunner
    from datasets import Image as ImageFeature
    from datasets import load_from_disk

    from services.cli import main

    want = _corrected_steps(tracked_run)
    out, cli = tmp_path / "hf", CliRunner()
    res = cli.invoke(main, ["export", str(tracked_run), str(out), "--format", "hf", "--corrected"])
    assert res.exit_code == 0, res.output
    assert f"{len(want)} steps" in res.output
    ds = load_from_disk(str(out))
    assert isinstance(ds.features["image"], ImageFeature)
    assert ds["step_id"] == [s.id for s in want]
    assert ds[0]["image"].size == (64, 64) and ds[0]["prompt"] == want[0].prompt
    # An existing path is refused, nothing overwritten; an unknown run is a message, not a trace.
    again = cli.invoke(main, ["export", str(tracked_run), str(out)])
    assert again.exit_code != 0 and "already exists" in again.output
    missing = cli.invoke(main, ["export", "999999", str(tmp_path / "x.jsonl")])
    assert missing.exit_code == 1 and "does not exist" in missing.output
    assert not (tmp_path / "x.jsonl").exists() or (tmp_path / "x.jsonl").stat().st_size == 0


def test_gtr_sft_trains_on_an_exported_dataset(tracked_run, warm_checkpoint, tmp_path) -> None:
    """Close the loop: one run's corrections, exported, are the SFT data of the next warm start."""
    from click.testing import CliRunner
    from safetensors.torch import load_file

    from services.cli import main
    from services.policy.checkpoint import FULL, read_checkpoint_meta

    want = _corrected_steps(tracked_run)
    assert want, "the tracked run has no corrected step to train on"
    harvest, out, cli = tmp_path / "harvest", tmp_path / "warm", CliRunner()
    res = cli.invoke(
        main, ["export", str(tracked_run), str(harvest), "--format", "hf", "--corrected"]
    )
    assert res.exit_code == 0, res.output
    cfg = tmp_path / "next.toml"
    cfg.write_text(
        tiny_config(warm_checkpoint).replace(
            f'checkpoint = "{warm_checkpoint}"',
            f'checkpoint = "{warm_checkpoint}"\nsft_steps = 3\nbatch_size = 4',
        )
    )
    args = ["sft", str(cfg), "--out", str(out), "--dataset", str(harvest), "--eval-episodes", "0"]
    res = cli.invoke(main, args)
    assert res.exit_code == 0, res.output
    summary = json.loads((out / "warm_start.json").read_text())
    from services.trainer.sft_data import _rows

    rows = {r["step_id"]: r for r in _rows(harvest)}
    unused = {
        st.id: (
            st.action_text,
            st.image_sha,
            {k: rows.get(st.id, {}).get(k) for k in ("target", "corrected_thought")},
        )
        for st in want
        if not (rows.get(st.id, {}).get("target") and rows[st.id].get("image"))
    }
    assert summary["dataset/samples"] == len(want), unused
    assert summary["sft/steps"] == 3
    assert read_checkpoint_meta(out)["finetune"] == "full"  # a checkpoint the next run can name
    before, after = load_file(str(warm_checkpoint / FULL)), load_file(str(out / FULL))
    assert before.keys() == after.keys()
    assert any(not before[k].equal(after[k]) for k in before), "SFT on the dataset changed nothing"
    # Bad data sets are a message and a non-zero exit, never a trace.
    none = tmp_path / "none.jsonl"
    res = cli.invoke(main, ["export", str(tracked_run), str(none), "--update-from", "99"])
    assert res.exit_code == 0 and none.read_text() == "", res.output
    for bad, says in ((none, "no corrected or agreed step"), (cfg, "not a dataset written by")):
        res = cli.invoke(main, [*args[:3], str(tmp_path / "again"), "--dataset", str(bad)])
        assert res.exit_code == 1 and says in res.output, res.output
        assert res.exception is None or isinstance(res.exception, SystemExit)


def test_summary_fits_80_columns_with_full_names_and_names_the_trackers(
    tracked_run, capsys
) -> None:
    from services.controller.console import print_summary

    capsys.readouterr()
    print_summary(tracked_run, 12.0)
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= 80
    assert "eval/success_rate" in out and "probe_top_thought_share" in out and "…" not in out
    for name in ("tensorboard", "wandb", "mlflow"):
        assert f"{name}: " in out
