"""The ``parity`` command: stdout carries only the product, failures are one line on stderr
with a non-zero status. Runs in-process on a tiny synthetic GGUF model."""

from __future__ import annotations

import json

import pytest

from parity.arch.synthetic import synthetic_model, tiny_spec, write_model_gguf
from parity.cli import main
from parity.gguf.writer import tiny_bpe_tokenizer

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    spec, weights = synthetic_model(tiny_spec("llama"), seed=5)
    path = tmp_path_factory.mktemp("cli") / "tiny.gguf"
    write_model_gguf(path, spec, weights, tokenizer=tiny_bpe_tokenizer(), chat_template=CHATML)
    return str(path)


@pytest.fixture
def home(tmp_path, monkeypatch):
    """An empty model cache, so nothing real is found or pulled by accident."""
    monkeypatch.setenv("PARITY_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def cli(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_run_prints_only_the_generated_text(capsys, model_path):
    base = ("run", "-m", model_path, "-b", "cpu", "--ctx", "64", "-t", "0", "-n", "6")
    rc, out, err = cli(capsys, *base, "--ignore-eos", "hello there")
    # nothing on stderr but, with a cold numba cache, the compile notice
    assert rc == 0 and all(line.startswith("parity: compil") for line in err.splitlines()), err
    rc, js, _ = cli(capsys, *base, "--ignore-eos", "--json", "hello there")
    *pieces, result = [json.loads(line) for line in js.splitlines()]
    assert out == result["text"] and len(result["tokens"]) == 6
    assert result["finish_reason"] == "length"
    assert "".join(p["text"] for p in pieces) == out  # streamed: one object per piece
    assert [p["token"] for p in pieces if p["token"] is not None] == result["tokens"]


def test_run_verbose_reports_on_stderr(capsys, model_path):
    rc, out, err = cli(
        capsys, "run", "-m", model_path, "-b", "cpu", "--ctx", "64", "-n", "3", "-v", "hi"
    )
    assert rc == 0 and "ttft" in err and "ttft" not in out


def test_tokenize_json_is_one_line_of_ids(capsys, model_path):
    rc, out, err = cli(capsys, "tokenize", "-m", model_path, "--json", "hello world")
    assert rc == 0 and err == ""
    ids = json.loads(out)
    assert out.count("\n") == 1 and all(isinstance(i, int) for i in ids) and ids


def test_chat_reads_turns_from_stdin(capsys, model_path, monkeypatch):
    import io

    monkeypatch.setattr("sys.stdin", io.StringIO("hi\n/reset\nagain\n"))
    rc, out, _ = cli(capsys, "chat", "-m", model_path, "-b", "cpu", "--ctx", "64", "-n", "3")
    assert rc == 0 and out.count("\n") == 2  # one line per reply


def test_chat_without_a_template_says_so_and_takes_one(capsys, tmp_path, monkeypatch):
    """A base model (no tokenizer.chat_template): one error line, no silent ChatML; with
    --template FILE it chats with that template."""
    import io

    spec, weights = synthetic_model(tiny_spec("llama"), seed=5)
    path = tmp_path / "base.gguf"
    write_model_gguf(path, spec, weights, tokenizer=tiny_bpe_tokenizer())
    monkeypatch.setattr("sys.stdin", io.StringIO("hi\n"))
    argv = ("chat", "-m", str(path), "-b", "cpu", "--ctx", "64", "-n", "2")
    rc, out, err = cli(capsys, *argv)
    assert rc == 1 and out == ""
    assert err.count("\n") == 1 and "has no chat template" in err and "--template FILE" in err
    template = tmp_path / "t.jinja"
    template.write_text(CHATML, encoding="utf-8")
    monkeypatch.setattr("sys.stdin", io.StringIO("hi\n"))
    rc, out, err = cli(capsys, *argv, "--template", str(template))
    assert rc == 0 and out.count("\n") == 1
    rc, out, err = cli(capsys, *argv, "--template", str(tmp_path / "missing.jinja"))
    assert rc == 1 and err.startswith("parity: error: cannot read the chat template")


def test_perplexity_prints_the_llama_cpp_line(capsys, model_path, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text(" ".join(f"w{i % 13}" for i in range(120)), encoding="utf-8")
    argv = ("perplexity", "-m", model_path, "-b", "cpu", "-f", str(text), "--ctx", "16")
    rc, out, err = cli(capsys, *argv, "--chunks", "2")
    assert rc == 0 and out.startswith("PPL = ") and " +/- " in out and "[2/2]" in err


def test_bench_json_has_the_metrics(capsys, model_path):
    argv = ("bench", "-m", model_path, "-b", "cpu", "--ctx", "64", "-p", "8", "-g", "4")
    rc, out, _ = cli(capsys, *argv, "--json")
    result = json.loads(out)
    assert rc == 0
    for key in ("prefill_tok_s", "decode_tok_s", "ttft_ms", "first_step_ms", "step_ms"):
        assert result[key] > 0


def test_backends_and_explain(capsys, model_path):
    rc, out, _ = cli(capsys, "backends", "--json")
    assert rc == 0 and any(b["name"] == "cpu" for b in json.loads(out)["backends"])
    rc, out, _ = cli(capsys, "backends", "--explain", "-m", model_path, "-b", "cpu")
    assert rc == 0 and "split" in out
    assert "fusions (the first backend's rewrite):" in out and "MATMUL_SWIGLU" in out
    rc, out, _ = cli(capsys, "backends", "--explain", "-m", model_path, "--ctx", "32", "--json")
    assert rc == 0 and {f["op"] for f in json.loads(out)["fusions"]} >= {"RMS_NORM_MUL", "QUANTIZE"}
    rc, out, _ = cli(capsys, "backends", "--explain", "-m", model_path, "--graph", "text")
    assert rc == 0 and "= MATMUL_ADD F32" in out and "@cpu" in out
    rc, out, _ = cli(capsys, "backends", "--explain", "-m", model_path, "--graph", "dot")
    assert rc == 0 and out.startswith("digraph parity {") and "MATMUL_SWIGLU" in out


def test_models_lists_the_registry(capsys, home):
    rc, out, _ = cli(capsys, "models", "--json")
    assert rc == 0
    names = {m["name"] for m in json.loads(out)}
    assert {"smollm2-135m", "qwen2.5-coder-0.5b"} <= names


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("run", "-m", "no-such-model", "x"), "unknown model"),
        (("run", "-m", "/nonexistent/file.gguf", "x"), "does not exist"),
        (("tokenize", "-m", "nope", "x"), "unknown model"),
        (("run", "-b", "warp-drive", "-m", "{model}", "x"), "unknown backend"),
        (("run", "-m", "{model}", "-t", "-1", "x"), "temperature"),
        (("run", "-m", "{model}", "-b", "cpu", "--ctx", "4", "a b c d e f g h"), "context"),
        (("perplexity", "-m", "{model}", "-f", "/nonexistent.txt"), "cannot read"),
    ],
)
def test_bad_input_is_one_line_on_stderr(capsys, home, model_path, argv, message):
    rc, out, err = cli(capsys, *(a.replace("{model}", model_path) for a in argv))
    assert rc == 1 and out == ""
    assert err.startswith("parity: error: ") and err.count("\n") == 1 and message in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("run", "-m", "{model}", "--device", "cpu:1", "x"), "backend 'cpu' has no device 1"),
        (("bench", "-m", "{model}", "-b", "cpu", "--device", "cuda:0"), "a device of cuda, not"),
        (("conformance", "cpu", "--device", "cuda:1"), "a device of cuda, not of cpu"),
        (("run", "-m", "{model}", "--device", "x", "x"), "a device index (1) or id (cuda:1)"),
    ],
)
def test_device_ids_pick_the_backend_or_say_what_is_wrong(capsys, home, model_path, argv,
                                                          message):  # fmt: skip
    try:
        rc, _, err = cli(capsys, *(a.replace("{model}", model_path) for a in argv))
    except SystemExit as e:  # an argparse usage error
        rc, err = e.code, capsys.readouterr().err
    assert rc in (1, 2) and message in err and "Traceback" not in err


def test_not_a_gguf_file(capsys, home, tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a model at all")
    rc, out, err = cli(capsys, "run", "-m", str(bad), "x")
    assert rc == 1 and out == "" and err.count("\n") == 1


def test_usage_errors_are_one_line_pointing_to_help(capsys):
    with pytest.raises(SystemExit) as e:
        main(["run", "--temperature", "hot", "x"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1
    assert "invalid float value: 'hot'" in err and "(see parity run --help)" in err


def test_help_shows_the_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    out = capsys.readouterr().out
    for default in ("(default: 256)", "(default: 0.8)", "(default: 40)", "(default: 0.95)",
                    "(default: 0.05)"):  # fmt: skip
        assert default in out


def test_chat_commands_multiline_and_a_stopped_reply(capsys, model_path, monkeypatch):
    """/help and an unknown /command go to stderr, not the model; a \"\"\" block is one
    message; //text sends /text; Ctrl-C in a reply stops it and the chat goes on with it."""
    import io

    import parity.model as model_module
    from parity.cli import commands

    asked: list[list[dict]] = []  # the messages of each reply
    real_chat, real_stream = model_module.Model.chat, commands._stream

    def chat(self, messages, **options):
        asked.append([dict(m) for m in messages])
        return real_chat(self, messages, **options)

    def stream(gen):
        if len(asked) == 1:
            raise KeyboardInterrupt  # Ctrl-C during the first reply
        real_stream(gen)

    monkeypatch.setattr(model_module.Model, "chat", chat)
    monkeypatch.setattr(commands, "_stream", stream)
    script = 'hi\n/bogus\n/help\n"""\nline one\nline two\n"""\n//slash\n'
    monkeypatch.setattr("sys.stdin", io.StringIO(script))
    rc, _, err = cli(capsys, "chat", "-m", model_path, "-b", "cpu", "--ctx", "128", "-n", "3")
    assert rc == 0
    assert "[stopped]" in err and "[unknown command /bogus" in err and "/reset" in err
    users = [[m["content"] for m in h if m["role"] == "user"] for h in asked]
    assert users == [["hi"], ["hi", "line one\nline two"], ["hi", "line one\nline two", "/slash"]]
    assert [m["role"] for m in asked[1]] == ["user", "assistant", "user"]  # the stopped reply
