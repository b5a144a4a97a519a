"""`mlxcel inspect REF`: what a checkpoint is (architecture, parameter count, dtype,
quantization), optionally with every tensor checked (`--check-tensors`: shapes against the
model, values for NaN/Inf, one tensor at a time), and `--list-devices`: what this machine offers.

REF resolves as `mlxcel show` resolves it (a directory, owner/name, or a bare name in the store),
never downloading. Exit status 1 when a check finds a problem, so a script can gate on it.
"""

from __future__ import annotations

from mlxcel.cli.inspect_cmds import summary_rows
from mlxcel.cli.store_cmds import _common, default_org, _fail, _root


def _resolve(args):
    from mlxcel.store.resolve import (AmbiguousName, ModelNotAvailable, ModelSourceRefused, prefer_local,
                                      resolve_model)

    root = _root(args)
    try:
        ref = prefer_local(args.ref, root, default_org())
        return resolve_model(ref, root=root, default_org=default_org(), offline=True, flag="inspect"), None
    except (ModelSourceRefused, AmbiguousName) as e:
        return None, str(e)
    except ModelNotAvailable:
        return None, f"{args.ref} is not in the model store {root} (`mlxcel pull NAME` fetches a model)"


def cmd_inspect(args) -> int:
    if args.list_devices:
        from mlxcel.cli.devices import print_devices

        print_devices()
        if args.ref is None:
            return 0
        print()
    if args.ref is None:
        return _fail("inspect", "name a checkpoint (REF), or pass --list-devices")
    path, error = _resolve(args)
    if path is None:
        return _fail("inspect", error)
    from mlxcel.store.describe import describe

    s = describe(path)
    rows = summary_rows(s)
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    if not args.check_tensors:
        return 0
    from mlxcel.runtime.tensor_check import check_tensors

    report = check_tensors(path)
    for line in report.lines():
        print(line)
    verdict = "ok" if report.ok else f"{len(report.shape_problems) + len(report.bad_values)} problem(s)"
    print(f"{'tensors':<{width}}  {report.tensors} checked, {verdict}")
    return 0 if report.ok else 1


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("inspect", help="a checkpoint's architecture, size, dtype and quantization; "
                                              "--check-tensors, --list-devices")
    p.add_argument("ref", nargs="?", help="checkpoint directory, owner/name, or bare name")
    p.add_argument("--check-tensors", action="store_true",
                   help="check every tensor's shape against the model and its values for NaN/Inf")
    p.add_argument("--list-devices", action="store_true", help="print the devices this machine offers")
    _common(p)
    p.set_defaults(func=cmd_inspect)
