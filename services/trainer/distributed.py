"""Data-parallel updates over several GPUs with ``accelerate``.

The Celery trainer worker stays one process; on a multi-GPU pod (``GTR_TRAINER_ACCELERATE_CONFIG``
names an accelerate config) it launches one job per update::

    accelerate launch --config_file configs/accelerate/multi_gpu.yaml \\
        -m services.trainer.distributed RUN_ID UPDATE_IDX

Every rank loads the latest checkpoint, scores its share of each minibatch and all-reduces the
gradients before the optimiser step; rank 0 writes the checkpoint and the metrics.
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

from sqlalchemy import select

from services.trainer.runs import TRAINED_KEY, run_update
from shared.db.models import Update
from shared.db.session import session_scope


def main(argv: list[str] | None = None) -> None:
    """One update of one run on every process of the accelerate launch."""
    from accelerate import Accelerator

    args = argv if argv is not None else sys.argv[1:]
    if len(args) != 2 or not all(a.lstrip("-").isdigit() for a in args):
        raise SystemExit("usage: python -m services.trainer.distributed RUN_ID UPDATE_IDX")
    accelerator = Accelerator()
    with session_scope() as session:
        run_update(session, int(args[0]), int(args[1]), accelerator=accelerator)
        if not accelerator.is_main_process:
            session.rollback()  # only rank 0 writes
    accelerator.wait_for_everyone()


def launch(run_id: int, update_idx: int, config_file: str) -> dict[str, Any]:
    """Run ``main`` under ``accelerate launch`` and return the metrics rank 0 recorded."""
    query = select(Update).where(Update.run_id == run_id, Update.idx == update_idx)
    with session_scope() as session:
        row = session.scalar(query)
        if row is not None and row.metrics.get(TRAINED_KEY):
            return {"skipped": True}
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        config_file,
        "-m",
        "services.trainer.distributed",
        str(run_id),
        str(update_idx),
    ]
    subprocess.run(cmd, check=True)
    with session_scope() as session:
        row = session.scalar(query)
        return dict(row.metrics) if row is not None else {}


if __name__ == "__main__":
    main()
