"""The extractor: help parsing, fact/policy merging, idempotence and archive verification.

CI has no upstream binary or sources, so the round trip renders a help text and the two
fact tables from the committed manifest's own facts, extracts from them into a copy of the
manifest and expects no change. With MLXCEL_LLAMA_B10621_HELP (a saved `llama-server --help`)
and MLXCEL_LLAMA_SOURCE_DIR (the pinned llama.cpp tree) set, the real inputs are checked too;
with MLXCEL_LLAMA_SERVER_BIN (a built llama-server), the binary's own --help is compared with
the saved reference help and extracted against the manifest.

One build variant is tolerated, and reported as a warning when it applies: llama-server lists
`--rpc` only when ggml was built with the RPC backend (upstream's release builds are;
`cmake -DGGML_RPC=ON`). A binary without it is compared with the reference minus the `--rpc`
entry, and its extraction must equal the manifest minus `option:--rpc`. Nothing else is
normalised: `--help` prints no version line, so the text is compared byte for byte.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import os
import shutil
import stat
import tarfile
import warnings
from pathlib import Path

import pytest

from mlxcel.compat import manifest as mf
from scripts.ci import check_llama_compat_manifest as check
from scripts.compat import extract_b10621_manifest as ex
from scripts.compat.help_parse import parse_help

ROOT = Path(__file__).resolve().parents[2]
SECTIONS = ("common", "sampling", "speculative", "example-specific")

SAMPLE_HELP = """----- common params -----

-h,    --help, --usage                  print usage and exit
-c,    --ctx-size N                     size of the context (default: 0, 0 = from model)
                                        (env: LLAMA_ARG_CTX_SIZE)
-kvo,  --kv-offload, -nkvo, --no-kv-offload
                                        offload the KV cache (default: enabled)
                                        (env: LLAMA_ARG_KV_OFFLOAD)

----- example-specific params -----

--spec-type none,draft-simple,ngram-simple
                                        which drafter (default:
                                        none)
"""


def test_parse_help_sample():
    rows = parse_help(SAMPLE_HELP)
    assert [r["long"] for r in rows] == [["--help", "--usage"], ["--ctx-size"],
                                         ["--kv-offload", "--no-kv-offload"], ["--spec-type"]]
    assert rows[2]["short"] == ["-kvo", "-nkvo"]
    assert rows[1] == {"section": "common", "long": ["--ctx-size"], "short": ["-c"],
                       "value_hint": "N", "env": "LLAMA_ARG_CTX_SIZE", "help_default": "0"}
    assert rows[3]["section"] == "example-specific"
    assert rows[3]["value_hint"] == "none,draft-simple,ngram-simple"
    assert rows[3]["help_default"] == "none"
    assert rows[0]["env"] is None and rows[0]["help_default"] is None


def test_parse_help_refuses_garbage():
    with pytest.raises(ValueError):
        parse_help("----- common params -----\n\nnot an option line\n")


def render_inputs(manifest: mf.Manifest, tmp: Path) -> tuple[Path, Path, Path]:
    """A help text and the two tables, written from the manifest's facts alone."""
    lines: list[str] = []
    options = manifest.of_kind("option")
    for section in SECTIONS:
        lines += [f"----- {section} params -----", ""]
        for e in (o for o in options if o["section"] == section):
            args = ", ".join(e["short"] + e["long"])
            if e["value_hint"]:
                args += " " + e["value_hint"]
            desc = ["an option"]
            if e["help_default"] is not None:
                desc.append(f"(default: {e['help_default']})")
            if e["env"]:
                desc.append(f"(env: {e['env']})")
            if len(args) < 40:
                lines.append(args.ljust(40) + desc[0])
            else:
                lines += [args, " " * 40 + desc[0]]
            lines += [" " * 40 + d for d in desc[1:]]
        lines.append("")
    help_path = tmp / "help.txt"
    help_path.write_text("\n".join(lines) + "\n")
    routes = tmp / "routes.tsv"
    routes.write_text("".join(f"{e['method']}\t{e['path']}\n" for e in manifest.of_kind("route")))
    fields = tmp / "native-fields.tsv"
    rows = ["field\taliases\ttype\ttarget\tlimits\tstruct_default\tsource\tdescription"]
    for e in manifest.of_kind("native_request_field"):
        source = {"schema-nested": "schema (nested subfield)"}.get(e["source"], e["source"])
        rows.append("\t".join([e["name"], ",".join(e["aliases"]), e["type"], "",
                               e["limits"] or "", "", source, ""]))
    fields.write_text("\n".join(rows) + "\n")
    return help_path, routes, fields


@pytest.fixture()
def workspace(tmp_path: Path):
    copy = tmp_path / "b10621"
    shutil.copytree(mf.default_manifest_dir(), copy)
    inputs = render_inputs(mf.load_manifest(copy), tmp_path)
    return copy, inputs


def _run(copy: Path, inputs, *extra: str) -> int:
    help_path, routes, fields = inputs
    return ex.main(["--help-text", str(help_path), "--routes-tsv", str(routes),
                    "--native-fields-tsv", str(fields), "--manifest-dir", str(copy), *extra])


def test_round_trip_leaves_the_manifest_unchanged(workspace):
    copy, inputs = workspace
    assert _run(copy, inputs, "--check") == 0
    assert _run(copy, inputs) == 0
    for path in mf.default_manifest_dir().glob("*.json"):
        assert (copy / path.name).read_text() == path.read_text(), path.name


def test_new_upstream_entry_is_unclassified_and_policy_survives(workspace):
    copy, inputs = workspace
    help_path, routes, _ = inputs
    routes.write_text(routes.read_text() + "GET\t/v2/brand-new\n")
    help_path.write_text(help_path.read_text().replace(
        "----- sampling params -----",
        "--brand-new-flag                        an option\n\n----- sampling params -----"))
    doc = json.loads((copy / "authentication.json").read_text())
    doc["entries"][0]["notes"] = "hand-written note that must survive"
    (copy / "authentication.json").write_text(mf.dumps(doc))
    assert _run(copy, inputs) == 0
    unclassified = json.loads((copy / "_unclassified.json").read_text())
    assert sorted(e["id"] for e in unclassified["entries"]) == [
        "option:--brand-new-flag", "route:GET /v2/brand-new"]
    assert all(e["state"] is None for e in unclassified["entries"])
    again = json.loads((copy / "authentication.json").read_text())
    assert again["entries"][0]["notes"] == "hand-written note that must survive"
    problems = check.validate(copy, ROOT)
    assert any("unclassified" in p for p in problems)
    assert _run(copy, inputs, "--check") == 0  # second run: nothing left to change


def _fake_release(tmp: Path, help_text: str) -> tuple[Path, Path]:
    binary = tmp / "llama-server"
    (tmp / "help-out.txt").write_text(help_text)
    binary.write_text(f"#!/bin/sh\ncat '{tmp / 'help-out.txt'}'\n")
    binary.chmod(binary.stat().st_mode | stat.S_IXUSR)
    archive = tmp / "release.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(binary, arcname="build/bin/llama-server")
    return binary, archive


def test_archive_verification(tmp_path, workspace):
    copy, inputs = workspace
    binary, archive = _fake_release(tmp_path, inputs[0].read_text())
    digest = hashlib.sha256(archive.read_bytes()).hexdigest()
    with pytest.raises(ex.ExtractError, match="not the pinned"):
        ex.verify_archive(archive, binary, "0" * 64)
    assert ex.verify_archive(archive, binary, digest) == "build/bin/llama-server"
    other = tmp_path / "other"
    other.write_bytes(b"not the released binary")
    with pytest.raises(ex.ExtractError, match="not byte-identical"):
        ex.verify_archive(archive, other, digest)
    # end to end: pin the fake archive's digest in the copy, then extract through the binary
    pin = json.loads((copy / mf.PIN_FILE).read_text())
    pin["reference"]["archive_sha256"] = digest
    (copy / mf.PIN_FILE).write_text(mf.dumps(pin))
    _, routes, fields = inputs
    code = ex.main(["--llama-server", str(binary), "--archive", str(archive),
                    "--routes-tsv", str(routes), "--native-fields-tsv", str(fields),
                    "--manifest-dir", str(copy), "--check"])
    assert code == 0
    assert ex.main(["--llama-server", str(other), "--archive", str(archive), "--routes-tsv",
                    str(routes), "--native-fields-tsv", str(fields), "--manifest-dir",
                    str(copy), "--check"]) == 2


@pytest.mark.skipif(not (os.environ.get("MLXCEL_LLAMA_B10621_HELP")
                         and os.environ.get("MLXCEL_LLAMA_SOURCE_DIR")),
                    reason="set MLXCEL_LLAMA_B10621_HELP and MLXCEL_LLAMA_SOURCE_DIR to check "
                           "the manifest against the real upstream inputs")
def test_real_upstream_inputs_reproduce_the_manifest(tmp_path):
    copy = tmp_path / "b10621"
    shutil.copytree(mf.default_manifest_dir(), copy)
    code = ex.main(["--help-text", os.environ["MLXCEL_LLAMA_B10621_HELP"],
                    "--source-dir", os.environ["MLXCEL_LLAMA_SOURCE_DIR"],
                    "--manifest-dir", str(copy), "--check"])
    assert code == 0


LLAMA_BIN = os.environ.get("MLXCEL_LLAMA_SERVER_BIN")
REFERENCE_HELP = os.environ.get("MLXCEL_LLAMA_B10621_HELP")
needs_binary = pytest.mark.skipif(
    not LLAMA_BIN, reason="set MLXCEL_LLAMA_SERVER_BIN to a llama-server b10621/b10622 binary "
                          "to compare its --help and extraction with the manifest")
RPC_ENTRY = "option:--rpc"
NO_RPC_WARNING = ("llama-server was built without the RPC backend (GGML_RPC off), so its help "
                  "has no --rpc entry; compared without it")


def drop_help_entry(text: str, spelling: str) -> str:
    """The help text without the entry whose first line starts with `spelling`."""
    out, skipping = [], False
    for line in text.splitlines(keepends=True):
        if line.startswith(spelling + " ") or line.rstrip("\n") == spelling:
            skipping = True
            continue
        if skipping and line.startswith(" ") and line.strip():
            continue
        skipping = False
        out.append(line)
    return "".join(out)


def _has_rpc(help_text: str) -> bool:
    return any(row["long"][:1] == ["--rpc"] for row in parse_help(help_text))


def test_drop_help_entry():
    text = "-a x                a\n--rpc SERVERS       r\n                    (env: R)\n--b  b\n"
    assert drop_help_entry(text, "--rpc") == "-a x                a\n--b  b\n"


@needs_binary
@pytest.mark.skipif(not REFERENCE_HELP, reason="set MLXCEL_LLAMA_B10621_HELP to the saved "
                                               "reference help.txt to compare the binary with")
def test_binary_help_reproduces_the_reference_help():
    actual = ex.help_from_binary(Path(LLAMA_BIN))
    reference = Path(REFERENCE_HELP).read_text(encoding="utf-8")
    if not _has_rpc(actual):
        warnings.warn(NO_RPC_WARNING)
        reference = drop_help_entry(reference, "--rpc")
    if actual != reference:
        diff = difflib.unified_diff(reference.splitlines(), actual.splitlines(),
                                    "reference help.txt", LLAMA_BIN, lineterm="")
        pytest.fail("llama-server --help differs from the reference:\n" + "\n".join(diff))


@needs_binary
def test_binary_extraction_reproduces_the_manifest(tmp_path):
    copy = tmp_path / "b10621"
    shutil.copytree(mf.default_manifest_dir(), copy)
    if os.environ.get("MLXCEL_LLAMA_SOURCE_DIR"):
        facts = ["--source-dir", os.environ["MLXCEL_LLAMA_SOURCE_DIR"]]
    else:  # routes and fields from the manifest itself: only the options are under test
        _, routes, fields = render_inputs(mf.load_manifest(copy), tmp_path)
        facts = ["--routes-tsv", str(routes), "--native-fields-tsv", str(fields)]
    assert ex.main(["--llama-server", LLAMA_BIN, *facts, "--manifest-dir", str(copy)]) == 0
    committed = mf.load_manifest(mf.default_manifest_dir())
    if _has_rpc(ex.help_from_binary(Path(LLAMA_BIN))):
        for path in mf.default_manifest_dir().glob("*.json"):
            assert (copy / path.name).read_text() == path.read_text(), path.name
        assert sorted(p.name for p in copy.glob("*.json")) == sorted(
            p.name for p in mf.default_manifest_dir().glob("*.json"))
        return
    warnings.warn(NO_RPC_WARNING)
    extracted = mf.load_manifest(copy)
    assert list(extracted.entries()) == [(shard, e) for shard, e in committed.entries()
                                         if e["id"] != RPC_ENTRY]
    assert {k: v for k, v in extracted.pin.items() if k != "counts"} == {
        k: v for k, v in committed.pin.items() if k != "counts"}
