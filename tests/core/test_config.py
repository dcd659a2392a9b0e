"""kvd.config: defaults, every shipped file, the generated docs, and the errors users see."""

from __future__ import annotations

import dataclasses
import json
import pickle
import subprocess
import sys
from pathlib import Path
from typing import get_type_hints

import pytest

from kvd.config import (
    AuthConfig,
    Config,
    ConfigError,
    ConfigErrors,
    DaemonConfig,
    ECConfig,
    TransferConfig,
    config_keys,
    config_reference_markdown,
    example_toml,
    load_config,
    parse_config,
    resolve_agent_name,
    resolve_socket_path,
)

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "configs"
README = ROOT / "README.md"


def _write(tmp_path: Path, text: str, name: str = "kvd.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def _error(tmp_path: Path, text: str) -> ConfigError:
    path = _write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.source == str(path)
    return info.value


# --- defaults and shipped files ----------------------------------------------------------


def test_defaults_need_no_file() -> None:
    cfg = load_config(None)
    assert cfg == Config()
    assert cfg.daemon.socket_mode == 0o660
    assert cfg.daemon.max_frame_bytes == 16 * 1024 * 1024
    assert cfg.side_channel.port == 5600
    assert cfg.nixl.ucx_error_handling_mode == "peer"
    assert cfg.transfer.kv_lease_duration == 30.0
    assert cfg.auth.load_secret() is None
    assert cfg.ec.num_blocks == 256


def test_every_field_has_a_doc_and_a_default() -> None:
    for section_type in get_type_hints(Config).values():
        assert (section_type.__doc__ or "").strip(), section_type
        for f in dataclasses.fields(section_type):
            assert f.metadata["doc"].strip(), f.name
            assert f.default is not dataclasses.MISSING, f.name
    assert len(config_keys()) == len(set(config_keys())) > 30


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.toml")), ids=lambda p: p.name)
def test_shipped_config_parses(path: Path) -> None:
    load_config(path)


def test_shipped_configs_exist() -> None:
    names = {p.name for p in CONFIGS.glob("*.toml")}
    assert {"kvd.example.toml", "prefill.toml", "decode.toml", "encoder.toml"} <= names


def test_prefill_and_decode_configs_can_share_a_host() -> None:
    p = load_config(CONFIGS / "prefill.toml")
    d = load_config(CONFIGS / "decode.toml")
    assert (p.daemon.name, d.daemon.name) == ("kvd-prefill", "kvd-decode")
    assert (p.side_channel.port, d.side_channel.port) == (5600, 5601)
    assert resolve_socket_path(p) == Path("/run/kvd/prefill.sock")
    assert resolve_socket_path(d) == Path("/run/kvd/decode.sock")
    assert p.transfer.kv_lease_duration == d.transfer.kv_lease_duration
    assert load_config(CONFIGS / "encoder.toml").ec.role == "producer"


def test_example_file_is_generated() -> None:
    """configs/kvd.example.toml is `python -m kvd.config --example`, byte for byte."""
    assert (CONFIGS / "kvd.example.toml").read_text() == example_toml()


def test_example_holds_every_key_at_its_default() -> None:
    import tomllib

    data = tomllib.loads(example_toml())
    assert [f"{s}.{k}" for s, table in data.items() for k in table] == config_keys()
    assert parse_config(data, "example") == Config()


def test_reference_table_lists_every_key() -> None:
    table = config_reference_markdown()
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    assert len(rows) == len(config_keys())
    for key in config_keys():
        assert f"| `{key}` |" in table
    assert "| `daemon.socket_mode` | int | `0o660` |" in table


@pytest.mark.skipif(not README.exists(), reason="README.md not written yet")
def test_readme_documents_every_key() -> None:
    readme = README.read_text()
    missing = [key for key in config_keys() if f"`{key}`" not in readme]
    assert not missing, f"README.md lacks {missing}: paste `python -m kvd.config --reference`"


def test_module_cli() -> None:
    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "kvd.config", *args], capture_output=True, text=True
        )

    assert run("--example").stdout == example_toml()
    assert run("--reference").stdout == config_reference_markdown()
    ok = run("--check", str(CONFIGS / "prefill.toml"))
    assert ok.returncode == 0
    bad = run("--check", str(ROOT / "no-such-file.toml"))
    assert bad.returncode == 1
    assert "no-such-file.toml" in bad.stderr


# --- parsing ----------------------------------------------------------------------------


def test_values_are_read(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        """
        [daemon]
        name = "kvd-a.1_x"
        socket_mode = 0o600
        [transfer]
        kv_lease_duration = 60      # an int is fine for a float
        [ec]
        role = "both"
        region_bytes = 4_194_304
        block_bytes = 65_536
        cache_blocks_reserve = 64
        """.replace("        ", ""),
    )
    cfg = load_config(path)
    assert cfg.daemon.name == "kvd-a.1_x"
    assert cfg.daemon.socket_mode == 0o600
    assert cfg.transfer.kv_lease_duration == 60.0
    assert isinstance(cfg.transfer.kv_lease_duration, float)
    assert cfg.ec.num_blocks == 64
    assert cfg.side_channel == Config().side_channel  # untouched sections keep defaults


def test_config_is_frozen() -> None:
    cfg = load_config(None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.daemon.name = "x"  # type: ignore[misc]


def test_unknown_key_is_named_with_a_suggestion(tmp_path: Path) -> None:
    err = _error(tmp_path, "[transfer]\nkv_lease_duraton = 10\n")
    assert err.key == "transfer.kv_lease_duraton"
    assert "unknown key" in err.message
    assert "'kv_lease_duration'" in err.message
    assert str(err).startswith(f"{tmp_path / 'kvd.toml'}: transfer.kv_lease_duraton: ")


def test_unknown_section_is_named_with_a_suggestion(tmp_path: Path) -> None:
    err = _error(tmp_path, "[side-channel]\nport = 1\n")
    assert err.key == "side-channel"
    assert "unknown section" in err.message
    assert "'side_channel'" in err.message


def test_key_outside_its_section_points_to_it(tmp_path: Path) -> None:
    err = _error(tmp_path, "kv_lease_duration = 10\n")
    assert err.key == "kv_lease_duration"
    assert "transfer.kv_lease_duration" in err.message


def test_unknown_key_without_close_match(tmp_path: Path) -> None:
    err = _error(tmp_path, "[log]\nzzzz = 1\n")
    assert err.key == "log.zzzz"
    assert "did you mean" not in err.message


def test_section_must_be_a_table(tmp_path: Path) -> None:
    err = _error(tmp_path, 'daemon = "x"\n')
    assert err.key == "daemon"
    assert "must be a table" in err.message


def test_value_error_names_file_and_key(tmp_path: Path) -> None:
    err = _error(tmp_path, "[transfer]\nkv_lease_duration = -1\n")
    assert err.key == "transfer.kv_lease_duration"
    assert str(err) == f"{tmp_path / 'kvd.toml'}: transfer.kv_lease_duration: must be > 0 (got -1)"


@pytest.mark.parametrize(
    ("toml", "key", "needle"),
    [
        ('[transfer]\nkv_lease_duration = "30s"', "transfer.kv_lease_duration", "number"),
        ("[transfer]\nkv_lease_duration = true", "transfer.kv_lease_duration", "number"),
        ("[transfer]\nkv_lease_duration = inf", "transfer.kv_lease_duration", "finite"),
        ("[transfer]\nkv_lease_duration = nan", "transfer.kv_lease_duration", "finite"),
        ("[daemon]\nmailbox_size = 1.5", "daemon.mailbox_size", "integer"),
        ("[daemon]\nmailbox_size = true", "daemon.mailbox_size", "integer"),
        ("[daemon]\nmailbox_size = 0", "daemon.mailbox_size", "between 1 and 1_000_000"),
        ("[daemon]\nname = 5600", "daemon.name", "string"),
        ('[daemon]\nname = "kvd prefill"', "daemon.name", "A-Za-z0-9"),
        (f'[daemon]\nname = "{"a" * 65}"', "daemon.name", "64"),
        (f'[daemon]\nsocket = "/{"s" * 120}"', "daemon.socket", "107"),
        ("[daemon]\nsocket_mode = 0o1000", "daemon.socket_mode", "0o777"),
        ("[daemon]\nmax_frame_bytes = 100", "daemon.max_frame_bytes", "4 KiB"),
        ("[daemon]\nclient_timeout = 0", "daemon.client_timeout", "> 0"),
        ("[side_channel]\nport = 70000", "side_channel.port", "65535"),
        ('[side_channel]\nhost = ""', "side_channel.host", "address"),
        ('[side_channel]\nhost = "0.0.0.0"', "side_channel.advertise_host", "wildcard"),
        ('[side_channel]\nadvertise_host = "::"', "side_channel.advertise_host", "connect"),
        ('[side_channel]\nhost = "my_host"', "side_channel.host", "RFC 1123"),
        (
            '[side_channel]\nhost = "0.0.0.0"\nadvertise_host = "p_0.local"',
            "side_channel.advertise_host",
            "RFC 1123",
        ),
        ("[log]\nrejection_interval = 0", "log.rejection_interval", "> 0"),
        ('[nixl]\nbackend = "ucx"', "nixl.backend", "(did you mean 'UCX'?)"),
        ('[nixl]\nucx_error_handling_mode = "peers"', "nixl.ucx_error_handling_mode", "peer"),
        ("[nixl]\npoll_max_idle_us = 5", "nixl.poll_max_idle_us", "between 10"),
        ("[nixl]\nnum_threads = -1", "nixl.num_threads", "between 0"),
        ("[transfer]\nexpired_tombstones = -1", "transfer.expired_tombstones", "between 0"),
        ('[log]\nlevel = "INFO"', "log.level", "(did you mean 'info'?)"),
        ('[log]\nformat = "text"', "log.format", "console"),
        ("[metrics]\nport = -1", "metrics.port", "between 0"),
        ('[ec]\nrole = "server"', "ec.role", "producer"),
        ("[ec]\nregion_bytes = 1000\nblock_bytes = 300", "ec.region_bytes", "multiple"),
        ("[ec]\nregion_bytes = 0", "ec.region_bytes", "> 0"),
        ("[ec]\nblock_bytes = 0", "ec.block_bytes", "> 0"),
        ("[ec]\ncache_blocks_reserve = 257", "ec.cache_blocks_reserve", "256"),
        ("[ec]\nxfer_timeout = 0.0", "ec.xfer_timeout", "> 0"),
        ("[metrics]\nport = 5600", "metrics.port", "side_channel.port"),
        ('[ec]\nrole = "producer"\nport = 5600', "ec.port", "side_channel.port"),
    ],
)
def test_bad_value_is_named(tmp_path: Path, toml: str, key: str, needle: str) -> None:
    err = _error(tmp_path, toml + "\n")
    assert err.key == key
    assert needle in err.message
    assert str(err).startswith(f"{tmp_path / 'kvd.toml'}: {key}: ")


def test_ports_may_repeat_on_different_hosts_or_when_unused(tmp_path: Path) -> None:
    load_config(_write(tmp_path, '[metrics]\nport = 5600\nhost = "10.0.0.1"\n'))
    load_config(_write(tmp_path, '[ec]\nrole = "consumer"\nport = 5600\n'))


def test_toml_syntax_error(tmp_path: Path) -> None:
    err = _error(tmp_path, "[daemon\nname = 1\n")
    assert err.key == ""
    assert "invalid TOML" in err.message
    assert "line 1" in str(err)


def test_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "kvd.toml"
    path.write_bytes(b'[daemon]\nname = "\xff"\n')
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_config(path)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path / "absent.toml")
    assert info.value.source == str(tmp_path / "absent.toml")
    assert "cannot read" in info.value.message


def test_parse_config_blames_its_source() -> None:
    with pytest.raises(ConfigError) as info:
        parse_config({"daemon": {"mailbox_size": 0}}, "from-test")
    assert info.value.source == "from-test"
    assert str(info.value).startswith("from-test: daemon.mailbox_size: ")


def test_sections_validate_when_built_in_code() -> None:
    with pytest.raises(ConfigError) as info:
        TransferConfig(transfer_timeout=0)
    assert info.value.key == "transfer.transfer_timeout"
    with pytest.raises(ConfigError, match=r"ec\.region_bytes"):
        ECConfig(region_bytes=3, block_bytes=2)
    assert DaemonConfig(client_timeout=1).client_timeout == 1.0


def test_config_error_pickles() -> None:
    err = ConfigError("a.toml", "log.level", "bad")
    copy = pickle.loads(pickle.dumps(err))
    assert (copy.source, copy.key, copy.message, str(copy)) == (
        "a.toml",
        "log.level",
        "bad",
        "a.toml: log.level: bad",
    )


# --- auth secret -------------------------------------------------------------------------


def _secret(tmp_path: Path, content: bytes, mode: int) -> Path:
    path = tmp_path / "secret"
    path.write_bytes(content)
    path.chmod(mode)
    return path


def _auth_toml(tmp_path: Path, secret: Path) -> Path:
    return _write(tmp_path, f'[auth]\nsecret_file = "{secret}"\n')


def test_secret_file_is_loaded(tmp_path: Path) -> None:
    secret = _secret(tmp_path, b"s3cret\n", 0o600)
    cfg = load_config(_auth_toml(tmp_path, secret))
    assert cfg.auth.load_secret() == b"s3cret"
    secret.chmod(0o400)
    assert AuthConfig(secret_file=str(secret)).load_secret() == b"s3cret"


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o644, 0o660, 0o610])
def test_secret_readable_by_others_is_refused(tmp_path: Path, mode: int) -> None:
    secret = _secret(tmp_path, b"s3cret", mode)
    path = _auth_toml(tmp_path, secret)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.source == str(path)
    assert info.value.key == "auth.secret_file"
    assert "group or others" in info.value.message
    assert f"{mode:#o}" in info.value.message


def test_empty_secret_is_refused(tmp_path: Path) -> None:
    secret = _secret(tmp_path, b"\n", 0o600)
    with pytest.raises(ConfigError, match="empty"):
        load_config(_auth_toml(tmp_path, secret))


def test_missing_secret_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist") as info:
        load_config(_auth_toml(tmp_path, tmp_path / "nope"))
    assert info.value.key == "auth.secret_file"


def test_secret_must_be_a_regular_file(tmp_path: Path) -> None:
    directory = tmp_path / "dir"
    directory.mkdir(mode=0o700)
    with pytest.raises(ConfigError, match="regular file"):
        load_config(_auth_toml(tmp_path, directory))


# --- derived values ----------------------------------------------------------------------


def test_socket_path_from_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_RUNTIME_DIR", "/run/user/1000")
    cfg = parse_config({"daemon": {"socket": "/tmp/x.sock"}}, "t")
    assert resolve_socket_path(cfg) == Path("/tmp/x.sock")


def test_socket_path_under_xdg_runtime_dir(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_RUNTIME_DIR", "/run/user/1000")
    assert resolve_socket_path(Config()) == Path("/run/user/1000/kvd/kvd.sock")


@pytest.mark.parametrize("value", [None, ""])
def test_socket_path_without_xdg_runtime_dir(
    monkeypatch: pytest.MonkeyPatch, value: str | None
) -> None:
    if value is None:
        monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    else:
        monkeypatch.setenv("XDG_RUNTIME_DIR", value)
    assert resolve_socket_path(Config()) == Path("/run/kvd/kvd.sock")


def test_agent_name() -> None:
    assert resolve_agent_name(Config(), hostname="node-1", pid=42) == "kvd-node-1-5600"
    ephemeral = parse_config({"side_channel": {"port": 0}}, "t")
    assert resolve_agent_name(ephemeral, hostname="node-1", pid=42) == "kvd-node-1-42"
    assert resolve_agent_name(ephemeral, pid=42).endswith("-42")
    named = parse_config({"daemon": {"name": "kvd-prefill"}}, "t")
    assert resolve_agent_name(named) == "kvd-prefill"
    odd = resolve_agent_name(Config(), hostname="h\u00e9st " + "x" * 80, pid=1)
    assert len(odd) <= 64
    assert DaemonConfig(name=odd).name == odd  # always a valid name


def test_advertised_host() -> None:
    assert Config().side_channel.advertised_host == "127.0.0.1"
    cfg = parse_config({"side_channel": {"host": "0.0.0.0", "advertise_host": "10.1.2.3"}}, "t")
    assert cfg.side_channel.advertised_host == "10.1.2.3"


def test_every_error_in_a_file_is_reported_not_only_the_first() -> None:
    data = {
        "daemon": {"client_timeout": -1, "mailbox_sise": 3, "socket_mode": "x"},
        "transfer": {"kv_lease_duration": 0},
        "bogus": {},
        "ec": {"region_bytes": 3, "block_bytes": 2},  # a rule across fields, values fine
    }
    with pytest.raises(ConfigErrors) as info:
        parse_config(data, "many.toml")
    errors = info.value.all()
    assert sorted(e.key for e in errors) == [
        "bogus",
        "daemon.client_timeout",
        "daemon.mailbox_sise",
        "daemon.socket_mode",
        "ec.region_bytes",
        "transfer.kv_lease_duration",
    ]
    assert all(e.source == "many.toml" for e in errors)
    assert "did you mean 'mailbox_size'" in str(info.value)
    assert len(str(info.value).splitlines()) == 6  # one line each
    # it survives pickling (the daemon's start-up error crosses processes in tests)
    again = pickle.loads(pickle.dumps(info.value))
    assert [str(e) for e in again.all()] == [str(e) for e in errors]
    # a single error is raised as itself, as before
    with pytest.raises(ConfigError) as one:
        parse_config({"daemon": {"client_timeout": -1}}, "one.toml")
    assert not isinstance(one.value, ConfigErrors) and one.value.key == "daemon.client_timeout"


def test_check_config_lists_every_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('[daemon]\nclient_timeout = -1\nmailbox_size = "a"\n[transfer]\nbogus = 1\n')
    res = subprocess.run(
        [sys.executable, "-m", "kvd", "check-config", str(bad)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 2
    for key in ("daemon.client_timeout", "daemon.mailbox_size", "transfer.bogus"):
        assert f"{bad}: {key}:" in res.stderr, res.stderr
    assert "3 errors" in res.stderr
    res = subprocess.run(
        [sys.executable, "-m", "kvd", "check-config", str(bad), "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    out = json.loads(res.stdout)
    assert res.returncode == 2 and out["ok"] is False and len(out["errors"]) == 3
