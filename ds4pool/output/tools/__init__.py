"""Tool-call parsers, one per output format, by the names `--tool-parser` takes."""

from __future__ import annotations

from ds4pool.output.tools.base import Calls, ToolParser
from ds4pool.output.tools.deepseek_v3 import DeepSeekV3Parser
from ds4pool.output.tools.hermes import HermesParser
from ds4pool.output.tools.llama3_json import Llama3JsonParser
from ds4pool.output.tools.mistral import MistralParser
from ds4pool.output.tools.qwen3_coder import Qwen3CoderParser

PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesParser,
    "llama3_json": Llama3JsonParser,
    "mistral": MistralParser,
    "deepseek_v3": DeepSeekV3Parser,
    "qwen3_coder": Qwen3CoderParser,
}

__all__ = ["PARSERS", "Calls", "ToolParser"]
