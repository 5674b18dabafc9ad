"""`pantheon profile` writes a Perfetto trace with the scheduler's annotations."""

from __future__ import annotations

import pytest

from pantheon.config import ModelConfig
from pantheon.engine.engine import Engine
from pantheon.engine.profile import capture, event_names, trace_files
from tests.fixtures.tiny_models import write_tiny_llama


@pytest.mark.parametrize("template", [True, False], ids=["chat", "base model"])
def test_profile_trace_has_prefill_decode_and_sample_spans(tmp_path, template):
    """A base model without a chat template is profiled on raw prompts (it used to raise)."""
    path = write_tiny_llama(tmp_path / "tiny.gguf", **({} if template else {"chat_template": None}))
    engine = Engine(ModelConfig(str(path), ctx_cap=128, max_sessions=1))
    assert (engine.template is not None) == template
    out = capture(engine, tmp_path / "profiles", requests=2, max_tokens=4)
    assert out.parent == tmp_path / "profiles" and out.name.endswith(engine.name)
    perfetto = [f for f in trace_files(out) if f.name.startswith("perfetto")]
    assert perfetto
    names = event_names(perfetto[0])
    assert {"prefill_chunk", "decode_step", "sample", "request_0", "request_1"} <= names
