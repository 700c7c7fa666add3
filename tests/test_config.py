"""orchestrator.daemon.config: the TOML config file of `start --config` and `reload`."""

from __future__ import annotations

import os
import pickle
import textwrap
import tomllib

import pytest

from orchestrator.daemon import config
from orchestrator.daemon.config import Config, ConfigError, DaemonSettings, PoolDecl, diff, load, parse
from orchestrator.errors import OrchestratorError
from orchestrator.policy import Policy
from orchestrator.spec import WorkerSpec
from orchestrator.store import KEEP_EVENTS, KEEP_REPLICAS, KEEP_SECONDS


def write(tmp_path, text: str, name: str = "orchestrator.toml") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def error_of(tmp_path, text: str) -> ConfigError:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load(path)
    message = str(info.value)
    assert "\n" not in message, message
    assert message.startswith(path + ":"), message
    return info.value


FULL = """\
[daemon]
grace = 2.5
stop_budget = 20
metrics_port = 9464
cgroup = "/sys/fs/cgroup/orch"
log_max_bytes = "1M"
log_backups = 5
keep_replicas = 100
keep_events = 200
keep_days = 2
result_max_bytes = "4M"
http = ["unix:http.sock", "tcp://127.0.0.1:8470"]
http_token_file = "http.token"
http_read_token_file = "read.token"

[pools.web]
kind = "replicas"
command = ["python3", "-m", "http.server", "{port}"]
size = 3
env = { MODE = "prod", PORT_COPY = "{port}" }
env_file = "web.env"
cwd = "srv"
log_max_bytes = 65536
log_backups = 1
memory_max = "512M"
pids_max = 64
cpu_weight = 200
restart = "always"
backoff = [0.5, 10]
healthy_after = 20
max_restarts = [3, 30]
ready = "http://127.0.0.1:{port}/"
ready_timeout = 15
probe_timeout = 2
start_secs = 1
live = "tcp:127.0.0.1:{port}"
live_interval = 5
live_failures = 2
stop_signal = "INT"
grace = 3
port_base = 8100
sockets = ["tcp://127.0.0.1:8000", "unix:/run/web.sock"]
after = ["jobs:started"]

[pools.jobs]
target = "myapp.jobs:main"
preload = ["json", "email.parser"]
"""


# -- what is parsed --------------------------------------------------------------------


def test_every_key_is_parsed(tmp_path):
    (tmp_path / "web.env").write_text("FROM_FILE=1\nMODE=dev\n")
    cfg = load(write(tmp_path, FULL))
    assert cfg.daemon == DaemonSettings(
        grace=2.5, stop_budget=20.0, metrics_port=9464, cgroup="/sys/fs/cgroup/orch", log_max_bytes=1 << 20,
        log_backups=5, keep_replicas=100, keep_events=200, keep_days=2.0, result_max_bytes=4 << 20,
        http=("unix:http.sock", "tcp://127.0.0.1:8470"), http_token_file=str(tmp_path / "http.token"),
        http_read_token_file=str(tmp_path / "read.token"),
    )
    assert list(cfg.pools) == ["web", "jobs"]
    web = cfg.pools["web"]
    assert web.name == "web" and web.size == 3
    assert web.spec == {
        "command": ["python3", "-m", "http.server", "{port}"],
        "env": {"FROM_FILE": "1", "MODE": "prod", "PORT_COPY": "{port}"},
        "cwd": str(tmp_path / "srv"),
    }
    assert web.env == web.spec["env"] and web.cwd == str(tmp_path / "srv")
    assert (web.log_max_bytes, web.log_backups) == (65536, 1)
    assert (web.memory_max, web.pids_max, web.cpu_weight) == (512 << 20, 64, 200)
    assert Policy.from_wire(web.policy) == Policy(
        restart="always", backoff=(0.5, 10.0), healthy_after=20, max_restarts=(3, 30.0),
        ready="http://127.0.0.1:{port}/", ready_timeout=15, probe_timeout=2, start_secs=1, live="tcp:127.0.0.1:{port}",
        live_interval=5, live_failures=2, stop_signal="INT", grace=3, port_base=8100,
        log_max_bytes=65536, log_backups=1, sockets=("tcp://127.0.0.1:8000", "unix:/run/web.sock"),
        after=("jobs:started",),
    )
    # The wire forms are what launch sends: they round-trip through the daemon's readers.
    assert WorkerSpec.from_wire(web.spec).to_wire() == web.spec
    assert Policy.from_wire(web.policy).to_wire() == web.policy
    jobs = cfg.pools["jobs"]
    assert jobs.spec == {"target": "myapp.jobs:main", "cwd": str(tmp_path), "preload": ["json", "email.parser"]}
    assert jobs.preload == ("json", "email.parser")


def test_every_table_key_is_covered_by_the_full_example():
    import tomllib

    doc = tomllib.loads(FULL)
    assert set(doc["daemon"]) == set(config.DAEMON_KEYS)
    assert set(doc["pools"]["web"]) | {"target", "preload"} == set(config.POOL_KEYS)  # preload: of jobs
    assert set(config.POLICY_KEYS) == {
        "restart", "backoff", "healthy_after", "max_restarts", "ready", "ready_timeout", "probe_timeout", "start_secs",
        "live", "live_interval", "live_failures", "stop_signal", "grace", "port_base",
        "log_max_bytes", "log_backups", "sockets", "after",
    }


def test_defaults(tmp_path):
    cfg = load(write(tmp_path, '[pools.a]\ncommand = ["sleep", "9"]\n'))
    assert cfg.daemon == DaemonSettings()
    d = cfg.daemon
    assert (d.grace, d.stop_budget, d.metrics_port, d.cgroup) == (5.0, 30.0, None, "auto")
    assert (d.log_max_bytes, d.log_backups) == (10 << 20, 3)
    assert (d.keep_replicas, d.keep_events, d.keep_days) == (KEEP_REPLICAS, KEEP_EVENTS, KEEP_SECONDS / 86400)
    a = cfg.pools["a"]
    assert a.size == 1 and a.policy == {} and a.preload == ()
    assert a.spec == {"command": ["sleep", "9"], "cwd": str(tmp_path)}  # cwd: the file's directory
    assert (a.log_max_bytes, a.log_backups, a.memory_max, a.pids_max, a.cpu_weight) == (None,) * 5
    assert a.line == 1


def test_an_empty_file_is_no_pools():
    assert parse("") == Config()
    assert parse("[daemon]\n").pools == {}


def test_size_zero_and_cgroup_modes():
    cfg = parse('[daemon]\ncgroup = "off"\n[pools.a]\ncommand = ["x"]\nsize = 0\n')
    assert cfg.pools["a"].size == 0 and cfg.daemon.cgroup == "off"


def test_sizes_and_a_single_preload_module():
    cfg = parse('[pools.a]\ntarget = "m:f"\nmemory_max = "1.5G"\nlog_max_bytes = "64KiB"\npreload = "json"\n')
    a = cfg.pools["a"]
    assert a.memory_max == 3 << 29 and a.log_max_bytes == 64 << 10 and a.preload == ("json",)
    assert config.parse_size(12345) == 12345
    assert config.parse_size("2k") == 2048


def test_other_ways_to_write_a_pool():
    text = '[pools]\nweb = { command = ["a"], size = 2 }\n[pools.b]\ntarget = "m:f"\n[pools.b.env]\nK = "v"\n'
    cfg = parse(text, base_dir="/srv")
    assert cfg.pools["web"].size == 2 and cfg.pools["web"].cwd == "/srv"
    assert cfg.pools["b"].env == {"K": "v"}


def test_parse_without_a_file_is_relative_to_the_current_dir():
    assert parse('[pools.a]\ncommand = ["x"]\n').pools["a"].cwd == os.getcwd()


# -- errors: one line, FILE:LINE: KEY: what -------------------------------------------------


@pytest.mark.parametrize(
    "text, line, key, suggestion",
    [
        ('[daemon]\ngrace = 1\n\npool = 3\n', 4, "daemon.pool", None),  # [daemon] holds it now
        ('pool = 3\n', 1, "pool", "pools"),
        ('[daemon]\ngrace = 1\nstop_budjet = 3\n', 3, "daemon.stop_budjet", "stop_budget"),
        ('[pools.web]\ncommand = ["x"]\n# a comment\nrestrt = "always"\n', 4, "pools.web.restrt", "restart"),
        ('[pools.web]\ncommand = ["x"]\nportbase = 8000\n', 3, "pools.web.portbase", "port_base"),
        ('[pools.web]\ncommand = ["x"]\nmemory = "1G"\n', 3, "pools.web.memory", "memory_max"),
    ],
)
def test_unknown_keys_are_errors_with_a_suggestion(tmp_path, text, line, key, suggestion):
    err = error_of(tmp_path, text)
    assert str(err).startswith(f"{err.source}:{line}: {key}: unknown key"), str(err)
    assert (err.line, err.key) == (line, key)
    if suggestion:
        assert f"did you mean {suggestion}" in str(err)
    else:
        assert "takes:" in str(err) and "stop_budget" in str(err)  # no close match: what is known


def test_syntax_error_has_its_line(tmp_path):
    err = error_of(tmp_path, '[daemon]\ngrace = 5\n\n[pools.web]\nsize = \ncommand = ["x"]\n')
    assert err.line == 5
    assert str(err).startswith(f"{err.source}:5: pools.web.size: invalid TOML: ")
    assert "column" in str(err) and "at line" not in str(err)


@pytest.mark.parametrize(
    "text, line",
    [
        ('[pools.web]\ncommand = ["x"\n', 2),
        ('[pools.web]\ncommand ["x"]\n', 2),
        ('[pools.web]\ncommand = ["x"]\n[pools.web]\n', 3),
        ('x = """\nunclosed\n', 2),
    ],
)
def test_other_syntax_errors(tmp_path, text, line):
    err = error_of(tmp_path, text)
    assert err.line == line and "invalid TOML" in str(err)


BAD_VALUES = [
    # (text, line, key, words in the message)
    ('[pools.web]\ncommand = ["x"]\nsize = -1\n', 3, "pools.web.size", "from 0"),
    ('[pools.web]\ncommand = ["x"]\nsize = 2.5\n', 3, "pools.web.size", "whole number"),
    ('[pools.web]\ncommand = ["x"]\n\nrestart = "sometimes"\n', 4, "pools.web.restart", "always, on-failure, never"),
    ('[pools.web]\ncommand = ["x"]\nbackoff = [5, 1]\n', 3, "pools.web.backoff", "MAX must be at least MIN"),
    ('[pools.web]\ncommand = ["x"]\nbackoff = 5\n', 3, "pools.web.backoff", "pair"),
    ('[pools.web]\ncommand = ["x"]\nready = "http://10.0.0.1/"\n', 3, "pools.web.ready", "loopback"),
    ('[pools.web]\ncommand = ["x"]\nready = "http://127.0.0.1:{port}/"\n', 3, "pools.web.ready", "port_base"),
    ('[pools.web]\ncommand = ["x"]\nlive = "notify"\n', 3, "pools.web.live", "notify"),
    ('[pools.web]\ncommand = ["x"]\ntarget = "m:f"\n', 3, "pools.web.target", "not both"),
    ('[pools.web]\ntarget = "m:f"\ncommand = ["x"]\n', 3, "pools.web.command", "not both"),
    ('[pools.web]\nsize = 2\n', 1, "pools.web", "needs command"),
    ('[pools.web]\ncommand = "python3 -m http.server"\n', 2, "pools.web.command", "list of strings"),
    ('[pools.web]\ncommand = []\n', 2, "pools.web.command", "empty"),
    ('[pools.web]\ntarget = "myapp.jobs"\n', 2, "pools.web.target", "module:function"),
    ('[pools.web]\ncommand = ["x"]\nport_base = 70000\n', 3, "pools.web.port_base", "65535"),
    ('[pools.web]\ncommand = ["x"]\nport_base = 0\n', 3, "pools.web.port_base", "at least 1"),
    ('[pools.web]\ncommand = ["x"]\nstop_signal = "SIGNOPE"\n', 3, "pools.web.stop_signal", "not a signal"),
    ('[pools.web]\ncommand = ["x"]\nlive_failures = 0\n', 3, "pools.web.live_failures", "at least 1"),
    ('[pools.web]\ncommand = ["x"]\ngrace = true\n', 3, "pools.web.grace", "number"),
    ('[pools.web]\ncommand = ["x"]\nmemory_max = "lots"\n', 3, "pools.web.memory_max", "512M"),
    ('[pools.web]\ncommand = ["x"]\nmemory_max = 0\n', 3, "pools.web.memory_max", "positive"),
    ('[pools.web]\ncommand = ["x"]\npids_max = 0\n', 3, "pools.web.pids_max", "at least 1"),
    ('[pools.web]\ncommand = ["x"]\ncpu_weight = 20000\n', 3, "pools.web.cpu_weight", "10000"),
    ('[pools.web]\ncommand = ["x"]\nlog_backups = -1\n', 3, "pools.web.log_backups", "at least 0"),
    ('[pools.web]\ntarget = "m:f"\npreload = ["not a module"]\n', 3, "pools.web.preload", "module names"),
    ('[pools.web]\ncommand = ["x"]\npreload = ["json"]\n', 3, "pools.web.preload", "Python target"),
    ('[pools.web]\ncommand = ["x"]\nenv = { PORT = 8080 }\n', 3, "pools.web.env.PORT", "strings"),
    ('[pools.web]\ncommand = ["x"]\nenv = "A=1"\n', 3, "pools.web.env", "table"),
    ('[pools.web]\ncommand = ["x"]\ncwd = 5\n', 3, "pools.web.cwd", "directory"),
    ('[pools."bad name!"]\ncommand = ["x"]\n', 1, 'pools."bad name!"', "invalid pool name"),
    ('[pools]\nweb = 3\n', 2, "pools.web", "must be a table"),
    ('pools = 3\n', 1, "pools", "table"),
    ('daemon = 3\n', 1, "daemon", "table"),
    ('[daemon]\nmetrics_port = 0\n', 2, "daemon.metrics_port", "1 to 65535"),
    ('[daemon]\nmetrics_port = 65536\n', 2, "daemon.metrics_port", "1 to 65535"),
    ('[daemon]\nstop_budget = 0\n', 2, "daemon.stop_budget", "more than 0"),
    ('[daemon]\ngrace = -1\n', 2, "daemon.grace", "at least 0"),
    ('[daemon]\ncgroup = "relative/path"\n', 2, "daemon.cgroup", "absolute"),
    ('[daemon]\nkeep_days = 0\n', 2, "daemon.keep_days", "more than 0"),
    ('[daemon]\nkeep_events = "many"\n', 2, "daemon.keep_events", "whole number"),
    ('[pools]\nweb = { command = ["x"], size = -1 }\n', 2, "pools.web.size", "from 0"),
]


@pytest.mark.parametrize("text, line, key, words", BAD_VALUES, ids=[f"{k}-{n}" for n, (_, _, k, _) in enumerate(BAD_VALUES)])
def test_bad_values_name_the_key_and_its_line(tmp_path, text, line, key, words):
    err = error_of(tmp_path, text)
    assert (err.line, err.key) == (line, key), str(err)
    assert str(err).startswith(f"{err.source}:{line}: {key}: "), str(err)
    assert words in str(err), str(err)


def test_the_key_line_is_found_among_lookalikes(tmp_path):
    text = """\
    [pools.a]
    command = ["x"]
    env.X = '''
    size = -3
    '''
    # size = 1
    env.Y = "size = 1"
    size = -2
    """
    err = error_of(tmp_path, text)
    assert (err.key, err.line) == ("pools.a.size", 8), str(err)


def test_a_key_line_that_cannot_be_found_falls_back_to_its_table(tmp_path):
    err = error_of(tmp_path, '[pools.a]\ncommand = ["x"]\nenv = { "A B" = 1 }\n')
    assert (err.key, err.line) == ('pools.a.env."A B"', 3)  # the env line
    err = error_of(tmp_path, '\n\n[pools.a]\ncommand = ["x"]\n\n[pools.a.env]\nK = 1\n')
    assert (err.key, err.line) == ("pools.a.env.K", 7)


def test_config_error_is_an_orchestrator_error_that_crosses_the_wire():
    with pytest.raises(ConfigError) as info:
        parse("[daemon]\nstop_budget = -1\n", "/etc/o.toml")
    err = info.value
    assert isinstance(err, OrchestratorError) and err.code == "config"
    assert str(err) == "/etc/o.toml:2: daemon.stop_budget: must be more than 0, got -1"
    again = pickle.loads(pickle.dumps(err))
    assert str(again) == str(err)


def test_unreadable_and_non_utf8_files(tmp_path):
    with pytest.raises(ConfigError, match=r"^.*nope\.toml: cannot read the config file: No such file"):
        load(tmp_path / "nope.toml")
    path = tmp_path / "latin1.toml"
    path.write_bytes(b"[daemon]\n# caf\xe9\n")
    with pytest.raises(ConfigError, match=r"latin1\.toml:2: .*not UTF-8"):
        load(path)


# -- env_file and cwd -----------------------------------------------------------------------


def test_env_file_is_merged_and_env_wins(tmp_path):
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "app.env").write_text(
        "# comment\n\nexport A=from-file\nB = 'quoted value'\nC=\"x=y\"\n"
    )
    path = write(tmp_path / "conf", '[pools.a]\ncommand = ["x"]\nenv_file = "app.env"\nenv = { A = "from-env" }\n')
    assert load(path).pools["a"].env == {"A": "from-env", "B": "quoted value", "C": "x=y"}


def test_env_file_absolute_path(tmp_path):
    env = tmp_path / "abs.env"
    env.write_text("K=V\n")
    cfg = parse(f'[pools.a]\ncommand = ["x"]\nenv_file = "{env}"\n', base_dir="/nonexistent")
    assert cfg.pools["a"].env == {"K": "V"}


def test_env_file_errors_have_both_lines(tmp_path):
    err = error_of(tmp_path, '[pools.a]\ncommand = ["x"]\n\nenv_file = "missing.env"\n')
    assert (err.key, err.line) == ("pools.a.env_file", 4) and "No such file" in str(err)
    (tmp_path / "bad.env").write_text("OK=1\nnot a pair\n")
    err = error_of(tmp_path, '[pools.a]\ncommand = ["x"]\nenv_file = "bad.env"\n')
    assert (err.key, err.line) == ("pools.a.env_file", 3)
    assert f"{tmp_path / 'bad.env'}:2: expected KEY=VALUE" in str(err)


def test_cwd_is_relative_to_the_config_file(tmp_path):
    sub = tmp_path / "etc"
    sub.mkdir()
    text = '[pools.a]\ncommand = ["x"]\ncwd = "../srv/app"\n[pools.b]\ncommand = ["x"]\ncwd = "/opt/b"\n[pools.c]\ncommand = ["x"]\n'
    cfg = load(write(sub, text))
    assert cfg.pools["a"].cwd == str(tmp_path / "srv" / "app")
    assert cfg.pools["b"].cwd == "/opt/b"
    assert cfg.pools["c"].cwd == str(sub)


def test_a_relative_config_path_is_made_absolute(tmp_path, monkeypatch):
    write(tmp_path, '[pools.a]\ncommand = ["x"]\ncwd = "w"\n')
    monkeypatch.chdir(tmp_path)
    cfg = load("orchestrator.toml")
    assert cfg.pools["a"].cwd == str(tmp_path / "w")
    assert cfg.source == "orchestrator.toml"


# -- diff: what reload applies --------------------------------------------------------------

BASE = """\
[pools.same]
command = ["sleep", "60"]

[pools.grow]
command = ["sleep", "60"]
size = 2

[pools.envchange]
command = ["sleep", "60"]
env = { A = "1" }

[pools.gone]
command = ["sleep", "60"]

[pools.policychange]
command = ["sleep", "60"]
restart = "always"
"""

NEW = """\
[pools.same]
command = ["sleep", "60"]

[pools.grow]
command = ["sleep", "60"]
size = 5

[pools.envchange]
command = ["sleep", "60"]
env = { A = "2" }
size = 4

[pools.policychange]
command = ["sleep", "60"]
restart = "never"

[pools.fresh]
target = "m:f"
"""


def test_diff_classifies_every_pool():
    old, new = parse(BASE, base_dir="/srv"), parse(NEW, base_dir="/srv")
    plan = diff(old, new)
    assert [d.name for d in plan.added] == ["fresh"]
    assert plan.removed == ["gone"]
    assert [d.name for d in plan.changed] == ["envchange", "policychange"]
    assert [d.name for d in plan.resized] == ["grow"]
    assert plan.unchanged == ["same"]
    assert plan.resized[0].size == 5
    assert plan.changed[0].size == 4  # a changed pool is rolled and sized at once
    assert plan.daemon_changed == [] and not plan.empty


def test_diff_from_nothing_adds_everything_and_to_itself_is_empty():
    cfg = parse(NEW, base_dir="/srv")
    plan = diff(None, cfg)
    assert [d.name for d in plan.added] == list(cfg.pools) and not plan.removed
    again = diff(cfg, parse(NEW, base_dir="/srv"))
    assert again.empty and again.unchanged == list(cfg.pools)


def test_diff_sees_daemon_settings():
    plan = diff(parse("[daemon]\ngrace = 1\n"), parse("[daemon]\ngrace = 2\nmetrics_port = 9000\n"))
    assert plan.daemon_changed == ["grace", "metrics_port"] and not plan.empty


@pytest.mark.parametrize(
    "extra",
    [
        'env = { A = "1" }', 'cwd = "/elsewhere"', 'memory_max = "1G"',
        "pids_max = 10", "cpu_weight = 50", "log_max_bytes = 20000", "log_backups = 0",
        "live_failures = 5", 'stop_signal = "INT"', "port_base = 9000",
    ],
)
def test_key_changes_with_what_runs_and_how(extra):
    base = '[pools.a]\ncommand = ["x"]\n'
    assert parse(base, base_dir="/srv").pools["a"].key() != parse(base + extra + "\n", base_dir="/srv").pools["a"].key()


def test_key_changes_with_preload():
    base = '[pools.a]\ntarget = "m:f"\n'
    assert parse(base, base_dir="/srv").pools["a"].key() != parse(base + 'preload = ["json"]\n', base_dir="/srv").pools["a"].key()


def test_key_ignores_size_and_spelling():
    a = parse('[pools.a]\ncommand = ["x"]\nsize = 1\nstop_signal = "TERM"\nbackoff = [0.1, 30]\n', base_dir="/s")
    b = parse('[pools.a]\nsize = 7\ncommand = ["x"]\n', base_dir="/s")
    assert a.pools["a"].key() == b.pools["a"].key()
    c = parse('[pools.a]\ncommand = ["x"]\nstop_signal = "SIGINT"\n', base_dir="/s")
    d = parse('[pools.a]\ncommand = ["x"]\nstop_signal = 2\n', base_dir="/s")
    assert c.pools["a"].key() == d.pools["a"].key()


def test_reload_rereads_the_env_file(tmp_path):
    (tmp_path / "a.env").write_text("K=1\n")
    path = write(tmp_path, '[pools.a]\ncommand = ["x"]\nenv_file = "a.env"\n')
    first = load(path)
    assert diff(first, load(path)).unchanged == ["a"]
    (tmp_path / "a.env").write_text("K=2\n")  # reload re-reads the env file
    assert [d.name for d in diff(first, load(path)).changed] == ["a"]


def test_pool_decl_is_frozen():
    decl = PoolDecl(name="a", spec={"command": ["x"]})
    with pytest.raises(AttributeError):
        decl.size = 3  # type: ignore[misc]


def test_an_executor_pool_table(tmp_path):
    (tmp_path / "code").mkdir()
    text = """
[pools.tasks]
kind = "executor"
size = 4
target = "app.tasks:handle"
preload = ["json"]
cwd = "code"
env = { MODE = "prod" }
memory_max = "200M"
max_tasks_per_child = 100
timeout = 30
grace = 2
retries = 1
log_max_bytes = "1M"
log_backups = 2
tenant_weights = { alice = 2, bob = 0.5 }
max_wait = 60
"""
    elastic = {"min_workers", "idle_timeout", "memory_budget"}  # test_elastic_fake.py reads those
    assert set(tomllib.loads(text)["pools"]["tasks"]) | {"env_file"} | elastic == set(config.EXECUTOR_KEYS)
    decl = load(write(tmp_path, text)).pools["tasks"]
    assert decl.size == 4
    assert decl.executor == {"max_tasks_per_child": 100, "timeout": 30.0, "grace": 2.0, "retries": 1,
                             "memory_max": 200 << 20, "target": "app.tasks:handle",
                             "tenant_weights": {"alice": 2, "bob": 0.5}, "max_wait": 60.0}
    assert decl.spec["target"] == "orchestrator.taskworker:main"
    assert decl.spec["preload"] == ["orchestrator.taskworker", "json"]
    assert decl.spec["cwd"] == str(tmp_path / "code") and decl.spec["env"] == {"MODE": "prod"}
    assert decl.policy == {"restart": "always", "grace": 2.0, "log_max_bytes": 1 << 20, "log_backups": 2}


@pytest.mark.parametrize("body, key", [
    ('kind = "executor"\ncommand = ["x"]', "command"),
    ('kind = "executor"\nretries = -1', "retries"),
    ('kind = "executor"\ntarget = "nocolon"', "target"),
    ('kind = "jobs"', "kind"),
    ('kind = "executor"\nsize = 0', "size"),
    ('kind = "executor"\ntenant_weights = { alice = -2 }', "tenant_weights"),
    ('kind = "executor"\ntenant_weights = 2', "tenant_weights"),
    ('kind = "executor"\nmax_wait = 0', "max_wait"),
])
def test_a_bad_executor_pool_is_one_line(tmp_path, body, key):
    with pytest.raises(ConfigError) as info:
        load(write(tmp_path, f"[pools.p]\n{body}\n"))
    assert f": {key}:" in str(info.value) or f".{key}:" in str(info.value), str(info.value)
    assert "\n" not in str(info.value)
