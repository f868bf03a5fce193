"""A recorded step's frame for people, drawn from its stored state the first time it is viewed.

The PNG is stored as a content-addressed blob and the step row keeps its sha (``display_sha``),
so the next view is one blob read. A step whose state cannot redraw its frame (THOR frames are
drawn while the run records; steps written by hand) shows the stored frame, else the model's
input.
"""

from __future__ import annotations

from sqlalchemy import update
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session

from services.api.service import NotFound, get_run
from shared.db.models import ApiToken, Run, Step
from shared.storage import BlobNotFound, BlobStore


def visible_step(db: Session, token: ApiToken, step_id: int) -> tuple[Step, Run]:
    """The step and its run, if the token's team may see them (else NotFound: a 404)."""
    step = db.get(Step, step_id)
    if step is None:
        raise NotFound(f"step {step_id} not found")
    try:
        return step, get_run(db, token, step.run_id)
    except NotFound:
        raise NotFound(f"step {step_id} not found") from None


def display_png(db: Session, blobs: BlobStore, step: Step, run: Run) -> bytes | None:
    """The step's display frame as PNG (drawn and cached on first use), else its model input;
    None when it has neither."""
    if step.display_sha:
        try:
            return blobs.get(step.display_sha)
        except BlobNotFound:
            pass  # the blob store was cleared: draw it again below
    png = _draw(run, step)
    if png is None:
        return blobs.get(step.image_sha) if step.image_sha else None
    sha = blobs.put(png)
    try:  # a cache fill: a locked SQLite file (a run writing) only means drawing it next time
        with db.begin_nested():
            db.execute(update(Step).where(Step.id == step.id).values(display_sha=sha))
    except OperationalError:
        pass
    return png


def _draw(run: Run, step: Step) -> bytes | None:
    # Imported here: the API starts without the env package's drawing stack (PIL fonts,
    # matplotlib's font path, gymnasium) until a frame is first drawn.
    from services.env.display import display_size, draw_state
    from services.env.render import display_png as encode

    env = dict((run.config or {}).get("env") or {})
    size = display_size(env)
    if not size:
        return None
    frame = draw_state(run.task, env, step.state or {}, size)
    return None if frame is None else encode(frame)
