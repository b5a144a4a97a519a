"""Router mode's configuration: the flags, the preset INI and the model inventory (mlxcel/router).

No model is loaded here: the registry is read from small directories holding only a
config.json, which is all discovery looks at.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mlxcel.cli.flags import model_settings, parse_server_args
from mlxcel.config.refusal import StartupRefusal
from mlxcel.router.mode import is_router
from mlxcel.router.preset import GLOBAL, effective_args, parse_preset
from mlxcel.router.registry import CACHE, MODELS_DIR, PRESET, RegistryError, discover, lookup


def _ckpt(path: Path, model_type: str = "llama") -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({"model_type": model_type}))
    return path


def _ini(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "presets.ini"
    p.write_text(text)
    return p


# --- flags -------------------------------------------------------------------------------------


def test_router_flags_land_in_settings(tmp_path):
    s = parse_server_args(["--models-dir", str(tmp_path), "--models-max", "2", "--no-models-autoload"], {})
    assert (s.router.models_dir, s.router.models_max, s.router.models_autoload) == (tmp_path, 2, False)
    assert is_router(s)
    env = parse_server_args([], {"LLAMA_ARG_MODELS_DIR": str(tmp_path), "LLAMA_ARG_MODELS_MAX": "0",
                                 "LLAMA_ARG_MODELS_AUTOLOAD": "false"})
    assert (env.router.models_dir, env.router.models_max, env.router.models_autoload) == (tmp_path, 0, False)
    single = parse_server_args(["-m", "some/model", "--models-max", "2"], {})
    assert not is_router(single)
    assert any("--models-max applies to router mode only" in n for n in single.notices)


@pytest.mark.parametrize("argv, words", [
    (["--models-dir", "{d}", "-m", "x/y"], ["--models-dir", "model argument", "--model-store-root"]),
    (["--models-dir", "{d}", "--hf-repo", "x/y"], ["--models-dir", "model argument"]),
    (["--models-preset", "{ini}", "-m", "x/y"], ["--models-preset", "model argument"]),
    (["--models-dir", "{d}/missing"], ["no such directory"]),
    (["--models-preset", "{d}/missing.ini"], ["no such file"]),
    (["--models-max", "-1"], ["--models-max", "-1"]),
    (["--models-max", "two"], ["--models-max", "two"]),
    (["--models-dir", "{d}", "--embeddings"], ["--embeddings", "router mode"]),
    (["--models-dir", "{d}", "--any-model-name"], ["--any-model-name", "picks the model"]),
])
def test_router_flag_refusals(tmp_path, argv, words):
    ini = _ini(tmp_path, "[*]\n")
    argv = [a.format(d=tmp_path, ini=ini) for a in argv]
    with pytest.raises(StartupRefusal) as e:
        parse_server_args(argv, {})
    for w in words:
        assert w in e.value.message


# --- the preset INI ----------------------------------------------------------------------------


def test_preset_sections_and_key_spellings(tmp_path):
    p = parse_preset(_ini(tmp_path, "; comment\n[*]\nLLAMA_ARG_CTX_SIZE = 512\ntemperature = 0.5\n\n"
                                    "[chat]\nmodel = /x\nalias = b,a\ntags = t\nctx_size = 256\n--top-k = 7\n"
                                    "load-on-startup = true\nstop-timeout = 5\n"))
    assert p.global_.name == GLOBAL and p.global_.values == {"ctx-size": "512", "temp": "0.5"}
    chat = p.sections["chat"]
    assert chat.model == "/x" and chat.listed("alias") == ["a", "b"] and chat.listed("tags") == ["t"]
    assert chat.values["ctx-size"] == "256" and chat.values["top-k"] == "7" and chat.load_on_startup


@pytest.mark.parametrize("text, words", [
    ("[m]\nmodel = /x\nflash-attn = on\n", ["'flash-attn'", "[m]"]),
    ("[*]\nLLAMA_ARG_N_GPU_LAYERS = 9\n", ["'LLAMA_ARG_N_GPU_LAYERS'", "[*]"]),
    ("[*]\nmodel = /x\n", ["[*]", "own section"]),
    ("[m]\nload-on-startup = maybe\n", ["load-on-startup", "maybe"]),
    ("[m]\nstop-timeout = soon\n", ["stop-timeout", "soon"]),
    ("no section header\n", ["not a readable INI file"]),
])
def test_preset_refusals_name_key_and_section(tmp_path, text, words):
    with pytest.raises(StartupRefusal) as e:
        parse_preset(_ini(tmp_path, text))
    for w in words:
        assert w in e.value.message


def test_preset_values_apply_through_the_flag_pipeline(tmp_path):
    p = parse_preset(_ini(tmp_path, "[*]\nctx-size = 512\ntemp = 0.3\n[m]\nmodel = /x\nctx-size = 256\n"
                                    "parallel = 2\nseed = 7\nn-predict = 9\ntop-p = 0.5\nmin-p = 0.1\n"))
    base = parse_server_args(["--models-preset", str(p.path), "--top-k", "3"], {})
    own = model_settings(base, [p.global_, p.sections["m"]])
    assert (own.engine.ctx_size, own.engine.parallel, own.sampling.seed, own.engine.n_predict) == (256, 2, 7, 9)  # the model's section wins
    assert (own.sampling.temperature, own.sampling.top_p, own.sampling.min_p, own.sampling.top_k) == (0.3, 0.5, 0.1, 3)
    assert base.engine.ctx_size == 0 and own.router.models_preset is None  # the router's own settings are untouched
    # a flag the router was started with wins over every preset
    pinned = parse_server_args(["--models-preset", str(p.path), "-c", "1024"], {})
    assert model_settings(pinned, [p.global_, p.sections["m"]]).engine.ctx_size == 1024
    assert "--ctx-size" not in effective_args(pinned, [p.global_, p.sections["m"]])
    assert effective_args(base, [p.global_, p.sections["m"]])[:2] == ["--ctx-size", "256"]


def test_preset_bad_value_is_refused_like_the_flag(tmp_path):
    p = parse_preset(_ini(tmp_path, "[m]\nmodel = /x\nctx-size = lots\n"))
    with pytest.raises(StartupRefusal) as e:
        model_settings(parse_server_args(["--models-preset", str(p.path)], {}), [p.global_, p.sections["m"]])
    assert "ctx-size in [m]" in e.value.message and "lots" in e.value.message


# --- the inventory -----------------------------------------------------------------------------


def test_sources_and_precedence(tmp_path):
    store, mdir = tmp_path / "store", tmp_path / "md"
    _ckpt(store / "org" / "cached")
    _ckpt(store / "org" / "embedder", model_type="bert")  # not a generation checkpoint: not listed
    _ckpt(mdir / "local")
    _ckpt(mdir / "org")  # not a clash: cache names are owner/name
    _ckpt(tmp_path / "elsewhere")
    (mdir / "escape").symlink_to(tmp_path / "elsewhere")  # resolves outside: skipped
    (mdir / "inside").symlink_to(mdir / "local")  # resolves inside: its own name
    (mdir / "notes").mkdir()  # no config.json: not a model
    ini = _ini(tmp_path, f"[local]\nmodel = {tmp_path / 'elsewhere'}\nalias = loc\n"
                         "[org/cached]\ntags = fast\n[hub]\nhf-repo = org/cached\n")
    found = discover(store, mdir, parse_preset(ini))
    assert sorted(found) == ["hub", "inside", "local", "org", "org/cached"]
    assert found["org/cached"].source == CACHE and found["org/cached"].tags == ["fast"]
    assert found["inside"].source == MODELS_DIR and found["inside"].path == (mdir / "local").resolve()
    assert found["local"].source == PRESET and found["local"].path == (tmp_path / "elsewhere").resolve()
    assert found["hub"].path == store / "org" / "cached" and found["hub"].repo_id == "org/cached"
    assert lookup(found, "loc") is found["local"] and lookup(found, "nope") is None
    assert [s.name for s in found["local"].sections] == ["*", "local"]


@pytest.mark.parametrize("ini, words", [
    ("[ghost]\nctx-size = 5\n", ["[ghost]", "neither model nor hf-repo"]),
    ("[a]\nmodel = {m}\nalias = b\n[b]\nmodel = {m}\n", ["alias 'b'", "another model"]),
    ("[a]\nmodel = {m}\nalias = x\n[b]\nmodel = {m}\nalias = x\n", ["alias 'x'", "also an alias"]),
    ("[a]\nmodel = {m}/nothing\n", ["not a checkpoint directory"]),
    ("[a]\nhf-repo = a/b/c\n", ["not a repository id"]),
])
def test_registry_refusals(tmp_path, ini, words):
    m = _ckpt(tmp_path / "m")
    with pytest.raises(RegistryError) as e:
        discover(None, None, parse_preset(_ini(tmp_path, ini.format(m=m))))
    for w in words:
        assert w in str(e.value)
