"""`kvbroker serve` refuses bad settings as argparse refuses a bad flag: exit 2, one line naming each; a
daemon installed without its tooling says so for `demo` and `bench`."""

from __future__ import annotations

import sys

import pytest

from kvbroker import cli


def test_a_bad_flag_value_names_the_setting_its_variable_and_the_rule(capsys):
    with pytest.raises(SystemExit) as exited:
        cli.main(["serve", "--backend", "bogus"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("kvbroker serve: error: backend (--backend / KVBROKER_BACKEND): ")
    assert "'nixl' or 'mooncake'" in err and "'bogus'" in err
    assert "Traceback" not in err


def test_a_bad_environment_value_is_refused_the_same_way(capsys, monkeypatch):
    monkeypatch.setenv("KVBROKER_MAX_PEER_READS", "0")
    with pytest.raises(SystemExit) as exited:
        cli.main(["serve"])
    assert exited.value.code == 2
    assert "max_peer_reads (--max-peer-reads / KVBROKER_MAX_PEER_READS): Input should be greater than 0" in \
        capsys.readouterr().err


@pytest.mark.parametrize("command", ["demo", "bench"])
def test_a_daemon_without_its_tooling_says_which_package_the_command_needs(capsys, monkeypatch, command):
    monkeypatch.setitem(sys.modules, "kvbroker_tools", None)  # as in the image: the package is not installed
    assert cli.main([command]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kvbroker {command}: needs the kvbroker-tools package")
    assert "pip install -e tooling" in err and "Traceback" not in err


def test_the_version_is_the_packages(capsys):
    from kvbroker import __version__

    with pytest.raises(SystemExit) as exited:
        cli.main(["--version"])
    assert exited.value.code == 0 and capsys.readouterr().out == f"kvbroker {__version__}\n"
