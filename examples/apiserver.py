"""A request server to copy: a FastAPI app that runs each request in a worker process of an
orchestrator daemon's executor pool, keyed by the request's id.

- ``POST /requests`` ``{"id": "req-1", "steps": 20, "interval": 0.1}`` runs the request as
  the task keyed ``req-1``: the same id again (a client's retry) is that task, not a second run.
- ``GET /requests/{id}?wait=S`` its state, and its result once it has ended (waiting up to S s).
- ``DELETE /requests/{id}`` cancels it from any server process: ``Cancelled`` is raised in
  that task alone, which cleans up.
- ``GET /requests/{id}/log`` streams its own stdout as it is written, to the task's end.

A worker killed under a request (kill -9, the OOM killer) costs it a second run: the pool has
``retries=1``, so the request runs again, from its start, on another worker (killed again, it
fails with ``WorkerLost``). The requests are the
daemon's, not the server's: they run on through a restart of the server, and every server
process (``--workers N``) sees and cancels all of them.

Run it from the repository's root (``pip install -e '.[examples]'``)::

    orchestrator start                                   # the daemon: $ORCHESTRATOR_STATE_DIR
    uvicorn examples.apiserver:app --workers 2           # or ~/.local/state/orchestrator
    curl -X POST localhost:8000/requests -H 'content-type: application/json' \\
        -d '{"id": "req-1", "steps": 50}'
    curl -N localhost:8000/requests/req-1/log            # the lines as they come
    curl -X DELETE localhost:8000/requests/req-1
    curl 'localhost:8000/requests/req-1?wait=10'         # {"state": "CANCELLED", ...}

``REQUEST_WORKERS`` sets the pool's size (default 4). The workers import this module (the
task function is ``run_request``) from the server's directory and ``PYTHONPATH``.
"""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import CancelledError
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, Field

import orchestrator
from orchestrator.logread import follow
from orchestrator.paths import default_state_dir

STATE_DIR = default_state_dir()  # $ORCHESTRATOR_STATE_DIR, as the `orchestrator` command's
POOL = "requests"
WORKERS = int(os.environ.get("REQUEST_WORKERS", "4"))


def run_request(request_id: str, steps: int, interval: float) -> dict[str, Any]:
    """One request's work, in a worker process. What it prints goes to this task's own log
    (flushed per line, so that a reader sees each as it is written)."""
    print(f"{request_id}: started in pid {os.getpid()}", flush=True)
    step = 0
    try:
        for step in range(1, steps + 1):
            time.sleep(interval)
            print(f"{request_id}: step {step} of {steps}", flush=True)
    except orchestrator.Cancelled:  # DELETE /requests/{id}, from whichever server process
        print(f"{request_id}: cancelled in step {step}, cleaning up", flush=True)
        raise
    return {"id": request_id, "steps": steps, "pid": os.getpid()}


class NewRequest(BaseModel):
    id: str = Field(min_length=1, max_length=200, pattern=r"^[^/]+$")  # a task key: no "/"
    steps: int = Field(10, ge=1, le=100_000)
    interval: float = Field(0.1, ge=0, le=60)


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    # Made here, not at import: the workers import this module too, to run run_request.
    client = orchestrator.Client(STATE_DIR)
    app.state.client = client
    app.state.executor = client.executor(pool=POOL, max_workers=WORKERS, retries=1)
    try:
        yield
    finally:
        app.state.executor.shutdown(wait=False)  # the requests run on in the daemon
        client.close()


app = FastAPI(title="requests in worker processes", lifespan=lifespan)


def task_of(request: Request, request_id: str) -> Any:
    """The handle on the task the request id names (from any process: by its key)."""
    try:
        return request.app.state.client.task(f"{POOL}/@{request_id}")
    except orchestrator.UnknownTask:
        raise HTTPException(404, f"no request {request_id!r}") from None


# Plain `def` routes: FastAPI runs them in its thread pool, so their blocking calls to the
# daemon (one round trip each) never hold the event loop.
@app.post("/requests", status_code=202)
def submit(body: NewRequest, request: Request) -> dict[str, Any]:
    ex = request.app.state.executor
    fut = ex.options(key=body.id).submit(run_request, body.id, body.steps, body.interval)
    return {"id": body.id, "task": fut.task_id}


@app.get("/requests/{request_id}")
def status(request_id: str, request: Request, wait: float = 0) -> dict[str, Any]:
    task = task_of(request, request_id)
    out: dict[str, Any] = {"id": request_id, "task": task.id}
    try:
        out["result"] = task.result(timeout=min(max(wait, 0), 60))
    except TimeoutError:
        pass  # not ended yet
    except CancelledError:
        out["error"] = "cancelled"
    except Exception as err:  # what the task raised, or WorkerLost once no retry was left
        out["error"] = f"{type(err).__name__}: {err}"
    info = task.info()
    out.update(state=info["state"], attempts=info["attempts"], worker=info["worker"])
    return out


@app.delete("/requests/{request_id}")
def cancel(request_id: str, request: Request) -> dict[str, Any]:
    task = task_of(request, request_id)
    return {"id": request_id, "cancelled": task.cancel()}


@app.get("/requests/{request_id}/log")
def log(request_id: str, request: Request) -> StreamingResponse:
    task = task_of(request, request_id)

    def ended() -> bool:
        return orchestrator.TaskState(task.info()["state"]).terminal

    def lines() -> Iterator[str]:
        # From its first line, then each as it is written; the stream ends with the task.
        for line in follow(request.app.state.client.paths.logs, [task.id], prefix=False,
                           stop=ended, lines=100_000, interval=0.2):
            yield line + "\n"

    return StreamingResponse(lines(), media_type="text/plain")
