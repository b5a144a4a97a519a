"""The hardening suites (tests/hardening), run longer than `make test` runs them.

    python -m scripts.hardening atheris gbnf --seconds 600     # coverage-guided, one parser target
    python -m scripts.hardening fuzz --scale 20                # route + parser fuzz, 20x the examples
    python -m scripts.hardening soak --minutes 30 --clients 16 # one server, mixed load, a report

`fuzz` and `soak` start their own loopback server from the model store (MLXCEL_MODELS_DIR); the
soak serves the default model (`make default-model`) unless --model names another fixture
(`make test`'s short soak uses qwen2-tiny). docs/hardening.md has the latest long soak's figures.
A crash found by `atheris` is written to crash-* in the working directory; replay it with
`python -c "from tests.hardening import targets; targets.TARGET(open('crash-...','rb').read())"`.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.fixtures import DEFAULT_MODEL

REPO = Path(__file__).resolve().parent.parent
# the parser modules each target reaches; instrumented so libFuzzer sees their branches
_INSTRUMENT = ["mlxcel.chat.gbnf", "mlxcel.api.multipart", "mlxcel.api.audio_upload",
               "mlxcel.api.openai.response_format", "mlxcel.engine.grammar", "tests.hardening.targets"]


def run_atheris(target: str, seconds: int, extra: list[str]) -> None:
    import atheris

    with atheris.instrument_imports(include=_INSTRUMENT):
        from tests.hardening import targets
    fn = targets.TARGETS[target]
    # random bytes are almost never a JSON schema or a WAV: start from valid inputs and mutate
    corpus = Path(tempfile.mkdtemp(prefix=f"atheris-{target}-"))
    for i, seed in enumerate(targets.SEEDS[target]):
        (corpus / f"seed{i}").write_bytes(seed)
    # -rss_limit_mb: the audio decoder allocates per clip; -timeout: one input past this is a hang
    atheris.Setup([sys.argv[0], f"-max_total_time={seconds}", "-timeout=10", "-rss_limit_mb=4096", *extra,
                   str(corpus)], fn)
    atheris.Fuzz()


def run_fuzz(scale: float, seed: bool) -> int:
    env = {**os.environ, "MLXCEL_FUZZ_SCALE": str(scale)}
    if seed:
        env["MLXCEL_FUZZ_SEED"] = "1"  # a fresh random search instead of CI's fixed cases
    return subprocess.call([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                            "tests/hardening/test_fuzz_routes.py", "tests/hardening/test_fuzz_multipart.py",
                            "tests/hardening/test_parser_fuzz.py",
                            "-k", "not atheris"], cwd=REPO, env=env)


def run_soak(minutes: float, clients: int, model: str) -> int:
    from tests.hardening.soak import soak_report

    report = soak_report(seconds=minutes * 60, clients=clients, model=model)
    print(report.summary())
    return 0 if report.ok() else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("atheris", help="coverage-guided fuzz of one parser target")
    a.add_argument("target", choices=["gbnf", "json_schema", "multipart", "audio"])
    a.add_argument("--seconds", type=int, default=60)
    f = sub.add_parser("fuzz", help="the Hypothesis route and parser fuzz with more examples")
    f.add_argument("--scale", type=float, default=10, help="multiplies each test's example count")
    f.add_argument("--random", action="store_true", help="a fresh random search, not CI's fixed cases")
    s = sub.add_parser("soak", help="mixed load on one server, then the report")
    s.add_argument("--minutes", type=float, default=30)
    s.add_argument("--clients", type=int, default=16)
    s.add_argument("--model", default=DEFAULT_MODEL, help=f"the fixture to serve (default {DEFAULT_MODEL})")
    args, extra = p.parse_known_args(argv)
    if args.cmd == "atheris":
        run_atheris(args.target, args.seconds, extra)
        return 0
    if extra:
        p.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.cmd == "fuzz":
        return run_fuzz(args.scale, args.random)
    return run_soak(args.minutes, args.clients, args.model)


if __name__ == "__main__":
    sys.exit(main())
