"""Security round 4 (issue 57), each attack tried as an outsider would, on real servers: another
team's corrector key variable, games outside their roots on the env and policy services, hostile
study bundles, the racing auth limit, the open /metrics, IPv6 forms embedding IPv4, invisible
CSV prefixes, strict types on the corrector `/test`, and nested routes naming another parent."""

from __future__ import annotations

import csv
import gzip
import importlib.util
import io
import ipaddress
import json
import re
import threading
import time
import tracemalloc
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from sqlalchemy import func, select

from services.api.app import create_app
from services.api.auth import create_token
from services.api.routes.search import _cell as _csv_cell
from services.corrector.egress import blocked
from services.corrector.tasks import correct as correct_task
from services.env.app import create_app as env_app
from services.study.bundle import BundleError, import_study, read_bundle
from services.study.schemas import StudyConfig
from shared.db import models
from shared.db.session import session_scope
from shared.paths import GAMES_NOT_FOUND
from shared.settings import Settings, get_settings
from tests.conftest import ROOT, RealRun, free_port, live_server, need
from tests.faults.client import call as _call
from tests.faults.client import count as _count
from tests.faults.client import refused_422 as _refused_422
from tests.services.corrector.helpers import make_step
from tests.services.study.tiny_study import gtr_cli

TOKEN = "round4-service-token-" + "s" * 32
TEAMS = [
    ("alpha", "write", "alpha"),
    ("alpha-admin", "admin", "alpha"),
    ("beta", "write", "beta"),
    ("beta-read", "read", "beta"),
]


@pytest.fixture(scope="module")
def api(pg_url: str) -> Iterator[dict[str, Any]]:
    tokens = {}
    with session_scope() as s:
        for name, scope, team in TEAMS:
            tokens[name] = create_token(s, f"round4-{name}", scope, team)[1]
    with live_server(create_app()) as url:
        yield {"url": url, "tokens": tokens}


class Capture:
    """A real local HTTP server standing in for a team's corrector endpoint: it records every
    request's path and Authorization header and answers 500 (nothing is meant to reach it)."""

    def __init__(self) -> None:
        self.hits: list[tuple[str, str | None]] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _any(self) -> None:
                self.rfile.read(int(self.headers.get("content-length") or 0))
                outer.hits.append((self.path, self.headers.get("authorization")))
                self.send_response(500)
                self.send_header("content-length", "0")
                self.end_headers()

            do_GET = do_POST = _any

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def capture() -> Iterator[Capture]:
    server = Capture()
    yield server
    server.close()


# ---- 1: another team's corrector key variable ---------------------------------------------------

ALPHA_KEY = "sk-alpha-private-" + "k" * 20


def test_an_inline_corrector_cannot_name_another_teams_key(
    api: dict, capture: Capture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GTR_CORRECTOR_KEY_TEAMA", ALPHA_KEY)
    alpha_url = "https://alpha-corrector.example/v1"
    made = _call(
        api,
        "POST",
        "/api/correctors",
        "alpha-admin",
        json={
            "name": "alpha-private",
            "kind": "http",
            "base_url": alpha_url,
            "api_key_env": "GTR_CORRECTOR_KEY_TEAMA",
        },
    )
    assert made.status_code == 201, made.text
    before = _count(models.Run)
    # beta sends alpha's key to its own server, to alpha's own server, or names a variable no
    # corrector registers: one refusal, before any row is written
    for var, url in [
        ("GTR_CORRECTOR_KEY_TEAMA", capture.url),
        ("GTR_CORRECTOR_KEY_TEAMA", alpha_url),
        ("GTR_CORRECTOR_KEY_UNREGISTERED", capture.url),
    ]:
        inline = {"kind": "http", "base_url": url, "api_key_env": var}
        r = _call(
            api, "POST", "/api/runs", "beta", json={"task": "numberline", "corrector": inline}
        )
        msg = _refused_422(r, ["corrector", "api_key_env"], "is not a key of team 'beta'")
        assert ALPHA_KEY not in msg
    assert _count(models.Run) == before
    # alpha may send its key inline to the endpoint it registered it for, and nowhere else
    mine = {"kind": "http", "base_url": alpha_url, "api_key_env": "GTR_CORRECTOR_KEY_TEAMA"}
    ok = _call(api, "POST", "/api/runs", "alpha", json={"task": "numberline", "corrector": mine})
    assert ok.status_code == 201, ok.text
    elsewhere = {**mine, "base_url": capture.url}
    r = _call(
        api, "POST", "/api/runs", "alpha", json={"task": "numberline", "corrector": elsewhere}
    )
    _refused_422(r, ["corrector", "api_key_env"])

    # A run stored before the launch check (or edited in the database): the real worker refuses
    # it too, before anything is sent.
    inline = {"kind": "http", "base_url": capture.url, "api_key_env": "GTR_CORRECTOR_KEY_TEAMA"}
    with session_scope() as s:
        run = models.Run(
            name="b", team="beta", task="numberline", algorithm="gtr", total_env_steps=1,
            num_updates=1, config={"task": "numberline", "corrector": {"name": "inline", **inline}},
        )  # fmt: skip
        s.add(run)
        s.flush()
        step_id = make_step(s, "numberline", {"position": 1, "target": 3}, "+", run=run).id
    assert correct_task(step_id, "inline")["status"] == "failed"
    with session_scope() as s:
        row = s.scalar(select(models.Correction).where(models.Correction.step_id == step_id))
        assert row is not None and row.error is not None
        assert "is not a key of team 'beta'" in row.error, row.error
    assert capture.hits == []  # zero requests reached beta's server: alpha's key never left


# ---- 3: a study bundle turned against the store ------------------------------------------------


def _spec(task: str = "numberline", **base: Any) -> dict[str, Any]:
    return StudyConfig.model_validate(
        {
            "name": "round4 import",
            "tasks": {task: {"base": {"task": task, **base}}},
            "arms": {"gtr": {"algorithm": "gtr"}},
            "seeds": [0, 1],
        }
    ).model_dump(mode="json")


def _entry(spec: dict[str, Any], seed: int = 0, status: str = "completed") -> dict[str, Any]:
    """A finished run as `gtr study export` writes it."""
    cfg = StudyConfig.model_validate(spec)
    cell = next(c for c in cfg.cells() if c.seed == seed)
    config = cfg.run_config(cell).model_dump(mode="json")
    return {
        "id": 7000 + seed, "name": config["name"], "task": cell.task, "algorithm": "gtr",
        "status": status, "config": config, "error": None, "env_steps": 8,
        "total_env_steps": 8, "num_updates": 1, "updates_done": 1, "alarm": None,
        "study_task": cell.task, "study_arm": cell.arm, "study_seed": seed,
        "study_variant": cell.variant, "study_attempt": 1,
        "created_at": "2026-12-01T10:00:00+00:00", "started_at": None, "finished_at": None,
        "info": {}, "training_deals": [],
        "updates": [{"idx": 0, "metrics": {"eval/success_rate": 0.5}, "alarm": False}],
        "eval_outcomes": [],
    }  # fmt: skip


def _bundle(spec: dict[str, Any], runs: list[dict[str, Any]], **study: Any) -> dict[str, Any]:
    return {
        "format": "gtr-study-bundle",
        "version": 1,
        "study": {"name": spec["name"], "team": "alpha", "spec": spec, **study},
        "runs": runs,
        "warm_starts": [],
    }


def _write(path: Path, data: dict[str, Any] | str) -> Path:
    text = data if isinstance(data, str) else json.dumps(data)
    path.write_bytes(gzip.compress(text.encode(), mtime=0))
    return path


def _studies(name: str = "round4 import") -> list[tuple[str, int]]:
    """(team, runs) of every study of this name in the store."""
    with session_scope() as s:
        rows = s.scalars(select(models.Study).where(models.Study.name == name)).all()
        count = func.count(models.Run.id)
        return sorted(
            (r.team, s.scalar(select(count).where(models.Run.study_id == r.id)) or 0) for r in rows
        )


def _import(path: Path, team: str | None) -> int:
    """What `gtr study import` does with the file, in this process (the CLI prints a
    BundleError as its one line: test_hostile_study_bundles_are_one_line_and_write_nothing)."""
    with session_scope() as s:
        return import_study(s, read_bundle(path), team).study_id


def test_a_study_bundle_that_inflates_past_the_cap_is_refused_while_inflating(
    tmp_path: Path,
) -> None:
    bomb = tmp_path / "bomb.json.gz"
    with gzip.open(bomb, "wb") as f:  # 200 KB that inflates to 200 MB
        f.write(b'{"format": "gtr-study-bundle", "pad": "')
        for _ in range(200):
            f.write(b" " * 2**20)
        f.write(b'"}')
    tracemalloc.start()
    try:
        with pytest.raises(BundleError, match="more than 16 MiB of JSON"):
            read_bundle(bomb, 16 * 2**20)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 40 * 2**20, peak  # refused after the cap, not after the whole file
    many = _write(tmp_path / "many.json.gz", "[" + "{}," * 4_500_000 + "{}]")  # 13 MB of {}
    with pytest.raises(BundleError, match="more than 4,000,000 JSON values"):
        read_bundle(many)


def _hostile_bundles(tmp_path: Path) -> dict[str, tuple[dict[str, Any] | str, str]]:
    spec = _spec()
    good = _entry(spec)
    warm = {"task": "numberline", "arm": "gtr", "seed": 1, "variant": ""}
    clash = {"files": {"a": "AA==", "a/b": "AA=="}, "weights_sha256": "0" * 64, "inputs": {}}
    deep = json.dumps(_bundle(spec, [good])).replace(
        '"info": {}', '"info": ' + "[" * 5000 + "]" * 5000
    )
    return {
        "deep nesting": (deep, "nests deeper than 32 levels"),
        "a little nesting": (
            json.dumps(_bundle(spec, [good])).replace(
                '"info": {}', '"info": ' + "[" * 40 + "]" * 40
            ),
            "nests deeper than 32 levels",
        ),
        "idx 1e400": (
            json.dumps(_bundle(spec, [good])).replace('"idx": 0', '"idx": 1e400'),
            "the number 1e400 is out of range",
        ),
        "score 1e308": (
            json.dumps(_bundle(spec, [good])).replace("0.5", "1e308"),
            "the number 1e308 is out of range",
        ),
        "score -1e308": (
            json.dumps(_bundle(spec, [good])).replace("0.5", "-1e308"),
            "out of range",
        ),
        "NaN": (json.dumps(_bundle(spec, [good])).replace("0.5", "NaN"), "NaN is not a number"),
        "bad created_at": (_bundle(spec, [], created_at="yesterday"), "is not an ISO 8601 time"),
        "bad run created_at": (
            _bundle(spec, [{**good, "created_at": "32/13/2026"}]),
            "is not an ISO 8601 time",
        ),
        "NUL in a name": (
            _bundle({**spec, "name": "round4\u0000import"}, []),
            "a text holds a NUL character",
        ),
        "over-long run name": (
            _bundle(spec, [{**good, "name": "n" * 5000}]),
            "name must be 1 to 200 characters, none a control one",
        ),
        "file and folder": (
            {**_bundle(spec, [good]), "warm_starts": [{"cell": warm, "entry": clash}]},
            "has a file it cannot hold",
        ),
    }


def test_hostile_study_bundles_are_one_line_and_write_nothing(pg_url: str, tmp_path: Path) -> None:
    before = _count(models.Study), _count(models.Run)
    for case, (data, says) in _hostile_bundles(tmp_path).items():
        path = _write(tmp_path / "hostile.json.gz", data)
        with pytest.raises(BundleError, match=re.escape(says)):
            _import(path, "beta")
        assert (_count(models.Study), _count(models.Run)) == before, case
    # The command prints the reason as one line, never a traceback.
    path = _write(tmp_path / "deep.json.gz", _hostile_bundles(tmp_path)["deep nesting"][0])
    got = gtr_cli("study", "import", str(path))
    assert got.returncode == 1 and "nests deeper than 32 levels" in got.stderr, got.stderr
    assert len(got.stderr.strip().splitlines()) == 1, got.stderr
    assert (_count(models.Study), _count(models.Run)) == before


def test_the_operator_names_the_team_never_the_bundle(pg_url: str, tmp_path: Path) -> None:
    spec = {**_spec(), "name": "round4 forged"}
    _import(_write(tmp_path / "a.json.gz", _bundle(spec, [_entry(spec, 0)])), "alpha")
    # A forged bundle naming alpha (and alpha's study) adds its scores to the operator's team.
    forged = _entry(spec, 1)
    forged["updates"][0]["metrics"]["eval/success_rate"] = 1.0
    _import(_write(tmp_path / "f.json.gz", _bundle(spec, [forged])), None)
    assert _studies("round4 forged") == [("alpha", 1), ("default", 1)]


def test_imported_specs_and_runs_pass_the_launch_checks(api: dict, tmp_path: Path) -> None:
    """As beta: alpha's private corrector and a model path outside the roots are refused at
    import; a config that passed at import is checked again when resumed through the API (here
    its games folder is gone since: absent and not allowed are one answer)."""
    made = _call(
        api, "POST", "/api/correctors", "alpha-admin", json={"name": "alpha-only", "kind": "oracle"}
    )
    assert made.status_code == 201, made.text
    before = _count(models.Study)
    for base, says in [
        ({"corrector": {"name": "alpha-only"}}, "corrector.name: no corrector named"),
        ({"model": {"path": "/etc"}}, "model.path"),
    ]:
        spec = _spec(**base)
        path = _write(tmp_path / "x.json.gz", _bundle(spec, [_entry(spec, 0, "failed")]))
        with pytest.raises(BundleError, match=re.escape(says)):
            _import(path, "beta")
    assert _count(models.Study) == before
    games = tmp_path / "games"
    games.mkdir()
    spec = {**_spec("alfworld", env={"options": {"games": str(games)}}), "name": "round4 games"}
    study_id = _import(
        _write(tmp_path / "g.json.gz", _bundle(spec, [_entry(spec, 0, "failed")])), "beta"
    )
    games.rmdir()
    with session_scope() as s:
        (run_id,) = s.scalars(select(models.Run.id).where(models.Run.study_id == study_id)).all()
    r = _call(api, "POST", f"/api/studies/{study_id}/resume", "beta")
    _refused_422(r, ["arms", "gtr", "env", "options", "games"])
    r = _call(api, "POST", f"/api/runs/{run_id}/resume", "beta")
    _refused_422(r, ["env", "options", "games"])
    with session_scope() as s:
        runs = s.scalars(select(models.Run).where(models.Run.study_id == study_id)).all()
        assert [r.status for r in runs] == ["failed"]  # nothing queued


# ---- 9: a nested route shows only a child of the parent in its URL ------------------------------


def test_a_nested_route_shows_only_a_child_of_its_parent(api: dict, real_run: RealRun) -> None:
    launched = httpx.post(
        f"{api['url']}/api/runs",
        json={"task": "numberline", "name": "round4-other"},
        headers={"Authorization": f"Bearer {real_run.write_token}"},
    )
    assert launched.status_code == 201, launched.text
    other = launched.json()["id"]  # a run of the same team, so only the nesting can refuse
    try:
        with session_scope() as s:
            step = s.scalars(
                select(models.Step).where(models.Step.run_id == real_run.run_id).limit(1)
            ).one()
            step_id, episode_id = step.id, step.episode_id
        cookies = {"gtr_token": real_run.read_token}
        url, run_id = api["url"], real_run.run_id
        own = httpx.get(f"{url}/runs/{run_id}/steps/{step_id}", cookies=cookies)
        assert own.status_code == 200, own.status_code
        opens = httpx.get(f"{url}/runs/{run_id}/episodes/{episode_id}", cookies=cookies)
        assert opens.status_code == 303 and opens.headers["location"].startswith(
            f"/runs/{run_id}/steps/"
        )
        for path in (f"/runs/{other}/steps/{step_id}", f"/runs/{other}/episodes/{episode_id}"):
            wrong = httpx.get(url + path, cookies=cookies)
            assert wrong.status_code == 404, (path, wrong.status_code, wrong.headers)
            assert "location" not in wrong.headers and f"/runs/{run_id}/" not in wrong.text, path
    finally:
        httpx.post(
            f"{api['url']}/api/runs/{other}/cancel",
            headers={"Authorization": f"Bearer {real_run.write_token}"},
        )


# ---- 2: path options on every route of the env service and the policy service's /env -----------

SAMPLE = ROOT.parent / "shared" / "alfworld_sample" / "real"


def _games_are_confined_on_reset(url: str, secret: Path) -> None:
    auth = {"Authorization": f"Bearer {TOKEN}"}
    body = {"task": "alfworld", "config": {"image_size": 64, "options": {"games": str(SAMPLE)}}}
    made = httpx.post(f"{url}/envs", json=body, headers=auth, timeout=120)
    assert made.status_code == 201, made.text[:300]
    sid = made.json()["id"]
    answers = set()
    for game in (str(secret), str(secret) + ".absent", "/etc/passwd", "../../../etc/passwd", [1]):
        r = httpx.post(
            f"{url}/envs/{sid}/reset", json={"options": {"game": game}}, headers=auth, timeout=60
        )
        assert r.status_code == 422, (game, r.status_code, r.text[:300])
        assert "secret" not in r.text and "passwd" not in r.text and "rrno" not in r.text, r.text
        answers.add(r.json()["detail"])
    assert answers == {f"options.game: {GAMES_NOT_FOUND}"}  # one text: existence not confirmed
    # Inside the roots but not a game: the option is named, not the path or the OS's reason.
    r = httpx.post(
        f"{url}/envs/{sid}/reset", json={"options": {"game": str(SAMPLE)}}, headers=auth, timeout=60
    )
    assert r.status_code == 422 and str(SAMPLE) not in r.text, r.text
    assert r.json()["detail"].startswith("options.game: "), r.text
    # A real game loads and renders here (the refusals above do not): seconds on a loaded host.
    ok = httpx.post(
        f"{url}/envs/{sid}/reset", json={"options": {"game": 0}}, headers=auth, timeout=60
    )
    assert ok.status_code == 200, ok.text[:300]


@pytest.fixture
def secret_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    secret = tmp_path_factory.mktemp("elsewhere") / "secret.pem"
    secret.write_text("-----BEGIN PRIVATE KEY-----\n")
    return secret


def test_the_env_service_confines_the_game_of_a_reset(secret_file: Path) -> None:
    need(importlib.util.find_spec("alfworld") is not None, "the alfworld extra is not installed")
    need(SAMPLE.is_dir(), f"the ALFWorld sample is missing at {SAMPLE}")
    settings = Settings(service_token=TOKEN, games_roots=[SAMPLE])  # type: ignore[arg-type]
    with live_server(env_app(settings=settings)) as url:
        _games_are_confined_on_reset(url, secret_file)


def test_the_policy_service_hosted_envs_confine_the_game_of_a_reset(
    tiny_model_dir: Path, secret_file: Path
) -> None:
    need(importlib.util.find_spec("alfworld") is not None, "the alfworld extra is not installed")
    need(SAMPLE.is_dir(), f"the ALFWorld sample is missing at {SAMPLE}")
    from services.policy.app import create_app as policy_app
    from services.policy.service import Policy

    settings = Settings(  # type: ignore[arg-type]
        service_token=TOKEN, policy_hosts_envs=True, games_roots=[SAMPLE]
    )
    app = policy_app(Policy.load(tiny_model_dir, lora_r=4), settings=settings)
    with live_server(app) as url:
        _games_are_confined_on_reset(f"{url}/env", secret_file)


# ---- 4: the failed-authentication limit under parallel requests, IPv6 per /64 ------------------


@contextmanager
def _served(app: Any, **options: Any) -> Iterator[str]:
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, port=port, log_level="warning", **options))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        while not server.started:
            assert thread.is_alive()
            time.sleep(0.02)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def test_parallel_wrong_tokens_get_no_more_401s_than_the_limit(api: dict) -> None:
    app = create_app(Settings(api_rate_limit_per_minute=0, auth_failures_per_minute=5))
    with _served(app) as url:
        barrier = threading.Barrier(64)

        def wrong(i: int) -> int:
            with httpx.Client(timeout=60) as client:
                barrier.wait()
                return client.get(
                    f"{url}/api/me", headers={"Authorization": f"Bearer wrong-{i}"}
                ).status_code

        with ThreadPoolExecutor(64) as pool:
            codes = list(pool.map(wrong, range(64)))
        assert sorted(set(codes)) == [401, 429] and codes.count(401) <= 5, codes
        # a right token from the same address is refused as well now
        right = {"Authorization": f"Bearer {api['tokens']['beta-read']}"}
        assert httpx.get(f"{url}/api/me", headers=right).status_code == 429
    # Parallel requests of a token that works are not held against the address.
    app = create_app(Settings(api_rate_limit_per_minute=0, auth_failures_per_minute=5))
    with _served(app) as url:
        assert httpx.get(f"{url}/api/me", headers=right).status_code == 200
        with ThreadPoolExecutor(32) as pool:
            codes = list(
                pool.map(lambda _: httpx.get(f"{url}/api/me", headers=right).status_code, range(32))
            )
        assert codes == [200] * 32


def test_ipv6_clients_are_counted_per_64() -> None:
    app = create_app(Settings(api_rate_limit_per_minute=0, auth_failures_per_minute=3))
    with _served(app, **Settings(trusted_proxies=["127.0.0.1"]).uvicorn_proxy_options()) as url:

        def wrong(client: str) -> int:
            headers = {"Authorization": "Bearer wrong", "X-Forwarded-For": client}
            return httpx.get(f"{url}/api/me", headers=headers).status_code

        # one /64: a host that walks its own addresses is one client
        assert [wrong(f"2001:db8:1:2::{i:x}") for i in range(1, 6)] == [401] * 3 + [429] * 2
        assert wrong("2001:db8:1:2:ffff:ffff:ffff:ffff") == 429
        # the next /64 is another client
        assert wrong("2001:db8:1:3::1") == 401


# ---- 6: IPv6 forms embedding an IPv4 address ----------------------------------------------------


@pytest.fixture
def no_private(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("GTR_CORRECTOR_ALLOW_PRIVATE_NETWORKS", "false")
    get_settings.cache_clear()
    yield
    monkeypatch.undo()
    get_settings.cache_clear()


EMBEDDED = {
    "6to4 of 127.0.0.1": "2002:7f00:1::1",
    "6to4 of the cloud metadata": "2002:a9fe:a9fe::",
    "6to4 of 10.0.0.1": "2002:a00:1::1",
    "NAT64 of 127.0.0.1": "64:ff9b::7f00:1",
    "NAT64 of 192.168.1.1": "64:ff9b::c0a8:101",
    "Teredo to 10.0.0.1": "2001:0:4136:e378:8000:63bf:f5ff:fffe",
}


def test_ipv6_forms_embedding_an_internal_ipv4_are_refused(api: dict, no_private: None) -> None:
    for i, (what, address) in enumerate(EMBEDDED.items()):
        body = {"name": f"embedded-{i}", "kind": "http", "base_url": f"http://[{address}]:9/v1"}
        made = _call(api, "POST", "/api/correctors", "alpha-admin", json=body)
        if made.status_code == 201:  # registered: its first call is refused before it is sent
            cid = made.json()["id"]
            made = _call(api, "POST", f"/api/correctors/{cid}/test", "alpha-admin")
            assert made.status_code == 200 and made.json()["ok"] is False, (what, made.text)
        else:  # or refused at registration already
            assert made.status_code == 422, (what, made.text)
        assert "loopback, private, link-local or reserved" in made.text, (what, made.text)
    # judged by the IPv4 address they lead to: a public one is not refused for its form
    assert not blocked(ipaddress.ip_address("2002:808:808::1"))
    assert not blocked(ipaddress.ip_address("64:ff9b::808:808"))


# ---- 8: what schemathesis --checks all found ----------------------------------------------------


def test_strict_types_and_the_allow_of_a_literal_path(api: dict) -> None:
    made = _call(
        api, "POST", "/api/correctors", "alpha-admin", json={"name": "probe-0", "kind": "oracle"}
    )
    assert made.status_code == 201, made.text
    for body in ({"probe": 0}, {"probe": "false"}, {"seed": True}, {"seed": "1"}):
        r = _call(
            api, "POST", f"/api/correctors/{made.json()['id']}/test", "alpha-admin", json=body
        )
        assert r.status_code == 422, (body, r.status_code, r.text[:300])
    ok = _call(
        api,
        "POST",
        f"/api/correctors/{made.json()['id']}/test",
        "alpha-admin",
        json={"probe": False},
    )
    assert ok.status_code == 200, ok.text
    with live_server(env_app(settings=Settings(service_token=TOKEN))) as url:  # type: ignore[arg-type]
        auth = {"Authorization": f"Bearer {TOKEN}"}
        r = httpx.request("OPTIONS", f"{url}/envs/step", headers=auth)
        assert r.status_code == 405 and r.headers["allow"] == "POST", r.headers
        r = httpx.request("OPTIONS", f"{url}/envs/abc", headers=auth)
        assert r.status_code == 405 and r.headers["allow"] == "DELETE, GET", r.headers


# ---- 7: CSV cells behind a blank or invisible character -----------------------------------------

HIDDEN_ARMS = ["\u00a0=1+2", "\u3000=SUM(A1)", "\u200b@cmd", "\u2060-1+1"]


def test_csv_quotes_cells_behind_any_blank_or_invisible_character(
    api: dict, tmp_path: Path
) -> None:
    spec = StudyConfig.model_validate(
        {
            "name": "round4 csv",
            "tasks": {"numberline": {"base": {"task": "numberline"}}},
            "arms": {arm: {"algorithm": "gtr"} for arm in HIDDEN_ARMS},
            "seeds": [0],
        }
    )
    runs = []
    for i, cell in enumerate(spec.cells()):
        entry = _entry(spec.model_dump(mode="json"), 0)
        config = spec.run_config(cell).model_dump(mode="json")
        runs.append({**entry, "id": 7100 + i, "config": config, "name": config["name"],
                     "study_arm": cell.arm})  # fmt: skip
    bundle = _bundle(spec.model_dump(mode="json"), runs)
    study_id = _import(_write(tmp_path / "csv.json.gz", bundle), "beta")
    r = httpx.get(
        f"{api['url']}/studies/{study_id}/report.csv", cookies={"gtr_token": api["tokens"]["beta"]}
    )
    assert r.status_code == 200, r.text[:300]
    arms = {row["arm"] for row in csv.DictReader(io.StringIO(r.text)) if row["arm"]}
    assert arms == {"'" + a for a in HIDDEN_ARMS}, arms
    # VT, FF and the other line breaks cannot be in a name; in model text they are quoted too.
    for lead in ("\x0b", "\x0c", "\u2028", "\u00a0", "\u3000", "\u200b", "\ufeff"):
        assert _csv_cell(lead + "=1+2") == "'" + lead + "=1+2", repr(lead)
    assert _csv_cell("plain text") == "plain text"


def test_the_largest_importable_scores_are_served_not_500(api: dict, tmp_path: Path) -> None:
    spec = {**_spec(), "name": "round4 extremes"}
    runs = []
    for seed, score in ((0, 1e15), (1, -1e15)):
        entry = _entry(spec, seed)
        entry["updates"][0]["metrics"]["eval/success_rate"] = score
        runs.append(entry)
    study_id = _import(_write(tmp_path / "e.json.gz", _bundle(spec, runs)), "beta")
    assert _call(api, "GET", f"/api/studies/{study_id}", "beta").status_code == 200
    cookies = {"gtr_token": api["tokens"]["beta"]}
    for page in ("", "/report.json", "/report.csv", "/curves.json"):
        r = httpx.get(f"{api['url']}/studies/{study_id}{page}", cookies=cookies)
        assert r.status_code == 200, (page, r.status_code, r.text[:300])
