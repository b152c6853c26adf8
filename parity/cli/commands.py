"""One function per ``parity`` subcommand. Each takes the parsed arguments and returns the exit
status; the product goes to stdout, everything else to stderr."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

from parity import __version__
from parity.errors import ChatTemplateError, ParityError

if TYPE_CHECKING:
    from parity.hub.registry import ModelStatus


EXIT_FAILED = 3  # a check ran and found a violation (conformance, compare); errors exit 1


def version() -> str:
    return f"parity {__version__}"


def _err(*parts: object) -> None:
    print(*parts, file=sys.stderr, flush=True)


def _read_arg_or_stdin(value: str | None, what: str) -> str:
    if value is not None and value != "-":
        return value
    if sys.stdin.isatty():
        raise ParityError(f"no {what} given: pass it as an argument or pipe it on stdin")
    return sys.stdin.read().removesuffix("\n")  # the newline `echo` adds is not the prompt


def _model_ref(args: argparse.Namespace) -> str:
    from parity.hub.registry import DEFAULT_MODEL

    return args.model or DEFAULT_MODEL


def _load(args: argparse.Namespace, *, n_ctx: int | None = None, **options: bool):
    """Open the model on the configured backends, reporting the load on stderr if verbose."""
    from parity.model import load

    if getattr(args, "threads", None) is not None:  # -j N: this process's PARITY_THREADS
        os.environ["PARITY_THREADS"] = str(args.threads)
    t0 = time.perf_counter()
    model = load(
        _model_ref(args),
        backend=args.backend,
        device=args.device,
        numerics=args.numerics,
        strict=args.strict,
        n_ctx=n_ctx if n_ctx is not None else args.ctx,
        config=args.config,
        **options,
    )
    if getattr(args, "verbose", False):
        _err(
            f"[{model.name} on {model.backends[0].device.id}, ctx {model.n_ctx}, "
            f"loaded in {time.perf_counter() - t0:.2f} s]"
        )
    return model


def _sampling(args: argparse.Namespace):
    from parity.generation.sampling import SamplingParams

    return SamplingParams(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        repetition_penalty=args.repeat_penalty,
        repeat_last_n=args.repeat_last_n,
        seed=args.seed,
    )


def _stream(generation) -> None:
    out = sys.stdout
    for piece in generation:
        if piece.text:
            out.write(piece.text)
            out.flush()


def _report(generation) -> None:
    s = generation.stats
    steps = len(s.step_s)
    rate = f", {steps / s.decode_s:.1f} tok/s decode" if steps and s.decode_s > 0 else ""
    _err(
        f"[{s.prompt_tokens} prompt tokens ({s.reused_tokens} cached), "
        f"ttft {s.ttft_s * 1e3:.0f} ms, {s.generated_tokens} generated{rate}, "
        f"finish: {generation.finish_reason}]"
    )


# -- generation ----------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    prompt = _read_arg_or_stdin(args.prompt, "prompt")
    sampling = _sampling(args)
    model = _load(args)
    gen = model.generate(
        prompt,
        max_tokens=args.max_tokens,
        sampling=sampling,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
    )
    if args.json:  # one object per piece as it comes, then the whole with its stats
        for piece in gen:
            print(json.dumps({"text": piece.text, "token": piece.token}, ensure_ascii=False),
                  flush=True)  # fmt: skip
        s = gen.stats
        print(
            json.dumps(
                {
                    "text": gen.text,
                    "tokens": gen.tokens,
                    "finish_reason": gen.finish_reason,
                    "prompt_tokens": s.prompt_tokens,
                    "ttft_ms": round(s.ttft_s * 1e3, 3),
                    "decode_tok_s": round(len(s.step_s) / s.decode_s, 2) if s.step_s else None,
                },
                ensure_ascii=False,
            )
        )
    else:
        _stream(gen)
        if sys.stdout.isatty():
            sys.stdout.write("\n")
    if args.verbose:
        _report(gen)
    return 0


CHAT_HELP = """commands:
  /help     this list
  /reset    forget the conversation (the system prompt stays)
  /exit     quit (also /quit, or Ctrl-D)
  \"\"\"       on a line of its own: start or end a multi-line message
  //text    send a message that begins with a slash ("/text")
Ctrl-C stops a reply and keeps the conversation."""


def _chat_input(interactive: bool) -> str | None:
    """One message: a line, or the lines between two \"\"\" lines. None at the end of input."""

    def line(prompt: str) -> str | None:
        try:
            got = input(prompt) if interactive else sys.stdin.readline()
        except EOFError:
            return None
        if not interactive and not got:
            return None
        return got.rstrip("\n")

    first = line("> ")
    if first is None or first.strip() != '"""':
        return first
    lines: list[str] = []
    while (more := line(". ")) is not None and more.strip() != '"""':
        lines.append(more)
    return "\n".join(lines)


def _chat_template(model, path: str | None, *, command: str) -> None:
    """The chat template ``--template`` names, else the model's own; either way checked now.
    A model without one is one error line before any prompt (chat) or a warning (serve, whose
    completions still work)."""
    if path is not None:
        try:
            source = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ParityError(f"cannot read the chat template {path}: {e}") from None
        model.use_template(source)
    try:
        model.template  # noqa: B018  (raises ChatTemplateError when there is none)
    except ChatTemplateError:
        if command == "chat":
            raise
        _err(f"parity serve: warning: {model.name} has no chat template: chat requests get "
             "a 400 (completions work); --template FILE gives one")  # fmt: skip


def chat(args: argparse.Namespace) -> int:
    sampling = _sampling(args)
    model = _load(args)
    _chat_template(model, args.template, command="chat")
    interactive = sys.stdin.isatty() and sys.stdout.isatty()
    if interactive:
        import readline  # noqa: F401  (line editing and history for input())

        _err(f"chatting with {model.name}; /help lists the commands, /exit or Ctrl-D quits")
    history: list[dict[str, str]] = []
    if args.system:
        history.append({"role": "system", "content": args.system})
    first_turn = len(history)
    while True:
        try:
            message = _chat_input(interactive)
        except KeyboardInterrupt:  # at the prompt: a fresh line, as a shell does
            _err("\n[/exit or Ctrl-D quits]")
            continue
        if message is None:  # end of input
            if interactive:
                _err()
            return 0
        text = message.strip()
        if not text:
            continue
        if text.startswith("/") and not text.startswith("//"):
            command = text.split()[0]
            if command in ("/exit", "/quit"):
                return 0
            if command == "/reset":
                del history[first_turn:]
                _err("[history cleared]")
            elif command == "/help":
                _err(CHAT_HELP)
            else:
                _err(f"[unknown command {command}; /help lists them, //text sends /text]")
            continue
        if text.startswith("//"):
            text = text[1:]
        history.append({"role": "user", "content": text})
        gen = model.chat(
            history,
            max_tokens=args.max_tokens,
            sampling=sampling,
            stop=args.stop,
            ignore_eos=args.ignore_eos,
        )
        try:
            _stream(gen)
        except KeyboardInterrupt:  # the reply stops here; the conversation goes on
            _err("\n[stopped]")
        sys.stdout.write("\n")
        sys.stdout.flush()
        history.append({"role": "assistant", "content": gen.text})
        if args.verbose and gen.finish_reason is not None:
            _report(gen)


# -- models --------------------------------------------------------------------------------


def pull(args: argparse.Namespace) -> int:
    from parity.hub.registry import pull as pull_model

    for name in args.names:
        path = pull_model(name, force=args.force, stream=sys.stderr, verbose=args.verbose)
        if args.print_path:
            print(path)
    return 0


def models(args: argparse.Namespace) -> int:
    from parity.hub.registry import list_models

    listed = list_models()
    if args.json:
        print(json.dumps([_status_dict(m) for m in listed]))
        return 0
    for m in listed:
        d = _status_dict(m)
        where = d.get("path") if d.get("cached") else "not pulled"
        size = f"{d['size'] / 1e6:8.1f} MB" if d.get("size") else " " * 11
        print(f"{d['name']:<22} {size}  {where}")
        about = [d[k] for k in ("description", "license") if d.get(k)]
        if about:
            print(f"{'':<22} {' · license: '.join(about)}")
    return 0


def _status_dict(status: ModelStatus) -> dict:
    import attrs

    d = attrs.asdict(status)
    return d | {"path": str(status.path)}


def tokenize(args: argparse.Namespace) -> int:
    from parity.gguf.reader import read_gguf
    from parity.hub.registry import resolve_model
    from parity.text.tokenizer import Tokenizer

    text = _read_arg_or_stdin(args.text, "text")
    # the tokenizer alone: from the file's metadata, whatever its architecture
    tok = Tokenizer.from_metadata(read_gguf(resolve_model(_model_ref(args))).metadata)
    ids = tok.encode(
        text, add_bos=False if args.no_bos else None, parse_special=not args.no_parse_special
    )
    if args.json:
        print(json.dumps(ids))
        return 0
    for i in ids:
        piece = tok.piece(i).decode("utf-8", errors="backslashreplace")
        print(f"{i:>7} {piece!r}")
    return 0


# -- backends ------------------------------------------------------------------------------


def backends(args: argparse.Namespace) -> int:
    from parity.core.plugins import PluginFilterWarning, load_backends
    from parity.core.tiers import backend_manifest

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        registry = load_backends()  # broken plugins are listed below, not warned about
    for w in caught:
        if issubclass(w.category, PluginFilterWarning):
            _err(f"parity: warning: {w.message}")
    if args.explain:
        return _explain(args)
    rows = []
    for name, cls in registry.backends.items():
        ok = cls.available()
        devices = cls.devices() if ok.ok else []
        rows.append(
            {
                "name": name,
                "plugin": registry.owners.get(name, ""),
                "available": ok.ok,
                "reason": ok.reason,
                "numerics": list(cls.numerics_modes),
                "tiers": backend_manifest(cls).to_dict(),
                "fast_tiers": backend_manifest(cls, "fast").to_dict(),
                "devices": [
                    {"id": d.id, "description": d.description, "score": cls.score(d)}
                    for d in devices
                ],
            }
        )
    broken = [{"plugin": p, "error": why} for p, why in registry.broken.items()]
    if args.json:
        print(json.dumps({"backends": rows, "broken": broken}))
        return 0
    for r in rows:
        state = "available" if r["available"] else f"unavailable: {r['reason']}"
        tiers = ", ".join(f"{k} {v}" for k, v in r["tiers"].items())
        if r["fast_tiers"] != r["tiers"]:
            fast = ", ".join(f"{k} {v}" for k, v in r["fast_tiers"].items() if v != "exact")
            tiers = f"{tiers}; under fast: {fast}"
        print(f"{r['name']:<10} {state}  (numerics: {', '.join(r['numerics'])}; tiers: {tiers})")
        for d in r["devices"]:
            print(f"{'':<10} {d['id']:<10} score {d['score']:<4} {d['description']}")
    for b in broken:
        print(f"{b['plugin']:<10} broken: {b['error']}")
    return 0


def _explain(args: argparse.Namespace) -> int:
    from parity.core.dump import format_graph, to_dot

    model = _load(args, pull=False, prepare=False)  # planned, not uploaded
    plan = model.plan(1)
    if args.graph == "text":
        print(format_graph(plan.graph, plan))
    elif args.graph == "dot":
        print(to_dot(plan.graph, plan))
    elif args.json:
        print(json.dumps({**json.loads(plan.to_json()), "capture": _capture_policy(model, plan)}))
    else:
        print(plan.explain(verbose=args.verbose))
        for i, how in enumerate(_capture_policy(model, plan)):
            print(f"  split {i} graph capture: {how}")
    return 0


def _capture_policy(model, plan) -> list[str]:
    """Per split of a plan, whether its step will replay a captured graph, or why not."""
    from parity.core.backend import Backend
    from parity.core.runtime import CAPTURE_AFTER_RUNS

    by_name = {b.name: b for b in model.backends}
    out = []
    for sp in plan.splits:
        backend = by_name.get(sp.backend)
        if not model.runtime.capture:
            out.append("off (capture = false)")
        elif backend is None or type(backend).capture is Backend.capture:
            out.append(f"never: {sp.backend} does not capture graphs")
        else:
            out.append(
                f"captured on run {CAPTURE_AFTER_RUNS} and replayed after, unless "
                f"{sp.backend} refuses (bench --json gives the reason)"
            )
    return out


# -- measurements --------------------------------------------------------------------------


def perplexity(args: argparse.Namespace) -> int:
    from parity.measure.perplexity import perplexity as measure

    if args.kl_divergence_base:
        return _agreement(args)
    path = Path(args.file)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ParityError(f"cannot read {path} as UTF-8 text: {e}") from None
    text = text.removesuffix("\n")  # as llama.cpp's -f does, so the token streams agree
    n_ctx = args.ctx or 512
    model = _load(args, n_ctx=n_ctx)

    def progress(done: int, total: int, ppl: float) -> None:
        print(f"[{done}/{total}] {ppl:.4f}", file=sys.stderr, flush=True)

    result = measure(model, text, n_ctx, max_chunks=args.chunks, progress=progress)
    if args.json:
        import attrs

        print(json.dumps(attrs.asdict(result)))
    else:
        print(result.line())
    return 0


def _agreement(args: argparse.Namespace) -> int:
    from parity.measure.agreement import agreement, read_base

    base = read_base(args.kl_divergence_base)
    if args.ctx and args.ctx != base.n_ctx:
        raise ParityError(
            f"{base.path} scores chunks of {base.n_ctx} tokens; leave out --ctx or give "
            f"--ctx {base.n_ctx}"
        )
    model = _load(args, n_ctx=base.n_ctx)

    def progress(done: int, total: int, share: float) -> None:
        print(f"[{done}/{total}] top-1 {100 * share:.2f} %", file=sys.stderr, flush=True)

    result = agreement(model, base, max_chunks=args.chunks, progress=progress)
    if args.json:
        import attrs

        print(json.dumps(attrs.asdict(result)))
    else:
        print("\n".join(result.lines()))
    return 0


def bench(args: argparse.Namespace) -> int:
    from parity.measure.bench import bench as measure

    t0 = time.perf_counter()
    model = _load(args, verify_capture=True)  # a captured step must give the eager bits
    result = measure(model, args.prompt_tokens, args.gen_tokens, load_s=time.perf_counter() - t0)
    if args.json:
        print(json.dumps(result.to_dict()))
        return 0
    r = result
    print(f"model       {r.model} on {r.backend}")
    print(f"prefill     {r.prefill_tok_s:10.1f} tok/s  ({r.prompt_tokens} tokens)")
    print(f"decode      {r.decode_tok_s:10.1f} tok/s  ({r.gen_tokens} tokens)")
    print(f"ttft        {r.ttft_ms:10.1f} ms     (cold: {r.cold_ttft_ms:.1f} ms)")
    print(f"first step  {r.first_step_ms:10.2f} ms")
    print(f"step        {r.step_ms:10.2f} ms     (median)")
    print(f"load        {r.load_s:10.2f} s")
    return 0


def serve(args: argparse.Namespace) -> int:
    try:
        import uvicorn

        from parity.server.app import Server, create_app
    except ImportError as e:
        raise ParityError(
            f"parity serve needs FastAPI and uvicorn ({e.name} is missing): "
            "pip install 'parity[serve]'"
        ) from None
    api_key = args.api_key or os.environ.get("PARITY_API_KEY") or None
    if args.host not in ("127.0.0.1", "localhost", "::1") and api_key is None:
        _err(f"parity serve: warning: listening on {args.host} without --api-key: anyone who "
             "can reach this port can use the model")  # fmt: skip
    model = _load(args)
    _chat_template(model, args.template, command="serve")
    name = model.name
    server = Server(model, name, slots=args.slots, queue=args.queue, api_key=api_key,
                    max_body=args.max_body)  # fmt: skip
    _err(f"parity serve: {name} on {model.backends[0].device.id}, ctx {model.n_ctx}, "
         f"{args.slots} slot(s), at http://{args.host}:{args.port}/v1")  # fmt: skip
    uvicorn.run(create_app(server), host=args.host, port=args.port, log_level="warning")
    return 0


def conformance(args: argparse.Namespace) -> int:
    from parity.conformance.harness import CaseResult
    from parity.conformance.report import backend_factory, checked_modes, format_table, run_suite
    from parity.core.plugins import load_backends

    registry = load_backends()
    modes = [args.numerics] if args.numerics else checked_modes(registry.get(args.backend))
    factories = {m: backend_factory(registry, args.backend, args.device, numerics=m)
                 for m in modes}  # fmt: skip

    bar = None
    if not args.verbose and sys.stderr.isatty():  # a long run shows where it is
        from tqdm import tqdm

        bar = tqdm(desc=f"conformance {args.backend}", unit=" cases", file=sys.stderr,
                   leave=False)  # fmt: skip

    def progress(r: CaseResult) -> None:
        if args.verbose:
            _err(f"{r.verdict:<11} {r.case}")
        elif bar is not None:
            bar.update(1)

    runs = {}
    try:
        for mode, factory in factories.items():
            runs[mode] = run_suite(
                factory,
                patterns=args.patterns,
                case_files=args.cases,
                suite=bool(args.patterns) or not args.cases,
                progress=progress,
            )
    finally:
        if bar is not None:
            bar.close()
    if not any(runs.values()):
        raise ParityError(f"no case matches {', '.join(args.patterns)}; see `parity conformance "
                          f"{args.backend} --json` for the case ids")  # fmt: skip
    if args.json:
        cases = [dict(r.to_dict(), numerics=m) for m, results in runs.items() for r in results]
        print(json.dumps({"backend": args.backend, "cases": cases}))
    else:
        tables = [format_table(args.backend if len(runs) == 1 else f"{args.backend} ({m})", rs)
                  for m, rs in runs.items()]  # fmt: skip
        print("\n\n".join(tables))
    return EXIT_FAILED if any(r.failed for rs in runs.values() for r in rs) else 0


def compare(args: argparse.Namespace) -> int:
    from parity.conformance.compare_steps import compare_steps
    from parity.conformance.report import backend_factory
    from parity.core.plugins import load_backends
    from parity.generation.sampling import SamplingParams
    from parity.model import load

    names = [n.strip() for n in args.backends.split(",")]
    if len(names) != 2 or not all(names):
        raise ParityError(f"--backends takes two names, reference,candidate; got {args.backends!r}")
    registry = load_backends()
    reference = backend_factory(registry, names[0], reference=True)
    candidate = backend_factory(registry, names[1], args.device, numerics=args.numerics)
    model = load(_model_ref(args), backends=())  # the file and its tokenizer; no upload
    prompt = model.tokenize(args.prompt)
    if not prompt:
        raise ParityError("the prompt encodes to no tokens; give a non-empty --prompt")
    spec = model.spec
    needed = len(prompt) + args.tokens - 1
    n_ctx = args.ctx or needed
    if not needed <= n_ctx <= spec.n_ctx_train:
        raise ParityError(
            f"the prompt ({len(prompt)} tokens) and {args.tokens} sampled tokens need a context "
            f"of {needed}, within the model's {spec.n_ctx_train} (--ctx {args.ctx}); shorten "
            "the prompt, sample fewer --tokens or change --ctx"
        )
    save_dir = Path(args.save_dir)
    # made only when there is a case to save, but checked now, before minutes of work
    existing = next(p for p in (save_dir.absolute(), *save_dir.absolute().parents) if p.exists())
    if not existing.is_dir() or not os.access(existing, os.W_OK):
        raise ParityError(f"cannot save cases under --save-dir {save_dir}: {existing} is not a "
                          "writable folder")  # fmt: skip
    report = compare_steps(
        Path(_model_ref(args)).name.removesuffix(".gguf"),
        spec,
        model.file.weights,
        prompt,
        args.tokens,
        reference,
        candidate,
        sampling=SamplingParams(temperature=args.temperature, seed=args.seed),
        case_dir=save_dir,
        n_ctx=n_ctx,
        fallback=None if args.strict or names[1] == "cpu" else backend_factory(registry, "cpu"),
    )
    print(json.dumps(report.to_dict()) if args.json else report.summary())
    if report.violation is not None and report.violation.case_path is not None:
        _err(f"replay it with: parity conformance {names[1]} --case {report.violation.case_path}")
    return EXIT_FAILED if report.violation is not None else 0
