"""Tokenizer, chat templates and streaming detokenization, checked against transformers."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from ds4pool.errors import ChatTemplateError, ModelLoadError
from ds4pool.model.demo_tokenizer import _CORPUS, DemoTokenizerInfo, build_demo_tokenizer
from ds4pool.model.tokenizer import IncrementalDecoder, Tokenizer

UNICODE_TEXTS = [
    "",
    "Hello, world!",
    "  leading and trailing spaces  \n\n\ttabs\r\n",
    "def f(x):\n    return {'a': [1, 2, 3]}  # comment",
    "emoji 😀🚀👩‍👩‍👧‍👦 flags 🇫🇷🇯🇵 skin 👍🏽",
    "東京は雨です。你好，世界。한국어 텍스트",
    "Ünïcödé — “quotes” … ∑∫√ ½ €£¥ \u200b zero-width \U0001f9ea",
    "special-looking <|im_start|> text <|begin_of_text|>",
]

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city <now> & later",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]

CONVERSATIONS = [
    [{"role": "user", "content": "Hi there!"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 東京 😀?"},
    ],
    [
        {"role": "developer", "content": [{"type": "text", "text": "Be kind."}]},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
    ],
    [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                },
                {
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Nice"}},
                },
            ],
        },
        {"role": "tool", "content": '{"temp_c": 21}'},
        {"role": "assistant", "content": "It is 21 °C."},
    ],
]


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("demo_tokenizer")
    build_demo_tokenizer(out)
    return out


@pytest.fixture(scope="module")
def demo(demo_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(demo_dir)


def make_dir(tmp_path: Path, demo_dir: Path, files: dict[str, object]) -> Path:
    """A model directory with the demo tokenizer.json plus `files` (dicts are written as JSON)."""
    shutil.copy(demo_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    for name, content in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content if isinstance(content, str) else json.dumps(content))
    return tmp_path


def render(tmp_path: Path, demo_dir: Path, template: str, **kwargs: object) -> str:
    tok = Tokenizer.from_dir(make_dir(tmp_path, demo_dir, {"chat_template.jinja": template}))
    messages = kwargs.pop("messages", [{"role": "user", "content": "hi"}])
    return tok.apply_chat_template(messages, **kwargs)  # type: ignore[arg-type]


# --- encode / decode -----------------------------------------------------------------------


@pytest.mark.parametrize("text", UNICODE_TEXTS)
def test_round_trip_is_exact_for_any_unicode(demo: Tokenizer, text: str) -> None:
    ids = demo.encode(text, add_special_tokens=False)
    assert demo.decode(ids, skip_special_tokens=False) == text
    assert all(0 <= i < demo.vocab_size for i in ids)


@pytest.mark.parametrize("special", [False, True])
def test_encode_gives_the_tokenizers_own_ids(demo: Tokenizer, special: bool) -> None:
    """Tokenizer.encode goes through encode_batch (it lets go of the GIL, so the step thread
    runs while a request is tokenized): the ids are those of the tokenizer's encode."""
    for text in UNICODE_TEXTS:
        want = demo.backend.encode(text, add_special_tokens=special).ids
        assert demo.encode(text, add_special_tokens=special) == want


def test_encode_prepends_bos_only_with_special_tokens(demo: Tokenizer) -> None:
    with_bos = demo.encode("hello")
    assert with_bos[0] == demo.bos_token_id
    assert with_bos[1:] == demo.encode("hello", add_special_tokens=False)
    assert demo.decode(with_bos) == "hello"
    assert demo.decode(with_bos, skip_special_tokens=False) == "<|begin_of_text|>hello"


def test_decode_skips_ids_outside_the_vocab(demo: Tokenizer) -> None:
    ids = demo.encode("padded embedding", add_special_tokens=False)
    noisy = [demo.vocab_size, *ids[:2], -1, 10**12, *ids[2:], demo.vocab_size + 7]
    assert demo.decode(noisy) == "padded embedding"


# --- the demo tokenizer --------------------------------------------------------------------


def test_demo_tokenizer_is_deterministic(demo_dir: Path, tmp_path: Path) -> None:
    info = build_demo_tokenizer(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (tmp_path / name).read_bytes() == (demo_dir / name).read_bytes(), name
    assert info == build_demo_tokenizer(tmp_path / "again")


def test_demo_info_matches_the_directory(demo: Tokenizer, tmp_path: Path) -> None:
    info = build_demo_tokenizer(tmp_path)
    assert info == DemoTokenizerInfo(
        vocab_size=1024, bos_token_id=0, eos_token_id=1, pad_token_id=1, eos_token_ids=(3, 1)
    )
    assert demo.vocab_size == info.vocab_size
    assert demo.bos_token == "<|begin_of_text|>" and demo.bos_token_id == info.bos_token_id
    assert demo.eos_token == "<|im_end|>" and demo.eos_token_ids == (3,)
    assert demo.has_chat_template
    # What the demo model builder writes makes both tokens stop generation.
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"eos_token_id": list(info.eos_token_ids)})
    )
    assert Tokenizer.from_dir(tmp_path).eos_token_ids == (3, 1)


def test_demo_chat_template_renders_a_multi_turn_chat(demo: Tokenizer) -> None:
    prompt = demo.apply_chat_template(CONVERSATIONS[1])
    assert prompt == (
        "<|begin_of_text|>"
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\n2+2?<|im_end|>\n"
        "<|im_start|>assistant\n4<|im_end|>\n"
        "<|im_start|>user\nAnd 東京 😀?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    ids = demo.encode(prompt, add_special_tokens=False)
    assert ids[0] == demo.bos_token_id and ids.count(demo.token_to_id("<|im_start|>")) == 5
    closed = demo.apply_chat_template(CONVERSATIONS[1], add_generation_prompt=False)
    assert closed.endswith("😀?<|im_end|>\n")


def test_demo_chat_template_renders_tools_and_tool_calls(demo: Tokenizer) -> None:
    prompt = demo.apply_chat_template(CONVERSATIONS[3], tools=TOOLS)
    assert prompt.startswith("<|begin_of_text|><|im_start|>system\nUse tools.\n\n# Tools")
    assert json.dumps(TOOLS[0], ensure_ascii=False) in prompt  # tojson, not HTML-escaped
    # A JSON-string argument is inserted verbatim, a dict is serialized: both read the same.
    paris = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>\n'
    nice = '<tool_call>{"name": "get_weather", "arguments": {"city": "Nice"}}</tool_call>'
    assert paris + nice + "<|im_end|>" in prompt
    assert '<|im_start|>tool\n{"temp_c": 21}<|im_end|>' in prompt
    assert "None" not in prompt


def test_demo_chat_template_rejects_unknown_roles_and_parts(demo: Tokenizer) -> None:
    with pytest.raises(ChatTemplateError, match="unknown chat role: wizard"):
        demo.apply_chat_template([{"role": "wizard", "content": "x"}])
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]
    with pytest.raises(ChatTemplateError, match="only supports text content parts"):
        demo.apply_chat_template(image)


@pytest.mark.parametrize("index", range(len(CONVERSATIONS)))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("with_tools", [False, True])
def test_chat_template_matches_transformers(
    demo: Tokenizer, demo_dir: Path, index: int, add_generation_prompt: bool, with_tools: bool
) -> None:
    auto_tokenizer = pytest.importorskip("transformers").AutoTokenizer
    reference = auto_tokenizer.from_pretrained(str(demo_dir))
    tools = TOOLS if with_tools else None
    messages = CONVERSATIONS[index]
    expected = reference.apply_chat_template(
        messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False
    )
    got = demo.apply_chat_template(
        messages, tools=tools, add_generation_prompt=add_generation_prompt
    )
    assert got == expected
    assert demo.encode(got, add_special_tokens=False) == reference.encode(
        got, add_special_tokens=False
    )


def test_encode_decode_match_transformers(demo: Tokenizer, demo_dir: Path) -> None:
    transformers = pytest.importorskip("transformers")
    reference = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(demo_dir / "tokenizer.json")
    )
    assert len(transformers.AutoTokenizer.from_pretrained(str(demo_dir))) == demo.vocab_size
    for text in UNICODE_TEXTS:
        ids = demo.encode(text)
        assert ids == reference.encode(text)
        assert demo.decode(ids) == reference.decode(ids, skip_special_tokens=True)


# --- loading a model directory -------------------------------------------------------------


def test_eos_token_ids_are_the_union_of_three_files(demo_dir: Path, tmp_path: Path) -> None:
    make_dir(
        tmp_path,
        demo_dir,
        {
            # transformers writes AddedToken objects as dicts with "content"
            "tokenizer_config.json": {"eos_token": {"content": "<|im_end|>", "special": True}},
            "config.json": {"eos_token_id": 1},
            "generation_config.json": {"eos_token_id": [1, 2, 3]},
        },
    )
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.eos_token == "<|im_end|>"
    assert tok.eos_token_ids == (3, 1, 2)


def test_eos_token_ids_without_tokenizer_config(demo_dir: Path, tmp_path: Path) -> None:
    make_dir(tmp_path, demo_dir, {"generation_config.json": {"eos_token_id": 1}})
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.eos_token is None and tok.bos_token_id is None and not tok.has_chat_template
    assert tok.eos_token_ids == (1,)


def test_missing_tokenizer_json_names_the_file(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError) as caught:
        Tokenizer.from_dir(tmp_path)
    assert str(tmp_path / "tokenizer.json") in str(caught.value)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize(
    "name",
    ["tokenizer.json", "tokenizer_config.json", "config.json", "generation_config.json"],
)
def test_unparsable_json_names_the_file(demo_dir: Path, tmp_path: Path, name: str) -> None:
    make_dir(tmp_path, demo_dir, {})
    (tmp_path / name).write_text('{"eos_token_id": [1, 2,')
    with pytest.raises(ModelLoadError, match=name.replace(".", r"\.")) as caught:
        Tokenizer.from_dir(tmp_path)
    assert "\n" not in str(caught.value)


def test_malformed_eos_token_id_is_a_load_error(demo_dir: Path, tmp_path: Path) -> None:
    make_dir(tmp_path, demo_dir, {"config.json": {"eos_token_id": "</s>"}})
    with pytest.raises(ModelLoadError, match="config.json"):
        Tokenizer.from_dir(tmp_path)


# --- chat template selection and rendering semantics --------------------------------------


def test_chat_template_jinja_file_wins_over_config(demo_dir: Path, tmp_path: Path) -> None:
    config = {"chat_template": "from config"}
    make_dir(tmp_path, demo_dir, {"tokenizer_config.json": config})
    assert Tokenizer.from_dir(tmp_path).apply_chat_template([]) == "from config"
    (tmp_path / "chat_template.jinja").write_text("from file")
    assert Tokenizer.from_dir(tmp_path).apply_chat_template([]) == "from file"


def test_template_list_form_uses_default_and_tool_use(demo_dir: Path, tmp_path: Path) -> None:
    templates = [
        {"name": "tool_use", "template": "tools: {{ tools | length }}"},
        {"name": "default", "template": "plain"},
    ]
    make_dir(tmp_path, demo_dir, {"tokenizer_config.json": {"chat_template": templates}})
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.apply_chat_template([]) == "plain"
    assert tok.apply_chat_template([], tools=TOOLS) == "tools: 1"


def test_additional_chat_templates_directory(demo_dir: Path, tmp_path: Path) -> None:
    files = {"chat_template.jinja": "plain", "additional_chat_templates/tool_use.jinja": "tool"}
    tok = Tokenizer.from_dir(make_dir(tmp_path, demo_dir, files))
    assert tok.apply_chat_template([]) == "plain"
    assert tok.apply_chat_template([], tools=TOOLS) == "tool"


def test_missing_chat_template_is_a_chat_template_error(demo_dir: Path, tmp_path: Path) -> None:
    tok = Tokenizer.from_dir(make_dir(tmp_path, demo_dir, {}))
    assert not tok.has_chat_template
    with pytest.raises(ChatTemplateError, match="model has no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_template_variables(demo_dir: Path, tmp_path: Path) -> None:
    template = (
        "{{ bos_token }}|{{ eos_token }}|{{ add_generation_prompt }}|{{ tools is none }}|"
        "{{ documents is none }}|"
        "{{ enable_thinking }}|{% for m in messages %}{{ m.role }}:{{ m.content }}{% endfor %}"
    )
    config = {"bos_token": "<|begin_of_text|>", "eos_token": {"content": "<|im_end|>"}}
    make_dir(tmp_path, demo_dir, {"chat_template.jinja": template, "tokenizer_config.json": config})
    tok = Tokenizer.from_dir(tmp_path)
    out = tok.apply_chat_template([{"role": "user", "content": "x"}], enable_thinking=False)
    assert out == "<|begin_of_text|>|<|im_end|>|True|True|True|False|user:x"


def test_unset_special_tokens_render_empty_not_none(demo_dir: Path, tmp_path: Path) -> None:
    assert render(tmp_path, demo_dir, "[{{ bos_token }}]") == "[]"


def test_none_valued_message_keys_are_dropped(demo_dir: Path, tmp_path: Path) -> None:
    template = "{% for m in messages %}{{ m.content is defined }}{% endfor %}"
    messages = [{"role": "assistant", "content": None}]
    assert render(tmp_path, demo_dir, template, messages=messages) == "False"


def test_tojson_behaves_like_transformers(demo_dir: Path, tmp_path: Path) -> None:
    template = "{{ tools | tojson }}\n{{ tools[0] | tojson(indent=2, sort_keys=True) }}"
    tools = [{"b": "<&> é", "a": 1}]
    out = render(tmp_path, demo_dir, template, tools=tools)
    assert out == json.dumps(tools, ensure_ascii=False) + "\n" + json.dumps(
        tools[0], ensure_ascii=False, indent=2, sort_keys=True
    )


def test_template_helpers_and_generation_tag(demo_dir: Path, tmp_path: Path) -> None:
    template = (
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
        "{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}|{{ strftime_now('%Y') }}"
    )
    messages = [{"role": "user", "content": "one"}, {"role": "user", "content": "two"}]
    text, year = render(tmp_path, demo_dir, template, messages=messages).split("|")
    assert text == "one" and len(year) == 4 and year.isdigit()


def test_raise_exception_becomes_chat_template_error(demo_dir: Path, tmp_path: Path) -> None:
    template = "{{ raise_exception('Conversation roles must alternate user/assistant') }}"
    with pytest.raises(ChatTemplateError, match="^Conversation roles must alternate"):
        render(tmp_path, demo_dir, template)


@pytest.mark.parametrize(
    "template",
    [
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ messages.__class__.__base__ }}",
        "{{ messages.append(1) }}",  # the immutable sandbox forbids mutating inputs
        "{{ cycler.__init__.__globals__.os }}",
    ],
)
def test_sandbox_blocks_escapes(demo_dir: Path, tmp_path: Path, template: str) -> None:
    with pytest.raises(ChatTemplateError) as caught:
        render(tmp_path, demo_dir, template)
    assert "\n" not in str(caught.value)


def test_unsafe_attribute_renders_nothing(demo_dir: Path, tmp_path: Path) -> None:
    assert render(tmp_path, demo_dir, "[{{ ''.__class__ }}]") == "[]"


@pytest.mark.parametrize(
    "template", ["{{ 1 + 'a' }}", "{% for %}", "{{ messages[0].content | unknown_filter }}"]
)
def test_broken_templates_give_one_line_errors(
    demo_dir: Path, tmp_path: Path, template: str
) -> None:
    with pytest.raises(ChatTemplateError) as caught:
        render(tmp_path, demo_dir, template)
    assert "\n" not in str(caught.value) and "Traceback" not in str(caught.value)


# --- streaming detokenization --------------------------------------------------------------


def stream(tok: Tokenizer, ids: list[int], skip_special_tokens: bool = True) -> list[str]:
    decoder = IncrementalDecoder(tok, skip_special_tokens=skip_special_tokens)
    return [decoder.push(i) for i in ids] + [decoder.flush()]


def assert_streams_like_decode(tok: Tokenizer, ids: list[int], skip: bool) -> None:
    deltas = stream(tok, ids, skip)
    full = tok.decode(ids, skip_special_tokens=skip)
    assert "".join(deltas) == full, ids
    if "\ufffd" not in full:
        assert not any("\ufffd" in delta for delta in deltas), ids


@pytest.mark.parametrize("skip", [True, False])
def test_stream_equals_decode_for_random_ids(demo: Tokenizer, skip: bool) -> None:
    rng = random.Random(1234)
    for _ in range(300):
        # Include ids past the vocab, as a padded embedding can sample them.
        ids = [rng.randrange(demo.vocab_size + 8) for _ in range(rng.randrange(1, 40))]
        assert_streams_like_decode(demo, ids, skip)


@pytest.mark.parametrize("text", UNICODE_TEXTS)
def test_stream_never_emits_partial_characters(demo: Tokenizer, text: str) -> None:
    ids = demo.encode(text)
    assert_streams_like_decode(demo, ids, skip=True)
    assert_streams_like_decode(demo, ids, skip=False)


def test_emoji_split_across_tokens_is_held_back(demo: Tokenizer) -> None:
    ids = demo.encode("🦜", add_special_tokens=False)  # not in the corpus: one token per byte
    assert len(ids) > 1 and "\ufffd" in demo.decode(ids[:1])
    decoder = IncrementalDecoder(demo)
    assert [decoder.push(i) for i in ids] == [""] * (len(ids) - 1) + ["🦜"]
    assert decoder.flush() == ""


def test_flush_emits_an_incomplete_character(demo: Tokenizer) -> None:
    ids = demo.encode("ok 🦜", add_special_tokens=False)[:-1]  # the parrot's last byte is cut
    decoder = IncrementalDecoder(demo)
    emitted = "".join(decoder.push(i) for i in ids)
    flushed = decoder.flush()
    assert emitted.startswith("ok") and "\ufffd" not in emitted
    assert flushed.endswith("\ufffd") and emitted + flushed == demo.decode(ids)


def test_stream_decodes_a_bounded_window(demo: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    longest: list[int] = [0]
    real_decode = demo.decode

    def recording_decode(ids: list[int], skip_special_tokens: bool = True) -> str:
        longest[0] = max(longest[0], len(ids))
        return real_decode(ids, skip_special_tokens)

    monkeypatch.setattr(demo, "decode", recording_decode)
    ids = demo.encode(_CORPUS * 3)
    assert len(ids) > 3000
    assert "".join(stream(demo, ids)) == real_decode(ids)
    assert longest[0] <= 8  # a few tokens, never the whole stream


def test_stream_with_a_sentencepiece_style_decoder(tmp_path: Path) -> None:
    # Metaspace strips the leading space of the first token it decodes: each window must start
    # on the same token in its context and full decodes, or mid-stream spaces get lost.
    backend = BackendTokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    backend.decoder = decoders.Metaspace(prepend_scheme="first")
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False
    )
    backend.train_from_iterator(_CORPUS.splitlines(), trainer=trainer)
    backend.save(str(tmp_path / "tokenizer.json"))
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.decode(tok.encode("The tide is late.")) == "The tide is late."
    rng = random.Random(7)
    for _ in range(200):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 30))]
        assert_streams_like_decode(tok, ids, skip=rng.random() < 0.5)
