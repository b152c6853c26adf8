"""Argument parsing and dispatch for ``parity``; every failure parity expects becomes one line
on stderr and a non-zero exit status."""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Sequence
from typing import NoReturn

from parity.cli import commands
from parity.errors import ParityError

EXIT_ERROR = 1
EXIT_INTERRUPTED = 130


def _device_arg(value: str) -> tuple[str | None, int]:
    """``--device``: an index (1) or a backend's device id (cuda:1)."""
    name, _, index = value.rpartition(":")
    try:
        n = int(index)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a device index (1) or id (cuda:1), got {value!r}"
        ) from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"a device index is >= 0, got {value!r}")
    return (name or None, n)


def _resolve_device(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """``--device cuda:1`` picks the backend too, where the command has not named another."""
    if not isinstance(getattr(args, "device", None), tuple):
        return
    name, args.device = args.device
    if name is None:
        return
    if hasattr(args, "backends"):  # compare: the candidate's device
        chosen = [n.strip() for n in args.backends.split(",")][-1]
    else:  # --backend, or conformance's NAME
        chosen = getattr(args, "backend", None)
        if chosen in (None, "auto"):
            args.backend = chosen = name
    if chosen != name:
        parser.error(f"--device {name}:{args.device} is a device of {name}, not of {chosen}")


def _positive(value: str) -> int:
    n = int(value)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
    return n


def _non_negative(value: str) -> int:
    n = int(value)
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {n}")
    return n


def _template_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--template", metavar="FILE",
                   help="a Jinja chat template to use instead of the model's (needed for a "
                        "model without one)")  # fmt: skip


def _model_options(p: argparse.ArgumentParser, *, runtime: bool = True) -> None:
    g = p.add_argument_group("model")
    g.add_argument(
        "-m",
        "--model",
        default=None,
        help="a registry name (see `parity models`; pulled on first use) or a path to a .gguf "
        "file (default: smollm2-135m)",
    )
    if not runtime:
        return
    g.add_argument("-b", "--backend", help="backend name, or auto (default: from config)")
    g.add_argument("--device", type=_device_arg, help="device of the backend: 1 or cuda:1")
    g.add_argument("-j", "--threads", type=_positive,
                   help="cpu threads, fixed (or PARITY_THREADS; default: up to every core, "
                   "fewer while that is faster, as under a competing load)")  # fmt: skip
    g.add_argument("--numerics", choices=("exact", "fast"), help="default: exact")
    g.add_argument(
        "--strict", action="store_true", default=None, help="fail instead of falling back to cpu"
    )
    g.add_argument(
        "--ctx", type=_positive, help="context in tokens (default 4096, or the model's if less)"
    )
    g.add_argument("--config", help="config file (default: ./parity.toml, then user config)")


def _sampling_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("-n", "--max-tokens", type=_non_negative, default=256, help="tokens to generate")
    g.add_argument("-t", "--temperature", type=float, default=0.8, help="0: greedy")
    g.add_argument("--top-k", type=_non_negative, default=40, help="0: off")
    g.add_argument("--top-p", type=float, default=0.95, help="1: off")
    g.add_argument("--min-p", type=float, default=0.05, help="0: off")
    g.add_argument("--repeat-penalty", type=float, default=1.0, help="1: off")
    g.add_argument("--repeat-last-n", type=int, default=64, help="tokens the penalty looks at")
    g.add_argument("--seed", type=int, help="random when not given")
    g.add_argument("--stop", action="append", default=[], help="stop before this text (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", help="keep going past end-of-text")


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Help with each option's default, where it has one worth saying."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        d = action.default
        if d is None or d is False or d == [] or d is argparse.SUPPRESS or not action.help:
            return action.help
        return super()._get_help_string(action)


class _Parser(argparse.ArgumentParser):
    """Usage errors in one line with a pointer to --help; every --help shows the defaults."""

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        kwargs.setdefault("formatter_class", _Help)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="parity",
        description="Run GGUF language models on pluggable backends checked against a "
        "bit-exact CPU oracle.",
    )
    parser.add_argument("-V", "--version", action="version", version=commands.version())
    sub = parser.add_subparsers(
        dest="command", required=True, metavar="COMMAND", parser_class=_Parser
    )

    p = sub.add_parser("run", help="continue a prompt; prints only the generated text")
    p.add_argument("prompt", nargs="?", help="the prompt (default or '-': read stdin)")
    _model_options(p)
    _sampling_options(p)
    p.add_argument(
        "--json",
        action="store_true",
        help="a JSON line per piece of text, then one with the whole and its stats",
    )
    p.add_argument("-v", "--verbose", action="store_true", help="timings on stderr")
    p.set_defaults(func=commands.run)

    p = sub.add_parser("chat", help="talk with the model using its chat template")
    _model_options(p)
    _sampling_options(p)
    p.add_argument("-s", "--system", help="system prompt (default: the template's own)")
    _template_option(p)
    p.add_argument("-v", "--verbose", action="store_true", help="timings on stderr")
    p.set_defaults(func=commands.chat)

    p = sub.add_parser("pull", help="download a registry model into the cache")
    p.add_argument("names", nargs="+", metavar="NAME")
    p.add_argument("--print-path", action="store_true", help="print the cached file's path")
    p.add_argument("--force", action="store_true", help="download again even if cached")
    p.add_argument("-v", "--verbose", action="store_true", help="show pip's own log")
    p.set_defaults(func=commands.pull)

    p = sub.add_parser("models", help="list known and cached models")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=commands.models)

    p = sub.add_parser("backends", help="list backends; --explain shows which op runs where")
    _model_options(p)
    p.add_argument("--explain", action="store_true", help="the plan of a decode step")
    p.add_argument("--verbose", action="store_true", help="with --explain: every node")
    p.add_argument(
        "--graph", choices=("text", "dot"),
        help="with --explain: the decode step's graph, one node a line or Graphviz DOT, by backend",
    )  # fmt: skip
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=commands.backends)

    p = sub.add_parser("tokenize", help="print the token ids of a text")
    p.add_argument("text", nargs="?", help="the text (default or '-': read stdin)")
    _model_options(p, runtime=False)
    p.add_argument("--json", action="store_true", help="one JSON line: the id list")
    p.add_argument("--no-bos", action="store_true", help="never add BOS")
    p.add_argument(
        "--no-parse-special", action="store_true", help="treat special-token text as text"
    )
    p.set_defaults(func=commands.tokenize)

    p = sub.add_parser("perplexity", help="perplexity of a text file (llama.cpp's protocol)")
    _model_options(p)
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("-f", "--file", help="a UTF-8 text file")
    source.add_argument(
        "--kl-divergence-base", metavar="FILE",
        help="compare with the logits `llama-perplexity --kl-divergence-base FILE` saved, on "
             "its tokens and chunks: top-1 agreement, KL divergence and both perplexities",
    )  # fmt: skip
    p.add_argument("--chunks", type=_positive, help="score at most this many chunks")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=commands.perplexity)

    p = sub.add_parser("bench", help="prefill and decode speed")
    _model_options(p)
    p.add_argument("-p", "--prompt-tokens", type=_positive, default=128)
    p.add_argument("-g", "--gen-tokens", type=_positive, default=64)
    p.add_argument("--json", action="store_true", help="one JSON line")
    p.set_defaults(func=commands.bench)

    p = sub.add_parser(
        "serve", help="an OpenAI-compatible HTTP server (pip install 'parity[serve]')"
    )
    _model_options(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8080, help="port (default 8080)")
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' (or PARITY_API_KEY)")
    p.add_argument("--slots", type=_positive, default=1,
                   help="KV caches, one sequence each (default 1)")  # fmt: skip
    p.add_argument("--queue", type=_non_negative, default=16,
                   help="requests that may wait for a slot before a 429 (default 16)")  # fmt: skip
    p.add_argument("--max-body", type=_positive, default=1 << 20,
                   help="largest request body in bytes (default 1 MiB)")  # fmt: skip
    _template_option(p)
    p.set_defaults(func=commands.serve)

    p = sub.add_parser(
        "conformance", help="run the op conformance suite on a backend, against the cpu oracle"
    )
    p.add_argument("backend", metavar="NAME", help="the backend to check (see `parity backends`)")
    p.add_argument(
        "--device", type=_device_arg, help="device of the backend: 1 or cuda:1 (default 0)"
    )
    p.add_argument(
        "-k", dest="patterns", action="append", default=[], metavar="TEXT",
        help="only cases whose id contains TEXT (repeatable)",
    )  # fmt: skip
    p.add_argument(
        "--case", dest="cases", action="append", default=[], metavar="FILE",
        help="replay a case file saved by `parity compare` (repeatable; with no -k, only these)",
    )  # fmt: skip
    p.add_argument(
        "--numerics", choices=("exact", "fast"),
        help="check only this mode (default: exact, and fast too for a backend whose fast "
        "kernels differ)",
    )  # fmt: skip
    p.add_argument("--json", action="store_true", help="one JSON object: every case's result")
    p.add_argument("-v", "--verbose", action="store_true", help="each case as it finishes")
    p.set_defaults(func=commands.conformance)

    p = sub.add_parser(
        "compare", help="run a model on two backends step by step, comparing every node"
    )
    _model_options(p, runtime=False)
    p.add_argument(
        "--backends", required=True, metavar="A,B",
        help="reference,candidate (e.g. cpu,jax); the candidate is held to the tiers it declares",
    )  # fmt: skip
    p.add_argument("-p", "--prompt", default="The capital of France is", help="prompt text")
    p.add_argument("-n", "--tokens", type=_positive, default=8, help="tokens to sample (steps)")
    p.add_argument("-t", "--temperature", type=float, default=0.0, help="0 (default): greedy")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (both sides use it)")
    p.add_argument(
        "--save-dir", default="parity-cases", metavar="DIR",
        help="where the first violation is saved as a replayable case (default: ./parity-cases)",
    )  # fmt: skip
    p.add_argument("--device", type=_device_arg, help="device of the candidate: 1 or cuda:1")
    p.add_argument(
        "--numerics", choices=("exact", "fast"), default="exact",
        help="the candidate's numerics (default: exact)",
    )  # fmt: skip
    p.add_argument(
        "--ctx", type=_positive,
        help="KV cache size (default: just what the prompt and tokens need)",
    )  # fmt: skip
    p.add_argument(
        "--strict", action="store_true",
        help="fail if the candidate lacks an op (default: that op falls back to cpu)",
    )  # fmt: skip
    p.add_argument("--json", action="store_true", help="one JSON object")
    p.set_defaults(func=commands.compare)
    return parser


def _plugin_warnings():
    """Show a broken plugin as one line (plugins load once per process, so once) instead of
    Python's warning format; returns the previous ``warnings.showwarning`` to put back."""
    from parity.core.plugins import PluginWarning

    default = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None) -> None:
        if not issubclass(category, PluginWarning):
            default(message, category, filename, lineno, file, line)
        else:
            print(f"parity: warning: {message}", file=sys.stderr)

    warnings.showwarning = show
    return default


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _resolve_device(args, parser)
    previous = _plugin_warnings()
    try:
        return args.func(args) or 0
    except ParityError as e:
        print(f"parity: error: {e}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # e.g. `parity run ... | head`: the reader left
        sys.stderr.close()
        return EXIT_ERROR
    finally:
        warnings.showwarning = previous
