"""Files read on an operator's behalf: the config file (`start --config`, `reload`,
SIGHUP), the env files its pools name, and `launch --env-file`. Another user's file, one
others can write, anything but a regular file (a FIFO must never block, /dev/zero never
be read), and an oversized one are refused with one line, and the daemon stays healthy."""

from __future__ import annotations

import json
import os
import pwd
import signal
import stat
import time
from pathlib import Path

import pytest

from helpers import DaemonUnderTest, cli, wait_for
from orchestrator.daemon import config
from orchestrator.paths import CONFIG_MAX_BYTES, ENV_FILE_MAX_BYTES, UnsafeFile, read_operator_file

pytestmark = pytest.mark.timeout(120)

# A refusal is one syscall or two: a CLI call that takes longer than this hung on the file.
QUICK = 30.0


def _nobody() -> int:
    if os.geteuid() != 0:
        pytest.skip("needs root, to give a file to another user")
    try:
        return pwd.getpwnam("nobody").pw_uid
    except KeyError:
        pytest.skip("no user 'nobody' on this system")


def one_line(proc) -> str:
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    return lines[0]


CONFIG = """
[daemon]
grace = 1.0
stop_budget = 5

[pools.web]
command = ["sleep", "1000"]
size = 1
"""


# -- the rules, on their own ---------------------------------------------------------------


def test_a_regular_file_of_ours_is_read(tmp_path: Path) -> None:
    f = tmp_path / "ok.toml"
    f.write_text("x = 1\n")
    f.chmod(0o644)
    assert read_operator_file(f, "config file", 100) == b"x = 1\n"
    link = tmp_path / "link.toml"  # a ConfigMap's file is a symbolic link: what it leads to counts
    link.symlink_to(f)
    assert read_operator_file(link, "config file", 100) == b"x = 1\n"


@pytest.mark.parametrize("mode", [0o664, 0o646, 0o666])
def test_a_file_others_can_write_is_refused(tmp_path: Path, mode: int) -> None:
    f = tmp_path / "w.toml"
    f.write_text("x = 1\n")
    f.chmod(mode)
    with pytest.raises(UnsafeFile, match=rf"writable by group or others \(mode 0{mode:o}\)"):
        read_operator_file(f, "config file", 100)
    assert read_operator_file(f, "env file", 100, trusted=False) == b"x = 1\n"  # a client's own file


def test_another_users_file_is_refused_even_through_a_link(tmp_path: Path) -> None:
    nobody = _nobody()
    f = tmp_path / "theirs.toml"
    f.write_text("x = 1\n")
    os.chown(f, nobody, -1)
    with pytest.raises(UnsafeFile, match=r"theirs\.toml: the config file is owned by uid \d+ \(nobody\), not by root"):
        read_operator_file(f, "config file", 100)
    link = tmp_path / "mine.toml"
    link.symlink_to(f)
    with pytest.raises(UnsafeFile, match="owned by uid"):
        read_operator_file(link, "config file", 100)


def test_root_owned_files_are_trusted_by_anyone(tmp_path: Path) -> None:
    st = os.stat("/etc/passwd")  # root's, 0644 on every system that has it
    if st.st_uid != 0 or st.st_mode & 0o022:
        pytest.skip("/etc/passwd is not root's 0644 here")
    assert read_operator_file("/etc/passwd", "env file", 1 << 20)


def test_fifo_device_directory_socket_are_refused_without_blocking(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)  # nobody will ever write to it: a blocking open would hang here
    for path, kind in ((fifo, "a FIFO"), ("/dev/zero", "a character device"), (tmp_path, "a directory")):
        started = time.monotonic()
        for trusted in (True, False):
            with pytest.raises(UnsafeFile, match=f"is {kind}, not a regular file"):
                read_operator_file(path, "config file", 100, trusted=trusted)
        assert time.monotonic() - started < QUICK


def test_an_oversized_file_is_refused(tmp_path: Path) -> None:
    f = tmp_path / "big"
    f.write_bytes(b"#" * 101)
    with pytest.raises(UnsafeFile, match="is 101 bytes, more than the 100 bytes allowed"):
        read_operator_file(f, "config file", 100)
    f.write_bytes(b"#" * 100)
    assert len(read_operator_file(f, "config file", 100)) == 100


def test_the_bounds_are_what_the_docs_say() -> None:
    assert CONFIG_MAX_BYTES == 256 << 10 and ENV_FILE_MAX_BYTES == 1 << 20
    assert config.ENV_FILES_MAX_BYTES == 4 << 20


# -- config.load: the config file and its env files --------------------------------------


def test_config_load_refuses_with_one_line(tmp_path: Path) -> None:
    f = tmp_path / "c.toml"
    f.write_text(CONFIG)
    f.chmod(0o666)
    with pytest.raises(config.ConfigError, match=r"c\.toml: the config file is writable by group or others"):
        config.load(f)
    f.chmod(0o644)
    f.write_text(CONFIG + "#" * CONFIG_MAX_BYTES)
    with pytest.raises(config.ConfigError, match="more than the 256 KiB allowed"):
        config.load(f)


def test_env_files_are_held_to_the_same_rules(tmp_path: Path) -> None:
    f = tmp_path / "c.toml"
    env = tmp_path / "web.env"
    env.write_text("A=1\n")
    f.write_text(CONFIG + 'env_file = "web.env"\n')
    assert config.load(f).pools["web"].env == {"A": "1"}
    env.chmod(0o666)
    with pytest.raises(config.ConfigError, match=r"c\.toml:\d+: pools\.web\.env_file: .*web\.env: the env file is writable"):
        config.load(f)
    env.unlink()
    os.mkfifo(env)
    with pytest.raises(config.ConfigError, match="pools.web.env_file: .*is a FIFO"):
        config.load(f)
    f.write_text(CONFIG + 'env_file = "/dev/zero"\n')
    with pytest.raises(config.ConfigError, match="pools.web.env_file: /dev/zero: the env file is a character device"):
        config.load(f)


def test_env_files_of_all_pools_together_are_bounded(tmp_path: Path) -> None:
    env = tmp_path / "big.env"
    line = "K%d=" + "v" * 60 + "\n"
    env.write_text("".join(line % i for i in range(ENV_FILE_MAX_BYTES // 80)))
    pools = "".join(f'[pools.p{i}]\ncommand = ["true"]\nenv_file = "big.env"\n' for i in range(6))
    f = tmp_path / "c.toml"
    f.write_text(pools)
    with pytest.raises(config.ConfigError, match=r"pools\.p\d\.env_file: the env files .* add up to more than 4 MiB"):
        config.load(f)


def test_nobodys_env_file_is_refused(tmp_path: Path) -> None:
    nobody = _nobody()
    env = tmp_path / "web.env"
    env.write_text("A=1\n")
    os.chown(env, nobody, -1)
    f = tmp_path / "c.toml"
    f.write_text(CONFIG + 'env_file = "web.env"\n')
    with pytest.raises(config.ConfigError, match=r"pools\.web\.env_file: .*owned by uid \d+ \(nobody\)"):
        config.load(f)


# -- through the CLI, as an operator meets them --------------------------------------------


def test_start_refuses_an_untrusted_config_in_one_line(daemon: DaemonUnderTest, tmp_path: Path) -> None:
    conf = tmp_path / "c.toml"
    conf.write_text(CONFIG)
    conf.chmod(0o664)
    proc = cli(daemon.state_dir, "start", "--config", str(conf), timeout=QUICK)
    assert proc.returncode == 1 and "writable by group or others" in one_line(proc)
    conf.chmod(0o644)
    conf.unlink()
    os.mkfifo(conf)
    proc = cli(daemon.state_dir, "start", "--config", str(conf), timeout=QUICK)
    assert proc.returncode == 1 and "is a FIFO, not a regular file" in one_line(proc)
    conf.unlink()
    conf.write_text(CONFIG + "#" * CONFIG_MAX_BYTES)
    proc = cli(daemon.state_dir, "start", "--config", str(conf), timeout=QUICK)
    assert proc.returncode == 1 and "allowed" in one_line(proc)
    assert cli(daemon.state_dir, "status").returncode == 3  # nothing started


def test_start_refuses_nobodys_config(daemon: DaemonUnderTest, tmp_path: Path) -> None:
    nobody = _nobody()
    conf = tmp_path / "c.toml"
    conf.write_text(CONFIG)
    os.chown(conf, nobody, -1)
    proc = cli(daemon.state_dir, "start", "--config", str(conf), timeout=QUICK)
    assert proc.returncode == 1 and "owned by uid" in one_line(proc) and "(nobody)" in proc.stderr
    assert cli(daemon.state_dir, "status").returncode == 3


def _pool_commands(d: DaemonUnderTest) -> dict[str, list[str]]:
    return {p["name"]: p["spec"]["command"] for p in d.status()["pools"]}


def healthy_now(d: DaemonUnderTest) -> None:
    started = time.monotonic()
    proc = cli(d.state_dir, "health", "--json", timeout=QUICK)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert json.loads(proc.stdout)["lag"] < 1.0
    assert time.monotonic() - started < QUICK


def test_reload_refuses_an_untrusted_file_and_the_running_config_stays(daemon: DaemonUnderTest, tmp_path: Path) -> None:
    conf = tmp_path / "c.toml"
    conf.write_text(CONFIG)
    daemon.start("--config", str(conf))
    wait_for(lambda: any(r["state"] == "RUNNING" for r in daemon.status()["replicas"]), 20, "the web pool")
    before = _pool_commands(daemon)
    changed = CONFIG.replace('"1000"', '"1001"')

    def refused(words: str) -> None:
        proc = cli(daemon.state_dir, "reload", timeout=QUICK)
        assert proc.returncode == 1 and words in one_line(proc), proc.stderr
        assert _pool_commands(daemon) == before
        healthy_now(daemon)

    conf.write_text(changed)
    conf.chmod(0o646)
    refused("writable by group or others")

    conf.unlink()
    os.mkfifo(conf)  # nobody ever writes to it: a blocking open would hang the loop
    refused("is a FIFO")
    os.kill(daemon.pid, signal.SIGHUP)  # the same through SIGHUP: logged, the loop goes on
    healthy_now(daemon)
    assert _pool_commands(daemon) == before

    conf.unlink()
    conf.write_text(changed + 'env_file = "/dev/zero"\n')
    refused("/dev/zero: the env file is a character device")

    conf.write_text(changed + "#" * CONFIG_MAX_BYTES)
    refused("allowed")

    conf.write_text(changed)  # a good file again: applied
    proc = cli(daemon.state_dir, "reload", timeout=QUICK)
    assert proc.returncode == 0, proc.stderr
    assert _pool_commands(daemon) == {"web": ["sleep", "1001"]}
    assert cli(daemon.state_dir, "stop", timeout=QUICK).returncode == 0


def test_reload_refuses_nobodys_file(daemon: DaemonUnderTest, tmp_path: Path) -> None:
    nobody = _nobody()
    conf = tmp_path / "c.toml"
    conf.write_text(CONFIG)
    daemon.start("--config", str(conf))
    before = _pool_commands(daemon)
    conf.write_text(CONFIG.replace('"sleep", "1000"', '"touch", "/tmp/pwned"'))
    os.chown(conf, nobody, -1)
    proc = cli(daemon.state_dir, "reload", timeout=QUICK)
    assert proc.returncode == 1 and "owned by uid" in one_line(proc) and "(nobody)" in proc.stderr
    assert _pool_commands(daemon) == before
    os.chown(conf, 0, -1)
    env = tmp_path / "web.env"  # and an env file of theirs, named by a file of ours
    env.write_text("A=1\n")
    os.chown(env, nobody, -1)
    conf.write_text(CONFIG + 'env_file = "web.env"\n')
    proc = cli(daemon.state_dir, "reload", timeout=QUICK)
    assert proc.returncode == 1 and "pools.web.env_file" in one_line(proc) and "(nobody)" in proc.stderr
    assert _pool_commands(daemon) == before
    healthy_now(daemon)


def test_launch_env_file_is_bounded_and_never_blocks(daemon: DaemonUnderTest, tmp_path: Path) -> None:
    daemon.start()
    fifo = tmp_path / "env.fifo"
    os.mkfifo(fifo)
    big = tmp_path / "big.env"
    big.write_text("A=" + "x" * ENV_FILE_MAX_BYTES + "\n")
    for path, words in (("/dev/zero", "is a character device"), (str(fifo), "is a FIFO"),
                        (str(big), "allowed"), (str(tmp_path), "is a directory")):
        proc = cli(daemon.state_dir, "launch", "--pool", "p", "--env-file", path, "--", "sleep", "100", timeout=QUICK)
        assert proc.returncode == 1 and words in one_line(proc) and "--env-file" in proc.stderr, proc.stderr
    ok = tmp_path / "ok.env"
    ok.write_text("A=1\n")
    ok.chmod(0o666)  # the caller's own file, read with the caller's rights: its mode is its business
    proc = cli(daemon.state_dir, "launch", "--pool", "p", "--env-file", str(ok), "--", "sleep", "100", timeout=QUICK)
    assert proc.returncode == 0, proc.stderr
    assert stat.S_IMODE(ok.stat().st_mode) == 0o666
    healthy_now(daemon)
