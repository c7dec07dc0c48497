"""`credproxy plan | apply | export`: the store as a reviewed policy file
(store/policyfile/parse.py)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from addon.cli import report
from store.errors import InvalidInput
from store.policyfile import reconcile
from store.policyfile.parse import PolicyFile, PolicyFileError, load
from store.settings import Settings

# `plan`'s exit status: 0 nothing would change, 1 something would (drift), 2 an error.
CHANGES = 1


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "plan", parents=[common], help="show what applying a policy file would change"
    )
    p.add_argument("file", type=Path, help="the policy file (TOML)")
    p.add_argument("--prune", action="store_true", help="also revoke what the file leaves out")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("apply", parents=[common], help="make the store match a policy file")
    p.add_argument("file", type=Path, help="the policy file (TOML)")
    p.add_argument("--prune", action="store_true", help="also revoke what the file leaves out")
    p.add_argument("--yes", action="store_true", help="apply without asking")
    p.add_argument(
        "--token-dir", type=Path, help="write new principals' tokens here (default: token_dir)"
    )
    p.add_argument(
        "--print-tokens", action="store_true", help="print new principals' tokens instead"
    )
    p.set_defaults(func=cmd_apply)

    p = sub.add_parser("export", parents=[common], help="write the store as a policy file")
    p.add_argument("--out", type=Path, help="write to this file (default: standard output)")
    p.set_defaults(func=cmd_export)


def _plan_lines(plan: reconcile.Plan) -> list[str]:
    lines = [change.describe() for change in plan.changes] or ["no changes"]
    if plan.untouched:
        lines.append(
            f"left alone (not in the file; --prune revokes them): {', '.join(plan.untouched)}"
        )
    return lines


def _plan_json(plan: reconcile.Plan) -> dict[str, Any]:
    return {
        "changes": [c.as_json() for c in plan.changes],
        "untouched": list(plan.untouched),
    }


def _problems(e: PolicyFileError, as_json: bool) -> int:
    for problem in e.problems:
        report.error(problem, report.code_of(e), as_json)
    return 2


def _load(path: Path, settings: Settings, prune: bool) -> PolicyFile:
    """The policy file, with the checks that need the command's own settings."""
    policy = load(path)
    key_file = os.path.realpath(settings.key_file)
    for c in policy.credentials:
        if c.source is not None and c.source.file is not None:
            if os.path.realpath(c.source.file) == key_file:
                raise PolicyFileError(
                    [
                        f'{policy.where(c.source_line)}: credential "{c.name}": secret_file '
                        "may not be credproxy's master key file"
                    ]
                )
    if prune and not (policy.principals or policy.credentials or policy.grants):
        raise InvalidInput(
            f"{path} declares nothing: with --prune that would remove everything; refused"
        )
    return policy


def cmd_plan(args: argparse.Namespace, settings: Settings) -> int:
    try:
        policy = _load(args.file, settings, args.prune)
        store = settings.store()
        plan = reconcile.plan(store.db, settings.key(), policy, prune=args.prune)
    except PolicyFileError as e:
        return _problems(e, args.json)
    if args.json:
        print(json.dumps(_plan_json(plan)))
    else:
        print("\n".join(_plan_lines(plan)))
    return 0 if plan.empty else CHANGES


def cmd_apply(args: argparse.Namespace, settings: Settings) -> int:
    try:
        policy = _load(args.file, settings, args.prune)
        store = settings.store()
        key = settings.key()
        token_dir = args.token_dir or policy.token_dir
        writer = None
        if not args.print_tokens:
            writer = reconcile.token_writer(token_dir) if token_dir is not None else _no_tokens
        expected = None
        if not args.yes:
            shown = reconcile.plan(store.db, key, policy, prune=args.prune)
            print("\n".join(_plan_lines(shown)))
            if shown.empty:
                return 0
            if not sys.stdin.isatty():
                raise InvalidInput("standard input is not a terminal: pass --yes to apply")
            if input("apply these changes? [y/N] ").strip().lower() not in ("y", "yes"):
                print("nothing applied")
                return 1
            expected = shown
        applied = reconcile.apply(
            store.db, key, policy, prune=args.prune, expected=expected, write_tokens=writer
        )
    except PolicyFileError as e:
        return _problems(e, args.json)
    out: dict[str, Any] = {"applied": _plan_json(applied.plan)}
    lines = ["applied:", *("  " + line for line in _plan_lines(applied.plan))]
    if applied.plan.empty:
        lines = ["no changes"]
    if applied.tokens:
        if args.print_tokens:
            out["tokens"] = applied.tokens
            lines += [f"token {name} {token}" for name, token in applied.tokens.items()]
        else:
            assert token_dir is not None
            out["token_files"] = {n: str(token_dir / f"{n}.token") for n in applied.tokens}
            lines += [f"token of {n} written to {token_dir / f'{n}.token'}" for n in applied.tokens]
    if args.json:
        print(json.dumps(out))
    elif not (applied.plan.empty and not args.yes):
        print("\n".join(lines))
    return 0


def _no_tokens(tokens: dict[str, str]) -> Any:
    raise InvalidInput(
        f"new principals ({', '.join(tokens)}) need somewhere for their tokens: set token_dir "
        "in the file, or pass --token-dir DIR or --print-tokens"
    )


def cmd_export(args: argparse.Namespace, settings: Settings) -> int:
    text = reconcile.export(settings.reader().db)  # opens no secret: needs no key
    if args.out is None:
        sys.stdout.write(text)
        return 0
    try:
        fd = os.open(args.out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(text)
    except OSError as e:
        raise InvalidInput(f"cannot write {args.out}: {e.strerror}") from e
    print(f"exported to {args.out}")
    return 0
