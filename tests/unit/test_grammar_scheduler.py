"""Grammar-constrained requests through the scheduler on the demo model (random weights: its
free output is noise, so valid JSON here is the grammar's doing), batched with free ones."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import torch

from ds4pool.engine import Engine, EngineConfig
from ds4pool.model.grammar import Constraint
from ds4pool.model.loader import LoadedModel, load_model
from ds4pool.model.sampler import SamplingParams
from ds4pool.output.constraints import json_schema_spec, parse_tools
from ds4pool.output.tool_grammar import tool_call_spec
from ds4pool.sched.request import Request

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{1,8}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "ok"],
}


@pytest.fixture(scope="module")
def loaded(demo_dir: Path) -> LoadedModel:
    return load_model(str(demo_dir), torch.device("cpu"), torch.float32)


@pytest.fixture(scope="module")
def engine(loaded: LoadedModel):  # noqa: ANN201
    e = Engine(EngineConfig(kv_device_gb=0.05), loaded=loaded)
    yield e
    e.close()


@pytest.fixture(scope="module")
def constraint(engine: Engine) -> Constraint:
    return engine.compile_constraint(json_schema_spec(SCHEMA, "schema"))


def prompt(loaded: LoadedModel, i: int) -> str:
    msg = {"role": "user", "content": f"describe person {i} as JSON " * (1 + i % 3)}
    return loaded.tokenizer.apply_chat_template([msg])


def run(engine: Engine, reqs: list[Request]) -> list[tuple[str, str | None]]:
    streams = [engine.submit(r) for r in reqs]
    out = []
    for s in streams:
        text, _, final = s.collect(timeout=300)
        assert final.error is None, final.error
        out.append((text, final.finish_reason))
    return out


def test_schema_forced_on_noise_weights(loaded: LoadedModel, engine: Engine, constraint) -> None:  # noqa: ANN001
    reqs = [
        Request(
            prompt_text=prompt(loaded, i),
            max_tokens=200,
            sampling=SamplingParams(temperature=1.0, seed=i),
            constraint=constraint,
        )
        for i in range(6)
    ]
    free = [Request(prompt_text=r.prompt_text, max_tokens=60, sampling=r.sampling) for r in reqs]
    for text, reason in run(engine, reqs):
        assert reason == "stop"
        jsonschema.validate(json.loads(text), SCHEMA)
    for text, _ in run(engine, free):  # the same requests unconstrained: not JSON
        with pytest.raises(ValueError):
            json.loads(text)


def test_batched_mix_equals_solo(loaded: LoadedModel, engine: Engine, constraint) -> None:  # noqa: ANN001
    """Constrained and free requests in one batch give what each gives alone."""

    def reqs(tag: str) -> list[Request]:
        return [
            Request(
                session_id=f"{tag}{i}",
                prompt_text=prompt(loaded, i),
                max_tokens=40 if i % 2 else 120,
                sampling=SamplingParams(temperature=0.9, top_p=0.95, seed=100 + i),
                constraint=None if i % 2 else constraint,
            )
            for i in range(8)
        ]

    together = run(engine, reqs("t"))
    alone = [run(engine, [r])[0] for r in reqs("s")]
    assert together == alone
    assert all(reason == "stop" for _, reason in together[0::2])


def test_grammar_end_stops_even_with_ignore_eos_and_length_cuts(
    loaded: LoadedModel,
    engine: Engine,
    constraint,  # noqa: ANN001
) -> None:
    base = dict(prompt_text=prompt(loaded, 0), sampling=SamplingParams(temperature=1.0, seed=4))
    [(text, reason)] = run(
        engine, [Request(**base, max_tokens=200, ignore_eos=True, constraint=constraint)]
    )  # type: ignore[arg-type]
    assert reason == "stop"
    jsonschema.validate(json.loads(text), SCHEMA)
    [(cut, reason)] = run(engine, [Request(**base, max_tokens=5, constraint=constraint)])  # type: ignore[arg-type]
    assert reason == "length" and text.startswith(cut)
    # max_tokens = exactly the JSON's tokens: whole, so "stop" (not "length")
    req = Request(**base, max_tokens=200, constraint=constraint)  # type: ignore[arg-type]
    n = len(engine.submit(req).collect(timeout=60)[1])  # the tokens it sampled, eos excluded
    [(exact, reason)] = run(engine, [Request(**base, max_tokens=n, constraint=constraint)])  # type: ignore[arg-type]
    assert exact == text and reason == "stop"


def test_forced_tool_call_in_the_demo_template_format(loaded: LoadedModel, engine: Engine) -> None:
    tools = parse_tools(
        [
            {
                "type": "function",
                "function": {
                    "name": "grep",
                    "parameters": {
                        "type": "object",
                        "properties": {"pattern": {"type": "string", "pattern": "^[a-z]{1,6}$"}},
                        "required": ["pattern"],
                    },
                },
            }
        ]
    )
    tok = loaded.tokenizer
    spec = tool_call_spec("hermes", tools, lambda s: tok.token_to_id(s) is not None, parallel=False)
    c = engine.compile_constraint(spec)
    [(text, reason)] = run(
        engine,
        [
            Request(
                prompt_text=prompt(loaded, 1),
                max_tokens=100,
                constraint=c,
                sampling=SamplingParams(seed=9),
            )
        ],
    )
    assert reason == "stop"
    assert text.startswith("<tool_call>\n") and text.endswith("\n</tool_call>")
    call = json.loads(text.removeprefix("<tool_call>\n").removesuffix("\n</tool_call>"))
    assert call["name"] == "grep" and set(call["arguments"]) == {"pattern"}


def test_unsatisfiable_grammar_fails_alone(loaded: LoadedModel, engine: Engine) -> None:
    """A pattern that matches nothing compiles, then leaves no token to sample after the
    opening quote: that request ends with an invalid_request error, its batch goes on."""
    spec = json_schema_spec({"type": "string", "pattern": "[^\\s\\S]"}, "schema")
    dead = Request(
        prompt_text=prompt(loaded, 0), max_tokens=20, constraint=engine.compile_constraint(spec)
    )
    free = Request(prompt_text=prompt(loaded, 1), max_tokens=20)
    streams = [engine.submit(dead), engine.submit(free)]
    text, _, final = streams[0].collect(timeout=60)
    assert final.finish_reason == "error" and final.error_type == "invalid_request"
    assert "allows no next token" in (final.error or "")
    _, ids, final = streams[1].collect(timeout=60)
    assert final.error is None and len(ids) == 20
