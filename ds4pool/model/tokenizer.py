"""A Hugging Face model directory's tokenizer and chat template, without transformers.

Files read from the directory (only tokenizer.json is required):
  tokenizer.json                      the tokenizers pipeline (normalizer → model → decoder)
  tokenizer_config.json               bos/eos/pad/unk token strings, chat_template
  chat_template.jinja                 the default template, as transformers ≥ 4.43 saves it
  additional_chat_templates/*.jinja   named templates (e.g. "tool_use"), transformers 5 layout
  config.json, generation_config.json eos_token_id (int or list) for stopping

Chat templates render with transformers' semantics (same sandbox, filters and globals, same
template selection), so a prompt built here equals `apply_chat_template(..., tokenize=False)`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, NoReturn

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
import jinja2.runtime
import jinja2.sandbox
import tokenizers

from ds4pool.errors import ChatTemplateError, ModelLoadError

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
CHAT_TEMPLATE_DIR = "additional_chat_templates"
_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")
# Older names for a message's reasoning; transformers copies whichever is set to all of them.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_REPLACEMENT_CHAR = "\ufffd"
# Special tokens that carry structure in model output (reasoning blocks, tool calls): decoding
# keeps them even when it skips special tokens, so that the output parsers see them; the others
# (bos, eos, turn markers) are still dropped. Llama 3.1's <|python_tag|> and Mistral's
# [TOOL_CALLS] are special in their tokenizer.json; Qwen's and DeepSeek's markers are not.
OUTPUT_MARKERS = frozenset(
    {
        "<think>",
        "</think>",
        "<tool_call>",
        "</tool_call>",
        "<|python_tag|>",
        "[TOOL_CALLS]",
        "[ARGS]",
        "[CALL_ID]",
        "[THINK]",
        "[/THINK]",
        "<｜tool▁calls▁begin｜>",
        "<｜tool▁calls▁end｜>",
        "<｜tool▁call▁begin｜>",
        "<｜tool▁call▁end｜>",
        "<｜tool▁sep｜>",
    }
)


class Tokenizer:
    """Encode, decode and chat-format text for one model. Thread-safe after construction.

    Invariant: every id `encode` returns lies in [0, vocab_size); `decode` accepts any int and
    skips ids outside that range (a padded embedding may sample them).
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        special_tokens: Mapping[str, str],
        eos_token_ids: Sequence[int],
        chat_templates: Mapping[str, str],
    ) -> None:
        self._backend = backend
        # The variables transformers passes as `special_tokens_map`: only the tokens that are set,
        # so a template sees an undefined (empty) bos_token rather than the string "None".
        self._special_tokens = dict(special_tokens)
        self._chat_templates = dict(chat_templates)
        self._compiled: dict[str, jinja2.Template] = {}
        self._env = _make_environment()
        # Ids may have gaps (added tokens past the model vocab): the bound is max id + 1.
        self.vocab_size: int = max(backend.get_vocab(with_added_tokens=True).values()) + 1
        self.bos_token: str | None = self._special_tokens.get("bos_token")
        self.eos_token: str | None = self._special_tokens.get("eos_token")
        self.bos_token_id: int | None = self.token_to_id(self.bos_token) if self.bos_token else None
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(eos_token_ids))
        self.has_chat_template: bool = "default" in self._chat_templates
        added = backend.get_added_tokens_decoder()
        # content → id of every added token (the markers a model's output format uses live here)
        self.added_tokens: dict[str, int] = {token.content: i for i, token in added.items()}
        special = {i for i, token in added.items() if token.special}
        self._kept_ids = frozenset(i for i in special if added[i].content in OUTPUT_MARKERS)
        self._skipped_ids = frozenset(special - self._kept_ids)

    @classmethod
    def from_dir(cls, path: Path) -> Tokenizer:
        """Load the tokenizer of the model directory `path`; ModelLoadError if it is unusable."""
        model_dir = Path(path)
        backend = _load_backend(model_dir / TOKENIZER_FILE)
        config_path = model_dir / TOKENIZER_CONFIG_FILE
        config = _read_json(config_path) or {}
        special_tokens = {
            key: token
            for key in _SPECIAL_TOKEN_KEYS
            if (token := _token_content(config.get(key), config_path, key)) is not None
        }
        eos_ids = _eos_token_ids(model_dir, backend, special_tokens.get("eos_token"))
        # Template files, when present, replace the config's templates entirely (as transformers).
        templates = _file_templates(model_dir) or _config_templates(
            config.get("chat_template"), config_path
        )
        return cls(
            backend, special_tokens=special_tokens, eos_token_ids=eos_ids, chat_templates=templates
        )

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The `tokenizers` pipeline (its vocabulary, e.g. for grammar-constrained decoding)."""
        return self._backend

    def token_to_id(self, token: str) -> int | None:
        """The id of a vocabulary or added token, None if there is no such token."""
        return self._backend.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`. add_special_tokens runs the post-processor (e.g. prepends bos).

        Special-token strings inside `text` encode as those special tokens. Text rendered by
        `apply_chat_template` already carries bos: encode it with add_special_tokens=False.

        Through `encode_batch`, which lets go of the GIL while it tokenizes (`encode` holds it:
        ~9 ms for a 15k-token prompt, during which the step thread, which needs the GIL back
        after each of its hundreds of launches, waits; bench/gil_convoy.py).
        """
        return self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; ids outside [0, vocab_size) are skipped. Invalid UTF-8 becomes U+FFFD.

        skip_special_tokens drops special tokens except the OUTPUT_MARKERS (tool-call and
        reasoning markers), which stay in the text for the output processor."""
        bound = self.vocab_size
        if skip_special_tokens and self._kept_ids:
            skipped = self._skipped_ids
            valid = [i for i in ids if 0 <= i < bound and i not in skipped]
            return self._backend.decode(valid, skip_special_tokens=False)
        valid = [i for i in ids if 0 <= i < bound]
        return self._backend.decode(valid, skip_special_tokens=skip_special_tokens)

    def chat_template_text(self) -> str:
        """Every chat template's source, joined (for detecting the model's output formats)."""
        return "\n".join(self._chat_templates.values())

    def apply_chat_template(
        self,
        messages: list[dict],
        *,
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        **extra: object,
    ) -> str:
        """Render `messages` into prompt text with the model's chat template.

        The template selected is "tool_use" when tools are given and the model has one, else
        "default". Variables: messages (keys whose value is None dropped, reasoning aliases
        filled, as transformers does), tools, documents=None, add_generation_prompt, the set
        special tokens (bos_token, eos_token, ...), then **extra (e.g. enable_thinking=False).
        Raises ChatTemplateError (one-line message) if there is no template or rendering fails.
        """
        template = self._template(self._template_name(tools))
        variables: dict[str, Any] = {
            **self._special_tokens,
            "messages": _template_messages(messages),
            "tools": tools,
            "documents": None,
            "add_generation_prompt": add_generation_prompt,
            **extra,
        }
        try:
            return template.render(**variables)
        except ChatTemplateError:
            raise
        except Exception as e:
            # The template is untrusted code from the model directory: anything it raises is the
            # template's or the messages' fault (bad role order, wrong types), never ds4pool's.
            raise ChatTemplateError(f"chat template failed: {_describe(e)}") from e

    def _template_name(self, tools: list[dict] | None) -> str:
        if tools is not None and "tool_use" in self._chat_templates:
            return "tool_use"
        if "default" in self._chat_templates:
            return "default"
        raise ChatTemplateError(
            "model has no chat template; send a raw prompt to /v1/completions or add "
            f"{CHAT_TEMPLATE_FILE} to the model directory"
        )

    def _template(self, name: str) -> jinja2.Template:
        """Template `name`, compiled on first use (a race compiles it twice, harmlessly)."""
        compiled = self._compiled.get(name)
        if compiled is None:
            try:
                compiled = self._env.from_string(self._chat_templates[name])
            except jinja2.TemplateSyntaxError as e:
                raise ChatTemplateError(
                    f"chat template {name!r} does not compile: line {e.lineno}: {_one_line(e)}"
                ) from e
            self._compiled[name] = compiled
        return compiled


class IncrementalDecoder:
    """Streaming detokenizer: push ids one at a time, get text deltas.

    Invariants: the concatenation of all deltas (push, then one final flush) equals
    `tokenizer.decode(all ids)`; a delta never ends inside a character, so it contains U+FFFD
    only where the full text does. One exception, inherent to SentencePiece's ByteFallback
    decoder: it turns a whole invalid byte run into U+FFFDs, so an ASCII byte token already
    emitted as text can later become U+FFFD in the full decode (garbage output only).

    Each push decodes a short window, not the whole stream (vLLM's and TGI's prefix/read
    offsets, with the ids before the prefix offset dropped, so it sits at 0):
      ids[0, read_offset)          emitted; decoded again as left context, so that decoders
                                   whose output depends on neighbours (byte-level merges,
                                   SentencePiece's leading-space strip) see the same tokens
      ids[read_offset, len(ids))   not emitted yet: they end inside a character
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._ids: list[int] = []
        self._read_offset = 0

    def push(self, token_id: int) -> str:
        """Add one id; returns the newly completed text ("" while a character is incomplete)."""
        self._ids.append(token_id)
        prefix_text, full_text = self._decode_window()
        # An incomplete UTF-8 tail decodes to U+FFFD: hold it until the next ids complete it.
        if len(full_text) <= len(prefix_text) or full_text.endswith(_REPLACEMENT_CHAR):
            return ""
        self._advance()
        return full_text[len(prefix_text) :]

    def flush(self) -> str:
        """Emit whatever is held back (an incomplete character becomes U+FFFD). Call at the end."""
        prefix_text, full_text = self._decode_window()
        self._advance()
        return full_text[len(prefix_text) :]

    def _decode_window(self) -> tuple[str, str]:
        """(text of the context ids, text of context + pending ids)."""
        decode = self._tokenizer.decode
        skip = self._skip_special_tokens
        prefix_text = decode(self._ids[: self._read_offset], skip) if self._read_offset else ""
        return prefix_text, decode(self._ids, skip)

    def _advance(self) -> None:
        """Mark every id emitted; the ids emitted last become the next left context."""
        # That context always holds a token that produced text, so a decoder that strips the
        # leading space of its first token (SentencePiece) strips the same one in both windows.
        del self._ids[: self._read_offset]
        self._read_offset = len(self._ids)


# --- chat template environment -------------------------------------------------------------


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}…{% endgeneration %}` marks assistant text for transformers' training
    masks; it renders its body unchanged. Without it such templates would not compile."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        # A call block, like transformers: the body gets its own scope.
        call = self.call_method("_render_body")
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _render_body(self, caller: jinja2.runtime.Macro) -> str:
        return caller()


def _make_environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    """The environment transformers renders chat templates in (Hub templates are untrusted)."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _tojson(
    value: object,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's built-in tojson HTML-escapes <, >, & and ' and takes only indent; templates expect
    # plain json.dumps output (transformers overrides it the same way).
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_exception(message: object) -> NoReturn:
    raise ChatTemplateError(_one_line(message))


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _template_messages(messages: list[dict]) -> list[dict]:
    """Messages as transformers hands them to templates: None-valued keys dropped (templates
    test `message.content is defined`, not `is none`), reasoning copied to its aliases."""
    normalized = []
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping):
            kind = type(message).__name__
            raise ChatTemplateError(f"message {index} must be an object, got {kind}")
        clean = {key: value for key, value in message.items() if value is not None}
        if isinstance(clean.get("tool_calls"), list):
            clean["tool_calls"] = [_template_tool_call(call) for call in clean["tool_calls"]]
        reasoning = next((clean[k] for k in _REASONING_FIELDS if k in clean), None)
        if reasoning is not None:
            clean = {"thinking": reasoning, **clean, "reasoning_content": reasoning}
        normalized.append(clean)
    return normalized


class _JsonArguments(dict):  # type: ignore[type-arg]
    """A tool call's arguments as templates want them, whichever way they want them: a mapping
    (`arguments | tojson`, `arguments is mapping`, Qwen's and Llama's) that concatenates and
    prints as its JSON text (`'...' + arguments`, DeepSeek-V3's)."""

    def __str__(self) -> str:
        return json.dumps(self, ensure_ascii=False)

    def __add__(self, other: object) -> str:
        return str(self) + str(other)

    def __radd__(self, other: object) -> str:
        return str(other) + str(self)


def _template_tool_call(call: object) -> object:
    """An assistant tool call with its arguments (an object, or OpenAI's JSON text of one) as
    _JsonArguments; other shapes are left for the template to judge."""
    if not isinstance(call, Mapping) or not isinstance(call.get("function"), Mapping):
        return call
    args = call["function"].get("arguments")
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return call
    if not isinstance(args, Mapping):
        return call
    return {**call, "function": {**call["function"], "arguments": _JsonArguments(args)}}


# --- reading the model directory -----------------------------------------------------------


def _load_backend(path: Path) -> tokenizers.Tokenizer:
    if not path.is_file():
        raise ModelLoadError(f"missing tokenizer file {path}")
    try:
        return tokenizers.Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception for bad JSON or components
        raise ModelLoadError(f"cannot parse {path}: {_one_line(e)}") from e


def _read_json(path: Path) -> dict[str, Any] | None:
    """The JSON object in `path`, None if the file does not exist."""
    text = _read_text(path)
    if text is None:
        return None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"cannot parse {path}: {e}") from e
    if not isinstance(data, dict):
        raise ModelLoadError(f"cannot parse {path}: expected a JSON object")
    return data


def _read_text(path: Path) -> str | None:
    if not path.is_file():
        return None
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"cannot read {path}: {_one_line(e)}") from e


def _token_content(value: object, path: Path, key: str) -> str | None:
    """A special token as a string; transformers writes either "<s>" or {"content": "<s>", ...}."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise ModelLoadError(f"{path}: {key} must be a string or an object with a 'content' string")


def _eos_token_ids(
    model_dir: Path, backend: tokenizers.Tokenizer, eos_token: str | None
) -> list[int]:
    """tokenizer_config's eos token, then config.json's and generation_config.json's ids."""
    ids = []
    if eos_token is not None and (eos_id := backend.token_to_id(eos_token)) is not None:
        ids.append(eos_id)
    for name in ("config.json", "generation_config.json"):
        path = model_dir / name
        ids.extend(_id_list((_read_json(path) or {}).get("eos_token_id"), path))
    return ids


def _id_list(value: object, path: Path) -> list[int]:
    def is_id(item: object) -> bool:
        return isinstance(item, int) and not isinstance(item, bool) and item >= 0

    if value is None:
        return []
    if is_id(value):
        return [value]  # type: ignore[list-item]
    if isinstance(value, list) and all(is_id(item) for item in value):
        return list(value)
    raise ModelLoadError(f"{path}: eos_token_id must be a token id or a list of ids")


def _config_templates(value: object, path: Path) -> dict[str, str]:
    """tokenizer_config's chat_template: one string, or a list of {"name", "template"}."""
    if value is None:
        return {}
    if isinstance(value, str):
        return {"default": value}
    if isinstance(value, list) and all(_is_named_template(entry) for entry in value):
        return {entry["name"]: entry["template"] for entry in value}
    raise ModelLoadError(
        f"{path}: chat_template must be a string or a list of {{name, template}} objects"
    )


def _is_named_template(entry: object) -> bool:
    return (
        isinstance(entry, dict)
        and isinstance(entry.get("name"), str)
        and isinstance(entry.get("template"), str)
    )


def _file_templates(model_dir: Path) -> dict[str, str]:
    """chat_template.jinja as "default", plus additional_chat_templates/<name>.jinja."""
    templates = {}
    default = _read_text(model_dir / CHAT_TEMPLATE_FILE)
    if default is not None:
        templates["default"] = default
    extra_dir = model_dir / CHAT_TEMPLATE_DIR
    if extra_dir.is_dir():
        for path in sorted(extra_dir.glob("*.jinja")):
            templates[path.name.removesuffix(".jinja")] = _read_text(path) or ""
    return templates


def _one_line(value: object) -> str:
    return " ".join(str(value).split())


def _describe(error: Exception) -> str:
    return f"{type(error).__name__}: {_one_line(error)}"
