"""deploy/: the systemd unit and the Kubernetes manifest agree with the daemon's contract
and with examples/orchestrator.toml (stop budget, config path, state dir, probes).

PyYAML is not a dependency, so the manifest is read by ``read_yaml`` below: a small reader
of the block-style YAML subset the manifest is written in (mappings, sequences, plain and
quoted scalars, JSON-style flow sequences, ``|`` literal blocks, comments, ``---``). It
refuses what it does not understand, so a manifest edited beyond that subset fails here
loudly instead of being misread.
"""

from __future__ import annotations

import json
import os
import re
import shlex
from pathlib import Path
from typing import Any

import pytest

from orchestrator.daemon import config

ROOT = Path(__file__).resolve().parent.parent
UNIT = ROOT / "deploy" / "orchestrator.service"
MANIFEST = ROOT / "deploy" / "kubernetes.yaml"
EXAMPLE = ROOT / "examples" / "orchestrator.toml"
CONFIG_PATH = "/etc/orchestrator/orchestrator.toml"
STATE_DIR = "/var/lib/orchestrator"


# -- a systemd unit reader: sections of keys, each with every value it was given -----------


def read_unit(text: str) -> dict[str, dict[str, list[str]]]:
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] | None = None
    lines = iter(text.splitlines())
    for raw in lines:
        line = raw.strip()
        while line.endswith("\\"):  # a continued line
            line = line[:-1] + " " + next(lines, "").strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
            continue
        key, sep, value = line.partition("=")
        assert sep and current is not None, f"not a unit line: {raw!r}"
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def seconds(span: str) -> float:
    """A systemd time span: ``45``, ``45s``, ``1min 30s``, ``2m``."""
    units = {"": 1, "s": 1, "sec": 1, "second": 1, "seconds": 1, "m": 60, "min": 60, "minute": 60,
             "minutes": 60, "h": 3600, "hr": 3600, "hour": 3600, "hours": 3600, "ms": 0.001, "msec": 0.001}
    parts = re.findall(r"(\d+(?:\.\d+)?)\s*([a-z]*)", span.strip())
    assert parts and "".join(n + u for n, u in parts) == re.sub(r"\s+", "", span), span
    return sum(float(n) * units[u] for n, u in parts)


# -- a YAML reader for the manifest's subset ---------------------------------------------------


class _Yaml:
    def __init__(self, lines: list[str]) -> None:
        self.lines = lines
        self.i = 0

    def _skip(self) -> None:
        while self.i < len(self.lines) and (not self.lines[self.i].strip() or self.lines[self.i].lstrip().startswith("#")):
            self.i += 1

    def _indent(self) -> int:
        line = self.lines[self.i]
        return len(line) - len(line.lstrip(" "))

    def document(self) -> Any:
        self._skip()
        if self.i == len(self.lines):
            return None
        value = self.node(self._indent())
        self._skip()
        assert self.i == len(self.lines), f"unexpected line: {self.lines[self.i]!r}"
        return value

    def node(self, indent: int) -> Any:
        self._skip()
        assert self.i < len(self.lines) and self._indent() == indent, f"expected a node at indent {indent}"
        if self.lines[self.i].strip() == "-" or self.lines[self.i].lstrip().startswith("- "):
            return self.sequence(indent)
        return self.mapping(indent)

    def sequence(self, indent: int) -> list:
        items = []
        while True:
            self._skip()
            if self.i == len(self.lines) or self._indent() != indent:
                break
            content = self.lines[self.i].strip()
            if not (content == "-" or content.startswith("- ")):
                break
            rest = content[1:].strip()
            if not rest:
                self.i += 1
                self._skip()
                items.append(self.node(self._indent()))
            elif _KEY.match(rest):  # "- key: value" opens a mapping at the item's column
                self.lines[self.i] = " " * (indent + 2) + rest
                items.append(self.mapping(indent + 2))
            else:
                self.i += 1
                items.append(scalar(rest))
        return items

    def mapping(self, indent: int) -> dict:
        out: dict[str, Any] = {}
        while True:
            self._skip()
            if self.i == len(self.lines) or self._indent() != indent:
                break
            content = self.lines[self.i].strip()
            if content.startswith("- "):
                break
            m = _KEY.match(content)
            assert m, f"not a mapping entry: {content!r}"
            key, rest = m.group(1), _uncomment(m.group(2))
            assert key not in out, f"duplicate key {key!r}"
            self.i += 1
            if rest in ("|", "|-"):
                out[key] = self.literal(indent, keep_newline=rest == "|")
            elif rest:
                out[key] = scalar(rest)
            else:
                self._skip()
                child = self._indent() if self.i < len(self.lines) else -1
                is_seq = self.i < len(self.lines) and self.lines[self.i].lstrip().startswith("- ")
                assert child > indent or (child == indent and is_seq), f"{key}: no value"
                out[key] = self.node(child)
        return out

    def literal(self, indent: int, keep_newline: bool) -> str:
        block: list[str] = []
        while self.i < len(self.lines):
            line = self.lines[self.i]
            if line.strip() and len(line) - len(line.lstrip(" ")) <= indent:
                break
            block.append(line)
            self.i += 1
        while block and not block[-1].strip():
            block.pop()
        assert block, "empty literal block"
        cut = min(len(b) - len(b.lstrip(" ")) for b in block if b.strip())
        text = "\n".join(b[cut:] for b in block)
        return text + "\n" if keep_newline else text


_KEY = re.compile(r"([A-Za-z0-9_./-]+):(?:\s+(.*))?$")


def _uncomment(text: str | None) -> str:
    if not text:
        return ""
    if text[0] in "\"'[":
        return text.strip()
    return re.split(r"\s+#", text, maxsplit=1)[0].strip()


def scalar(text: str) -> Any:
    text = text.strip()
    if text[0] in '"[':
        value, end = json.JSONDecoder().raw_decode(text)
        rest = text[end:].strip()
        assert not rest or rest.startswith("#"), f"unsupported YAML: {text!r}"
        return value
    if text[0] == "'":
        m = re.match(r"'((?:[^']|'')*)'\s*(#.*)?$", text)
        assert m, text
        return m.group(1).replace("''", "'")
    assert text[0] not in "{&*!|>%@`", f"unsupported YAML: {text!r}"
    text = _uncomment(text)
    if re.fullmatch(r"-?\d+", text):
        return int(text)
    if re.fullmatch(r"-?\d+\.\d*", text):
        return float(text)
    return {"true": True, "false": False, "null": None, "~": None}.get(text, text)


def read_yaml(text: str) -> list[Any]:
    """Every document of a YAML stream (empty ones left out)."""
    docs, chunk = [], []
    for line in text.splitlines() + ["---"]:
        if line.rstrip() == "---":
            value = _Yaml(chunk).document()
            if value is not None:
                docs.append(value)
            chunk = []
        else:
            chunk.append(line)
    return docs


def test_the_yaml_reader():
    text = (
        "# c\n---\na: 1\nb:\n  c: \"x # y\"\n  d: [\"p\", \"q\"]\n  e:\n    - f: true\n      g: 'it''s'\n"
        "    - plain words # comment\n  lit: |\n    line 1\n\n    # not a comment\n  h: 2.5\nlist:\n- 1\n- null\n"
        "---\nz: 0\n"
    )
    assert read_yaml(text) == [
        {"a": 1, "b": {"c": "x # y", "d": ["p", "q"], "e": [{"f": True, "g": "it's"}, "plain words"],
                       "lit": "line 1\n\n# not a comment\n", "h": 2.5}, "list": [1, None]},
        {"z": 0},
    ]
    with pytest.raises(AssertionError):
        read_yaml("a: {b: 1}\n")
    with pytest.raises(AssertionError):
        read_yaml("a: 1\na: 2\n")


# -- the example config ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def example() -> config.Config:
    return config.load(EXAMPLE)


def test_the_example_config_loads(example):
    assert list(example.pools) == ["web", "jobs"]
    web, jobs = example.pools["web"], example.pools["jobs"]
    assert web.size == 3 and web.policy["port_base"] == 8100 and web.policy["ready"].startswith("http://127.0.0.1:")
    assert web.policy["restart"] == "always" and "{port}" in web.spec["command"]
    assert jobs.spec["target"] == "myapp.jobs:main" and jobs.size == 2 and jobs.cwd == "/srv/myapp"
    assert example.daemon.stop_budget == 30 and example.daemon.metrics_port == 9464


# -- the systemd unit --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def service() -> dict[str, list[str]]:
    unit = read_unit(UNIT.read_text())
    assert {"Unit", "Service", "Install"} <= set(unit)
    return unit["Service"]


def one(section: dict[str, list[str]], key: str) -> str:
    values = section.get(key)
    assert values, f"{key}= is not set"
    return values[-1]  # systemd: the last assignment of a single-valued key wins


def test_unit_runs_the_daemon_in_the_foreground_with_the_config(service):
    argv = shlex.split(one(service, "ExecStart"))
    assert argv[0] == "/opt/orchestrator/.venv/bin/orchestrator"
    assert argv[1:3] == ["start", "--foreground"]
    assert argv[argv.index("--config") + 1] == CONFIG_PATH


def test_unit_is_notify_type_and_only_the_daemon_may_notify(service):
    assert one(service, "Type") == "notify"
    assert one(service, "NotifyAccess") == "main"


def test_unit_kill_mode_leaves_the_shutdown_to_the_daemon(service):
    # mixed: SIGTERM to the daemon alone, SIGKILL to whatever is left afterwards
    assert one(service, "KillMode") == "mixed"
    assert one(service, "KillSignal") in ("SIGTERM", "TERM", "15")
    assert one(service, "ExecReload").split() == ["/bin/kill", "-HUP", "$MAINPID"]


def test_unit_stop_timeout_covers_the_stop_budget(service, example):
    assert seconds(one(service, "TimeoutStopSec")) >= example.daemon.stop_budget + 5


def test_unit_restarts_on_failure_and_delegates_its_cgroup(service):
    assert one(service, "Restart") == "on-failure"
    assert one(service, "Delegate") == "yes"


def test_unit_state_dir_is_consistent(service):
    env = dict(v.split("=", 1) for line in service.get("Environment", []) for v in shlex.split(line))
    assert env["ORCHESTRATOR_STATE_DIR"] == STATE_DIR
    assert one(service, "StateDirectory") == os.path.basename(STATE_DIR)  # /var/lib/ + it


def test_systemd_time_spans():
    assert seconds("45") == seconds("45s") == 45 and seconds("1min 30s") == 90 and seconds("2m") == 120


# -- the Kubernetes manifest -------------------------------------------------------------------


@pytest.fixture(scope="module")
def manifest() -> list[dict]:
    return read_yaml(MANIFEST.read_text())


def _kind(docs: list[dict], kind: str) -> dict:
    found = [d for d in docs if d.get("kind") == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


@pytest.fixture(scope="module")
def pod(manifest) -> dict:
    ds = _kind(manifest, "DaemonSet")
    assert ds["apiVersion"] == "apps/v1"
    labels = ds["spec"]["template"]["metadata"]["labels"]
    assert ds["spec"]["selector"]["matchLabels"].items() <= labels.items()
    return ds["spec"]["template"]["spec"]


@pytest.fixture(scope="module")
def container(pod) -> dict:
    (only,) = pod["containers"]
    return only


def _is_health(command: list[str]) -> bool:
    return os.path.basename(command[0]) == "orchestrator" and command[1:] == ["health"]


def test_manifest_runs_the_daemon_in_the_foreground_with_the_config(container):
    argv = container.get("command", []) + container.get("args", [])
    assert os.path.basename(argv[0]) == "orchestrator"
    assert argv[1:3] == ["start", "--foreground"]
    assert argv[argv.index("--config") + 1] == CONFIG_PATH


def test_manifest_probes_run_orchestrator_health(container):
    assert _is_health(container["livenessProbe"]["exec"]["command"])
    assert _is_health(container["readinessProbe"]["exec"]["command"])
    for probe in ("livenessProbe", "readinessProbe"):
        assert container[probe].get("timeoutSeconds", 1) >= 2  # health waits up to 1 s for the loop


def test_manifest_grace_period_covers_the_stop_budget(pod, example):
    assert pod["terminationGracePeriodSeconds"] >= example.daemon.stop_budget + 5


def test_manifest_config_comes_from_a_configmap_at_the_config_path(manifest, pod, container, example):
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    mount = mounts[os.path.dirname(CONFIG_PATH)]
    source = volumes[mount["name"]]["configMap"]
    cm = _kind(manifest, "ConfigMap")
    assert source["name"] == cm["metadata"]["name"]
    text = cm["data"][os.path.basename(CONFIG_PATH)]
    # the ConfigMap holds the example, so the stop budget the grace period was sized for
    assert text == EXAMPLE.read_text()
    assert config.parse(text, "configmap").daemon.stop_budget == example.daemon.stop_budget


def test_manifest_state_dir_is_a_volume(pod, container):
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["ORCHESTRATOR_STATE_DIR"] == STATE_DIR
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volume = {v["name"]: v for v in pod["volumes"]}[mounts[STATE_DIR]]
    assert "hostPath" in volume or "emptyDir" in volume or "persistentVolumeClaim" in volume
