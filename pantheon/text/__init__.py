"""Text: tokenizer, chat templates, incremental detokenizing, reasoning and tool-call parsing."""
