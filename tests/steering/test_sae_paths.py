"""/api/saes reads SAEs only from under MLXCEL_SAE_DIR or the model store root
(api/management/saes._path): an outside path, existing or not, or a symlink out, is refused
with one message; inside paths, relative names and store entries resolve."""

from __future__ import annotations

import os

import pytest

from mlxcel.api.management.envelope import Refusal
from mlxcel.api.management.saes import OUTSIDE, _path
from mlxcel.api.state import AppState
from mlxcel.cli.flags import parse_server_args
from mlxcel.config.settings import ServerSettings


@pytest.fixture
def dirs(tmp_path):
    for d in ("saes/tiny", "store/org/sae", "elsewhere/secret"):
        (tmp_path / d).mkdir(parents=True)
    os.symlink(tmp_path / "elsewhere", tmp_path / "saes" / "out")
    return tmp_path


def _state(dirs, sae_dir=True) -> AppState:
    settings = ServerSettings()
    settings.steering.sae_dir = dirs / "saes" if sae_dir else None
    return AppState(settings=settings, store_root=dirs / "store")


@pytest.mark.parametrize("ref", ["/etc", "/etc/no-such-sae", "{d}/elsewhere/secret", "{d}/elsewhere/missing",
                                 "{d}/saes/out/secret", "out/secret", "../elsewhere/secret", "{d}/saes/../elsewhere"])
def test_outside_paths_are_refused_alike(dirs, ref):
    with pytest.raises(Refusal) as e:
        _path({"path": ref.format(d=dirs)}, _state(dirs))
    assert (e.value.status, e.value.message) == (400, OUTSIDE)


def test_inside_paths_relative_names_and_store_entries(dirs):
    state = _state(dirs)
    assert _path({"path": str(dirs / "saes" / "tiny")}, state) == dirs / "saes" / "tiny"
    assert _path({"path": "tiny"}, state) == dirs / "saes" / "tiny"
    assert _path({"path": str(dirs / "saes" / "missing")}, state) == dirs / "saes" / "missing"  # then sae_not_found
    assert _path({"sae": "org/sae"}, state) == dirs / "store" / "org" / "sae"
    assert _path({"path": str(dirs / "store" / "org" / "sae")}, _state(dirs, sae_dir=False)) == dirs / "store/org/sae"
    with pytest.raises(Refusal):
        _path({"path": str(dirs / "saes" / "tiny")}, _state(dirs, sae_dir=False))


def test_the_cli_reads_the_directory():
    assert parse_server_args(["-m", "x"], {}).steering.sae_dir is None
    assert str(parse_server_args(["-m", "x"], {"MLXCEL_SAE_DIR": "/srv/saes"}).steering.sae_dir) == "/srv/saes"
