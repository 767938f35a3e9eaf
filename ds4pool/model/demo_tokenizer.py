"""The demo model's tokenizer: a small byte-level BPE written as a real Hugging Face directory.

The directory it writes is loaded by `Tokenizer.from_dir` like any checkpoint's, so the demo
exercises the same code path as real models. Byte-level means every string round-trips:
`decode(encode(s)) == s` for any unicode text, emoji and CJK included, with no unknown token.

Ids (the trainer puts special tokens first, in this order):
  0  <|begin_of_text|>   bos, added by the post-processor when add_special_tokens=True
  1  <|end_of_text|>     end of a raw document; also the pad token
  2  <|im_start|>        opens a chat turn
  3  <|im_end|>          closes a chat turn; tokenizer_config's eos_token
  [4, 1024)              256 byte symbols, then BPE merges learned from _CORPUS
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

BOS_TOKEN = "<|begin_of_text|>"
END_OF_TEXT_TOKEN = "<|end_of_text|>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
SPECIAL_TOKENS = (BOS_TOKEN, END_OF_TEXT_TOKEN, IM_START_TOKEN, IM_END_TOKEN)
VOCAB_SIZE = 1024


@dataclass(frozen=True)
class DemoTokenizerInfo:
    """Ids the demo model builder writes into config.json and generation_config.json.

    eos_token_id is `<|end_of_text|>` (config.json's single eos, like a base model's);
    eos_token_ids lists every token that stops generation: `<|im_end|>` ends a chat turn,
    `<|end_of_text|>` a raw completion.
    """

    vocab_size: int
    bos_token_id: int
    eos_token_id: int
    pad_token_id: int
    eos_token_ids: tuple[int, ...]


# ChatML. Roles system/developer/user/assistant/tool; content is a string or a list of
# {"type": "text", "text": ...} parts. With tools, a system turn lists them as JSON (merged with
# the conversation's own leading system/developer message). Assistant tool calls are rendered as
# <tool_call>{"name": ..., "arguments": ...}</tool_call>; arguments given as a JSON string (OpenAI
# style) are inserted verbatim, a dict is serialized.
CHAT_TEMPLATE = """\
{%- macro render_content(content) -%}
{%- if content is string -%}
{{- content -}}
{%- elif content is iterable and content is not mapping -%}
{%- for part in content -%}
{%- if part.type == 'text' -%}
{{- part.text -}}
{%- else -%}
{{- raise_exception('the demo chat template only supports text content parts, got ' ~ part.type) -}}
{%- endif -%}
{%- endfor -%}
{%- endif -%}
{%- endmacro -%}
{{- bos_token -}}
{%- set ns = namespace(first=0) -%}
{%- if tools -%}
{{- '<|im_start|>system\\n' -}}
{%- if messages and messages[0].role in ['system', 'developer'] -%}
{{- render_content(messages[0].content) ~ '\\n\\n' -}}
{%- set ns.first = 1 -%}
{%- endif -%}
{{- '# Tools\\n\\nYou may call these functions, each described by a JSON schema:\\n<tools>\\n' -}}
{%- for tool in tools -%}
{{- tool | tojson ~ '\\n' -}}
{%- endfor -%}
{{- '</tools>\\n\\nTo call one, reply with <tool_call>{"name": <name>, "arguments": <object>}' -}}
{{- '</tool_call><|im_end|>\\n' -}}
{%- endif -%}
{%- for message in messages[ns.first:] -%}
{%- if message.role not in ['system', 'developer', 'user', 'assistant', 'tool'] -%}
{{- raise_exception('unknown chat role: ' ~ message.role) -}}
{%- endif -%}
{{- '<|im_start|>' ~ message.role ~ '\\n' ~ render_content(message.content) -}}
{%- if message.role == 'assistant' and message.tool_calls -%}
{%- for call in message.tool_calls -%}
{%- set fn = call.function if call.function is defined else call -%}
{%- set args = fn.arguments if fn.arguments is string else fn.arguments | tojson -%}
{%- if message.content or not loop.first -%}
{{- '\\n' -}}
{%- endif -%}
{{- '<tool_call>{"name": ' ~ fn.name | tojson ~ ', "arguments": ' ~ args ~ '}</tool_call>' -}}
{%- endfor -%}
{%- endif -%}
{{- '<|im_end|>\\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{- '<|im_start|>assistant\\n' -}}
{%- endif -%}
"""


def build_demo_tokenizer(out_dir: Path) -> DemoTokenizerInfo:
    """Train the demo tokenizer and write tokenizer.json, tokenizer_config.json and
    chat_template.jinja into `out_dir` (created if needed, files overwritten).

    Deterministic: the same ds4pool version always writes byte-identical files.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    backend = _train()
    backend.save(str(out_dir / "tokenizer.json"), pretty=True)
    _write_text(out_dir / "tokenizer_config.json", json.dumps(_tokenizer_config(backend), indent=2))
    _write_text(out_dir / "chat_template.jinja", CHAT_TEMPLATE)
    return _info(backend)


def _train() -> Tokenizer:
    """A byte-level BPE with VOCAB_SIZE entries, specials at ids [0, 4)."""
    backend = Tokenizer(models.BPE())
    # No prefix space: "Hello" at the start of a prompt and after a newline encode the same way.
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        # All 256 bytes up front, so text the corpus never shows still encodes (no unknowns).
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(_CORPUS.splitlines(keepends=True), trainer=trainer)
    backend.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B:1",
        special_tokens=[(BOS_TOKEN, backend.token_to_id(BOS_TOKEN))],
    )
    assert backend.get_vocab_size(with_added_tokens=True) == VOCAB_SIZE, "corpus too small"
    return backend


def _tokenizer_config(backend: Tokenizer) -> dict[str, object]:
    """tokenizer_config.json as transformers writes it, so AutoTokenizer loads the directory."""
    added = {
        str(token_id): {
            "content": token.content,
            "lstrip": token.lstrip,
            "normalized": token.normalized,
            "rstrip": token.rstrip,
            "single_word": token.single_word,
            "special": token.special,
        }
        for token_id, token in sorted(backend.get_added_tokens_decoder().items())
    }
    return {
        "added_tokens_decoder": added,
        "bos_token": BOS_TOKEN,
        "eos_token": IM_END_TOKEN,
        "pad_token": END_OF_TEXT_TOKEN,
        "chat_template": CHAT_TEMPLATE,
        # Byte-level decoding is exact; the legacy space cleanup would break round trips.
        "clean_up_tokenization_spaces": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }


def _info(backend: Tokenizer) -> DemoTokenizerInfo:
    def token_id(token: str) -> int:
        found = backend.token_to_id(token)
        assert found is not None, token
        return found

    end_of_text = token_id(END_OF_TEXT_TOKEN)
    return DemoTokenizerInfo(
        vocab_size=backend.get_vocab_size(with_added_tokens=True),
        bos_token_id=token_id(BOS_TOKEN),
        eos_token_id=end_of_text,
        pad_token_id=end_of_text,
        eos_token_ids=(token_id(IM_END_TOKEN), end_of_text),
    )


def _write_text(path: Path, text: str) -> None:
    # newline="\n": the same bytes on every platform, which determinism tests rely on.
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        f.write(text if text.endswith("\n") else text + "\n")


# Training text, written for ds4pool: prose, Python, shell, JSON and a chat, so that merges
# cover words, identifiers, indentation and punctuation runs alike. Changing it changes the
# demo vocabulary (and therefore the demo model's fingerprint).
_CORPUS = r'''
The harbour town wakes before the sun does. Fishing boats slide out past the breakwater while
the bakery on the corner pulls its first trays from the oven, and the smell of bread drifts
down to the water. Nobody hurries here; the tide sets the schedule, and the tide has never
been late. Children walk to school along the sea wall, counting gulls and arguing about
whether the old lighthouse is haunted. It is not haunted. It is simply empty, and empty
buildings make people tell stories.

In the afternoon the wind turns and the market opens. Stalls sell apples, rope, honey,
second-hand books and small brass compasses that always point a little east of north.
A retired engineer repairs radios at a folding table, explaining to anyone who stops that
every fault is either a loose wire or a cold solder joint, and that patience finds both.
He keeps a notebook of every radio he has fixed: the model, the fault, the date, the owner.
The notebook is nearly full. He says he will start a second one when the first is done,
and that the second one will be better organised, which is what he said about the first.

Good software is a lot like that notebook. Write down what you did and why you did it.
Keep each function small enough to read in one breath. Name things for what they are,
not for how they happen to be stored today. When a test fails, read the message twice
before changing any code; the message is usually right. When a test passes on the first
try, be suspicious and make it fail once on purpose, so you know it is testing something.

def count_words(text: str) -> dict[str, int]:
    """Count how often each lower-cased word appears in text."""
    counts: dict[str, int] = {}
    for word in text.lower().split():
        word = word.strip(".,;:!?\"'()")
        if word:
            counts[word] = counts.get(word, 0) + 1
    return counts


def top_words(counts: dict[str, int], limit: int = 10) -> list[tuple[str, int]]:
    """The most frequent words first; ties are broken alphabetically."""
    ranked = sorted(counts.items(), key=lambda item: (-item[1], item[0]))
    return ranked[:limit]


class RingBuffer:
    """A fixed-size buffer that overwrites its oldest entry when full."""

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self.capacity = capacity
        self.items: list[object] = []
        self.start = 0

    def push(self, item: object) -> None:
        if len(self.items) < self.capacity:
            self.items.append(item)
        else:
            self.items[self.start] = item
            self.start = (self.start + 1) % self.capacity

    def __len__(self) -> int:
        return len(self.items)


async def fetch_all(client, urls: list[str]) -> list[bytes]:
    results = []
    for url in urls:
        response = await client.get(url, timeout=10.0)
        response.raise_for_status()
        results.append(response.content)
    return results


if __name__ == "__main__":
    import sys

    for word, count in top_words(count_words(sys.stdin.read())):
        print(f"{count:6d}  {word}")

$ git status --short
$ git log --oneline -n 5
$ python3 -m pytest tests/unit -q -x
$ ls -la /var/log | grep -v gz | sort -k5 -n | tail -n 3
$ find . -name "*.py" -newer setup.cfg -print | xargs wc -l
$ curl -s http://localhost:8000/v1/models | python3 -m json.tool
$ export PATH="$HOME/.local/bin:$PATH" && echo "$PATH" | tr ':' '\n'
$ tar -czf backup-$(date +%Y%m%d).tar.gz ./data && du -sh backup-*.tar.gz
$ docker compose up -d && docker compose logs -f --tail=50 server
$ for f in *.txt; do mv "$f" "${f%.txt}.md"; done

{
  "id": "req-0042",
  "model": "demo-tiny",
  "created": 1718000000,
  "messages": [
    {"role": "system", "content": "You are a careful assistant."},
    {"role": "user", "content": "List three prime numbers."}
  ],
  "temperature": 0.7,
  "max_tokens": 128,
  "stream": true,
  "stop": ["\n\n", "END"],
  "usage": {"prompt_tokens": 21, "completion_tokens": 9, "total_tokens": 30},
  "tags": null,
  "ok": false
}

User: Can you help me find why my script prints the same line twice?
Assistant: Sure. Could you paste the loop that does the printing?
User: It reads a file and prints every line that contains the word "error".
Assistant: If the file has Windows line endings, each line ends with a carriage return as well
as a newline, but that would not print it twice. More likely the same line matches two
conditions and the loop prints once for each. Try adding a "continue" after the first print.
User: That was it, thank you! The second check was for "Error" with a capital E.
Assistant: Glad it works. Using line.lower() once and checking a single word avoids the case
problem entirely.

Numbers and symbols show up everywhere: 3.14159, 2.71828, 1e-9, 0x7fff, -42, 100%, 3/4,
a <= b, x != y, i += 1, path/to/file.txt, user@example.com, #include <stdio.h>, [1, 2, 3].

Un café au lait, s'il vous plaît. Die Straße ist naß. Ñandú, jalapeño, smörgåsbord.
東京は雨です。 你好，世界。 Привет, мир. 🙂 🚀 ✅
'''
