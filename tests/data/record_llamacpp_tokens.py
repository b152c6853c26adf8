"""Record llama.cpp's token ids for the tokenizer fixtures (tests/data/llamacpp_tokens.json).

Usage: ``python tests/data/record_llamacpp_tokens.py PATH/TO/llama-tokenize [--models-dir DIR]``

Each text is written byte for byte to a file and tokenized with ``llama-tokenize -f FILE --ids
--no-escape`` (escapes off so backslashes survive; ``-f`` keeps whitespace, control characters and
a trailing newline exactly), once with llama-tokenize's default ``parse_special`` (on) and once
with ``--no-parse-special``; the second is stored only where it differs. BOS follows each model's
own ``add_bos_token``, as ``Tokenizer.encode`` does by default.
"""

# ruff: noqa: RUF001 (look-alike characters are the point of the test texts)

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
from pathlib import Path

MODELS = ("smollm2-135m", "qwen2.5-coder-0.5b", "gemma3-270m")
HOW = (
    "llama-tokenize -f FILE --ids --no-escape; parse_special on (default) and off; model's add_bos"
)

PROSE = (
    "The quick brown fox jumps over the lazy dog. In 1905, Albert Einstein published four "
    "papers that changed physics forever; the most famous introduced E=mc^2. Today, researchers "
    "across the world (from Tokyo to Toronto) still argue about what it all means -- and whether "
    'we\'ve understood it at all. "It\'s not what you know," she said, "it\'s what you can prove." '
    "Meanwhile, the committee's report, dated 2023-11-05, listed 17 recommendations, 3 of which "
    "were adopted immediately.\n\nA second paragraph follows, shorter than the first."
)

CASES: list[tuple[str, str]] = [
    ("empty", ""),
    ("lone space", " "),
    ("two spaces", "  "),
    ("many spaces", " " * 17),
    ("leading and trailing spaces", "   hello world   "),
    ("spaces before words", "a  b   c    d"),
    ("spaces before digits", "   123 a  1  b"),
    ("spaces before punctuation", "  . a  !b ,  ?"),
    ("tabs", "\t\tindented\twith tabs\t"),
    ("three newlines", "\n\n\n"),
    ("crlf", "\r\n"),
    ("crlf lines", "line1\r\nline2\r\n\r\nline4"),
    ("newline runs", "a\n\n\nb\n \n  \nc"),
    ("mixed whitespace", "a \t\n b\t \r\n\tc  \n"),
    ("trailing newline", "Hello\n"),
    ("unicode spaces", "a\u00a0b\u3000c\u2009d\u2028e\u0085f \u00a0 g"),
    ("vertical tab and form feed", "x\x0by\x0cz"),
    ("accents precomposed", "café naïve résumé Ångström"),
    ("accents combining", "cafe\u0301 e\u0301 vs \u00e9, A\u030angstro\u0308m, n\u0303"),
    ("lone combining mark", "\u0301abc \u0308"),
    ("cjk", "我爱自然语言处理。今天天气很好！"),
    ("japanese", "ひらがなとカタカナ、日本語のテキストです。ｶﾀｶﾅ"),
    ("korean", "안녕하세요, 세계! 한국어 텍스트입니다."),
    ("emoji", "Hello 👋 world 🌍! 😀😃😄"),
    ("emoji zwj", "👨‍👩‍👧‍👦 family, ❤️‍🔥 and 🏳️‍🌈"),
    ("emoji skin tones", "👍🏽👍🏿 👋🏻"),
    ("emoji flags", "🇺🇸🇯🇵🇫🇷 flags"),
    ("emoji keycap and selectors", "1️⃣ #️⃣ ☺︎ ☺️"),
    (
        "python tabs and spaces",
        "def f(x):\n    if x:\n\treturn x ** 2  # square\n    return None\n\n\nclass A:\n"
        "    pass\n",
    ),
    (
        "cpp",
        "std::vector<int> v; auto p = obj->field; ns::Type::method();\n"
        "int main() { return a->b ? 0 : -1; }",
    ),
    ("json", '{"key": [1, 2.5, null, true], "nested": {"a": "b\\n", "c": {}}}'),
    (
        "markdown",
        "# Title\n\n- item 1\n- item **bold** _it_\n\n```py\nprint('x')\n```\n",
    ),
    ("url and email", "https://example.com/path?q=1&r=2#frag user@example.org"),
    ("digits", "1234567890"),
    ("decimal", "3.14159"),
    ("thousands", "1,000,000"),
    ("hex", "0x1F 0xdeadBEEF"),
    ("digits next to letters", "abc123def 42nd 3rd 100km v2.0.1"),
    ("unicode numbers", "−5 ½ ² ٣٤٥ १२३ Ⅻ ①"),
    ("contractions", "don't I'M you'll we've they'D it's it'S IT'S"),
    ("apostrophes", "'s 's' '' ' ll 'll 're"),
    ("curly apostrophes", "it’s don’t ‘quoted’"),
    ("chat turn", "<|im_start|>user\nhi<|im_end|>"),
    ("endoftext", "<|endoftext|>"),
    ("special inside text", "text<|endoftext|>more text<|im_end|>\n"),
    ("adjacent specials", "<|im_start|><|im_end|><|im_start|>"),
    ("partial special", "partial <|im_start and <|im_end| and |im_end|>"),
    ("special in brackets", "<<|im_end|>>"),
    (
        "chat template",
        "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n"
        "<|im_start|>assistant\n",
    ),
    ("fim", "<|fim_prefix|>def f(<|fim_suffix|>) return<|fim_middle|>"),
    ("tool call", '<tool_call>{"name": "f"}</tool_call>'),
    ("end of sentence", "</s> and </s>x"),
    ("starcoder specials", "<repo_name>parity<reponame><file_sep>main.py"),
    ("arabic", "مرحبا بالعالم، كيف حالك؟"),
    ("hindi", "नमस्ते दुनिया, आप कैसे हैं?"),
    ("cyrillic", "Привет, мир! Ёжик в тумане."),
    ("thai", "สวัสดีชาวโลก ภาษาไทยไม่มีช่องว่าง"),
    ("greek", "Γειά σου Κόσμε! αβγδε ΑΒΓΔΕ"),
    ("hebrew", "שלום עולם"),
    ("mixed scripts", "English日本語Русский123العربية😀Ελληνικά"),
    ("control characters", "a\x00b\x01c\x07\x1b[31mred\x1b[0m\x7f\x08"),
    ("replacement character", "bad \ufffd char \ufffd\ufffd"),
    ("private use and unassigned", "\ue000 \U0010fffd \u0378x"),
    ("math and currency", "∀x∈ℝ: x²≥0 ⇒ √(x²)=|x|; €100 £50 ¥1000 ₹"),
    ("punctuation runs", "!!!???...---===***"),
    ("long word", ("supercalifragilisticexpialidocious" * 59)[:2000]),
    ("long run of one letter", "x" * 2000),
    ("prose", PROSE),
    # SentencePiece-style vocabularies (gemma3): specials in text, byte fallback, space runs
    (
        "gemma chat turn",
        "<start_of_turn>user\nWrite a haiku.<end_of_turn>\n<start_of_turn>model\n",
    ),
    ("gemma specials inside text", "a<start_of_turn>b<end_of_turn>c<eos>d<bos>e"),
    ("unused and multimodal tokens", "<unused0> [multimodal] <unused99>x<unused0>"),
    ("mask pad unk as text", "<mask><pad><unk> <mask>"),
    ("byte token texts", "<0x41><0xFF> and <0x0A>x"),
    ("literal sentencepiece spaces", "\u2581hello \u2581\u2581world\u2581"),
    ("rare characters", "\U0001d11e \U0002a6a5 \U000e0041 \ua66e \U00013000 \u0f3a"),
    ("new emoji", "\U0001fae8\U0001fae9 \U0001faaf"),
    ("every ascii control character", "".join(map(chr, range(32))) + "\x7f"),
    ("long run of spaces", " " * 300),
    ("long run of newlines", "\n" * 100),
    ("spaces and newlines alternating", " \n" * 40),
    ("spaces around specials", "   <start_of_turn>   user   <end_of_turn>   "),
    ("run of tabs", "\t" * 50 + "x"),
    ("html", '<div class="a"><p>Hi &amp; bye</p></div>'),
    ("repeated words", "the " * 64),
    ("line separators", "a\r\nb\rc\nd\u2028e\u2029f"),
    ("space before newline", "end of line \nnext  \n\n  last"),
]


def tokenize(binary: Path, model: Path, text: str, *, parse_special: bool) -> list[int]:
    """llama.cpp's ids for ``text``, passed through a file so its bytes survive exactly."""
    with tempfile.NamedTemporaryFile("wb", suffix=".txt") as f:
        f.write(text.encode("utf-8"))
        f.flush()
        cmd = [str(binary), "-m", str(model), "-f", f.name, "--ids", "--no-escape", "--log-disable"]
        if not parse_special:
            cmd.append("--no-parse-special")
        out = subprocess.run(cmd, capture_output=True, check=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("llama_tokenize", type=Path, help="path of the llama-tokenize binary")
    parser.add_argument(
        "--models-dir",
        type=Path,
        default=Path.home() / ".cache" / "parity" / "models",
        help="where <name>.gguf files live (default: ~/.cache/parity/models)",
    )
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).with_name("llamacpp_tokens.json")
    )
    args = parser.parse_args()

    shown = subprocess.run([str(args.llama_tokenize), "--version"], capture_output=True, text=True)
    version = (shown.stdout + shown.stderr).splitlines()[0]
    cases = []
    for name, text in CASES:
        case: dict[str, object] = {"name": name, "text": text, "ids": {}}
        differing = {}
        for model in MODELS:
            path = args.models_dir / f"{model}.gguf"
            ids = tokenize(args.llama_tokenize, path, text, parse_special=True)
            plain = tokenize(args.llama_tokenize, path, text, parse_special=False)
            case["ids"][model] = ids
            if plain != ids:
                differing[model] = plain
        if differing:
            case["ids_no_parse_special"] = differing
        cases.append(case)
        print(f"{name}: {', '.join(str(len(ids)) for ids in case['ids'].values())} tokens")
    # one case per line: reviewable diffs without one id per line
    lines = [
        "{",
        f'"llama_cpp": {json.dumps(version)},',
        f'"how": {json.dumps(HOW)},',
        '"cases": [',
        ",\n".join(json.dumps(case, ensure_ascii=False) for case in cases),
        "]",
        "}",
    ]
    args.out.write_text("\n".join(lines) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
