import pytest


@pytest.fixture(scope="session")
def smollm2_factory(smollm2_tokenizer):
    from pantheon.text.tools.grammar import GrammarFactory

    return GrammarFactory(smollm2_tokenizer)


@pytest.fixture(scope="session")
def qwen35_factory(qwen35_tokenizer):
    from pantheon.text.tools.grammar import GrammarFactory

    return GrammarFactory(qwen35_tokenizer)
