"""Chat templates: the real models' templates rendered to literal expected prompts, the ChatML
fallback, the sandbox, template errors and message validation."""

from __future__ import annotations

import pytest

from parity.arch.model_file import read_model_file
from parity.errors import ChatTemplateError
from parity.text.chat import CHATML, ChatTemplate

KEYS = (
    "tokenizer.chat_template",
    "tokenizer.ggml.bos_token_id",
    "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.tokens",
)


@pytest.fixture(scope="module")
def model_metadata(real_model):
    """``model_metadata(name)``: the template keys of a real model, read once per model."""
    cache: dict[str, dict[str, object]] = {}

    def read(name: str) -> dict[str, object]:
        if name not in cache:
            metadata = read_model_file(real_model(name)).metadata
            cache[name] = {k: metadata[k] for k in KEYS if k in metadata}
        return cache[name]

    return read


SYSTEM = {"role": "system", "content": "You are terse."}
USER = {"role": "user", "content": "Hi there"}
TURNS = [
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4."},
    {"role": "user", "content": "And 3+3?"},
]

SMOL_DEFAULT = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n"
)
QWEN_DEFAULT = (
    "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
    "<|im_end|>\n"
)
ASSISTANT = "<|im_start|>assistant\n"
EXPECTED_TURNS = (
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n4.<|im_end|>\n"
    "<|im_start|>user\nAnd 3+3?<|im_end|>\n"
)

# (messages, expected without the generation prompt): both templates are ChatML and differ
# only in the default system prompt they insert when the first message is not a system one
CASES = {
    "system+user": (
        [SYSTEM, USER],
        "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n",
    ),
    "user": ([USER], "{default}<|im_start|>user\nHi there<|im_end|>\n"),
    "multi-turn": (TURNS, "{default}" + EXPECTED_TURNS),
    "system+multi-turn": (
        [SYSTEM, *TURNS],
        "<|im_start|>system\nYou are terse.<|im_end|>\n" + EXPECTED_TURNS,
    ),
}
MODELS = {"smollm2-135m": SMOL_DEFAULT, "qwen2.5-coder-0.5b": QWEN_DEFAULT}


@pytest.mark.parametrize("generation_prompt", [True, False])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("model", MODELS)
def test_real_templates(model_metadata, model, case, generation_prompt):
    template = ChatTemplate.from_metadata(model_metadata(model))
    messages, expected = CASES[case]
    expected = expected.format(default=MODELS[model]) + (ASSISTANT if generation_prompt else "")
    assert template.render(messages, add_generation_prompt=generation_prompt) == expected
    assert not template.is_fallback


def test_real_template_special_tokens(model_metadata):
    smol = ChatTemplate.from_metadata(model_metadata("smollm2-135m"))
    assert (smol.bos_token, smol.eos_token) == ("<|im_start|>", "<|im_end|>")
    qwen = ChatTemplate.from_metadata(model_metadata("qwen2.5-coder-0.5b"))
    assert (qwen.bos_token, qwen.eos_token) == ("<|endoftext|>", "<|im_end|>")


def test_qwen_tools_and_tool_messages(model_metadata):
    template = ChatTemplate.from_metadata(model_metadata("qwen2.5-coder-0.5b"))
    tools = [{"type": "function", "function": {"name": "weather", "description": "Météo"}}]
    call = {"function": {"name": "weather", "arguments": {"city": "Zürich"}}}
    messages = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "sunny"},
        {"role": "tool", "content": "22C"},
        {"role": "user", "content": "Thanks"},
    ]
    assert template.render(messages, tools=tools) == (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
        "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        '{"type": "function", "function": {"name": "weather", "description": "Météo"}}\n'
        "</tools>\n\nFor each function call, return a json object with function name and "
        "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\nWeather?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "weather", "arguments": {"city": "Zürich"}}'
        "\n</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\n22C\n"
        "</tool_response><|im_end|>\n"
        "<|im_start|>user\nThanks<|im_end|>\n<|im_start|>assistant\n"
    )


# -- the ChatML fallback ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "metadata",
    [{}, {"tokenizer.chat_template": ""}, {"tokenizer.chat_template": "chatml"}],
)
def test_chatml_fallback(metadata):
    tokens = ["<unk>", "<s>", "</s>"]
    template = ChatTemplate.from_metadata(
        {**metadata, "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2}, tokens
    )
    # a stand-in only where the file has no template; "chatml" names llama.cpp's built-in one
    assert template.is_fallback == (metadata.get("tokenizer.chat_template") != "chatml")
    assert template.source == CHATML
    assert (template.bos_token, template.eos_token) == ("<s>", "</s>")
    assert template.render([SYSTEM, USER]) == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert template.render([USER], add_generation_prompt=False) == (
        "<|im_start|>user\nHi there<|im_end|>\n"
    )


def test_tool_use_variant_comes_before_chatml():
    template = ChatTemplate.from_metadata({"tokenizer.chat_template.tool_use": "T{{ 1 }}"})
    assert not template.is_fallback
    assert template.render([USER]) == "T1"


def test_missing_special_tokens_are_empty():
    template = ChatTemplate.from_metadata(
        {
            "tokenizer.chat_template": "[{{ bos_token }}|{{ eos_token }}]",
            "tokenizer.ggml.eos_token_id": 9,  # past the end of the token list
        },
        ["a", "b"],
    )
    assert template.render([USER]) == "[|]"


def test_non_text_template_in_metadata():
    with pytest.raises(ChatTemplateError, match=r"tokenizer\.chat_template is a list, not text"):
        ChatTemplate.from_metadata({"tokenizer.chat_template": ["x"]})


# -- the environment -------------------------------------------------------------------------


def render(source: str, messages=(USER,), **extra) -> str:
    return ChatTemplate(source, bos_token="<s>", eos_token="</s>").render(list(messages), **extra)


def test_whitespace_control_matches_transformers():
    # trim_blocks drops the newline after a tag, lstrip_blocks the indent before one
    source = (
        "{% for m in messages %}\n"
        "    {% if m.role == 'user' %}\n"
        "[{{ m.content }}]\n"
        "    {% endif %}\n"
        "{% endfor %}\n"
    )
    assert render(source, [USER, SYSTEM]) == "[Hi there]\n"


def test_variables_filters_and_globals():
    assert render("{{ bos_token }}{{ messages[0].content }}{{ eos_token }}") == "<s>Hi there</s>"
    assert render("{{ add_generation_prompt }}", add_generation_prompt=False) == "False"
    assert render("{{ custom }}", custom="x") == "x"
    assert render("{{ {'é': [1, 2]} | tojson }}") == '{"é": [1, 2]}'
    assert render("{{ {'a': 1} | tojson(indent=2) }}") == '{\n  "a": 1\n}'
    assert render("{{ strftime_now('%Y') | length }}") == "4"
    source = (
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
        "{{ m.role }}{% endfor %}"
    )
    assert render(source, [USER, SYSTEM]) == "user"
    assert render("{% generation %}<{{ messages[0].role }}>{% endgeneration %}") == "<user>"


def test_undefined_is_lenient_as_in_transformers():
    assert render("[{{ nothing }}]") == "[]"
    assert render("{% if tools %}T{% else %}none{% endif %}") == "none"
    assert render("{{ messages[0].tool_calls is defined }}") == "False"
    with pytest.raises(ChatTemplateError, match="UndefinedError: 'nothing' is undefined"):
        render("{{ nothing.attribute }}")


def test_raise_exception_carries_the_templates_message_and_line():
    source = (
        "{% if messages[0].role != 'system' %}\n"
        "{{ raise_exception('System message first!') }}\n"
        "{% endif %}"
    )
    with pytest.raises(
        ChatTemplateError, match=r"refused these messages at line 2: System message first!$"
    ):
        render(source)
    assert render(source, [SYSTEM]) == ""


@pytest.mark.parametrize(
    ("source", "line"),
    [
        ("{{ ''.__class__.__mro__ }}", 1),
        ("{{ ''.__class__ }}", 1),
        ("x\n{{ ().__class__.__base__.__subclasses__() }}", 2),
        ("{{ messages.__class__.__subclasses__() }}", 1),
        ("{{ ''.__class__.__mro__[1].__subclasses__() }}", 1),
        ("{% set x = [] %}\n\n{{ x.append(1) }}", 3),
        ("{% set d = {} %}{% set _ = d.update({'a': 1}) %}", 1),
        ("{{ messages.pop() }}", 1),
        ("{{ messages[0].clear() }}", 1),
        ("{{ '{0.__class__}'.format(1) }}", 1),
        ("{{ cycler.__init__.__globals__ }}", 1),
    ],
)
def test_sandbox_refusals_are_errors_and_do_nothing(source, line):
    messages = [dict(USER)]
    with pytest.raises(ChatTemplateError, match=f"sandbox forbids at line {line}: .*unsafe"):
        ChatTemplate(source).render(messages)
    assert messages == [USER]


def test_runtime_failures_are_template_errors():
    with pytest.raises(ChatTemplateError, match="failed at line 2: ZeroDivisionError"):
        render("ok\n{{ 1 / 0 }}")
    with pytest.raises(ChatTemplateError, match="Range too big"):
        render("{% for i in range(10**9) %}{% endfor %}")
    with pytest.raises(ChatTemplateError, match="TypeError"):
        render("{{ nothing | tojson }}")


@pytest.mark.parametrize(
    ("source", "line", "message"),
    [
        ("{% for m in messages %}\n{{ m.content }\n{% endfor %}", 2, "unexpected '}'"),
        ("a\nb\n{% if %}", 3, "Expected an expression"),
        ("{% for m in messages %}{{ m }}", 1, "Unexpected end of template"),
        ("{{ x | no_such_filter }}", 1, "No filter named 'no_such_filter'"),
    ],
)
def test_syntax_errors_name_the_line(source, line, message):
    with pytest.raises(ChatTemplateError, match=f"syntax error at line {line} .*{message}"):
        ChatTemplate(source)


def test_template_must_be_text():
    with pytest.raises(ChatTemplateError, match="a chat template must be text, got bytes"):
        ChatTemplate(b"{{ x }}")  # type: ignore[arg-type]


# -- message validation ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("messages", "message"),
    [
        ([], "there are no messages to render"),
        ("hello", "messages must be a list of .* mappings, got a str"),
        (USER, "messages must be a list of .* mappings, got a dict"),
        (["hello"], "message 0 is a str, not a mapping"),
        ([USER, {"content": "x"}], "message 1 has role None; a role is one of system, user"),
        ([{"role": "bot", "content": "x"}], "message 0 has role 'bot'"),
        ([{"role": "user"}], r"message 0 \(user\) has content NoneType; content must be text"),
        ([{"role": "user", "content": 3}], r"message 0 \(user\) has content int"),
    ],
)
def test_bad_messages(messages, message):
    with pytest.raises(ChatTemplateError, match=message):
        ChatTemplate(CHATML).render(messages)


def test_extra_message_keys_pass_through():
    messages = [{"role": "tool", "content": "42", "name": "calc"}]
    assert render("{{ messages[0].name }}:{{ messages[0].content }}", messages) == "calc:42"


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("{{ 'a' * 10**10 }}", "repeated 10000000000 times is too large"),
        ("{{ [0] * 10**9 }}", "too large"),
        ("{{ 2 ** (10**9) }}", "too large"),
        ("{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}"
         "{% endfor %}{{ ns.s }}", "a concatenation is too large"),
        ("{% set ns = namespace(s=['a']) %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}"
         "{% endfor %}{{ ns.s }}", "a concatenation is too large"),
        ("{% for i in range(10**9) %}{% endfor %}", "MAX_RANGE"),
        ("{% for i in range(99999) %}{{ 'x' * 999 }}{% endfor %}", "over 4194304 characters"),
        ("{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}",
         "took over 2 s"),
    ],
)  # fmt: skip
def test_templates_that_would_exhaust_memory_or_time_are_stopped(source, message):
    with pytest.raises(ChatTemplateError, match=message):
        ChatTemplate(source).render([{"role": "user", "content": "hi"}])


def test_message_content_is_never_template_code():
    content = "{{ 7 * 7 }}{% for i in range(3) %}x{% endfor %}{{ ''.__class__ }}"
    t = ChatTemplate("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert t.render([{"role": "user", "content": content}]) == content
