"""How prompts and chats become token ids, with a tokenizer that adds a BOS token (the default
model's does not): add_special_tokens on text prompts and rendered chats, and the chat
template's add_generation_prompt."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from tandem.engine.processor import InputProcessor
from tandem.server.openai.chat_request import ChatCompletionRequest

BOS, A, B = 0, 1, 2
USER_SAYS_A = [{"role": "user", "content": "a"}]


@pytest.fixture
def inputs() -> InputProcessor:
    core = Tokenizer(models.WordLevel({"<s>": BOS, "a": A, "b": B, "?": 3}, unk_token="?"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    core.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", BOS)]
    )
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", unk_token="?")
    # each tool's name, each message's text, then "b" where the assistant's turn would open
    tokenizer.chat_template = (
        "{% for t in tools or [] %}{{ t['function']['name'] }} {% endfor %}"
        "{% for m in messages %}{{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}b{% endif %}"
    )
    return InputProcessor(tokenizer, max_model_len=64, vocab_size=4, eos_token_ids=frozenset())


def test_text_prompts_get_the_bos_unless_told_not_to(inputs):
    assert inputs.tokenize("a b") == [BOS, A, B]
    assert inputs.tokenize("a b", add_special_tokens=False) == [A, B]
    assert inputs.tokenize([A, B], add_special_tokens=True) == [A, B]  # ids are taken as they are


def test_chats_take_what_the_template_writes(inputs):
    assert inputs.tokenize_chat(USER_SAYS_A) == [A, B]
    assert inputs.tokenize_chat(USER_SAYS_A, add_special_tokens=True) == [BOS, A, B]
    assert inputs.tokenize_chat(USER_SAYS_A, add_generation_prompt=False) == [A]


def test_tools_reach_the_template_and_unusable_tool_choices_are_refused(inputs):
    tools = [{"type": "function", "function": {"name": "b", "parameters": {"type": "object"}}}]
    choices = ("none", "auto", "required", {"type": "function", "function": {"name": "b"}})
    for choice in choices:
        request = ChatCompletionRequest(messages=USER_SAYS_A, tools=tools, tool_choice=choice)
        assert inputs.tokenize_chat(USER_SAYS_A, **request.template_options()) == [B, A, B]
        assert request.auto_tool_choice() == (choice == "auto")
    assert ChatCompletionRequest(messages=USER_SAYS_A, tools=tools).auto_tool_choice()
    refused = [
        ({"tool_choice": "required"}, "needs tools"),
        ({"tool_choice": "auto"}, "needs tools"),
        ({"tools": tools, "tool_choice": {"function": {"name": "c"}}}, "not among the tools"),
        ({"functions": [{"name": "b"}]}, "not supported"),
    ]
    for fields, message in refused:
        with pytest.raises(ValueError, match=message):
            ChatCompletionRequest(messages=USER_SAYS_A, **fields)
