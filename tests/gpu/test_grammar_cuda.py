"""Grammar-constrained decoding on CUDA: the bitmask upload and masking on the device, the
decode fast path (input batch, CUDA graphs) with constrained and free rows mixed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("xgrammar", reason="grammar-constrained decoding needs xgrammar")

from ds4pool.engine import Engine, EngineConfig
from ds4pool.model.grammar import apply_token_bitmask
from ds4pool.model.loader import load_model
from ds4pool.model.sampler import SamplingParams
from ds4pool.output.constraints import json_schema_spec
from ds4pool.sched.request import Request

pytestmark = pytest.mark.cuda

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{1,8}$"},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "n", "ok"],
}


def test_bitmask_on_cuda_equals_cpu() -> None:
    g = torch.Generator().manual_seed(0)
    vocab = 151936
    logits = torch.randn(5, vocab, generator=g)
    masks = [
        torch.randint(-(2**31), 2**31 - 1, ((vocab + 31) // 32,), dtype=torch.int32, generator=g)
        for _ in range(2)
    ]
    cpu = apply_token_bitmask(logits, [1, 4], masks)
    gpu = apply_token_bitmask(logits.cuda(), [1, 4], masks)
    assert torch.equal(gpu.cpu(), cpu)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_constrained_and_free_rows_on_cuda(demo_dir: Path, dtype: str) -> None:
    loaded = load_model(str(demo_dir), torch.device("cuda"), getattr(torch, dtype))
    e = Engine(EngineConfig(kv_device_gb=0.2, cuda_graphs="lazy"), loaded=loaded)
    try:
        c = e.compile_constraint(json_schema_spec(SCHEMA, "schema"))

        def reqs(tag: str) -> list[Request]:
            return [
                Request(
                    session_id=f"{tag}{i}",
                    prompt_text=loaded.tokenizer.apply_chat_template(
                        [{"role": "user", "content": f"item {i} " * (1 + i)}]
                    ),
                    max_tokens=120 if i % 2 == 0 else 30,
                    sampling=SamplingParams(temperature=1.0, seed=i),
                    constraint=c if i % 2 == 0 else None,
                )
                for i in range(8)
            ]

        def run(rs: list[Request]) -> list[tuple[str, str | None]]:
            out = []
            for s in [e.submit(r) for r in rs]:
                text, _, final = s.collect(timeout=300)
                assert final.error is None, final.error
                out.append((text, final.finish_reason))
            return out

        together = run(reqs("t"))
        alone = [run([r])[0] for r in reqs("s")]
        for text, reason in together[0::2]:
            assert reason == "stop"
            value = json.loads(text)
            assert set(value) == {"name", "n", "ok"} and 0 <= value["n"] <= 99
        if dtype == "float32":  # bf16 logits may differ across batch shapes in near-ties
            assert together == alone
    finally:
        e.close()
