"""The llama-server b10621 flag surface: spellings, pre-pass, environment rules, refusals, dump.

Refusals run the real command line in a subprocess (the parse path `mlxcel-server` runs before
it resolves a model) and check exit status 1, one `error:` line on stderr, nothing on stdout.
No model is loaded anywhere in this file.
"""

from __future__ import annotations

import importlib.util
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from mlxcel.cli.flags import _parse_given, parse_server_args, prepass, uvicorn_kwargs
from mlxcel.cli.introspect import completion_bash
from mlxcel.cli.options_apply import check_gpu_layers
from mlxcel.cli.options_model import STATES
from mlxcel.cli.options_reasons import PRESETS
from mlxcel.cli.options_table import TABLE, b10621_entries
from mlxcel.config.refusal import StartupRefusal

REPO = Path(__file__).resolve().parents[2]

# The real entry when it exists (the lead's server.py parses first), plus the parse-only check.
ENTRIES = [["-m", "mlxcel.cli.flags_check"]]
if importlib.util.find_spec("mlxcel.cli.server") is not None:
    ENTRIES.append(["-m", "mlxcel.cli.server"])


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("LLAMA_", "AIP_", "MTMD_")) and k not in ("HF_TOKEN",)}
    env["PYTHONPATH"] = str(REPO)
    env.update(extra)
    return env


def run(args: list[str], entry: list[str] | None = None, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *(entry or ENTRIES[0]), *args], capture_output=True, text=True,
                          env=clean_env(**env), cwd=REPO, timeout=60)


def parse(*argv: str, **environ: str):
    return parse_server_args(list(argv), environ)


def refused(*argv: str, **environ: str) -> str:
    with pytest.raises(StartupRefusal) as e:
        parse(*argv, **environ)
    assert "\n" not in e.value.message
    return e.value.message


# ---- the table --------------------------------------------------------------------------------


def test_table_covers_every_b10621_help_entry():
    entries = b10621_entries()
    assert len(entries) == 249
    longs = {s for o in entries for s in o.longs + o.neg_longs}
    shorts = {s for o in entries for s in o.shorts + o.neg_shorts}
    envs = {o.env for o in entries if o.env}
    assert len(longs) == 323 and len(shorts) == 84
    assert len({e for e in envs if e.startswith("LLAMA_")}) == 134
    assert envs - {e for e in envs if e.startswith("LLAMA_")} == {"HF_TOKEN", "MTMD_BACKEND_DEVICE"}
    assert all(o.state in STATES for o in TABLE)
    assert len({o.key for o in TABLE}) == len(TABLE)


def test_every_spelling_parses():
    for o in TABLE:
        for s in o.spellings:
            argv = [s] + (["x"] * o.nargs)
            given = _parse_given(argv, "mlxcel-server") if o.entry != "--help" else None
            if given is not None:
                assert o.key in given, s


# ---- pre-pass ---------------------------------------------------------------------------------


def test_prepass_rewrites_multi_letter_single_dash_and_joins_values():
    assert prepass(["-ngl", "99", "-fa", "on", "-nocb", "-np", "2"]) == [
        "--gpu-layers=99", "--flash-attn=on", "--no-cont-batching", "--parallel=2"]
    # underscores fold to dashes in long spellings, as b10621 does
    assert prepass(["--ctx_size", "128"]) == ["--ctx-size=128"]


def test_prepass_never_rewrites_a_value_and_stops_at_double_dash():
    s = parse("--api-key", "-ngl", "--alias", "-hf")
    assert s.server.api_keys == ["-ngl"] and s.source.alias == ["-hf"]
    assert prepass(["-c", "8", "--", "-ngl"]) == ["--ctx-size=8", "--", "-ngl"]


def test_short_and_multi_letter_spellings_reach_their_settings():
    s = parse("-m", "a/b", "-c", "4096", "-n", "16", "-np", "2", "-nocb", "-cram", "64", "-a", "zebra,apple",
              "-to", "30", "-lv", "4", "-s", "7")
    assert (s.source.model, s.engine.ctx_size, s.engine.n_predict, s.engine.parallel, s.engine.cont_batching) == ("a/b", 4096, 16, 2, False)
    assert (s.kv.cache_ram_mib, s.source.alias, s.server.timeout, s.logging.verbosity, s.sampling.seed) == (64, ["apple", "zebra"], 30, 4, 7)


def test_kv_cache_types_are_chosen_for_keys_and_values_apart():
    s = parse("-ctk", "int8")
    assert (s.kv.cache_type_k, s.kv.cache_type_v) == ("int8", "f16")
    s = parse("--cache-type-v", "int8", LLAMA_ARG_CACHE_TYPE_K="f16")
    assert (s.kv.cache_type_k, s.kv.cache_type_v) == ("f16", "int8")
    s = parse("-ctk", "turbo4", "-ctv", "turbo3")
    assert (s.kv.cache_type_k, s.kv.cache_type_v) == ("turbo4", "turbo3")


def test_hf_repo_wins_over_model():
    s = parse("--hf-repo", "org/mlx-model", "-m", "other/model")
    assert s.source.model == "org/mlx-model"
    assert any("supersedes" in n for n in s.notices)


def test_parallel_auto_and_seed_fold():
    assert parse("-np", "-1").engine.parallel == 4
    assert parse("--seed", "-2").sampling.seed == 4294967294
    assert parse("--seed", "4294967295").sampling.seed == -1


# ---- environment ------------------------------------------------------------------------------


def test_command_line_beats_environment():
    assert parse(LLAMA_ARG_CTX_SIZE="100").engine.ctx_size == 100
    s = parse("-c", "200", LLAMA_ARG_CTX_SIZE="100")
    assert s.engine.ctx_size == 200 and any("LLAMA_ARG_CTX_SIZE" in n for n in s.notices)
    assert parse("--no-cont-batching", LLAMA_ARG_CONT_BATCHING="on").engine.cont_batching is False


def test_flag_from_environment_fires_only_on_the_case_sensitive_truthy_set():
    for v in ("on", "enabled", "true", "1"):
        assert parse(LLAMA_ARG_OFFLINE=v).source.offline is True
    for v in ("0", "TRUE", "yes", ""):
        assert parse(LLAMA_ARG_OFFLINE=v).source.offline is False
    parse(LLAMA_ARG_CPU_MOE="0")  # not truthy: --cpu-moe never fires, so nothing to refuse
    assert "--cpu-moe" in refused(LLAMA_ARG_CPU_MOE="1")


def test_bool_pair_from_environment():
    assert parse(LLAMA_ARG_CONT_BATCHING="disabled").engine.cont_batching is False
    assert parse(LLAMA_ARG_CONT_BATCHING="enabled").engine.cont_batching is True
    assert "invalid boolean" in refused(LLAMA_ARG_PERF="sometimes")
    assert "invalid boolean" in refused(LLAMA_ARG_CONT_BATCHING="False")
    # LLAMA_ARG_NO_* means false whatever its value, and outranks the positive variable
    assert parse(LLAMA_ARG_NO_CONT_BATCHING="", LLAMA_ARG_CONT_BATCHING="1").engine.cont_batching is False
    assert parse(LLAMA_ARG_NO_UI="1").server.webui is False
    assert parse(LLAMA_ARG_UI="true").server.webui is True and parse().server.webui is True


def test_value_options_bind_their_variables():
    s = parse(LLAMA_ARG_HOST="/tmp/x.sock", LLAMA_ARG_PORT="0", LLAMA_API_KEY="k1,k2", HF_TOKEN="hf_abc",
              LLAMA_ARG_N_PARALLEL="3", LLAMA_ARG_TIMEOUT="5")
    assert (s.server.unix_socket, s.server.port, s.server.api_keys, s.source.hf_token, s.engine.parallel, s.server.timeout) == (
        "/tmp/x.sock", 0, ["k1", "k2"], "hf_abc", 3, 5)
    assert {"k1", "k2", "hf_abc"} <= set(s.logging.secrets)


# ---- refusals through the real command line ---------------------------------------------------

REFUSALS = [
    # GGML runtime group: refused unless inert, naming the option and the value
    (["--numa", "distribute"], "--numa distribute"),
    (["-sm", "row"], "--split-mode row"),
    (["-ts", "3,1"], "--tensor-split"),
    (["--rpc", "h:1"], "--rpc"),
    (["-t", "eight"], "--threads"),
    (["--mlock"], "--mlock"),
    (["-fa", "off"], "--flash-attn off"),
    (["--no-kv-offload"], "--cache-type-k"),
    (["--perf"], "--metrics"),
    (["-dev", "CUDA0,CUDA1"], "--device"),
    (["-dev", "tpu"], "--device"),
    (["--fit", "maybe"], "--fit"),
    # GGUF-only model sources
    (["-hff", "model-Q4_K_M.gguf"], "--hf-file"),
    (["-mu", "https://huggingface.co/org/repo/resolve/main/x.gguf"], "--hf-repo org/repo"),
    (["-dr", "gemma3"], "--docker-repo"),
    (["-hf", "org/repo-GGUF:Q4_K_M"], ":Q4_K_M"),
    (["--mmproj", "proj.gguf"], "--mmproj"),
    # presets name the nearest MLX checkpoint and the command line
    (["--gpt-oss-20b-default"], "mlxcel-server -m mlx-community/gpt-oss-20b-MXFP4-Q8"),
    (["--spec-default"], "--spec-default"),
    # web UI / tools / MCP / agent
    (["--webui-config", "{}"], "--webui-config"),
    (["--tools", "all"], "--tools all"),
    (["-ag"], "--agent"),
    (["--ui-mcp-proxy"], "--ui-mcp-proxy"),
    (["--path", "/nonexistent/www"], "not a directory"),
    # control vectors, prompt logging
    (["--control-vector", "v.gguf"], "logit_bias"),
    (["--control-vector-scaled", "v.gguf:0"], "--control-vector-scaled"),
    (["--log-prompts-dir", "/tmp/prompts"], "--verbosity 4"),
    # cache knobs with no mlxcel counterpart
    (["--cache-reuse", "256"], "--cache-reuse 256"),
    (["-ctk", "q8_0"], "--cache-type-k q8_0"),
    (["-ctv", "q4_0"], "the modes are f16, int8"),
    (["-ctv", "bf16"], "no bf16 storage"),
    (["-ctkd", "int8"], "the modes are f16"),
    (["-ctkd", "turbo4"], "the modes are f16"),
    (["-ctk", "fp16+turbo4"], "most recent tokens unquantized"),
    (["-ctv", "turbo4-delegated"], "the modes are f16, int8, turbo4, turbo3"),
    (["-ctk", "q9"], "expected one of"),
    (["-sps", "1.5"], "--slot-prompt-similarity 1.5"),
    (["-t", "4", "-tb", "8"], "pass -t 8 with it"),
    (["-ctxcp", "8"], "--ctx-checkpoints 8"),
    # deferred and removed options are refused, never silently accepted
    (["--json-schema", "{not json"], "--json-schema: invalid JSON schema"),
    (["--lora", "adapter.safetensors"], "LoRA adapter adapter.safetensors: no such file or directory"),
    (["--lora-scaled", "adapter:nan"], "must be a finite number"),
    (["--lora-scaled", "adapter:big"], "is not a number"),
    (["--draft", "5"], "the argument has been removed"),
    # usage errors
    (["--bogus"], "unrecognized arguments: --bogus"),
    (["-c", "lots"], "expected an integer"),
    (["--port", "70000"], "0..65535"),
]


# Every refusal through the parse-only entry; a sample through mlxcel.cli.server itself (when
# present), whose imports make each process start slower.
CASES = [(ENTRIES[0], argv, needle) for argv, needle in REFUSALS]
CASES += [(e, argv, needle) for e in ENTRIES[1:] for argv, needle in REFUSALS[::5]]


@pytest.mark.parametrize(("entry", "argv", "needle"), CASES,
                         ids=[f"{e[-1]}:{' '.join(a)}" for e, a, _ in CASES])
def test_refusal_runs_the_real_command_line(entry, argv, needle):
    p = run(argv, entry)
    assert p.returncode == 1, p.stderr
    assert p.stdout == ""
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), p.stderr
    assert needle in lines[0]


def test_environment_refusal_runs_the_real_command_line():
    p = run([], LLAMA_ARG_NUMA="distribute")
    assert p.returncode == 1 and p.stderr.startswith("error: LLAMA_ARG_NUMA=distribute (--numa)")


INERT = [
    ["-t", "-1"], ["-t", "0"], ["-fa", "auto"], ["-fa", "on"], ["-sm", "none"], ["--mmap"], ["--no-direct-io"],
    ["--repack"], ["-nr"], ["--no-perf"], ["-mg", "0"], ["--fit", "off"], ["-ngl", "all"], ["-ngl", "auto"],
    ["-ncmoe", "0"], ["-dt", "0.1"], ["-bs"], ["--kv-offload"], ["--op-offload"], ["--load-mode", "mmap"],
    ["--no-mmap", "--load-mode", "mmap"], ["-no-ag"], ["--no-ui-mcp-proxy"],
    ["--control-vector-layer-range", "1", "4"], ["--cache-reuse", "0"], ["-ctk", "f16"], ["-ctv", "f16"],
    ["-sps", "0.0"], ["-sps", "0.10"], ["-no-kvu"], ["--no-cache-idle-slots"],
    ["--cache-idle-slots"], ["-t", "8", "-tb", "8"], ["-tb", "-1"], ["-ctxcp", "0"], ["-cms", "256"], ["-ub", "256"],
    ["--threads-http", "8"], ["--jinja"], ["--no-jinja"], ["-kvu"], ["--chat-template", "chatml"], ["--repeat-penalty", "1.0"], ["--spec-type", "none"], ["--keep", "0"],
]


@pytest.mark.parametrize("argv", INERT, ids=" ".join)
def test_inert_values_are_accepted(argv):
    parse(*argv)


def test_every_preset_is_refused_with_an_mlx_suggestion():
    for name, repo in PRESETS.items():
        msg = refused(name)
        assert msg.startswith(name) and repo in msg
    assert "--spec-default" in refused("--spec-default")


def test_gpu_layers_needs_the_layer_count():
    s = parse("-ngl", "99")
    check_gpu_layers(s, 32)  # full offload: inert
    s = parse("-ngl", "10")
    with pytest.raises(StartupRefusal, match="partial offload"):
        check_gpu_layers(s, 32)
    check_gpu_layers(parse("-ngl", "all"), 32)


# ---- print-and-exit options -------------------------------------------------------------------


@pytest.mark.parametrize("prog", ["mlxcel-server", "mlxcel serve"])
def test_dump_flag_surface(prog):
    p = run(["--prog", prog, "--dump-flag-surface"])
    assert p.returncode == 0, p.stderr
    data = json.loads(p.stdout)
    assert data["binary"] == prog
    opts = data["options"]
    ctx = next(o for o in opts if o["b10621_entry"] == "--ctx-size")
    assert ctx == {"long": ["--ctx-size"], "short": ["-c"], "multi_dash": [], "env": "LLAMA_ARG_CTX_SIZE",
                   "neg_env": None, "takes_value": True, "kind": "value", "default": "0", "hidden": False,
                   "state": "supported", "b10621_entry": "--ctx-size"}
    ngl = next(o for o in opts if o["b10621_entry"] == "--gpu-layers")
    assert ngl["multi_dash"] == ["-ngl"] and ngl["hidden"] is True
    cb = next(o for o in opts if o["b10621_entry"] == "--cont-batching")
    assert cb["multi_dash"] == ["-cb", "-nocb"] and cb["neg_env"] == "LLAMA_ARG_NO_CONT_BATCHING"
    assert len([o for o in opts if o["b10621_entry"]]) == 249
    assert {o["long"][0] for o in opts if o["b10621_entry"] is None} >= {"--dump-flag-surface"}


def test_dump_wins_over_everything_else():
    p = run(["--numa", "distribute", "--dump-flag-surface"])
    assert p.returncode == 0 and json.loads(p.stdout)["binary"] == "mlxcel-server"


def test_help_shows_visible_options_only():
    p = run(["-h"])
    assert p.returncode == 0
    assert "--ctx-size" in p.stdout and "LLAMA_ARG_CTX_SIZE" in p.stdout
    for hidden in ("--dump-flag-surface", "--gpu-layers", "--mlock", "--control-vector", "--log-prompts-dir",
                   "--gpt-oss-20b-default", "--hf-file"):
        assert hidden not in p.stdout


@pytest.mark.parametrize("prog", ["mlxcel-server", "mlxcel serve"])
def test_completion_bash_is_valid_and_omits_hidden_options(prog, tmp_path):
    script = completion_bash(prog)
    (tmp_path / "c.sh").write_text(script)
    assert subprocess.run(["bash", "-n", str(tmp_path / "c.sh")]).returncode == 0
    assert script.rstrip().endswith("mlxcel" if prog == "mlxcel serve" else "mlxcel-server")
    assert "--ctx-size" in script and "--n-gpu-layers" not in script and "--dump-flag-surface" not in script
    p = run(["--completion-bash"])
    assert p.returncode == 0 and p.stdout == completion_bash("mlxcel-server")


def test_cache_list_shape(tmp_path):
    (tmp_path / "org" / "good").mkdir(parents=True)
    (tmp_path / "org" / "good" / "config.json").write_text("{}")
    (tmp_path / "org" / "partial").mkdir()
    (tmp_path / "acme" / "w").mkdir(parents=True)
    (tmp_path / "acme" / "w" / "model.safetensors").write_bytes(b"")
    p = run(["-cl"], MLXCEL_MODELS_DIR=str(tmp_path))
    assert p.returncode == 0
    assert p.stdout == "number of models in cache: 2\n   1. acme/w\n   2. org/good\n"


def test_version():
    p = run(["--version"])
    assert p.returncode == 0 and "version:" in p.stdout and "b10621" in p.stdout


# ---- process options --------------------------------------------------------------------------


def test_log_file_is_created_0600_and_tightened(tmp_path):
    new = tmp_path / "new.log"
    parse("--log-file", str(new))
    assert stat.S_IMODE(new.stat().st_mode) == 0o600
    old = tmp_path / "old.log"
    old.write_text("x")
    old.chmod(0o644)
    parse(LLAMA_ARG_LOG_FILE=str(old))
    assert stat.S_IMODE(old.stat().st_mode) == 0o600


def test_log_file_refusals(tmp_path):
    target = tmp_path / "t.log"
    target.write_text("")
    link = tmp_path / "link.log"
    link.symlink_to(target)
    assert "symbolic link" in refused("--log-file", str(link))
    assert "directory" in refused("--log-file", str(tmp_path))
    assert "does not exist" in refused("--log-file", str(tmp_path / "missing" / "x.log"))
    p = run(["--log-file", str(link)])
    assert p.returncode == 1 and "symbolic link" in p.stderr


def test_api_key_file(tmp_path):
    f = tmp_path / "keys"
    f.write_text("# comment\nkey-one\n\nkey-two\n")
    s = parse("--api-key-file", str(f), "--api-key", "key-three")
    assert sorted(s.server.api_keys) == ["key-one", "key-three", "key-two"]
    assert "cannot read" in refused("--api-key-file", str(tmp_path / "none"))


def test_host_port_tls_and_uvicorn_kwargs(tmp_path):
    s = parse("--host", "/tmp/mlxcel.sock")
    assert uvicorn_kwargs(s)["uds"] == "/tmp/mlxcel.sock" and "port" not in uvicorn_kwargs(s)
    kw = uvicorn_kwargs(parse("--host", "0.0.0.0", "--port", "0", "--timeout", "42"))
    assert (kw["host"], kw["port"], kw["timeout_keep_alive"], kw["log_config"]) == ("0.0.0.0", 0, 42, None)
    key, cert = tmp_path / "k.pem", tmp_path / "c.pem"
    key.write_text("k")
    cert.write_text("c")
    kw = uvicorn_kwargs(parse("--ssl-key-file", str(key), "--ssl-cert-file", str(cert)))
    assert kw["ssl_keyfile"] == str(key) and kw["ssl_certfile"] == str(cert)
    assert "both" in refused("--ssl-key-file", str(key))


def test_vertex_ai_environment():
    s = parse("--port", "9000", AIP_MODE="PREDICTION", AIP_HTTP_PORT="8081", AIP_HEALTH_ROUTE="healthz")
    assert (s.server.port, s.server.vertex_predict_route, s.server.vertex_health_route) == (8081, "/predict", "/healthz")
    assert any("AIP_HTTP_PORT" in n for n in s.notices)
    s = parse(AIP_HTTP_PORT="8081", AIP_PREDICT_ROUTE="/p")
    assert (s.server.port, s.server.vertex_predict_route) == (8080, None)
