"""Corrections per second of the OpenAI-compatible corrector at concurrency 1, 8 and 32.

The endpoint is a local chat-completions server that answers every request after a fixed delay
(200 ms by default: a fast hosted model). Each correction is one real HTTP round trip through the
`openai` SDK, the prompt building, the semaphore, and the answer's schema validation. The ideal
rate is concurrency / latency; the gap is client and server overhead on this machine.

    .venv/bin/python bench/corrector_bench.py [--latency-ms 200] [--seconds 4]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

# The fake endpoint listens on 127.0.0.1: allowed explicitly (off by default, docs/security.md).
os.environ.setdefault("GTR_CORRECTOR_ALLOW_PRIVATE_NETWORKS", "true")

from services.corrector.oracle import OracleCorrector  # noqa: E402
from services.corrector.remote import OpenAICorrector  # noqa: E402
from shared.schemas import CorrectionRequest  # noqa: E402

ANSWER = json.dumps({"answer1": "2 and 4", "answer2": "+", "evaluation": "YES", "correction": None})
COMPLETION = json.dumps(
    {
        "id": "bench",
        "object": "chat.completion",
        "created": 0,
        "model": "bench",
        "choices": [
            {
                "index": 0,
                "finish_reason": "stop",
                "message": {"role": "assistant", "content": ANSWER},
            }
        ],
        "usage": {"prompt_tokens": 300, "completion_tokens": 40, "total_tokens": 340},
    }
).encode()
STATE = {"task": "numberline", "current": 2, "target": 4, "max_position": 5, "steps": 0}
OUTPUT = {"current number": 2, "target number": 4, "thoughts": "2 < 4, I choose '+'", "action": "+"}


def serve(latency_s: float) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: Any) -> None:
            pass

        def setup(self) -> None:
            super().setup()
            # Headers and body go out as two writes: without this, Nagle + delayed ACKs add 40 ms.
            self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("content-length", 0)))
            time.sleep(latency_s)
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(COMPLETION)))
            self.end_headers()
            self.wfile.write(COMPLETION)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    server.request_queue_size = 256
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def measure(corrector: Any, concurrency: int, n: int) -> dict[str, float]:
    """Runs n corrections on `concurrency` threads; rate and per-correction latency."""
    req = CorrectionRequest.model_validate(
        {"task": "numberline", "prompt": "p", "output": json.dumps(OUTPUT), "state": STATE}
    )
    latencies: list[float] = []

    def one(_: int) -> None:
        latencies.append(corrector.correct(req).latency_ms)

    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(one, range(n)))
    elapsed = time.perf_counter() - start
    latencies.sort()
    return {
        "rate": n / elapsed,
        "p50": statistics.median(latencies),
        "p95": latencies[int(0.95 * (len(latencies) - 1))],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--latency-ms", type=float, default=200.0)
    parser.add_argument("--seconds", type=float, default=4.0, help="Rough wall time per level")
    parser.add_argument("--levels", default="1,8,32")
    args = parser.parse_args()
    server = serve(args.latency_ms / 1000)
    url = f"http://127.0.0.1:{server.server_address[1]}/v1"
    print("| corrector | concurrency | corrections/s | ideal | p50 ms | p95 ms |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for level in (int(x) for x in args.levels.split(",")):
        ideal = level / (args.latency_ms / 1000)
        n = max(level * 2, int(ideal * args.seconds))
        # A fixed level: what is measured is the client at that concurrency, not AIMD's ramp.
        params = {"concurrency": level, "max_retries": 0, "adaptive": False}
        corrector = OpenAICorrector(url, "bench", None, params)
        measure(corrector, level, level)  # warm-up: connections and imports
        r = measure(corrector, level, n)
        print(
            f"| openai ({args.latency_ms:.0f} ms endpoint) | {level} | {r['rate']:.1f} | "
            f"{ideal:.1f} | {r['p50']:.0f} | {r['p95']:.0f} |"
        )
    r = measure(OracleCorrector(), 1, 2000)
    print(f"| oracle (in process) | 1 | {r['rate']:.0f} | - | {r['p50']:.2f} | {r['p95']:.2f} |")
    server.shutdown()


if __name__ == "__main__":
    main()
