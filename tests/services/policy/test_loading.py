"""Process set-up for the policy: the allocator keeps freed memory (a fresh process per test)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]

# A batch-16 KV cache of the 10M model growing by one token per step, as decoding does: the
# minor page faults of 64 steps with glibc's default thresholds, then after keep_freed_memory().
GROWING_CACHE = textwrap.dedent(
    """
    import resource, torch
    from services.policy.loading import keep_freed_memory

    def faults():
        k = torch.zeros(16, 4, 100, 64)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(64):
            k = torch.cat([k, torch.zeros(16, 4, 1, 64)], dim=-2)
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

    default = faults()
    print(default, keep_freed_memory(), faults())
    """
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mallopt is glibc's (Linux)")
def test_a_growing_kv_cache_stops_page_faulting() -> None:
    out = subprocess.run(
        [sys.executable, "-c", GROWING_CACHE],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout.split()
    default, was_set, kept = int(out[0]), out[1], int(out[2])
    assert was_set == "True"
    # Each step faulted its whole ~2.7 MB cache in (~650 pages); kept on the heap, nearly none.
    assert default > 64 * 300, default
    assert kept * 5 < default, (default, kept)
