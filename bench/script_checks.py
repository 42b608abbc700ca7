"""Checks the bench/ scripts share, so that a wrong value or the wrong machine ends in one line
naming the cause instead of a traceback (or a result lost after the whole run).

Scripts import it as `bench.script_checks` with the checkout's root on sys.path; it imports
nothing of specserve's at module level, so `--help` stays quick.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

# A script this machine cannot run (no CUDA device, no vLLM) exits with this code: distinct
# from a failed run (1) and bad arguments (2), so a caller can tell "not here" from "broken".
NOT_HERE_EXIT = 3


def require_cuda(script: str, why: str = "") -> None:
    """Exit with NOT_HERE_EXIT and one line on stderr when torch sees no CUDA device."""
    import torch

    if not torch.cuda.is_available():
        name = os.path.join("bench", os.path.basename(script))
        detail = f" ({why})" if why else ""
        print(f"error: {name} needs a CUDA device{detail}; none found", file=sys.stderr)
        sys.exit(NOT_HERE_EXIT)


def require_module(script: str, module: str, what: str) -> None:
    """Exit with NOT_HERE_EXIT and one line on stderr when `module` cannot be imported."""
    import importlib.util

    if importlib.util.find_spec(module) is None:
        name = os.path.join("bench", os.path.basename(script))
        print(f"error: {name} needs {what}", file=sys.stderr)
        sys.exit(NOT_HERE_EXIT)


def check_output_file(parser: argparse.ArgumentParser, flag: str, path: str | None) -> None:
    """A result file is written after the run: its folder must exist before the run starts."""
    if not path:
        return
    if os.path.isdir(path):
        parser.error(f"argument {flag}: {path} is a folder; a file path is needed")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        parser.error(f"argument {flag}: its folder {parent} does not exist")


@contextlib.contextmanager
def engine_errors():
    """An engine refusing a value (InvalidArgument names the argument) or a missing file ends
    in the CLI's one-line error and exit 2, as `specserve bench` does."""
    from specserve.errors import InvalidArgument

    try:
        yield
    except InvalidArgument as e:
        # the engine names its keyword (model_path); a script's user typed the flag
        message = str(e).removeprefix(f"{e.field}: ")
        print(f"error: argument --{e.field.replace('_', '-')}: {message}", file=sys.stderr)
        sys.exit(2)
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
