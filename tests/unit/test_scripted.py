"""The scripted test model: rules, replies through the runner, history read from the KV."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ds4pool.errors import ModelLoadError
from ds4pool.generate import generate
from ds4pool.kv.blocks import BlockPool
from ds4pool.model.loader import LoadedModel, load_model
from ds4pool.model.runner import ModelRunner, SeqInput
from ds4pool.model.sampler import SamplingParams
from ds4pool.model.scripted import NO_MATCH_REPLY
from tests.real_tokenizers import real_tokenizer_dir
from tests.unit.test_cli import assert_one_line_error, run_cli

CPU = torch.device("cpu")
RULES = [
    {"match": r"weather in \w+", "reply": "Sunny, 21 degrees."},
    {"match": "hello", "reply": "Hi! I am the scripted model."},
    {"match": "hel+o", "reply": "never chosen for 'hello': the first match wins"},
]


def write_rules(directory: Path, rules: object) -> Path:
    path = directory / "rules.json"
    path.write_text(json.dumps(rules))
    return path


@pytest.fixture(scope="module")
def scripted(tmp_path_factory: pytest.TempPathFactory, demo_dir: Path) -> LoadedModel:
    path = write_rules(tmp_path_factory.mktemp("rules"), RULES)
    return load_model(f"scripted:{path}", CPU, torch.float32, cache_dir=demo_dir.parent)


def chat_ids(loaded: LoadedModel, text: str) -> list[int]:
    tok = loaded.tokenizer
    prompt = tok.apply_chat_template([{"role": "user", "content": text}])
    return tok.encode(prompt, add_special_tokens=False)


def run_ids(loaded: LoadedModel, prompts: list[list[int]], **kw: object) -> list[list[int]]:
    runner = ModelRunner(loaded, num_blocks=64, block_size=4)
    results = generate(
        runner,
        BlockPool(64),
        prompts,
        stop_token_ids=loaded.tokenizer.eos_token_ids,
        chunk_size=5,  # several prompt chunks: only the last one samples
        **{"max_tokens": 200, **kw},  # type: ignore[arg-type]
    )
    return [r.token_ids for r in results]


def run(loaded: LoadedModel, prompts: list[list[int]], **kw: object) -> list[str]:
    # eos within max_tokens: the reply ended by itself
    outputs = run_ids(loaded, prompts, **kw)
    return [loaded.tokenizer.decode(ids) for ids in outputs if len(ids) < 200]


def test_first_matching_rule_replies_then_eos_in_one_batch(scripted: LoadedModel) -> None:
    prompts = [
        chat_ids(scripted, "hello there"),
        chat_ids(scripted, "what is the weather in Paris?"),
        chat_ids(scripted, "nothing to match"),
    ]
    assert run(scripted, prompts) == [
        "Hi! I am the scripted model.",
        "Sunny, 21 degrees.",
        NO_MATCH_REPLY,
    ]


def test_sampling_at_any_temperature_yields_the_script(scripted: LoadedModel) -> None:
    hot = SamplingParams(temperature=2.0, top_p=0.9, seed=7, presence_penalty=1.5)
    assert run(scripted, [chat_ids(scripted, "hello")], sampling=hot) == [
        "Hi! I am the scripted model."
    ]


def test_history_is_read_from_the_kv_blocks(scripted: LoadedModel) -> None:
    """The model decides from what its cache holds, not from the ids of the step: the same
    decode step over the wrong blocks sees a different prompt."""
    runner = ModelRunner(scripted, num_blocks=16, block_size=4)
    ids = chat_ids(scripted, "hello")
    n_blocks = -(-(len(ids) + 1) // 4)
    good = list(range(1, 1 + n_blocks))
    [first] = runner.step([SeqInput(ids, 0, good)]).sampled
    assert first is not None
    [second] = runner.step([SeqInput([first], len(ids), good)]).sampled
    reply = scripted.tokenizer.encode("Hi! I am the scripted model.", add_special_tokens=False)
    assert [first, second] == reply[:2]
    # Blocks never written (all token 0): the prompt is gone, so no rule matches.
    wrong = list(range(1 + n_blocks, 1 + 2 * n_blocks))
    [other] = runner.step([SeqInput([first], len(ids), wrong)]).sampled
    fallback = scripted.tokenizer.encode(NO_MATCH_REPLY, add_special_tokens=False)
    assert other == fallback[0] != second


def test_kv_is_eight_bytes_a_token(scripted: LoadedModel) -> None:
    assert scripted.config.kv_bytes_per_token(scripted.dtype.itemsize) == 8


@pytest.mark.parametrize(
    ("rules", "fragment"),
    [
        ({"match": "a", "reply": "b"}, "expected a JSON list"),
        ([{"reply": "a"}], 'rule 0 needs a string field "match"'),
        ([{"match": "a"}], 'rule 0 needs "reply" (a string) or "reply_ids"'),
        ([{"match": "a", "reply_ids": [1, "x"]}], 'rule 0 needs "reply" (a string) or'),
        ([{"match": "a", "reply_ids": [10**7]}], "rule 0 has reply_ids outside the vocabulary"),
        ([{"match": "(", "reply": "b"}], "rule 0 has an invalid regex"),
    ],
)
def test_bad_rules_are_one_line_errors(
    tmp_path: Path, demo_dir: Path, rules: object, fragment: str
) -> None:
    path = write_rules(tmp_path, rules)
    with pytest.raises(ModelLoadError, match="rule 0|JSON list") as exc:
        load_model(f"scripted:{path}", CPU, torch.float32, cache_dir=demo_dir.parent)
    assert fragment in str(exc.value)


def test_cli_errors(tmp_path: Path, demo_dir: Path) -> None:
    cache = demo_dir.parent
    proc = run_cli(
        "generate", "--model", f"scripted:{tmp_path}/none.json", "--prompt", "x", cache=cache
    )
    assert_one_line_error(proc, "scripted rules file not found")
    proc = run_cli(
        "generate", "--model", "demo", "--tokenizer", str(tmp_path), "--prompt", "x", cache=cache
    )
    assert_one_line_error(proc, "--tokenizer applies to random:* and scripted:* models")


def test_cli_generate_prints_the_reply(tmp_path: Path, demo_dir: Path) -> None:
    path = write_rules(tmp_path, RULES)
    proc = run_cli(
        "generate", "--model", f"scripted:{path}", "--chat", "--prompt", "hello",
        cache=demo_dir.parent,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "Hi! I am the scripted model.\n"


def test_random_preset_takes_a_real_tokenizer() -> None:
    qwen3 = real_tokenizer_dir("qwen3")
    loaded = load_model("random:100m", CPU, torch.float32, tokenizer_dir=qwen3)
    assert loaded.config.vocab_size == loaded.tokenizer.vocab_size == 151669
    assert loaded.model.lm_head.weight.shape[0] == 151669
    assert loaded.tokenizer.eos_token_ids[0] == loaded.tokenizer.token_to_id("<|im_end|>")
    [out] = run_ids(loaded, [chat_ids(loaded, "hi")], max_tokens=3)
    assert len(out) == 3 and all(0 <= t < 151669 for t in out)


def test_reply_ids_are_emitted_exactly(tmp_path: Path, demo_dir: Path) -> None:
    tok = load_model("demo", CPU, torch.float32, cache_dir=demo_dir.parent).tokenizer
    split = tok.encode("Hel", add_special_tokens=False) + tok.encode("lo", add_special_tokens=False)
    path = write_rules(tmp_path, [{"match": "greet", "reply_ids": split}])
    loaded = load_model(f"scripted:{path}", CPU, torch.float32, cache_dir=demo_dir.parent)
    assert run_ids(loaded, [chat_ids(loaded, "greet me")]) == [split]
