"""Text: tokenizer, chat templates, incremental detokenizing, reasoning and tool-call parsing."""

from pantheon.text.chat_template import ChatTemplate, ChatTemplateError
from pantheon.text.detok import IncrementalDetokenizer
from pantheon.text.tokenizer import Tokenizer

__all__ = ["ChatTemplate", "ChatTemplateError", "IncrementalDetokenizer", "Tokenizer"]
