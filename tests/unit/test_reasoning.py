"""<think> blocks split from content, held back only as long as a marker may be forming."""

from __future__ import annotations

from ds4pool.output.deltas import ReasoningDelta, TextDelta
from ds4pool.output.processor import OutputProcessor
from ds4pool.output.reasoning import ThinkSplitter, prompt_opens_reasoning
from tests.unit.output_helpers import check_contract, feed_chunks, random_chunks


def processor(in_reasoning: bool = False) -> OutputProcessor:
    return OutputProcessor(reasoning=ThinkSplitter(in_reasoning))


def test_reasoning_and_content_in_any_chunking() -> None:
    text = "<think>\nStep 1: think.\n\nStep 2: <b>more</b>.\n</think>\n\nThe answer is 4."
    for seed in range(20):
        chunks = list(text) if seed == 0 else random_chunks(text, seed)
        msg = check_contract(feed_chunks(processor(), chunks))
        assert msg.reasoning == "Step 1: think.\n\nStep 2: <b>more</b>."
        assert msg.text == "The answer is 4."


def test_nothing_is_held_longer_than_a_marker_needs() -> None:
    proc = processor()
    assert proc.feed("<thi") == []
    assert proc.feed("nk>\nIdea") == [ReasoningDelta("Idea")]
    assert proc.feed(" one</th") == [ReasoningDelta(" one")]
    assert proc.feed("ink>\n\nAns") == [TextDelta("Ans")]
    assert proc.feed("wer <think> stays") == [TextDelta("wer <think> stays")]


def test_output_without_a_block_is_content() -> None:
    proc = processor()
    assert proc.feed("Hello") == [TextDelta("Hello")]
    msg = check_contract(feed_chunks(processor(), ["<", "b>bold</b>"]))
    assert (msg.text, msg.reasoning) == ("<b>bold</b>", None)


def test_prompt_that_opened_the_block() -> None:
    assert prompt_opens_reasoning("<｜Assistant｜><think>\n")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    msg = check_contract(
        feed_chunks(processor(in_reasoning=True), list("why\n</think>\n\nbecause"))
    )
    assert (msg.reasoning, msg.text) == ("why", "because")


def test_cut_inside_the_block_keeps_the_reasoning() -> None:
    msg = check_contract(feed_chunks(processor(), ["<think>\nhalf a thou", "ght\n"], "length"))
    assert msg.reasoning == "half a thought\n" and msg.text == ""
