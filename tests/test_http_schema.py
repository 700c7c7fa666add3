"""schemathesis against the HTTP control plane: every operation of ``GET /openapi.json``,
with examples generated from the document (valid ones and, for negative data, invalid
ones), sent over TCP with a full token to a real daemon that is thrown away afterwards (so
the destructive routes run too). A reply must never be a 5xx and must conform to the
document: its status among the operation's, its content type and body as the document
says; invalid input must be refused with a 4xx.

The document is the one the daemon serves (checked equal to ``httpapi.openapi()`` first).
What the test bends, and why, is in ``_tame``: streams (``follow=1``) are read up to their
head only (their body never ends); counts and timeouts are capped so that a generated
``launch`` of 10,000 replicas or a ``wait`` of a year stays within the test's bound.
``MAX_EXAMPLES`` keeps the whole run under a minute on two loaded cores.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

import pytest

schemathesis = pytest.importorskip("schemathesis")  # the test extra has it: pip install -e '.[test]'
import requests  # noqa: E402  (schemathesis' own transport)
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis.errors import Unsatisfiable  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.core.failures import FailureGroup  # noqa: E402
from schemathesis.checks import (  # noqa: E402
    content_type_conformance,
    negative_data_rejection,
    not_a_server_error,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from helpers import DaemonUnderTest, free_port_range  # noqa: E402
from orchestrator.daemon import httpapi  # noqa: E402

pytestmark = [pytest.mark.timeout(240), pytest.mark.long]

TOKEN = "schema-token-0123456789abcdef"
MAX_EXAMPLES = 12  # per operation and mode: ~25 operations x 2 modes x 12 in well under a minute
REQUEST_TIMEOUT = 15.0  # s: a reply later than this is a finding (a waiting command is capped at 2 s)
STREAMS = {"text/event-stream", "text/plain"}
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_headers_conformance,
          response_schema_conformance]
# The upgrade route re-executes the daemon: every example would be an exec (about a second
# each); a few, valid or not, are enough to see its replies conform.
FEW = {"/v1/upgrade": 3}


def _tame(case: Any) -> None:
    """Bounds on what a generated request may ask of the machine, keeping it valid: at most
    3 replicas a launch or scale, at most 2 s of waiting."""
    body = case.body if isinstance(case.body, dict) else None
    if body is not None:
        for key in ("count", "n"):
            if isinstance(body.get(key), int) and not isinstance(body.get(key), bool) and body[key] > 3:
                body[key] = 3
        for key in ("timeout",):
            if isinstance(body.get(key), (int, float)) and not isinstance(body.get(key), bool) and body[key] > 2:
                body[key] = 2
    query = case.query if isinstance(case.query, dict) else None
    if query is not None and isinstance(query.get("timeout"), (int, float)) and query["timeout"] > 2:
        query["timeout"] = 2


def _follows(case: Any) -> bool:
    query = case.query if isinstance(case.query, dict) else {}
    return str(query.get("follow", "")).lower() in ("1", "true")


def _stream_head(case: Any, base: str, headers: dict[str, str]) -> list[str]:
    """A ``follow=1`` request: the status and content type of its head, as the document
    lists them (a 200's body is a stream that does not end: closed once its head is read;
    an error is a whole reply, checked as any other)."""
    with requests.request(**case.as_transport_kwargs(base_url=base, headers=headers), stream=True,
                          timeout=REQUEST_TIMEOUT) as resp:
        ctype = resp.headers.get("Content-Type", "").split(";")[0].strip()
        if resp.status_code == 200:
            return [] if ctype in STREAMS else [f"{case.method} {case.formatted_path}: a stream of {ctype!r}"]
    case.validate_response(case.call(base_url=base, headers=headers, timeout=REQUEST_TIMEOUT), checks=CHECKS)
    return []


def _run(operation: Any, mode: Any, base: str, headers: dict[str, str], found: list[str]) -> None:
    examples = FEW.get(operation.path, MAX_EXAMPLES)

    @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck),
              phases=[Phase.generate])  # no shrinking: every finding is kept as it came
    @given(case=operation.as_strategy(generation_mode=mode))
    def one(case: Any) -> None:
        if mode is GenerationMode.POSITIVE:  # invalid data stays as it is: it is refused, whatever it asks
            _tame(case)
        try:
            if _follows(case):
                found.extend(_stream_head(case, base, headers))
                return
            resp = case.call(base_url=base, headers=headers, timeout=REQUEST_TIMEOUT)
            checks: list[Callable[..., Any]] = [*CHECKS, negative_data_rejection] if mode is GenerationMode.NEGATIVE \
                else CHECKS
            case.validate_response(resp, checks=checks)
        except requests.RequestException as err:
            found.append(f"{case.method} {case.formatted_path} {mode.value}: {type(err).__name__}: {err}")
        except (AssertionError, FailureGroup) as err:  # each finding kept, the run goes on
            failures = list(err.exceptions) if isinstance(err, FailureGroup) else [err]
            for failure in failures:
                lines = [ln.strip() for ln in str(failure).strip().splitlines() if ln.strip()]
                found.append(f"{case.method} {case.formatted_path} ({mode.value}) query={case.query or ''} "
                             f"body={case.body!r}: {' | '.join(lines[:5])}"[:700])

    try:
        one()
    except Unsatisfiable:  # negative data for an operation that takes nothing: there is none to make
        if mode is not GenerationMode.NEGATIVE:
            raise


def test_every_operation_conforms_to_the_document(daemon: DaemonUnderTest, tmp_path: Path) -> None:
    port = free_port_range(1)
    token = tmp_path / "token"
    token.write_text(TOKEN + "\n")
    os.chmod(token, 0o600)
    daemon.start("--http", f"tcp://127.0.0.1:{port}", "--http-token-file", str(token))
    base = f"http://127.0.0.1:{port}"
    headers = {"Authorization": f"Bearer {TOKEN}"}
    served = requests.get(f"{base}/openapi.json", headers=headers, timeout=REQUEST_TIMEOUT)
    assert served.status_code == 200 and served.json() == httpapi.openapi()
    schema = schemathesis.openapi.from_dict(served.json())
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {(op.method.upper(), op.path) for op in operations} == {(r.method, r.path) for r in httpapi.ROUTES}
    found: list[str] = []
    for operation in operations:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            _run(operation, mode, base, headers, found)
    daemon.status()  # the daemon lived through it all
    assert not found, f"{len(found)} non-conforming replies:\n" + "\n".join(found[:40])
