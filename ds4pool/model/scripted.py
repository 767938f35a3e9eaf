"""The scripted test model: replies chosen by regex over the prompt, emitted token by token.

`--model scripted:RULES.json` loads RULES.json, a JSON list of `{"match": REGEX, "reply": TEXT}`.
A request's reply is the first rule whose regex is found (`re.search`) in its rendered prompt
(the prompt's tokens decoded with special tokens kept); it is tokenized with the model's
tokenizer (`--tokenizer DIR`, default: the demo tokenizer) and emitted one token per step,
then eos. No rule matching gives `NO_MATCH_REPLY`. A rule may give `"reply_ids": [ID, ...]`
instead of "reply": those exact ids are emitted, e.g. a non-canonical split of a word ("hel" +
"lo"), as real models sample, for tests of what the server does with such output.

It is a real model to the engine: an `nn.Module` with the Llama forward signature whose "KV
cache" (1 layer, 1 KV head, head_dim 1, float32: 8 bytes a token) holds each token's id. The
history the reply is computed from is read back from the paged blocks through the block
table, so a session's state really lives in its KV and survives demotion, restore and disk
snapshots like any model's; a wrong block table or a lost block changes the output.

How a sampled position finds its place in the reply: the history h[0, n) is hashed; a table
maps the hash of (prompt + the first k reply tokens) to (reply, k), written when token k-1 was
emitted. A history not in the table is a new prompt: the rule is chosen on its decoded text
once and the table gets (reply, 0). Per step that is one gather and one hash over the
history (C speed, no Python loop over tokens); decoding and regex run once per prompt.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from cachetools import LRUCache
from torch import nn

from ds4pool.errors import ModelLoadError
from ds4pool.model.attention import AttentionMetadata
from ds4pool.model.config import ModelConfig
from ds4pool.model.kv_layout import KVLayout
from ds4pool.model.tokenizer import Tokenizer

NO_MATCH_REPLY = "[scripted model: no rule matched the prompt]"
ARCHITECTURE = "ScriptedForCausalLM"
MAX_POSITION = 1 << 18  # room for agent prompts (Claude Code sends ~60k tokens)
# Logit of every token but the scripted one: finite (JSON-safe, no NaN after penalties) and
# far below any Gumbel noise (< 25) at any temperature a client may send.
_OFF_LOGIT = -1e30
# Histories remembered (one entry per emitted token of recent replies): bounds the memory.
_TABLE_SIZE = 1 << 16


@dataclass(frozen=True)
class Rule:
    pattern: re.Pattern[str]
    reply: str | tuple[int, ...]  # text to tokenize, or exact token ids


def load_rules(path: Path) -> list[Rule]:
    """Parse RULES.json; ModelLoadError naming the file and the entry at fault."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ModelLoadError(f"scripted rules file not found: {path}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot parse {path}: {exc}") from None
    if not isinstance(data, list):
        raise ModelLoadError(f'{path}: expected a JSON list of {{"match": ..., "reply": ...}}')
    return [_rule(path, i, entry) for i, entry in enumerate(data)]


def _rule(path: Path, i: int, entry: object) -> Rule:
    if not isinstance(entry, dict) or not isinstance(entry.get("match"), str):
        raise ModelLoadError(f'{path}: rule {i} needs a string field "match"')
    reply = entry.get("reply")
    ids = entry.get("reply_ids")
    ids_ok = isinstance(ids, list) and all(type(t) is int and t >= 0 for t in ids)
    if not (isinstance(reply, str) and ids is None or reply is None and ids_ok):
        raise ModelLoadError(
            f'{path}: rule {i} needs "reply" (a string) or "reply_ids" (a list of token ids)'
        )
    try:
        pattern = re.compile(entry["match"])
    except re.error as exc:
        raise ModelLoadError(f"{path}: rule {i} has an invalid regex: {exc}") from None
    return Rule(pattern, reply if isinstance(reply, str) else tuple(ids))  # type: ignore[arg-type]


class Script:
    """The decision: history ids → the next scripted token. Not thread-safe; the runner calls
    it from the step thread only."""

    def __init__(self, rules: list[Rule], tokenizer: Tokenizer, eos_id: int) -> None:
        self.rules = rules
        self.tokenizer = tokenizer
        self.eos_id = eos_id
        # digest of h[0, n) → (reply ids, k): the next token is reply[k], or eos past the end
        self._table: LRUCache[bytes, tuple[tuple[int, ...], int]] = LRUCache(_TABLE_SIZE)
        self.num_prompts_decided = 0  # prompts whose rule was chosen (tests read it)

    def reply_for(self, prompt: str) -> tuple[int, ...]:
        reply: str | tuple[int, ...] = NO_MATCH_REPLY
        for rule in self.rules:
            if rule.pattern.search(prompt):
                reply = rule.reply
                break
        if isinstance(reply, tuple):
            return reply
        return tuple(self.tokenizer.encode(reply, add_special_tokens=False))

    def next_token(self, history: torch.Tensor) -> int:
        """history [n] float32 on the CPU: the ids as the cache holds them (hashed as they
        are, no conversion: this runs every step over the whole history)."""
        hasher = hashlib.blake2b(history.numpy().tobytes(), digest_size=16)
        key = hasher.digest()
        state = self._table.get(key)
        if state is None:
            ids = history.to(torch.int64).tolist()
            prompt = self.tokenizer.decode(ids, skip_special_tokens=False)
            state = (self.reply_for(prompt), 0)
            self._table[key] = state
            self.num_prompts_decided += 1
        reply, k = state
        if k >= len(reply):
            return self.eos_id
        token = reply[k]
        hasher.update(torch.tensor([token], dtype=history.dtype).numpy().tobytes())
        self._table[hasher.digest()] = (reply, k + 1)
        return token


class ScriptedForCausalLM(nn.Module):
    """The engine-facing model. forward() stores the step's ids in the KV cache and returns
    "hidden states" [T, 2] = (block-table row, position) per token; compute_logits() reads each
    asked-for row's history back from the cache and puts all mass on its scripted next token.

    compute_logits uses the cache and block tables of the latest forward: the runner calls the
    two in pairs within one step (under the engine lock), as it does for any model. Its
    host reads cannot be captured in a CUDA graph, hence `supports_cuda_graphs = False`.
    """

    supports_cuda_graphs = False

    def __init__(self, config: ModelConfig, script: Script) -> None:
        super().__init__()
        self.config = config
        self.script = script
        self._cache: torch.Tensor | None = None
        self._meta: AttentionMetadata | None = None

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        kv_caches: list[torch.Tensor],  # one layer [2, N_blocks, block_size, 1, 1]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, 2] int64: (row, position)
        cache = kv_caches[0]
        values = input_ids.to(cache.dtype)[:, None, None]  # [T, 1, 1]; ids < 2**24 are exact
        tokens = KVLayout.token_view(cache)  # [2, slots, 1, 1]
        tokens[0].index_copy_(0, meta.slot_mapping, values)
        tokens[1].index_copy_(0, meta.slot_mapping, values)
        rows = torch.empty_like(meta.positions)  # [T] block-table row of each token
        if meta.decode_rows.numel():
            rows.index_copy_(0, meta.decode_tokens, meta.decode_rows)
        for p in meta.prefills:
            rows[p.token_start : p.token_end] = p.row
        self._cache, self._meta = cache, meta
        return torch.stack([rows, meta.positions], dim=-1)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, 2] → [N, V]
        assert self._cache is not None and self._meta is not None, "forward() comes first"
        cache, meta = self._cache, self._meta
        bs = meta.block_size
        logits = torch.full(
            (hidden.shape[0], self.config.vocab_size), _OFF_LOGIT, device=hidden.device
        )
        # A host sync per sampled row: this is a test model, the CPU is its home.
        for i, (row, pos) in enumerate(hidden.tolist()):
            n = pos + 1  # the history ends at the token this row belongs to
            table = meta.block_tables[row, : -(-n // bs)]
            ids = KVLayout.keys(cache)[table].reshape(-1)[:n]  # [n] in token order
            logits[i, self.script.next_token(ids.cpu())] = 0.0
        return logits


def load_scripted(
    spec: str, tokenizer: Tokenizer, tokenizer_id: str, device: torch.device
) -> tuple[ScriptedForCausalLM, ModelConfig, str]:
    """(model, config, weights_id) for `scripted:RULES.json`; always float32 (ids exact)."""
    path = Path(spec.removeprefix("scripted:")).expanduser()
    rules = load_rules(path)
    if not tokenizer.eos_token_ids:
        raise ModelLoadError("the scripted model needs a tokenizer with an eos token")
    if tokenizer.vocab_size >= 1 << 24:
        raise ModelLoadError("the scripted model stores ids in float32: vocabulary too large")
    cfg = ModelConfig(
        architecture=ARCHITECTURE,
        vocab_size=tokenizer.vocab_size,
        hidden_size=2,
        intermediate_size=1,
        num_layers=1,
        num_heads=1,
        num_kv_heads=1,
        head_dim=1,
        max_position=MAX_POSITION,
        rms_norm_eps=1e-6,
        eos_token_ids=tokenizer.eos_token_ids,
    )
    for i, rule in enumerate(rules):
        if isinstance(rule.reply, tuple) and any(t >= tokenizer.vocab_size for t in rule.reply):
            raise ModelLoadError(f"{path}: rule {i} has reply_ids outside the vocabulary")
    script = Script(rules, tokenizer, tokenizer.eos_token_ids[0])
    model = ScriptedForCausalLM(cfg, script).to(device).eval()
    # The rules and the tokenizer decide every output: together they are the "weights".
    weights_id = hashlib.sha256(path.read_bytes() + tokenizer_id.encode()).hexdigest()[:32]
    return model, cfg, weights_id
